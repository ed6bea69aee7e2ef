"""bf16 convolutions read in place from pair planes (``E("contract")`` with a
:class:`~cuvil.kernels.contraction_planes.PlaneContraction`, over the stage ``E("pplanes")``): no im2col.

* **On AMX tiles** (``tdpbf16ps``, ``bf16_planes_amx``): a unit is one block of 32 output channels over 32 wide
  positions of one image, four 16 x 16 float32 accumulator tiles. Per tap and block of 32 input channels it
  loads two weight tiles (16 channels x 32 bfloat16, packed at compile time) and two position tiles straight
  from the planes (16 rows, one per channel pair, ``F * PL * 4`` bytes apart; 16 wide positions x one pair
  each) and issues four ``tdpbf16ps``; the tiles are stored to the stack.
* **With vdpbf16ps** (``X86Tuning(bf16_planes=True)`` on a CPU with AVX512_BF16 and no AMX, or with
  ``amx=False``: opt-in until measured on such a CPU; ``bf16_planes_dp``): a unit is 8
  output channels over 16, 32 or 48 wide positions (``nr``, the least padded work, as the int8 VNNI kernel),
  8 x nr / 16 accumulators in registers. Per tap and channel pair it loads nr / 16 vectors of pairs straight
  from the planes, broadcasts each channel's weight pair and issues ``vdpbf16ps``; then stores them.
* Either way the stage's fused epilogue (bias, folded BatchNorm, activation, residual add) then runs over the
  stored accumulators, on vectors of 16 wide positions (:class:`_WideEpilogue`) or element by element; the
  columns of dropped wide positions (``ow >= OW``) are skipped. Units take the operand that is re-read
  fastest: where the weights outweigh one image's planes (deep 7x7 and 14x14 layers) a thread's consecutive
  units share a weight block (each weight read once per image), else a block of positions.
* **The planes** (:func:`emit_pair_planes_stage`, :mod:`cuvil.targets.x86.phase_planes`): per grid row and 16
  positions, the two channel rows of a pair are each one masked load (padding and a missing last channel read
  zero; a strided row takes every ``sw``-th element), rounded to bfloat16 (``vcvtneps2bf16``; a bfloat16 input
  as it is) and interleaved into one 64-byte store. The bytes written are the input's (as bfloat16), where the
  packed form wrote its im2col.

Only where the CPU runs the path the lowering chose (AMX-BF16, or AVX512_BF16); else the stages compute their
plain values. The manifest's step ``kernel`` says ``bf16_planes_amx`` / ``bf16_planes_dp`` / ``bf16_planes``, its
``path`` ``amx_bf16`` or ``avx512_bf16``: the library checks those features at session creation (and asks Linux
for the AMX tile state, amx.py), as for the packed form.
"""
from __future__ import annotations

from typing import Optional, Tuple

import llvmlite.ir as ir

from ...ir.dtype import DType
from ...kernels.contraction_planes import CHANNEL_BLOCK, PairPlanes, PlaneContraction
from ...kernels.schedule import Stage
from ...kernels.texpr import E, nodes
from ..llvm.narrow import I16
from ..llvm.types import F32, I32, I64, PTR, const_value, splat
from .amx import AMX_BF16_PATH, Tiles, bf16_tile_loop, has_amx
from .gemm import find_contraction, runs_along_last_axis, tile_epilogue, vector_epilogue_plan, vector_op
from .gemm_bf16 import AVX512_BF16, PAIRS, bf16_supported, dpbf16, to_bf16
from .gemm_int8 import byte_ptr, carry_loop
from .phase_planes import emit_phase_planes

KIND = "bf16_planes_amx"
DP_KIND = "bf16_planes_dp"
PLANES_KIND = "bf16_planes"
DP_MR = 8            # output channels of a vdpbf16ps unit (8 x nr / 16 accumulator registers)
I8 = ir.IntType(8)
VW = 16


