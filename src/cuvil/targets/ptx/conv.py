"""Implicit-GEMM convolution kernels for the GPU.

A convolution lowered as a packed contraction (:mod:`cuvil.kernels.contraction`: ``E("contract")`` with a
:class:`~cuvil.kernels.contraction.Contraction`, weights packed at compile time into panels ``Ap[g, m // TM, k, m % TM]``
of TM output channels; the GPU's lowering keeps the input unpadded and records the pads) is, per image and
group, the product of an M x K weight matrix and a K x P window matrix (im2col, never stored). A block
computes a TM x TP tile of (channel x position) outputs, each thread a 4 x 4 register tile, and walks the
reduction in chunks of :data:`TK` = 32 terms:

* the weight tile is TK contiguous rows of the panel (``float4`` loads, coalesced, no index arithmetic: the
  packing put the TM channels of one term side by side, zero rows past M);
* the window tile reads ``x[n, g*C + c, o*s - pad + k*d]``: a per-thread position (computed once per tile: a
  thread always loads the same column) plus a per-term channel and kernel tap (unflattened once per row); a
  coordinate outside the input (padding) is tested per load and reads 0 (unsigned compares, the address
  clamped), positions past P re-read the last position (computed, never stored), terms past K (when TK does
  not divide it) load 0;
* both go to shared memory (``bar.sync``), and each thread accumulates 16 products per term from two
  ``float4`` shared loads, with ``fma`` when the kernel rules contracted the reduction (else multiply, add);
  the next chunk's global loads are issued into registers before this chunk's products (software
  pipelining: their latency hides behind the FMAs) and stored to shared memory after the next barrier.

Float16 with 64-channel panels on sm_80+ (and fma allowed: an ``mma`` accumulates fused) runs on the tensor
cores instead: the tiles stay half in shared memory, stored k-contiguous (``sa[m][k]``, ``sb[p][k]``, rows
padded by 8 halves) so a fragment register is one 32-bit shared load, and each warp computes a 32 x 32
sub-tile with ``mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32`` (2 x 4 per 16 terms, float32
accumulators; fragment layouts from the PTX ISA, "Matrix Fragments for mma.m16n8k16").

Small grids (the late layers at batch 1: 512 channels x 49 positions is 8 blocks of 64 x 64) split the
reduction into S slices (split-K) so that about ``PtxTuning.target_blocks`` blocks run
(:mod:`cuvil.targets.ptx.tuning`): each slice writes its raw partial sums to a scratch area after the model's
arena, and a second kernel adds the S partials in slice order (deterministic) and runs the stage's fused
epilogue. With S = 1 the epilogue runs in the tile kernel.
"""
from __future__ import annotations

from typing import Optional

import attrs
import llvmlite.ir as ir

from ...ir.dtype import DType
from ...kernels.contraction import Contraction
from ...kernels.schedule import ARENA, Stage
from ...kernels.texpr import Buf, E, cast, iadd, imul, load, nodes, reduce, replace_node
from ..llvm.types import F16, F32, I32, I64
from .emitter import PtxEmitter, set_contraction, shared_global
from .tuning import DEFAULT_TUNING

TK = 32                # reduction terms per chunk (rows of the shared tiles; 16 was 6% slower on ResNet-50)
MIN_SPLIT_TERMS = 128  # a reduction slice keeps at least this many terms
TILE_CHANNELS = (64, 32, 16)   # weight panel widths (TM) the GPU lowering offers (choose_tile picks per conv)


