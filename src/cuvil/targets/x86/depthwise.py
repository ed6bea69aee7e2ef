"""Row kernels for window stages, depthwise convolutions and max pools (see
:class:`cuvil.kernels.contraction.DepthwiseWindow`; an average pool is a depthwise window of ones, its epilogue
dividing by the window's count).

One unit of the parallel range is one (image, channel) plane. For each output row the kernel keeps up
to :data:`CHUNK` vectors of outputs in registers and, for every kernel offset (fully unrolled: the
weights are splatted once per plane), loads the input row segment and accumulates with a fused
multiply-add (a max pool: numpy's fmax, NaN only for an all-NaN window, like the reference). Stride 1 reads the segment directly; stride 2 loads twice the width and keeps the even
lanes. Every load is masked to the input row, so nothing past the buffer is touched; lanes past the
output width compute values that are never stored. A depthwise convolution reads its input unpadded:
columns left of or past the row and whole rows above or below the input are masked off and read as
the zeros padding would hold (ShuffleNet: 17 padded copies, 1.9 of 11.9 ms, no longer stored). The row is spilled to a stack array and the stage's
epilogue runs over it like the GEMM kernels' (:func:`cuvil.targets.x86.gemm.tile_epilogue`).
"""
from __future__ import annotations

from typing import Optional, Tuple

import llvmlite.ir as ir

from ...ir.dtype import DType
from ...kernels.contraction import DepthwiseWindow
from ...kernels.schedule import Stage
from ..llvm.types import F32, I1, I32, I64, PTR, splat
from .emitter import ROW_MAX
from .gemm import batch_only, find_contraction, tile_epilogue

CHUNK = 4   # output vectors per register block (accumulators)


