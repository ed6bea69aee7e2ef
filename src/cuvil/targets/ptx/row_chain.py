"""Row reductions and the element stage that uses them as one GPU kernel, a thread block per row: LayerNorm
(mean, variance, normalise) and Softmax (max, sum of exponentials, divide) as the GPU schedule lowers them.

Which stages (:func:`row_chain_at`): consecutive stages ``s_1 .. s_k`` (k >= 2) where ``s_k`` is an element
stage of shape ``R + [N]`` (no reduction) and each earlier one computes one value per row, shape ``R + [1]``,
from one top-level float32 reduction (sum, fma, max, min; or a float16 max or min, as the float16 path's
softmax computes its row maximum) of at least :data:`MIN_TERMS` terms, with an element epilogue (the mean's
division). A stage of the chain may read an earlier one's output only at its own row
(each index of a row dimension the stage's own variable, or a dimension of size 1), and no buffer the chain
writes may share bytes with any other buffer the chain reads (the arena may reuse a buffer once its last
reader has run; within one kernel that reader would still be running). Static shapes, no region, no guard.

The kernel (:func:`emit_row_chain`): block ``r`` (grid-stride over the rows) runs the stages in order. For a
reduction stage thread ``t`` of ``T`` combines terms t, t + T, ... in increasing order (the flattened
reduction index; consecutive threads read consecutive elements), a butterfly of ``shfl.sync.bfly`` combines
the 32 lanes of a warp, the warps' results meet in shared memory and every thread combines them in warp
order; the stage's epilogue runs on that total and thread 0 stores the row's value; a block barrier makes the
store visible to the block before the next stage loads it (those loads are not ``ld.global.nc``). The
element stage's threads then take columns t, t + T, ... of the row.

Numerics: float32 throughout, every operation the stage's own (``add.rn`` / ``fma.rn`` / ``div.rn`` /
``sqrt.rn``, no contraction beyond the kernel rules' explicit fmas, no flush-to-zero): the strict float32
path's contract. Only the order of a sum differs from the one-thread-per-row kernel: a fixed reassociation
(per-thread strided partial sums, then lanes pairwise, then warps in order), the same on every run, as the
lane-split kernels do. A max or min is order-independent but for the sign of a zero among equal zeros (a
later +0 does not replace a -0, nor the reverse), which a softmax's ``x - max`` and ``exp`` do not see; a
float16 max or min is combined in float32 (widening is exact, the result one of the row's float16 values,
narrowed back exactly).
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import llvmlite.ir as ir

from ...ir.dtype import DType
from ...kernels.schedule import Stage
from ...kernels.texpr import E, identity_value, nodes, top_level
from ..llvm.types import F16, F32, I32, I64, const_value
from .emitter import PtxEmitter, overlaps, set_contraction

KINDS = ("sum", "fma", "max", "min")
MIN_TERMS = 32            # a shorter row is better served by one thread per row
MAX_THREADS = 256


def _static(st: Stage) -> bool:
    return (st.region is None and st.guard is None and st.expr.op != "sequential"
            and all(isinstance(d, int) for d in st.buf.shape))


def _reduction(st: Stage) -> Optional[E]:
    """The stage's one top-level float32 reduction of a kind in :data:`KINDS` (or float16 max / min) with static
    extents (nothing reduced inside it), else None."""
    _, reductions = top_level(st.expr, "__none__")
    if len(reductions) != 1:
        return None
    red = reductions[0]
    if red.op != "reduce" or red.attr[0] not in KINDS:
        return None
    if red.dtype != DType.FLOAT and not (red.dtype == DType.FLOAT16 and red.attr[0] in ("max", "min")):
        return None
    if not all(isinstance(x, int) for x in red.attr[2]):
        return None
    if any(x.op in ("reduce", "argscan") for a in red.args for x in nodes(a)):
        return None
    return red


def _terms(red: E) -> int:
    n = 1
    for x in red.attr[2]:
        n *= int(x)
    return n


def _is_element(st: Stage) -> bool:
    return not any(x.op in ("reduce", "argscan", "sequential") for x in nodes(st.expr))


def _loads(st: Stage) -> List[E]:
    return [x for x in nodes(st.expr) if x.op == "load"]


def _same_row(load: E, st: Stage, rank: int) -> bool:
    """Whether ``load`` (of a per-row buffer ``R + [1]``) reads the row that ``st``'s element or value is in."""
    buf = load.attr
    for d in range(rank - 1):
        a = load.args[d]
        if int(buf.shape[d]) != 1 and not (a.op == "var" and a.attr == st.vars[d].attr):
            return False
    return True


def row_chain_at(stages: Sequence[Stage], i: int) -> int:
    """How many stages from ``stages[i]`` form one row-chain kernel (see the module docstring); 0 if none."""
    k = i
    while k < len(stages) and _static(stages[k]) and _reduction(stages[k]) is not None:
        k += 1
    if k == i or k >= len(stages) or not _static(stages[k]) or not _is_element(stages[k]):
        return 0
    last = stages[k]
    shape = tuple(int(d) for d in last.buf.shape)
    if len(shape) < 1:
        return 0
    rank = len(shape)
    row_shape = shape[:-1] + (1,)
    chain = list(stages[i:k + 1])
    for st in chain[:-1]:
        if tuple(int(d) for d in st.buf.shape) != row_shape or len(st.vars) != rank:
            return 0
        if _terms(_reduction(st)) < MIN_TERMS:
            return 0
    if len(last.vars) != rank:
        return 0
    written = [st.buf for st in chain]
    for j, st in enumerate(chain):
        for ld in _loads(st):
            hit = [w for w in written if overlaps(ld.attr, w)]
            if not hit:
                continue
            own = [w for w in written[:j] if w is ld.attr]
            if len(hit) != 1 or not own or not _same_row(ld, st, rank):
                return 0
    return len(chain)


