"""Sliding windows shared by convolutions and pools: the window parameters of a node and the input read
through a window with its padding."""
from __future__ import annotations

from typing import Sequence

from ...ir.dim import dmax
from ..contraction import PadWindow
from ..texpr import E, all_of, in_range
from .core import TensorFn


def window_params(ctx, spatial: int, kernel: Sequence[int], in_sizes: Sequence[int], out_sizes: Sequence[int]):
    """(strides, dilations, begin pads) of a window op, its ``auto_pad`` resolved to explicit begin pads."""
    strides = ctx.attr("strides") or [1] * spatial
    dil = ctx.attr("dilations") or [1] * spatial
    pads = ctx.attr("pads")
    auto = ctx.attr("auto_pad", "NOTSET")
    if auto in ("SAME_UPPER", "SAME_LOWER"):
        begin = []
        for k in range(spatial):
            total = dmax((out_sizes[k] - 1) * strides[k] + (kernel[k] - 1) * dil[k] + 1 - in_sizes[k], 0)
            begin.append(total // 2 if auto == "SAME_UPPER" else total - total // 2)
    elif pads:
        begin = list(pads[:spatial])
    else:
        begin = [0] * spatial
    return strides, dil, begin


def may_exceed(a, b) -> bool:
    """a > b for some value of the symbols (symbolic sizes whose difference is not a constant: assumed)."""
    d = a - b
    return d > 0 if isinstance(d, int) else True


def padded_window_input(ctx, x: TensorFn, out_sp, kern, strides, dil, begin, fill, store_dtype=None):
    """For a sliding window that reads outside ``x`` (padding, or a ceil-mode window past the end): a
    materialised copy bordered with ``fill`` and zero begin pads, so the window's loops read memory with no
    bounds tests (stored as ``store_dtype``, default x's: a bf16 convolution's copy as bfloat16, the values
    it rounds to). Otherwise ``x`` and ``begin`` unchanged."""
    spatial = len(kern)
    need = [(o - 1) * s + (k - 1) * d + 1 for o, s, k, d in zip(out_sp, strides, kern, dil)]
    if not (any(b0 != 0 for b0 in begin) or any(may_exceed(n, size) for n, size in zip(need, x.shape[2:]))):
        return x, list(begin)
    padded = list(x.shape[:2]) + [dmax(size + b0, n) for size, b0, n in zip(x.shape[2:], begin, need)]

    def pad_fn(idx):
        src = [i - b0 for i, b0 in zip(idx[2:], begin)]
        safe = x.at_or(idx[:2] + src, all_of([in_range(p, 0, size) for p, size in zip(src, x.shape[2:])]), fill)
        if not ctx.gemm_cols or not all(isinstance(d, int) for d in list(x.shape[2:]) + list(begin)):
            return safe
        spec = PadWindow(tuple(begin), tuple(x.shape[2:]), fill, lambda: x(idx[:2] + src))
        return E("padwin", [safe], x.dtype, spec)
    return ctx.temp(padded, store_dtype or x.dtype, pad_fn, "pad"), [0] * spatial
