"""Block copies: a stage that only moves a buffer's elements (``out[i] = x[i + c]``, e.g. a piece of a split
concatenation such as a decode step's ``present = Concat(past, new)``) as one ``memmove`` per contiguous run.

The generic loop nest copies such a stage one innermost row per parallel unit (64 floats for a head of 64),
recomputing the row's address from its flattened index (divisions) and testing the two rows for overlap each
time. Here the dims after the first partial one are whole in both buffers, so from that dim on source and
destination are one contiguous run each (a head's whole past: 1,023 x 64 floats); the run is cut into blocks
of ``BLOCK_BYTES`` and a unit of the parallel range is one block of one run, copied by the C library's
``memmove`` (llvm.memmove). Bits are moved, not values: the result is the loop's exactly.

A stage that copies at least ``STREAM_BYTES`` into a graph output stores with non-temporal (streaming) stores
instead: 64-byte vectors written around the caches after a ``memmove`` of the bytes up to the destination's first
64-byte boundary, the last partial vector by ``memmove`` too, an ``sfence`` at the end of every unit (the thread
pool's barrier then publishes the bytes like any store). Such a copy is larger than a core's L2, so its
destination would be evicted before any reader came anyway, and a cached store first reads every destination
line (read-for-ownership): 3 bytes of traffic per byte copied instead of 2. Only into an output: the caller reads
it after the run, while a concatenation in the arena is read by the next kernels, which the last-level cache
(larger than 2 MiB on a server) may still serve if the stores went through it. GPT-2's 24 present copies at past
1,023 (3 MB each) on a Xeon (family 6, model 167): 11.0 ms as ``memcpy`` does them, 7.1-8.9 ms streamed
(``bench/stream_copy.c copy 3072 24``; the decode step's figure in bench/RESULTS.md, session 18).
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import llvmlite.ir as ir

from ...kernels.schedule import ARENA, WEIGHTS, Stage
from ..llvm.types import I1, I8, I64, PTR

#: a unit of the parallel range copies at most this much of a run (a head's 1,023 x 64 past keys: 4 blocks)
BLOCK_BYTES = 64 * 1024
#: runs shorter than this stay with the generic loop nest (its inline vector moves beat a call per row)
MIN_RUN_BYTES = 1024
#: a stage copying at least this many bytes in all into a graph output streams its stores past the caches
#: (None: never)
STREAM_BYTES: Optional[int] = 2 * 1024 * 1024
#: bytes of one streaming store (a cache line; an AVX-512 vector, two AVX2 ones)
LINE = 64


def _shift(e, name: str) -> Optional[int]:
    """c when the index expression ``e`` is the variable ``name`` plus a constant c, else None."""
    if e.op == "var":
        return 0 if e.attr == name else None
    if e.op == "add" and len(e.args) == 2:
        for v, c in (e.args, e.args[::-1]):
            if v.op == "var" and v.attr == name and c.op == "const" and float(c.attr) == int(c.attr):
                return int(c.attr)
    return None


def copy_plan(km, st: Stage) -> Optional[dict]:
    """How ``st`` copies, or None when it is not a plain block copy: ``src`` (the Buf read), ``lo`` / ``src_lo``
    (each dim's first index written / read), ``shape`` (the extents copied), ``j`` (the first dim of the
    contiguous run), ``run`` (elements per run)."""
    e = st.expr
    if e.op != "load" or not hasattr(e.attr, "strides"):
        return None
    src, dst = e.attr, st.buf
    shape = km.loop_shape(st)
    n = len(shape)
    if src.dtype != dst.dtype or len(src.shape) != n or len(e.args) != n or len(st.vars) != n:
        return None
    if not all(isinstance(d, int) for d in (*shape, *src.shape, *dst.shape)):
        return None
    if src.storage is dst.storage:       # a move within one buffer keeps the loop's element order
        return None
    if src.pitch is not None or dst.pitch is not None:      # (runs below assume row-major storage)
        return None
    lo = [0] * n
    if st.region is not None:
        axis, r0, _ = st.region
        lo[axis] = r0
    src_lo = []
    for k, (a, v) in enumerate(zip(e.args, st.vars)):
        c = _shift(a, v.attr)
        if c is None:
            return None
        src_lo.append(lo[k] + c)
        if src_lo[k] < 0 or src_lo[k] + shape[k] > src.shape[k]:
            return None                  # (the schedule proves its reads; refuse rather than assume)
    j = n - 1
    while j > 0 and shape[j] == dst.shape[j] == src.shape[j]:
        j -= 1                           # dims after j are whole in both buffers: one run from dim j on
    run = 1
    for d in shape[j:]:
        run *= d
    if run * dst.dtype.itemsize < MIN_RUN_BYTES or 0 in shape:
        return None
    return {"src": src, "lo": lo, "src_lo": src_lo, "shape": shape, "j": j, "run": run}


def emit_copy_stage(km, st: Stage, sym: str) -> Optional[Tuple[int, int]]:
    """Emit ``st`` as block copies when :func:`copy_plan` finds it one; returns (parallel extent, grain)."""
    plan = copy_plan(km, st)
    if plan is None:
        return None
    src, dst = plan["src"], st.buf
    shape, j, run = plan["shape"], plan["j"], plan["run"]
    item = dst.dtype.itemsize
    block = max(1, BLOCK_BYTES // item)
    blocks = -(-run // block)
    outer = 1
    for d in shape[:j]:
        outer *= d
    em, begin, end = km.kernel(sym)
    b = em.b
    memmove = km.declare("llvm.memmove.p0.p0.i64", ir.VoidType(), [PTR, PTR, I64, I1])
    stream = STREAM_BYTES is not None and outer * run * item >= STREAM_BYTES and dst.base not in (ARENA, WEIGHTS)
    line = ir.VectorType(ir.IntType(32), LINE // 4)
    if stream:
        sfence = km.declare("llvm.x86.sse.sfence", ir.VoidType(), [])
        nontemporal = b.module.add_metadata([ir.IntType(32)(1)])

    def flat(buf, starts: List, o) -> object:
        """Byte address of the run of outer index ``o`` (flattened over dims < j) in ``buf``."""
        strides = buf.strides
        off = sum(starts[d] * strides[d] for d in range(len(shape)))    # the first element copied
        at = I64(off)
        rest = o
        for d in reversed(range(j)):
            i = b.srem(rest, I64(shape[d])) if d > 0 else rest
            rest = b.sdiv(rest, I64(shape[d])) if d > 0 else rest
            at = b.add(at, b.mul(i, I64(strides[d])))
        p = b.gep(em.base(buf), [I64(buf.offset)], source_etype=I8, inbounds=True)
        return b.gep(p, [b.mul(at, I64(item))], source_etype=I8, inbounds=True)

    def unit(u):
        o, k = b.sdiv(u, I64(blocks)), b.srem(u, I64(blocks))
        first = b.mul(k, I64(block))
        left = b.sub(I64(run), first)
        count = b.select(b.icmp_signed("<", left, I64(block)), left, I64(block))
        at = b.mul(first, I64(item))
        d_ptr = b.gep(flat(dst, plan["lo"], o), [at], source_etype=I8, inbounds=True)
        s_ptr = b.gep(flat(src, plan["src_lo"], o), [at], source_etype=I8, inbounds=True)
        nbytes = b.mul(count, I64(item))
        if stream:
            streamed(d_ptr, s_ptr, nbytes)
        else:
            b.call(memmove, [d_ptr, s_ptr, nbytes, I1(0)])

    def streamed(d_ptr, s_ptr, nbytes):
        """``nbytes`` from ``s_ptr`` to ``d_ptr`` (never overlapping: copy_plan refuses one buffer): the head up
        to ``d_ptr``'s first line boundary and the tail after its last by memmove, the lines between by
        non-temporal vector stores (unaligned loads), then an sfence."""
        mis = b.and_(b.ptrtoint(d_ptr, I64), I64(LINE - 1))
        head = b.select(b.icmp_signed("==", mis, I64(0)), I64(0), b.sub(I64(LINE), mis))
        head = b.select(b.icmp_signed("<", nbytes, head), nbytes, head)
        b.call(memmove, [d_ptr, s_ptr, head, I1(0)])
        lines = b.sdiv(b.sub(nbytes, head), I64(LINE))
        d0 = b.gep(d_ptr, [head], source_etype=I8, inbounds=True)
        s0 = b.gep(s_ptr, [head], source_etype=I8, inbounds=True)

        def one(k):
            off = b.mul(k, I64(LINE))
            v = b.load(b.gep(s0, [off], source_etype=I8, inbounds=True), typ=line, align=1)
            store = b.store(v, b.gep(d0, [off], source_etype=I8, inbounds=True), align=LINE)
            store.set_metadata("nontemporal", nontemporal)
        em.loop_range(I64(0), lines, one)
        done = b.add(head, b.mul(lines, I64(LINE)))
        b.call(memmove, [b.gep(d_ptr, [done], source_etype=I8, inbounds=True),
                         b.gep(s_ptr, [done], source_etype=I8, inbounds=True), b.sub(nbytes, done), I1(0)])
        b.call(sfence, [])

    em.loop_range(begin, end, unit)
    b.ret_void()
    return outer * blocks, 1