def emit_depthwise_stage(km, st: Stage, sym: str) -> Optional[Tuple[int, int, str]]:
    """Emit a window stage; returns (parallel extent, grain, window kind) or None if ``st`` is not one."""
    node = find_contraction(st, "window")
    if node is None:
        return None
    spec: DepthwiseWindow = node.attr
    if spec.kind == "sum":
        return None          # (a channels-last mean over the whole map: gemm_nhwc.emit_channels_last_mean)
    if not batch_only(spec.x.shape, st.buf.shape) or spec.x.pitch is not None or st.buf.pitch is not None:
        return None          # (rows along W are contiguous here: a pitched view takes the loop nest)
    # a max pool may read the bfloat16 words of a value stored so (kernels/bf16_storage.py): 16-bit loads,
    # widened to float32 exactly (the word in the high half)
    x16 = spec.x.dtype == DType.BFLOAT16
    if spec.x.dtype not in (DType.FLOAT, DType.BFLOAT16) or x16 and spec.kind != "max":
        return None
    vw = max(4, km.vector_bits // 32)
    vec = ir.VectorType(F32, vw)
    mvec = ir.VectorType(I1, vw)
    N, C, Hp, Wp = spec.x.shape      # conv: the unpadded input, read through masks (see spec.pads)
    pt, pl = spec.pads
    KH, KW = spec.kernel
    sh, sw = spec.strides
    dh, dw = spec.dilations
    OH, OW = spec.out_spatial
    nvec = -(-OW // vw)
    if nvec * vw > ROW_MAX:      # the output row is spilled to the stack: wider rows take the loop nest
        return None
    chunk = min(CHUNK, nvec)

    em, begin, end = km.kernel(sym)
    b = em.b
    fma = km.declare(f"llvm.fma.v{vw}f32", vec, [vec, vec, vec])
    I16 = ir.IntType(16)
    xet = I16 if x16 else F32
    xvec = ir.VectorType(xet, vw)
    mload = km.declare(f"llvm.masked.load.v{vw}{'i16' if x16 else 'f32'}.p0", xvec, [PTR, I32, mvec, xvec])
    row = em.alloca(vec, nvec)
    row_f = b.bitcast(row, ir.PointerType(F32))
    zero = ir.Constant(vec, [0.0] * vw)
    is_max = spec.kind == "max"
    nan = ir.Constant(vec, [float("nan")] * vw)
    neg_inf = ir.Constant(vec, [float("-inf")] * vw)
    # what a masked-off lane reads: the padding's value, zero for a convolution, -inf for a max pool
    if x16:
        fill = ir.Constant(xvec, [0xFF80] * vw)       # bfloat16 -inf
    else:
        fill = ir.Constant(vec, [float("-inf") if is_max else 0.0] * vw)
    shl16 = ir.Constant(ir.VectorType(I32, vw), [16] * vw)
    lanes = ir.Constant(ir.VectorType(I64, vw), list(range(vw)))

    def fptr(base, off):
        return b.gep(base, [off], source_etype=F32, inbounds=True)

    def xptr(base, off):
        return b.gep(base, [off], source_etype=xet, inbounds=True)

    def masked(rp, col, inside):
        """vw floats of row rp from input column col, lanes whose column col + lane is inside the row;
        none when the row is outside the input (``inside`` false: padding rows read as ``fill``)."""
        at = b.add(splat(b, col, vw), lanes)
        # the column mask apart from the row test: col is a constant for every vector of a row block, so the
        # mask folds to a constant, and the row test is one scalar per kernel row. With the row test folded
        # into the column bound, every load computed its mask from 64-bit lane compares at run time:
        # ShuffleNet's depthwise convolutions took 0.567 ms, now 0.450 (1 thread, bench/ab_libs.py --kinds).
        m = b.and_(b.icmp_signed("<", at, splat(b, I64(Wp), vw)), b.icmp_signed(">=", at, splat(b, I64(0), vw)))
        m = b.and_(m, splat(b, inside, vw))
        v = b.call(mload, [b.gep(rp, [col], source_etype=xet), I32(2 if x16 else 4), m, fill])
        return b.bitcast(b.shl(b.zext(v, ir.VectorType(I32, vw)), shl16), vec) if x16 else v

    x_base = b.gep(em.base(spec.x), [I64(spec.x.offset)], source_etype=ir.IntType(8), inbounds=True)
    w_base = None if spec.w is None else b.gep(em.base(spec.w), [I64(spec.w.offset)], source_etype=ir.IntType(8),
                                                inbounds=True)
    even = ir.Constant(ir.VectorType(I32, vw), [2 * i for i in range(vw)])

    def plane(t):
        n = b.sdiv(t, I64(C))
        c = b.srem(t, I64(C))
        xp = xptr(x_base, b.mul(t, I64(Hp * Wp)))
        wv = [] if is_max else [splat(b, b.load(fptr(w_base, b.add(b.mul(c, I64(KH * KW)), I64(k))), typ=F32), vw)
                                for k in range(KH * KW)]

        def out_row(oh):
            def block(v0):
                """output vectors v0 .. v0+chunk-1 of the row"""
                # a max starts at -inf and takes x where x > acc (one vmaxps: a NaN x is skipped), and counts
                # the lanes that saw a number (padding's -inf included): a window of NaN only gives its last
                # NaN, bits and all (what the rule written the other way, and the loop nest, give)
                accs = [neg_inf if is_max else zero] * chunk
                seen = [ir.Constant(mvec, [0] * vw)] * chunk
                last = [nan] * chunk
                for kh in range(KH):
                    ih = b.add(b.mul(oh, I64(sh)), I64(kh * dh - pt))
                    inside = b.and_(b.icmp_signed(">=", ih, I64(0)), b.icmp_signed("<", ih, I64(Hp)))
                    rp = b.gep(xp, [b.mul(b.select(inside, ih, I64(0)), I64(Wp))], source_etype=xet)
                    for kw in range(KW):
                        for v in range(chunk):
                            col = b.add(b.mul(b.add(v0, I64(v)), I64(vw * sw)), I64(kw * dw - pl))
                            if sw == 1:
                                xv = masked(rp, col, inside)
                            else:
                                lo = masked(rp, col, inside)
                                hi = masked(rp, b.add(col, I64(vw)), inside)
                                xv = b.shuffle_vector(lo, hi, even)
                            if is_max:   # fmax: x wins when greater; NaN skipped (the reference's)
                                accs[v] = b.select(b.fcmp_ordered(">", xv, accs[v]), xv, accs[v])
                                seen[v] = b.or_(seen[v], b.fcmp_ordered("ord", xv, xv))
                                last[v] = xv
                            else:
                                accs[v] = b.call(fma, [wv[kh * KW + kw], xv, accs[v]])
                for v in range(chunk):
                    acc = b.select(seen[v], accs[v], last[v]) if is_max else accs[v]
                    b.store(acc, b.gep(row, [b.add(v0, I64(v))], source_etype=vec, inbounds=True), align=4)
            # whole chunks, then the vectors left (fewer than chunk) one block of their own
            full = nvec // chunk
            em.loop_range(I64(0), I64(full), lambda k: block(b.mul(k, I64(chunk))))
            rest = nvec - full * chunk
            if rest:
                nonlocal_chunk(block, full * chunk, rest)

            def slot(_r, j):
                return b.gep(row_f, [j], source_etype=F32, inbounds=True)

            def index(_r, j):
                return [n, c, oh, j]
            tile_epilogue(em, st, node, slot, index, I64(1), I64(OW))
        em.loop_range(I64(0), I64(OH), out_row)

    def nonlocal_chunk(block, v0, count):
        nonlocal chunk
        saved, chunk = chunk, count
        block(I64(v0))
        chunk = saved

    em.loop_range(begin, end, plane)
    b.ret_void()
    return N * C, 1, spec.kind
