"""Padded copies: the fill-bordered input a sliding window reads without bounds tests
(:func:`cuvil.kernels.lower.padded_window_input`, a ``padwin`` node, :class:`cuvil.kernels.contraction.PadWindow`).

The generic loop nest evaluates ``select(inside, x[clamped index], fill)`` for every element: clamped
indices are not affine in the loop variable, so nothing vectorises and every element pays the bounds
tests. Here every spatial axis is split at the pad boundaries instead, with no test per element: rows
outside the input are filled, rows inside are ``fill`` for ``[0, begin)``, the unclamped input expression
for ``[begin, begin + size)`` (contiguous reads of the producer, which LLVM vectorises) and ``fill`` after.
The parallel range is the (image, channel) planes. A copy whose interior its producer wrote in place
(``PadWindow.in_place``, :mod:`cuvil.kernels.pad_in_place`) writes the border only.
"""
from __future__ import annotations

from typing import Optional, Tuple

from ...ir.dim import SymExpr, product
from ...ir.types import DType
from ...kernels.contraction import PadWindow
from ...kernels.schedule import Stage
from ..llvm.types import I64, const_value


def emit_pad_stage(km, st: Stage, sym: str) -> Optional[Tuple[object, int]]:
    node = st.expr
    if node.op != "padwin" or not isinstance(node.attr, PadWindow) or st.buf.dtype == DType.BOOL:
        return None
    spec: PadWindow = node.attr
    shape = list(st.buf.shape)
    lead = len(shape) - len(spec.begin)
    if any(isinstance(d, SymExpr) for d in shape[1:]) or lead != 2:
        return None
    offset = [0] * len(shape)
    if st.region is not None:          # a channel slice of a split concatenation
        axis, lo, hi = st.region
        if axis >= lead:
            return None
        shape[axis], offset[axis] = hi - lo, lo
    interior = spec.interior()
    fill_value = const_value(spec.fill, st.buf.dtype)
    em, begin, end = km.kernel(sym)
    b = em.b
    channels = shape[1]

    def store(idx, value_of):
        for v, i in zip(st.vars, idx):
            em.env[v.attr] = i
        b.store(em.to_memory(value_of(), st.buf.dtype), em.address(st.buf, idx))

    fold = km.cheap_masks      # rows are short (7 to 113): end them in one masked vector where that is cheap
    last = len(spec.begin) - 1

    def fill(prefix, d, lo, hi):
        """Spatial axis d over [lo, hi), the axes after it whole, all fill."""
        if hi <= lo:
            return
        if d == last:
            em.loop_range(I64(lo), I64(hi), lambda w: store(prefix + [w], lambda: fill_value), tail_fold=fold)
        else:
            em.loop_range(I64(lo), I64(hi), lambda i: fill(prefix + [i], d + 1, 0, shape[lead + d + 1]))

    def spatial(prefix, d):
        """Spatial axis d..: the padding before and after the input's extent filled, the interior between."""
        extent, b0, size = shape[lead + d], spec.begin[d], spec.sizes[d]
        fill(prefix, d, 0, b0)
        if d == last:
            if not spec.in_place:     # (in place: the producer wrote the interior, only the border is ours)
                em.loop_range(I64(b0), I64(b0 + size), lambda w: store(prefix + [w], lambda: em.emit(interior)),
                              tail_fold=fold)
        else:
            em.loop_range(I64(b0), I64(b0 + size), lambda i: spatial(prefix + [i], d + 1))
        fill(prefix, d, b0 + size, extent)

    def body(t):
        c = b.add(b.srem(t, I64(channels)), I64(offset[1]))
        n = b.add(b.sdiv(t, I64(channels)), I64(offset[0]))
        spatial([n, c], 0)

    em.loop_range(begin, end, body)
    b.ret_void()
    return product(shape[:2]), 1
