"""One-row products ``y[n] = sum_k x[k] * W[k, n]`` (+ the stage's fused epilogue) at memory speed: the GPT-2
decode step's weight GEMVs (``x[1, 768] @ W[768, 2304 / 768 / 3072]``, ``[1, 3072] @ [3072, 768]``, the LM
head) with the weight row-major, ``n`` contiguous (opt-in: ``PtxTuning.gemv``).

The lane-split kernels (:meth:`~cuvil.targets.ptx.codegen.PtxKernelModule.add_split_stage`) give each output
16-32 consecutive threads splitting its ``k`` sum, so one warp load reads 16-32 different weight rows 4-8 bytes
each. Here threads run along ``n`` instead:

* a block of :data:`THREADS` threads (more, up to :data:`MAX_THREADS`, where the grid leaves the GPU mostly
  empty and a thread would have more rows than one unrolled round) owns ``TN = VEC * CT`` consecutive
  columns of one output row (several rows: a batch of products, each with a matrix of its own, such as a
  decode step's attention ``P[h, 1, p] @ V[h, p, d]``); thread ``t`` takes the ``VEC`` columns from
  ``VEC * (t % CT)`` (one 16-byte ``ld.global.nc.v4`` of ``W`` per row, 4 float32 or 8 float16 columns, where
  the row stride and the buffer's offset keep 16 bytes aligned; else ``VEC = 4`` columns ``t % CT + j * CT``,
  four scalar loads at clamped columns, each instruction reading ``CT`` consecutive elements of a row) and
  rows ``k = t / CT, t / CT + KS, ...`` (``KS = THREADS / CT`` row slices); so a warp's vector load reads
  ``32 / CT`` rows of ``16 * CT`` contiguous bytes each (whole 32-byte sectors for every ``CT`` >= 2).
  ``CT`` is the largest of 8, 4, 2 that still launches ``PtxTuning.gemv_min_blocks`` blocks (else 2).
* ``x`` (the factor without ``n``, whatever its expression) is evaluated once per block into shared memory
  (``K`` floats, at most :data:`MAX_K`), then read by broadcast.
* the row loop is unrolled up to :data:`MAX_UNROLL` times, all the unrolled rows' weight loads issued before
  their multiply-adds (several 16-byte loads in flight per thread: what streams the weight at HBM speed);
* the ``KS`` partial sums of a column meet in shared memory and are added in a fixed order (deterministic, run
  to run): groups of ``KS / G`` consecutive slices, each by a thread in slice order, then the ``G = THREADS /
  TN`` groups in order by one thread per column, which evaluates the stage's expression (bias, residual,
  GELU) and stores.

The summation order differs from the lane-split kernels' (each thread's rows in order, then the slices in
order), as any other schedule's would; the multiply-adds are the reduction's own (``fma`` only where a kernel
rule made the reduction an ``fma`` one). Only products with one output row (every output dimension but the
last of extent 1), or a few rows each with its own weight matrix, take it."""
from __future__ import annotations

from typing import List, Optional

import attrs
import llvmlite.ir as ir

from ...ir.dtype import DType
from ...kernels.schedule import ARENA, WEIGHTS, Stage
from ...kernels.texpr import nodes
from ..llvm.types import F32, I32, I64, const_value, mem_type
from .emitter import PtxEmitter, overlaps, set_contraction
from .matmul_mma import _stride

THREADS = 256            # threads per block, doubled up to MAX_THREADS for small grids with long rows (GemvPlan)
MAX_THREADS = 1024
RESIDENT = 132 * 2048    # threads an H200 holds at once (132 SMs x 2,048)
SMEM_LIMIT = 46 * 1024   # static shared memory a block may take (48 KB, with room)
MAX_K = 8192             # reduction length at most (x cached in shared memory: 32 KB)
MAX_ROWS = 64            # output rows at most (a decode step's attention: one per head)
MAX_UNROLL = 8           # rows per iteration of a thread's loop at most (their loads issued together)
MAX_BLOCKS = 65535       # one block per column tile (no grid-stride loop)