@attrs.define
class ConvPlan:
    tm: int          # output channels per block tile (the weight panel width)
    tp: int          # positions per block tile
    splits: int      # reduction slices (split-K)
    kchunk: int      # terms per slice (a multiple of TK)
    n: int
    groups: int
    m: int           # output channels per group
    p: int           # output positions per image
    k: int           # reduction terms (input channels per group x kernel taps)
    mma: bool = False   # float16 tensor cores: each warp a 32 x 32 tile of mma.m16n8k16 (else 4 x 4 per thread)

    @property
    def threads(self) -> int:
        return self.tm * self.tp // (32 if self.mma else 16)

    @property
    def tiles_m(self) -> int:
        return -(-self.m // self.tm)

    @property
    def tiles_p(self) -> int:
        return -(-self.p // self.tp)

    @property
    def blocks(self) -> int:
        return self.n * self.groups * self.tiles_m * self.tiles_p * self.splits

    @property
    def scratch_floats(self) -> int:
        return self.splits * self.n * self.groups * self.m * self.p if self.splits > 1 else 0


def conv_node(st: Stage) -> Optional[E]:
    """The stage's convolution ``contract`` node when an implicit-GEMM kernel can compute the stage: one
    such node, float32 or float16, static shapes, the stage's output indexed exactly by the node's (n, m,
    o...) and written whole (no region), weight panels TM in :data:`TILE_CHANNELS` wide, and every element
    offset the kernel forms (input, weights) below 2^31: its address arithmetic is 32-bit."""
    if st.region is not None or st.buf.dtype not in (DType.FLOAT, DType.FLOAT16):
        return None
    found = [x for x in nodes(st.expr) if x.op == "contract"]
    if len(found) != 1 or not isinstance(found[0].attr, Contraction) or found[0].attr.interleaved:
        return None     # (interleaved groups: x86's Winograd GEMMs only; their expression is still exact)
    node, spec = found[0], found[0].attr
    shape = tuple(st.buf.shape)
    if not all(isinstance(d, int) for d in shape + tuple(spec.x.shape) + tuple(spec.out_spatial)):
        return None
    if shape != (spec.n, spec.groups * spec.m) + tuple(spec.out_spatial) or spec.mr not in TILE_CHANNELS:
        return None
    if len(node.args) != len(st.vars) + 1 or not all(a.op == "var" and a.attr == v.attr
                                                     for a, v in zip(node.args[:-1], st.vars)):
        return None
    red = accumulation(node)
    if red.op != "reduce" or red.attr[0] not in ("sum", "fma") or red.dtype != DType.FLOAT:
        return None
    if spec.x.dtype not in (DType.FLOAT, DType.FLOAT16) or spec.a.dtype != spec.x.dtype or node.dtype != spec.x.dtype:
        return None
    esize = 2 if spec.x.dtype == DType.FLOAT16 else 4
    for buf in (spec.x, spec.a):
        elems = 1
        for d in buf.shape:
            elems *= int(d)
        if buf.offset // esize + elems >= 2 ** 31:
            return None
    return node


def accumulation(node: E) -> E:
    """The float32 reduction of a contraction node: its last argument, under the cast back to half of a
    float16 one (``widen_half_reductions`` accumulates half sums in float32)."""
    red = node.args[-1]
    return red.args[0] if red.op == "cast" and red.args and red.args[0].op == "reduce" else red


def plan_conv(spec: Contraction, target_blocks: int = DEFAULT_TUNING.target_blocks, mma: bool = False) -> ConvPlan:
    """Tile shape and split-K for one convolution: TP = 64 unless 32 pads the positions less (a 14 x 14
    map: 224 instead of 256); slices doubled while the grid is below ``target_blocks`` and the slices keep
    :data:`MIN_SPLIT_TERMS` terms on average (each slice a multiple of TK terms, the last one the rest:
    576 terms in 4 slices are 160, 160, 160, 96)."""
    p = 1
    for d in spec.out_spatial:
        p *= int(d)
    tp = 64 if -(-p // 64) * 64 <= -(-p // 32) * 32 else 32
    k = spec.k
    plan = ConvPlan(spec.mr, tp, 1, -(-k // TK) * TK, spec.n, spec.groups, spec.m, p, k,
                    mma and spec.mr == 64 and spec.x.dtype == DType.FLOAT16)
    s = 1
    while plan.blocks * s < target_blocks and k // (2 * s) >= MIN_SPLIT_TERMS:
        s *= 2
    kchunk = -(-(-(-k // s)) // TK) * TK
    return attrs.evolve(plan, splits=-(-k // kchunk), kchunk=kchunk)



def scratch_buf(plan: ConvPlan, offset: int) -> Buf:
    """The split-K partial sums: [S, N, G*M, P] floats in the arena at ``offset``."""
    return Buf("splitk", DType.FLOAT, (plan.splits, plan.n, plan.groups * plan.m, plan.p), base=ARENA, offset=offset)


def combine_stage(st: Stage, node: E, plan: ConvPlan, scratch: Buf) -> Stage:
    """The stage with its convolution replaced by the sum of the S partials in slice order (the second
    kernel of a split-K convolution: it runs the fused epilogue)."""
    n_e, m_e = node.args[0], node.args[1]
    o = node.args[2:-1]
    p_e = o[0] if o else None
    for d, od in zip(node.attr.out_spatial[1:], o[1:]):
        p_e = iadd(imul(p_e, int(d)), od)
    if p_e is None:
        p_e = 0
    total = reduce("sum", [plan.splits], lambda s: load(scratch, [s, n_e, m_e, p_e]), DType.FLOAT)
    if node.dtype != DType.FLOAT:
        total = cast(total, node.dtype)
    return attrs.evolve(st, expr=replace_node(st.expr, node, total))


def emit_conv(km, st: Stage, sym: str, node: E, plan: ConvPlan, scratch: Optional[Buf],
              counters: Optional[int] = None):
    """Emit the tile kernel ``sym`` of a convolution stage (see the module docstring); with split-K it
    writes ``scratch``, and either the caller adds the combining kernel or (``counters``: the byte offset in
    the arena of one zeroed int32 per output tile) the last slice to finish a tile adds the partials in slice
    order and runs the epilogue itself. Software pipelining as ``km.tuning.pipeline`` says. Returns the
    launch size (threads)."""
    spec: Contraction = node.attr
    pipeline = km.tuning.pipeline
    red = accumulation(node)
    use_fma = red.attr[0] == "fma"
    half = spec.x.dtype == DType.FLOAT16     # float16 weights and input: widened on load into float32 tiles,
    # or (mma) kept half in shared memory for the tensor cores
    ET = F16 if half else F32
    esize = 2 if half else 4
    fn = km.kernel_fn(sym)
    bufs, _n = fn.args
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    em = PtxEmitter(km, fn, b, bufs, st.buf)
    TM, TP, T = plan.tm, plan.tp, plan.threads
    M, P, K, G, N = plan.m, plan.p, plan.k, plan.groups, plan.n
    NG, S = N * G, plan.splits
    xstr = spec.x.strides
    out_sp = [int(d) for d in spec.out_spatial]
    in_sp = [int(d) for d in spec.x.shape[2:]]
    pads = tuple(int(p) for p in spec.pads)
    kshape = [spec.cin] + [int(x) for x in spec.kernel]
    V4 = ir.VectorType(F32, 4)

    mma = plan.mma
    SK = TK + 8                  # mma: halves per shared row (k contiguous; +8 staggers the banks)

    def smem(name, count):
        return shared_global(km, f"{sym}_{name}", F16 if mma else F32, count)
    sa, sb = (smem("sa", TM * SK), smem("sb", TP * SK)) if mma else (smem("sa", TK * TM), smem("sb", TK * TP))
    bar = km.declare("llvm.nvvm.barrier0", ir.VoidType(), [])
    fence = km.declare("llvm.nvvm.membar.gl", ir.VoidType(), [])
    # partial sums written by other blocks of this kernel: read through L2 (ld.global.cg), never a stale L1
    ld_cg = ir.InlineAsm(ir.FunctionType(F32, [I64]), "ld.global.cg.f32 $0, [$1];", "=f,l", side_effect=True)
    flag = None
    if counters is not None:
        flag = shared_global(km, f"{sym}_last", I32, align=None)      # one word, the type's own alignment
    fmaf = km.declare("llvm.fma.f32", F32, [F32, F32, F32])

    def i32(v):
        return b.trunc(v, I32)

    def divmod_c(x32, d: int):
        return b.udiv(x32, I32(d)), b.urem(x32, I32(d))

    def unflatten(x32, dims):
        """Row-major digits of x32 over dims (32-bit: every index here is below 2^31)."""
        out = []
        rest = x32
        for d in reversed(dims[1:]):
            rest, r = divmod_c(rest, d)
            out.append(r)
        out.append(rest)
        return out[::-1]

    sbase = {}

    def sgep(g, idx32):
        if g.name not in sbase:
            sbase[g.name] = em.shared_pointer(g, F16 if mma else F32)
        return b.gep(sbase[g.name], [idx32], source_etype=F16 if mma else F32, inbounds=True)

    tid = i32(km.sreg(b, "tid.x"))
    ty, tx = divmod_c(tid, TP // 4)                # which 4 channels, which 4 positions
    col = b.urem(tid, I32(TP))                     # the window tile column this thread loads
    krow0 = b.udiv(tid, I32(TP))                   # ... its first row; rows krow0 + j * (T / TP)
    nb = TK * TP // T
    na4 = TK * TM // (4 * T)
    a_slots = []
    for j in range(na4):
        e4 = b.add(tid, I32(j * T))
        a_slots.append(divmod_c(e4, TM // 4))     # (row, float4 column)
    H4 = ir.VectorType(F16, 4)
    accs = [em.alloca(F32) for _ in range(32 if mma else 16)]
    # the next chunk, staged in registers (software pipelining); raw halves for the tensor cores
    aregs = [em.alloca(H4 if mma else V4) for _ in range(na4)]
    bregs = [em.alloca(F16 if mma else F32) for _ in range(nb)]
    if mma:
        lane = b.urem(tid, I32(32))
        warp = b.udiv(tid, I32(32))
        wm, wn = divmod_c(warp, TP // 32)            # this warp's 32 x 32 sub-tile
        lg, lt = b.lshr(lane, I32(2)), b.and_(lane, I32(3))
        mma_op = ir.InlineAsm(ir.FunctionType(ir.LiteralStructType([F32] * 4), [I32] * 6 + [F32] * 4),
                              "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {$0,$1,$2,$3}, {$4,$5,$6,$7}, "
                              "{$8,$9}, {$10,$11,$12,$13};", "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f")
    abuf = em.base(spec.a)
    xbuf = em.base(spec.x)
    a_off = spec.a.offset // esize
    x_off = spec.x.offset // esize
    mb_total = -(-M // TM)
    guard_k = K % TK != 0

    def widened(ptr, typ):
        """A float32 (x4) value from ``ptr``: loaded as is, or as float16 and converted (kept half for
        the tensor cores)."""
        lt = (H4 if typ == V4 else F16) if half else typ
        v = b.load(ptr, typ=lt, align=(4 * esize if typ == V4 else esize))
        v.set_metadata("invariant.load", km.empty_md)
        return b.fpext(v, typ) if half and not mma else v

    def gload(ptr, typ, ok):
        """``*ptr`` (float32, converted from float16 inputs) where ok, else zeros (no load)."""
        if ok is None:
            return widened(ptr, typ)
        pre = b.block
        yes = fn.append_basic_block("ld")
        join = fn.append_basic_block("ldj")
        b.cbranch(ok, yes, join)
        b.position_at_end(yes)
        v = widened(ptr, typ)
        yes = b.block
        b.branch(join)
        b.position_at_end(join)
        rt = v.type
        phi = b.phi(rt)
        phi.add_incoming(ir.Constant(rt, None) if isinstance(rt, ir.VectorType) else ir.Constant(rt, 0.0), pre)
        phi.add_incoming(v, yes)
        return phi

    def tile_body(bid64):
        bid = i32(bid64)
        rest, pt = divmod_c(bid, plan.tiles_p)
        rest, mt = divmod_c(rest, plan.tiles_m)
        s, ng = divmod_c(rest, NG)
        n, g = divmod_c(ng, G)
        m0 = b.mul(mt, I32(TM))
        p0 = b.mul(pt, I32(TP))
        klo = b.mul(s, I32(plan.kchunk))
        kend = b.add(klo, I32(plan.kchunk))
        khi = b.select(b.icmp_unsigned("<", kend, I32(K)), kend, I32(K))
        # this thread's window column: the position's offset in the padded input (clamped into the map)
        pos = b.add(p0, col)
        pos = b.select(b.icmp_unsigned("<", pos, I32(P)), pos, I32(P - 1))
        o = unflatten(pos, out_sp)
        xrow = b.add(b.mul(n, I32(xstr[0])), b.mul(b.mul(g, I32(spec.cin)), I32(xstr[1])))
        if pads:     # the window's first input row / column (may be negative: padding)
            corner = [b.sub(b.mul(od, I32(int(spec.strides[d]))), I32(pads[d])) for d, od in enumerate(o)]
        else:
            for d, od in enumerate(o):
                xrow = b.add(xrow, b.mul(od, I32(int(spec.strides[d]) * xstr[2 + d])))
        apanel = b.mul(b.add(b.mul(g, I32(mb_total)), mt), I32(K))   # row index of (g, mt, k = 0)
        for a_ in accs:
            b.store(ir.Constant(F32, 0.0), a_)

        def fetch(k0):
            """The chunk at k0 from global memory into this thread's staging registers."""
            for (row, c4), reg in zip(a_slots, aregs):
                k = b.add(k0, row)
                idx = b.add(b.mul(b.add(apanel, k), I32(TM)), b.mul(c4, I32(4)))
                src = b.gep(abuf, [b.zext(b.add(idx, I32(a_off)), I64)], source_etype=ET, inbounds=True)
                b.store(gload(src, V4, b.icmp_unsigned("<", k, I32(K)) if guard_k else None), reg)
            for j, reg in enumerate(bregs):
                row = b.add(krow0, I32(j * (T // TP)))
                k = b.add(k0, row)
                c, *taps = unflatten(k, kshape)
                off = b.add(xrow, b.mul(c, I32(xstr[1])))
                ok = b.icmp_unsigned("<", k, I32(K)) if guard_k else None
                if pads:     # inside the input (unsigned compare: a negative coordinate is out), else 0
                    for d, kd in enumerate(taps):
                        q = b.add(corner[d], b.mul(kd, I32(int(spec.dilations[d]))))
                        inside = b.icmp_unsigned("<", q, I32(in_sp[d]))
                        ok = inside if ok is None else b.and_(ok, inside)
                        off = b.add(off, b.mul(q, I32(xstr[2 + d])))
                    off = b.select(ok, off, I32(0))
                    src = b.gep(xbuf, [b.zext(b.add(off, I32(x_off)), I64)], source_etype=ET, inbounds=True)
                    v = widened(src, F32)
                    b.store(b.select(ok, v, ir.Constant(v.type, 0.0)), reg)
                    continue
                for d, kd in enumerate(taps):
                    off = b.add(off, b.mul(kd, I32(int(spec.dilations[d]) * xstr[2 + d])))
                src = b.gep(xbuf, [b.zext(b.add(off, I32(x_off)), I64)], source_etype=ET, inbounds=True)
                b.store(gload(src, F32, ok), reg)

        def chunk(k0_64):
            k0 = i32(k0_64)
            if not pipeline:
                fetch(k0)
            for (row, c4), reg in zip(a_slots, aregs):
                if mma:      # transposed: sa[m][k], so a fragment's two k's are one 32-bit word
                    v = b.load(reg, typ=H4)
                    for i in range(4):
                        m_ = b.add(b.mul(c4, I32(4)), I32(i))
                        b.store(b.extract_element(v, I32(i)), sgep(sa, b.add(b.mul(m_, I32(SK)), row)))
                    continue
                dst = sgep(sa, b.add(b.mul(row, I32(TM)), b.mul(c4, I32(4))))
                b.store(b.load(reg, typ=V4), b.bitcast(dst, ir.PointerType(V4, addrspace=3)), align=16)
            for j, reg in enumerate(bregs):
                row = b.add(krow0, I32(j * (T // TP)))
                if mma:      # sb[p][k]
                    b.store(b.load(reg, typ=F16), sgep(sb, b.add(b.mul(col, I32(SK)), row)))
                    continue
                b.store(b.load(reg, typ=F32), sgep(sb, b.add(b.mul(row, I32(TP)), col)))
            b.call(bar, [])
            if pipeline:
                nxt = b.add(k0, I32(TK))
                with b.if_then(b.icmp_unsigned("<", nxt, khi)):   # the next chunk's loads fly during this one's FMAs
                    fetch(nxt)

            def word(g_, idx32):
                """Two consecutive halves of shared tile g_ as one 32-bit register."""
                return b.load(b.bitcast(sgep(g_, idx32), ir.PointerType(I32, addrspace=3)), typ=I32, align=4)

            def mma_steps():
                for ks in range(0, TK, 16):
                    afr = []
                    for i in range(2):
                        r0 = b.add(b.add(b.mul(wm, I32(32)), I32(i * 16)), lg)
                        c0 = b.add(b.mul(lt, I32(2)), I32(ks))
                        afr.append([word(sa, b.add(b.mul(b.add(r0, I32(dr)), I32(SK)), b.add(c0, I32(dc))))
                                    for dr, dc in ((0, 0), (8, 0), (0, 8), (8, 8))])
                    for j in range(4):
                        pc = b.add(b.add(b.mul(wn, I32(32)), I32(j * 8)), lg)
                        c0 = b.add(b.mul(lt, I32(2)), I32(ks))
                        bfr = [word(sb, b.add(b.mul(pc, I32(SK)), b.add(c0, I32(dc)))) for dc in (0, 8)]
                        for i in range(2):
                            cs = accs[(i * 4 + j) * 4:(i * 4 + j) * 4 + 4]
                            out = b.call(mma_op, afr[i] + bfr + [b.load(c_, typ=F32) for c_ in cs])
                            for r, c_ in enumerate(cs):
                                b.store(b.extract_value(out, r), c_)

            def term(kk64):
                kk = i32(kk64)
                v4p = ir.PointerType(V4, addrspace=3)
                av = b.load(b.bitcast(sgep(sa, b.add(b.mul(kk, I32(TM)), b.mul(ty, I32(4)))), v4p), typ=V4, align=16)
                bv = b.load(b.bitcast(sgep(sb, b.add(b.mul(kk, I32(TP)), b.mul(tx, I32(4)))), v4p), typ=V4, align=16)
                ae = [b.extract_element(av, I32(i)) for i in range(4)]
                be = [b.extract_element(bv, I32(j)) for j in range(4)]
                for i in range(4):
                    for j in range(4):
                        a_ = accs[i * 4 + j]
                        acc = b.load(a_, typ=F32)
                        if use_fma:
                            nv = b.call(fmaf, [ae[i], be[j], acc])
                        else:
                            nv = b.fadd(acc, b.fmul(ae[i], be[j]))
                        b.store(nv, a_)
            if mma:
                mma_steps()
            else:
                em.loop_range(I64(0), I64(TK), term)
            b.call(bar, [])
        if pipeline:
            fetch(klo)
        em.loop_range(b.zext(klo, I64), b.zext(khi, I64), chunk, I64(TK))
        def coords(slot):
            if mma:          # accumulator (i, j, r): rows of m16 tile i, columns of n8 tile j
                i, j, r = slot // 16, (slot // 4) % 4, slot % 4
                m = b.add(m0, b.add(b.add(b.mul(wm, I32(32)), I32(i * 16 + (8 if r >= 2 else 0))), lg))
                p = b.add(p0, b.add(b.add(b.mul(wn, I32(32)), I32(j * 8 + (r & 1))), b.mul(lt, I32(2))))
            else:
                i, j = divmod(slot, 4)
                m = b.add(m0, b.add(b.mul(ty, I32(4)), I32(i)))
                p = b.add(p0, b.add(b.mul(tx, I32(4)), I32(j)))
            return m, p, b.and_(b.icmp_unsigned("<", m, I32(M)), b.icmp_unsigned("<", p, I32(P)))

        def partial(s_, m, p):
            mm = b.add(b.mul(g, I32(M)), m)
            flat = b.add(b.mul(b.add(b.mul(b.add(b.mul(s_, I32(N)), n), I32(G * M)), mm), I32(P)), p)
            dst = b.gep(em.base(scratch), [I64(scratch.offset)], source_etype=ir.IntType(8), inbounds=True)
            return b.gep(dst, [b.zext(flat, I64)], source_etype=F32, inbounds=True)

        def finish(m, p, acc):
            """The fused epilogue of output (m, p) with the convolution's value acc, stored."""
            mm = b.add(b.mul(g, I32(M)), m)
            idx = [b.zext(x, I64) for x in [n, mm] + unflatten(p, out_sp)]
            for v, x in zip(st.vars, idx):
                em.env[v.attr] = x
            em.memo.append(dict(em.memo[-1]))
            em.memo[-1][node.uid] = b.fptrunc(acc, F16) if half else acc
            val = em.emit(st.expr)
            b.store(val, em.address(st.buf, idx))
            em.memo.pop()

        for slot in range(len(accs)):
            m, p, ok = coords(slot)
            with b.if_then(ok):
                acc = b.load(accs[slot], typ=F32)
                if S > 1:
                    b.store(acc, partial(s, m, p))
                else:
                    finish(m, p, acc)
        if S > 1 and counters is not None:
            # the last slice of this tile to finish (an atomic count per tile) adds all S partials in slice
            # order (deterministic) and runs the epilogue; its partials and everyone else's are in L2
            tile = b.add(b.mul(b.add(b.mul(ng, I32(plan.tiles_m)), mt), I32(plan.tiles_p)), pt)
            last, cptr = em.last_arrival(scratch, counters, b.zext(tile, I64), S, flag,
                                         b.icmp_unsigned("==", tid, I32(0)))
            with b.if_then(last):
                b.call(fence, [])
                for slot in range(len(accs)):
                    m, p, ok = coords(slot)
                    with b.if_then(ok):
                        tot = ir.Constant(F32, 0.0)
                        for s_ in range(S):
                            tot = b.fadd(tot, b.call(ld_cg, [b.ptrtoint(partial(I32(s_), m, p), I64)]))
                        finish(m, p, tot)
                with b.if_then(b.icmp_unsigned("==", tid, I32(0))):
                    b.store(I32(0), cptr)     # ready for the next run (the runtime also zeroes them first)
    em.loop_range(km.sreg(b, "ctaid.x"), I64(plan.blocks), tile_body, km.sreg(b, "nctaid.x"))
    b.ret_void()
    set_contraction(fn, False)
    km.kernels.append(sym)
    return plan.blocks * T