def emit_pair_planes_stage(km, st: Stage, sym: str) -> Optional[Tuple[object, int]]:
    """Emit the pair planes of a bf16 convolution's input (``E("pplanes")``, :mod:`cuvil.targets.x86.phase_planes`):
    per grid row and 16 positions, two masked channel-row loads, rounded to bfloat16 (a bfloat16 input as it is)
    and interleaved into one 64-byte store. Only where the AMX kernels run (the planes' one reader); else the
    generic loop nest. (Only where the bf16 kernels that read them run: AMX tiles, or AVX512_BF16.)"""
    if st.expr.op != "pplanes" or not isinstance(st.expr.attr, PairPlanes) or st.region is not None:
        return None
    spec: PairPlanes = st.expr.attr
    if find_contraction(st, "pplanes") is not st.expr or not (has_amx(getattr(km, "cpu_features", ())) if spec.amx
                                                             else bf16_supported(km)):
        return None
    if (spec.strides[1] > 4 or len(spec.x.shape) != 4 or spec.x.strides[-1] != 1
            or spec.x.dtype not in (DType.FLOAT, DType.BFLOAT16)):
        return None
    x16 = spec.x.dtype == DType.BFLOAT16
    h16 = ir.VectorType(I16, VW)
    inter = ir.Constant(ir.VectorType(I32, 2 * VW), [i * VW + j for j in range(VW) for i in range(2)])

    def word(b, rows):   # each position's two channels adjacent: a (even, odd) pair of k
        rows = rows if x16 else [b.bitcast(to_bf16(b, r), h16) for r in rows]
        return b.shuffle_vector(rows[0], rows[1], inter)
    done = emit_phase_planes(km, st, sym, spec, 2, I16 if x16 else F32, 0 if x16 else 0.0, word,
                             ir.Constant(ir.VectorType(I16, 2 * VW), [0] * (2 * VW)))
    km.window_kinds[sym] = PLANES_KIND
    km.narrow_paths[sym] = AMX_BF16_PATH if spec.amx else AVX512_BF16
    return done


def weight_major(spec: PlaneContraction) -> bool:
    """Whether a thread's consecutive units share a weight block (positions fastest): where the packed weights
    outweigh one image's planes, each weight block is then read once per image instead of once per panel."""
    weights = spec.m_blocks * len(spec.taps) * spec.k_blocks * spec.mr * CHANNEL_BLOCK * 2
    return weights > spec.groups * spec.num_phases * spec.plane * 4