@attrs.frozen
class GemvPlan:
    n: int                   # columns (outputs)
    k: int                   # reduction length
    ct: int                  # column threads
    vector: bool             # 16-byte loads of W (aligned rows), else scalar loads at clamped columns
    vec: int = 4             # columns per thread: 16 bytes of W with vector loads (4 float32, 8 float16), else 4
    threads: int = THREADS   # per block
    rows: int = 1            # output rows (the product of every output dimension but the last): a block each tile

    @property
    def tiles(self) -> int:
        """Column tiles per row."""
        return -(-self.n // self.tn)

    @property
    def tn(self) -> int:
        return self.vec * self.ct

    @property
    def ks(self) -> int:
        return self.threads // self.ct

    @property
    def unroll(self) -> int:
        """Rows per iteration: every row the thread has (K / KS of them) up to MAX_UNROLL."""
        return min(MAX_UNROLL, max(1, self.k // self.ks))

    @property
    def blocks(self) -> int:
        return self.rows * self.tiles

    @property
    def smem_bytes(self) -> int:
        """x, the slices' partial sums, the groups' sums (floats)."""
        return 4 * (self.k + self.ks * self.tn + self.threads)


def plan_gemv(st: Stage, parts, min_blocks: int = 264) -> Optional[GemvPlan]:
    """The plan for a matmul stage (``parts`` from :func:`~cuvil.targets.ptx.matmul_mma.matmul_parts`) with one
    output row whose weight factor reads ``n`` contiguously; None for any other."""
    if parts is None:
        return None
    red, _a, w, _ = parts
    shape = [int(d) for d in st.buf.shape]
    rows = 1
    for d in shape[:-1]:
        rows *= d
    n, k = shape[-1], int(red.attr[2][0])
    if rows > MAX_ROWS or n < 1 or not 1 <= k <= MAX_K or red.dtype != DType.FLOAT:
        return None
    kv, nv = red.attr[1][0].attr, st.vars[-1].attr
    if _stride(w, nv) != 1:
        return None
    # several rows only where each reads a matrix of its own (attention's V per head): rows sharing W (x[M, K] @
    # W, M > 1) would each stream it again
    if any(d > 1 and _stride(w, v.attr) in (0, None) for v, d in zip(st.vars[:-1], shape[:-1])):
        return None
    vec = _vector_width(w, [kv] + [v.attr for v in st.vars[:-1]], n, nv)
    per = vec or 4
    ct = 2
    for c in (8, 4, 2):
        if rows * -(-n // (per * c)) >= min_blocks:
            ct = c
            break
    if rows * -(-n // (per * ct)) > MAX_BLOCKS:
        return None
    plan = GemvPlan(n, k, ct, vec > 0, per, rows=rows)
    # a grid that leaves the GPU mostly empty, with more rows per thread than one unrolled round: more threads
    # per block (the rows' loads all in flight at once, as split-K over blocks would have them)
    while (plan.threads < MAX_THREADS and plan.blocks * plan.threads < RESIDENT and k > MAX_UNROLL * plan.ks
           and attrs.evolve(plan, threads=2 * plan.threads).smem_bytes <= SMEM_LIMIT):
        plan = attrs.evolve(plan, threads=2 * plan.threads)
    return plan if plan.smem_bytes <= SMEM_LIMIT else None


def _uses_var_outside(e, var, skip) -> bool:
    """Whether ``e`` reads the loop variable ``var`` anywhere but inside the subtree ``skip``."""
    stack, seen = [e], set()
    while stack:
        x = stack.pop()
        if x.uid in seen or x.uid == skip.uid:
            continue
        seen.add(x.uid)
        if x.op == "var" and x.attr == var:
            return True
        stack.extend(x.args)
    return False


def _vector_width(w, others, n: int, n_var=None) -> int:
    """Elements of W in 16 bytes (4 float32, 8 float16) when every row's run of them from a multiple of that
    column is 16-byte aligned: one load, indexed by the plain variables, its strides along ``others`` (the
    reduction and the output's leading indices), columns and offset multiples of 16 bytes, no pitched view,
    storage in the weights or the arena (allocated by the runtime, 256-byte aligned; a graph input's device
    pointer is the caller's); else 0."""
    loads = [x for x in nodes(w) if x.op == "load"]
    # the vector path loads the thread's columns once and evaluates the rest of the factor at its first column:
    # only a factor whose one load is all that depends on n (W[k, n], a cast of it, W times a scalar) takes it
    if len(loads) != 1 or _uses_var_outside(w, n_var, loads[0]):
        return 0
    ld = loads[0]
    buf = ld.attr
    if buf.dtype not in (DType.FLOAT, DType.FLOAT16) or buf.pitch is not None:
        return 0
    el = 16 // buf.dtype.itemsize
    if n % el or buf.storage.base not in (ARENA, WEIGHTS):
        return 0
    if not all(a.op == "var" or (a.op == "const" and a.attr == 0) for a in ld.args):
        return 0
    strides = [_stride(w, v) for v in others]
    return el if all(x is not None and x % el == 0 for x in strides) and buf.offset % 16 == 0 else 0


def emit_gemv(km, st: Stage, sym: str, parts, plan: GemvPlan) -> int:
    """Emit the kernel ``sym``; returns its launch size in threads (``blocks * plan.threads``)."""
    red, afac, wfac, _ = parts
    fn = km.kernel_fn(sym)
    km.module.add_named_metadata("nvvm.annotations", [fn, "maxntidx", I32(plan.threads)])
    bufs, _n = fn.args
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    em = PtxEmitter(km, fn, b, bufs, st.buf)
    N, K, CT, TN, KS, VEC, THREADS = plan.n, plan.k, plan.ct, plan.tn, plan.ks, plan.vec, plan.threads
    kv, nv = red.attr[1][0].attr, st.vars[-1].attr
    lead = [v.attr for v in st.vars[:-1]]
    fma_kind = red.attr[0] == "fma"
    fmaf = em.fma_fn(DType.FLOAT) if fma_kind else None
    ld = [x for x in nodes(wfac) if x.op == "load"][0]
    wbuf = ld.attr
    invariant = not overlaps(wbuf, st.buf)

    xs, ps, qs = (em.shared_array(f"{sym}_{n}", F32, floats)
                  for n, floats in (("x", K), ("p", KS * TN), ("q", THREADS)))
    bar = km.declare("llvm.nvvm.barrier0", ir.VoidType(), [])

    def sptr(base, idx):
        return b.gep(base, [idx], source_etype=F32, inbounds=True)

    tid, blk = km.sreg(b, "tid.x"), km.sreg(b, "ctaid.x")
    # the block's output row (its leading indices, bound for x, W and the epilogue) and column tile
    row, tile = b.udiv(blk, I64(plan.tiles)), b.urem(blk, I64(plan.tiles))
    lead_idx: List[ir.Value] = []
    for d in reversed([int(x) for x in st.buf.shape[:-1]]):
        lead_idx.insert(0, b.urem(row, I64(d)))
        row = b.udiv(row, I64(d))
    for v, i in zip(lead, lead_idx):
        em.env[v] = i

    # x into shared memory, once per block
    def fill(k):
        em.env[kv] = k
        b.store(em.emit(afac), sptr(xs, k))
    em.loop_range(tid, I64(K), fill, I64(THREADS))
    b.call(bar, [])

    ct = b.urem(tid, I64(CT))
    ks = b.udiv(tid, I64(CT))
    # the thread's VEC columns in the tile: VEC ct .. VEC ct + VEC - 1 (one 16-byte load), else ct, ct + CT,
    # ct + 2 CT, ct + 3 CT (each scalar load instruction then reads CT consecutive elements of a row per warp)
    local = [b.add(b.mul(ct, I64(VEC)), I64(j)) if plan.vector else b.add(ct, I64(j * CT)) for j in range(VEC)]
    n0 = b.add(b.mul(tile, I64(TN)), local[0])
    accs = [em.alloca(F32) for _ in range(VEC)]
    for a in accs:
        b.store(const_value(0.0, DType.FLOAT), a)
    if plan.vector:      # columns n0.. all inside or all past N (N % VEC == 0): read the last VEC instead
        n0v = b.select(b.icmp_unsigned("<", n0, I64(N)), n0, I64(N - VEC))
        cols = [n0v]
    else:
        last = I64(N - 1)
        cols = []
        for j in range(VEC):
            c = b.add(b.mul(tile, I64(TN)), local[j])
            cols.append(b.select(b.icmp_unsigned("<", c, last), c, last))
    wt = mem_type(wbuf.dtype)
    vt = ir.VectorType(wt, VEC)

    half = wbuf.dtype == DType.FLOAT16
    rt = ir.IntType(32) if half else F32
    ldg = ir.InlineAsm(ir.FunctionType(ir.LiteralStructType([rt] * 4), [I64]),
                       "ld.global.nc.v4.%s {$0, $1, $2, $3}, [$4];" % ("b32" if half else "f32"),
                       ",".join(["=r" if half else "=f"] * 4 + ["l"]), side_effect=False)

    def ldg16(p):
        """The VEC elements of 16 bytes at global address p through the read-only data cache: NVPTX emits a
        plain ld.global.v4 for an ``!invariant.load`` vector load, so the ``ld.global.nc.v4`` is written out
        (float16: four 32-bit registers of two halves each)."""
        r = b.call(ldg, [b.ptrtoint(p, I64)])
        vals = [b.extract_value(r, j) for j in range(4)]
        if not half:
            return vals
        pairs = [b.bitcast(x, ir.VectorType(wt, 2)) for x in vals]
        return [b.extract_element(pr, I32(h)) for pr in pairs for h in range(2)]

    def weights(k):
        """The weight factor at row k, the thread's VEC columns."""
        em.env[kv] = k
        out = []
        if plan.vector:
            em.env[nv] = cols[0]
            em.memo.append(dict(em.memo[-1]))
            p = em.address(wbuf, [em.emit(a) for a in ld.args])
            em.memo.pop()
            if invariant:
                raw = ldg16(p)
            else:
                v = b.load(p, typ=vt, align=16)
                raw = [b.extract_element(v, I32(j)) for j in range(VEC)]
            for j in range(VEC):
                em.memo.append(dict(em.memo[-1]))
                em.memo[-1][ld.uid] = em.from_memory(raw[j], wbuf.dtype)
                out.append(em.emit(wfac))
                em.memo.pop()
        else:
            for j in range(VEC):
                em.env[nv] = cols[j]
                em.memo.append(dict(em.memo[-1]))
                out.append(em.emit(wfac))
                em.memo.pop()
        return out

    def accumulate(x, ws):
        for a, wv in zip(accs, ws):
            s = b.load(a, typ=F32)
            b.store(b.call(fmaf, [x, wv, s]) if fma_kind else b.fadd(s, b.fmul(x, wv)), a)

    def rows(ks_list):
        loaded = [(b.load(sptr(xs, k), typ=F32), weights(k)) for k in ks_list]   # every load first
        for x, ws in loaded:
            accumulate(x, ws)

    # main loop: U rows k, k + KS, ... per iteration (all of a thread's rows where it has at most MAX_UNROLL); then
    # the remaining rows one by one (in order)
    U = plan.unroll
    step = U * KS
    main_stop = K - (U - 1) * KS
    if main_stop > 0:
        em.loop_range(ks, I64(main_stop), lambda k: rows([b.add(k, I64(u * KS)) for u in range(U)]),
                      I64(step))
        left = b.sub(I64(main_stop), ks)
        iters = b.select(b.icmp_signed(">", left, I64(0)), b.udiv(b.add(left, I64(step - 1)), I64(step)), I64(0))
        tail = b.add(ks, b.mul(iters, I64(step)))
    else:
        tail = ks
    em.loop_range(tail, I64(K), lambda k: rows([k]), I64(KS))

    # the slices' partial sums meet in shared memory and are added in a fixed order in two rounds (a chain of KS
    # dependent adds in one thread per column took longer than the loads): the G = THREADS / TN groups of
    # PER = KS / G consecutive slices, each by one thread in slice order, then the groups in order
    for j, a in enumerate(accs):
        b.store(b.load(a, typ=F32), sptr(ps, b.add(b.mul(ks, I64(TN)), local[j])))
    b.call(bar, [])
    G = THREADS // TN
    PER = KS // G
    c, g = b.urem(tid, I64(TN)), b.udiv(tid, I64(TN))
    first = b.add(b.mul(g, I64(PER * TN)), c)
    part = b.load(sptr(ps, first), typ=F32)
    for s in range(1, PER):
        part = b.fadd(part, b.load(sptr(ps, b.add(first, I64(s * TN))), typ=F32))
    b.store(part, sptr(qs, tid))             # qs[g * TN + c]
    b.call(bar, [])
    col = b.add(b.mul(tile, I64(TN)), tid)
    with b.if_then(b.and_(b.icmp_unsigned("<", tid, I64(TN)), b.icmp_unsigned("<", col, I64(N)))):
        total = b.load(sptr(qs, tid), typ=F32)
        for s in range(1, G):
            total = b.fadd(total, b.load(sptr(qs, b.add(tid, I64(s * TN))), typ=F32))
        em.env[nv] = col
        em.memo.append(dict(em.memo[-1]))
        em.memo[-1][red.uid] = total
        val = em.to_memory(em.emit(st.expr), st.buf.dtype)
        b.store(val, em.address(st.buf, lead_idx + [col]))
        em.memo.pop()
    b.ret_void()
    set_contraction(fn, False)
    km.kernels.append(sym)
    return plan.blocks * plan.threads