def chain_threads(chain: Sequence[Stage], block: int = MAX_THREADS) -> int:
    """Threads per block: enough warps for the longest row (terms or columns), at most ``block``."""
    widest = max([_terms(_reduction(st)) for st in chain[:-1]] + [int(chain[-1].buf.shape[-1])])
    return max(32, min(-(-widest // 32) * 32, block // 32 * 32))


def emit_row_chain(km, chain: Sequence[Stage], sym: str, threads: int) -> int:
    """Emit the kernel ``sym`` of a row chain with ``threads`` threads per block; returns the row count
    (the launch is ``rows * threads`` threads in blocks of ``threads``)."""
    last = chain[-1]
    shape = [int(d) for d in last.buf.shape]
    rows = 1
    for d in shape[:-1]:
        rows *= d
    cols = shape[-1]
    warps = threads // 32
    fn = km.kernel_fn(sym)
    km.module.add_named_metadata("nvvm.annotations", [fn, "maxntidx", I32(threads)])
    bufs, _n = fn.args
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    em = PtxEmitter(km, fn, b, bufs, last.buf)
    em.mutable = [st.buf for st in chain]      # written here: never read through the non-coherent cache
    wbase = em.shared_array(f"{sym}_w", F32, warps, align=4)
    bar = km.declare("llvm.nvvm.barrier0", ir.VoidType(), [])
    shfl = km.declare("llvm.nvvm.shfl.sync.bfly.f32", F32, [I32, F32, I32, I32])
    tid = km.sreg(b, "tid.x")
    lane = b.and_(tid, I64(31))
    warp = b.trunc(b.lshr(tid, I64(5)), I32)

    def wslot(w):
        return b.gep(wbase, [w], source_etype=F32, inbounds=True)

    def row(r):
        ridx: List[ir.Value] = [None] * (len(shape) - 1)
        for d in reversed(range(len(ridx))):
            if d == 0:
                ridx[d] = r
            else:
                ridx[d] = b.urem(r, I64(shape[d]))
                r = b.udiv(r, I64(shape[d]))
        for st in chain[:-1]:
            red = _reduction(st)
            kind, vs, extents = red.attr
            extents = [int(x) for x in extents]
            em.out = st.buf
            em.memo.append({})
            for v, x in zip(st.vars, ridx + [I64(0)]):
                em.env[v.attr] = x
            acc = em.alloca(F32)
            combine = "sum" if kind == "fma" else kind
            # the start is the combining operation's neutral element: an fma reduction is a sum (0), never the
            # +inf that identity_value("fma") once gave (every LayerNorm variance +inf, the output beta alone)
            b.store(const_value(identity_value(combine, DType.FLOAT), DType.FLOAT), acc)
            fmaf = em.fma_fn(DType.FLOAT) if kind == "fma" else None
            half = red.dtype == DType.FLOAT16      # a max or min: combined in float32, exactly

            def term(t, red=red, vs=vs, extents=extents, kind=kind, acc=acc, fmaf=fmaf, combine=combine, half=half):
                for v, ext in zip(reversed(vs), reversed(extents)):
                    em.env[v.attr] = b.urem(t, I64(ext)) if ext > 1 else I64(0)
                    t = b.udiv(t, I64(ext)) if ext > 1 else t
                a = b.load(acc, typ=F32)
                if kind == "fma":
                    b.store(b.call(fmaf, [em.emit(red.args[0]), em.emit(red.args[1]), a]), acc)
                else:
                    x = em.emit(red.args[0])
                    b.store(em.combine(combine, a, b.fpext(x, F32) if half else x, DType.FLOAT), acc)
            em.loop_range(tid, I64(_terms(red)), term, I64(threads))
            v = b.load(acc, typ=F32)
            for off in (16, 8, 4, 2, 1):
                v = em.combine(combine, v, b.call(shfl, [I32(0xFFFFFFFF), v, I32(off), I32(0x1F)]), DType.FLOAT)
            with b.if_then(b.icmp_unsigned("==", lane, I64(0))):
                b.store(v, wslot(warp))
            b.call(bar, [])
            total = b.load(wslot(I32(0)), typ=F32)
            for w in range(1, warps):
                total = em.combine(combine, total, b.load(wslot(I32(w)), typ=F32), DType.FLOAT)
            em.memo[-1][red.uid] = b.fptrunc(total, F16) if half else total
            val = em.to_memory(em.emit(st.expr), st.buf.dtype)
            with b.if_then(b.icmp_unsigned("==", tid, I64(0))):
                b.store(val, em.address(st.buf, ridx + [I64(0)]))
            em.memo.pop()
            b.call(bar, [])     # the row's value visible to the block; the warp slots free for the next stage
        em.out = last.buf
        em.memo.append({})
        em.loop_range(tid, I64(cols), lambda c: em.store_element(last, ridx + [c]), I64(threads))
        em.memo.pop()
    em.loop_range(km.sreg(b, "ctaid.x"), I64(rows), row, km.sreg(b, "nctaid.x"))
    b.ret_void()
    set_contraction(fn, False)   # contraction only through kernel rules (explicit llvm.fma)
    km.kernels.append(sym)
    return rows