def emit_plane_gemm_stage(km, st: Stage, sym: str) -> Optional[Tuple[object, int]]:
    """Emit a convolution stage over pair planes (AMX tiles, or vdpbf16ps); (parallel extent, grain), or None
    (the generic loop nest computes the node's plain value)."""
    c = find_contraction(st)
    if c is None or not isinstance(c.attr, PlaneContraction) or st.region is not None or len(st.buf.shape) != 4:
        return None
    spec: PlaneContraction = c.attr
    if not (has_amx(getattr(km, "cpu_features", ())) if spec.amx else bf16_supported(km)):
        km.narrow_paths[sym] = "fp32 fallback"      # (the loop nest computes the plain bf16 expression)
        return None
    NR = spec.nr
    MR = spec.mr if spec.amx else DP_MR          # output channels a unit
    PB, MU = spec.p_blocks, -(-spec.m // MR)
    OW, Wq = spec.out_hw[1], spec.wq
    by_weights = weight_major(spec)
    em, begin, end = km.kernel(sym)
    b = em.b
    cbuf = em.alloca(ir.ArrayType(F32, MR * NR))      # the unit's accumulators, stored: [MR rows][NR positions]
    cbuf.align = 64
    tile_f = b.bitcast(cbuf, ir.PointerType(F32))
    # an epilogue of per-channel and same-position operands into an unpitched float32 / bfloat16 output runs on
    # vectors of 16 wide positions (WideEpilogue); any other the spilled-tile way, position by position
    vplan = vector_epilogue_plan(st, c)
    if vplan is not None and (st.buf.pitch is not None or any(
            _loaded(st.expr, uid).attr.pitch is not None for uid, kind in vplan.items() if kind != "channel")):
        vplan = None
    vector = _WideEpilogue(km, em, st, c, vplan, spec, tile_f, NR) if vplan is not None else None
    compute = (_amx_kernel if spec.amx else _dp_kernel)(km, em, spec, sym, tile_f)

    def unit(u):
        n = b.sdiv(u, I64(PB * MU))
        rest = b.srem(u, I64(PB * MU))
        if by_weights:
            mu, pb = b.sdiv(rest, I64(PB)), b.srem(rest, I64(PB))
        else:
            pb, mu = b.sdiv(rest, I64(MU)), b.srem(rest, I64(MU))
        p0 = b.mul(pb, I64(NR))
        compute(n, p0, mu)
        m0 = b.mul(mu, I64(MR))
        mleft = b.sub(I64(spec.m), m0)
        nrows = b.select(b.icmp_signed("<", mleft, I64(MR)), mleft, I64(MR))
        if vplan is not None:
            vector.run(n, m0, nrows, p0)
            return
        left = b.sub(I64(spec.wide), p0)
        ncols = b.select(b.icmp_signed("<", left, I64(NR)), left, I64(NR))

        def run(j0, length):         # wide positions within one grid row: its columns below OW are outputs
            q = b.add(p0, j0)
            oh, ow = b.sdiv(q, I64(Wq)), b.srem(q, I64(Wq))
            room = b.sub(I64(OW), ow)
            room = b.select(b.icmp_signed("<", room, I64(0)), I64(0), room)
            valid = b.select(b.icmp_signed("<", room, length), room, length)

            def index(r, j):
                return [n, b.add(m0, r), oh, b.add(ow, j)]

            def slot(r, j):
                return b.gep(tile_f, [b.add(b.mul(r, I64(NR)), b.add(j0, j))], source_etype=F32, inbounds=True)
            tile_epilogue(em, st, c, slot, index, nrows, valid)
        runs_along_last_axis(em, ncols, lambda j0: b.sub(I64(Wq), b.srem(b.add(p0, j0), I64(Wq))), run)

    em.loop_range(begin, end, unit)
    b.ret_void()
    km.window_kinds[sym] = KIND if spec.amx else DP_KIND
    km.narrow_paths[sym] = AMX_BF16_PATH if spec.amx else AVX512_BF16
    return spec.n * PB * MU, 1


def _amx_kernel(km, em, spec: PlaneContraction, sym: str, tile_f):
    """``compute(n, p0, mb)``: the 32 x 32 tile of weight block ``mb`` at wide positions p0.. into ``tile_f`` (four
    16 x 16 AMX accumulators; one loop over the steps s = (channel block, tap): the weight block's A tiles are
    consecutive in s; a step's position tiles are at its tap's shift, a constant table, in its block's first
    pair plane, so the taps of one channel block re-read the same few lines of each pair's plane). The weight
    tiles, read once per unit, are loaded with ``tileloaddt1`` (a hint to keep them out of L1, where the planes'
    lines are re-read over the taps; oneDNN's AMX convolutions load their weight tiles so): ResNet-50's 3x3 layers
    at 56x56 and 28x28 0.83x and 0.92x, at 14x14 level (a Xeon with AMX, family 6 model 207; bench/PRECISION.md,
    session 27). The same bits: a hint."""
    b = em.b
    tiles = Tiles(km, b)
    T, G, KB, F, PL, MR, NR = len(spec.taps), spec.groups, spec.k_blocks, spec.num_phases, spec.plane, spec.mr, spec.nr
    g_stride = F * PL * 4            # bytes from one channel pair's planes to the next
    a_bytes = MR * CHANNEL_BLOCK * 2     # one (tap, channel block) of a weight block: two A tiles
    arr = ir.ArrayType(I64, T)           # per tap, the words from a pair plane's start to its shifted panel
    shifts = ir.GlobalVariable(km.module, arr, name=f"{sym}.shifts")
    shifts.global_constant, shifts.linkage = True, "internal"
    shifts.initializer = ir.Constant(arr, [f_t * PL + off_t for f_t, off_t in spec.taps])

    def compute(n, p0, mb):
        w_mb = byte_ptr(em, spec.w, b.mul(mb, I64(T * KB * a_bytes)))
        b_n = byte_ptr(em, spec.b, b.mul(b.add(b.mul(n, I64(G * F * PL)), p0), I64(4)))

        def b_at(s, y):
            t, kb = b.urem(s, I64(T)), b.udiv(s, I64(T))
            shift = b.load(b.gep(shifts, [I32(0), t], inbounds=True), typ=I64)
            words = b.add(b.add(b.mul(kb, I64(CHANNEL_BLOCK // 2 * F * PL)), shift), I64(y * VW))
            return b.gep(b_n, [b.mul(words, I64(4))], source_etype=I8, inbounds=True)
        accs = bf16_tile_loop(em, tiles, I64(T * KB),
                              lambda s, x: b.gep(w_mb, [b.add(b.mul(s, I64(a_bytes)), I64(x * a_bytes // 2))],
                                                 source_etype=I8, inbounds=True), 64,
                              b_at, g_stride, 2, 2, a_streamed=True)
        for x in range(2):
            for y in range(2):
                tiles.store(accs[2 * x + y], b.gep(tile_f, [I64(x * 16 * NR + y * VW)], source_etype=F32), NR * 4)
    return compute


def _dp_kernel(km, em, spec: PlaneContraction, sym: str, tile_f):
    """``compute(n, p0, mu)``: DP_MR output channels (block ``mu // 4`` of the packed weights, rows from
    ``(mu % 4) * DP_MR``) x nr wide positions into ``tile_f``, in registers: per tap and channel pair, nr / 16
    vectors of pairs loaded straight from the planes, each channel's weight pair broadcast, ``vdpbf16ps``."""
    b = em.b
    mac = dpbf16(km, b)
    T, G, KB, F, PL, NR = len(spec.taps), spec.groups, spec.k_blocks, spec.num_phases, spec.plane, spec.nr
    nv = NR // VW
    half = CHANNEL_BLOCK // 2
    zero = ir.Constant(ir.VectorType(F32, VW), [0.0] * VW)

    def compute(n, p0, mu):
        mb, r0 = b.sdiv(mu, I64(spec.mr // DP_MR)), b.mul(b.srem(mu, I64(spec.mr // DP_MR)), I64(DP_MR))
        accs = [zero] * (DP_MR * nv)
        for t, (f_t, off_t) in enumerate(spec.taps):
            b_t = byte_ptr(em, spec.b, b.mul(b.add(b.mul(b.add(b.mul(n, I64(G * F)), I64(f_t)), I64(PL)),
                                                    b.add(p0, I64(off_t))), I64(4)))
            w_t = byte_ptr(em, spec.w, b.mul(b.add(b.mul(b.add(b.mul(mb, I64(KB * T)), I64(t)), I64(spec.mr)), r0),
                                              I64(half * 4)))

            def block(kb, accs, b_t=b_t, w_t=w_t):
                b_k = b.gep(b_t, [b.mul(kb, I64(half * F * PL * 4))], source_etype=I8, inbounds=True)
                w_k = b.gep(w_t, [b.mul(kb, I64(T * spec.mr * half * 4))], source_etype=I8, inbounds=True)

                def pair(j, accs):
                    row = b.gep(b_k, [b.mul(j, I64(F * PL * 4))], source_etype=I8, inbounds=True)
                    bv = [b.load(b.bitcast(b.gep(row, [I64(v * VW * 4)], source_etype=I8, inbounds=True),
                                           PAIRS.as_pointer()), typ=PAIRS, align=4) for v in range(nv)]
                    new = []
                    for r in range(DP_MR):
                        at = b.gep(w_k, [b.add(b.mul(I64(r), I64(half * 4)), b.mul(j, I64(4)))], source_etype=I8,
                                   inbounds=True)
                        w = splat(b, b.load(b.bitcast(at, I32.as_pointer()), typ=I32, align=4), VW)
                        new += [mac(w, bv[v], accs[r * nv + v]) for v in range(nv)]
                    return new
                return carry_loop(em, half, accs, pair)
            accs = carry_loop(em, KB, accs, block)
        for r in range(DP_MR):
            for v in range(nv):
                at = b.gep(tile_f, [I64(r * NR + v * VW)], source_etype=F32)
                b.store(accs[r * nv + v], b.bitcast(at, accs[0].type.as_pointer()), align=4)
    return compute


def _loaded(expr: E, uid: int) -> E:
    """The load of a vector plan's entry (a "position16" entry is the cast around its load)."""
    e = next(x for x in nodes(expr) if x.uid == uid)
    return e.args[0] if e.op == "cast" else e


class _WideEpilogue:
    """The stage's epilogue on vectors of 16 wide positions of the stored tile (a vector plan of
    :func:`cuvil.targets.x86.gemm.vector_epilogue_plan`): per channel row, operands at the output position (a
    residual) are the ``count`` consecutive output elements from the vector's first output position, loaded with a
    mask and expanded (``vexpandps``) onto the valid lanes; the result's valid lanes are compressed
    (``vcompressps``) and their ``count`` leading lanes stored, rounded to bfloat16 for a bfloat16 output. Both
    in registers: the memory forms of compress and expand are microcoded on some cores."""

    def __init__(self, km, em, st: Stage, node: E, kinds: dict, spec: PlaneContraction, tile_f, nr: int):
        self.em, self.b, self.st, self.node, self.kinds, self.spec, self.tile_f = em, em.b, st, node, kinds, spec, tile_f
        self.nr = nr
        self.vec = vec = ir.VectorType(F32, VW)
        self.i1v = i1v = ir.VectorType(ir.IntType(1), VW)
        self.h16 = h16 = ir.VectorType(I16, VW)
        self.compress = km.declare("llvm.x86.avx512.mask.compress.v16f32", vec, [vec, vec, i1v])
        self.expand = km.declare("llvm.x86.avx512.mask.expand.v16f32", vec, [vec, vec, i1v])
        self.fload = km.declare("llvm.masked.load.v16f32.p0", vec, [PTR, I32, i1v, vec])
        self.fstore = km.declare("llvm.masked.store.v16f32.p0", ir.VoidType(), [vec, PTR, I32, i1v])
        self.hload = km.declare("llvm.masked.load.v16i16.p0", h16, [PTR, I32, i1v, h16])
        self.hstore = km.declare("llvm.masked.store.v16i16.p0", ir.VoidType(), [h16, PTR, I32, i1v])
        self.ctpop = km.declare("llvm.ctpop.i32", I32, [I32])
        self.zero = ir.Constant(vec, [0.0] * VW)
        self.lanes = ir.Constant(ir.VectorType(I32, VW), list(range(VW)))

    def positions(self, q0):
        """(first output position, leading-lanes mask of the count, valid-lanes mask) of the 16 wide positions
        from ``q0``: the valid ones (``ow < OW``, below the last) are consecutive output positions."""
        b, spec = self.b, self.spec
        (_, OW), Wq = spec.out_hw, spec.wq
        i32v = self.lanes.type
        wp = b.add(splat(b, b.trunc(q0, I32), VW), self.lanes)
        valid = b.icmp_signed("<", wp, splat(b, I32(spec.wide), VW))
        if Wq != OW:
            valid = b.and_(valid, b.icmp_signed("<", b.srem(wp, splat(b, I32(Wq), VW)), splat(b, I32(OW), VW)))
        count = b.call(self.ctpop, [b.zext(b.bitcast(valid, ir.IntType(VW)), I32)])
        lead = b.icmp_signed("<", self.lanes, b.bitcast(splat(b, count, VW), i32v))
        oh, ow = b.sdiv(q0, I64(Wq)), b.srem(q0, I64(Wq))
        first = b.select(b.icmp_signed("<", ow, I64(OW)), b.add(b.mul(oh, I64(OW)), ow), b.mul(b.add(oh, I64(1)), I64(OW)))
        return first, lead, valid

    def run(self, n, m0, nrows, p0):
        b, em, st = self.b, self.em, self.st
        pos = [self.positions(b.add(p0, I64(v * VW))) for v in range(self.nr // VW)]
        names = [v.attr for v in st.vars]
        zero_h = ir.Constant(self.h16, [0] * VW)

        def row(r):
            m = b.add(m0, r)
            em.env[names[0]], em.env[names[1]] = n, m
            channel = lambda buf: em.address(buf, [n, m, I64(0), I64(0)])
            for v, (first, lead, valid) in enumerate(pos):
                memo = {}

                def emit(e: E):
                    if e.uid in memo:
                        return memo[e.uid]
                    kind = self.kinds.get(e.uid)
                    if e is self.node:
                        at = b.gep(self.tile_f, [b.add(b.mul(r, I64(self.nr)), I64(v * VW))], source_etype=F32)
                        out = b.load(b.bitcast(at, self.vec.as_pointer()), typ=self.vec, align=4)
                    elif e.op == "const":
                        out = splat(b, const_value(e.attr, e.dtype), VW)
                    elif kind == "channel":
                        out = splat(b, em.emit(e), VW)
                    elif kind == "position":
                        at = b.gep(channel(e.attr), [first], source_etype=F32)
                        out = b.call(self.expand, [b.call(self.fload, [at, I32(4), lead, self.zero]), self.zero, valid])
                    elif kind == "position16":           # a bfloat16 residual, widened exactly
                        ld = e.args[0]
                        at = b.gep(channel(ld.attr), [first], source_etype=I16)
                        h = b.call(self.hload, [at, I32(2), lead, zero_h])
                        wide = ir.VectorType(I32, VW)
                        f = b.bitcast(b.shl(b.zext(h, wide), ir.Constant(wide, [16] * VW)), self.vec)
                        out = b.call(self.expand, [f, self.zero, valid])
                    else:
                        out = vector_op(b, em, e, [emit(a) for a in e.args])
                    memo[e.uid] = out
                    return out
                value = b.call(self.compress, [emit(st.expr), self.zero, valid])
                if st.buf.dtype == DType.BFLOAT16:
                    h = b.bitcast(to_bf16(b, value), self.h16)
                    b.call(self.hstore, [h, b.gep(channel(st.buf), [first], source_etype=I16), I32(2), lead])
                else:
                    b.call(self.fstore, [value, b.gep(channel(st.buf), [first], source_etype=F32), I32(4), lead])
        em.loop_range(I64(0), nrows, row)
