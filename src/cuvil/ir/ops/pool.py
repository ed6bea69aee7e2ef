"""Pooling: windowed (Max/Average/Lp), global, unpooling and region-of-interest pooling (channels-first)."""
from __future__ import annotations

from ..dtype import DType
from ..registry import HALF_ACCUMULATE, HALF_EXACT, InferCtx, op
from ..types import TensorType
from .conv import ints, window_dims


def _input(ctx: InferCtx, min_rank: int = 3):
    x = ctx.shape(0)
    if len(x) < min_rank:
        ctx.fail(f"input must have rank >= {min_rank} (N, C, spatial...), got shape {list(x)}")
    return x


def _kernel(ctx: InferCtx, n: int):
    k = ctx.attr("kernel_shape")
    if not k:
        ctx.fail("attribute kernel_shape is required")
    if len(k) != n:
        ctx.fail(f"kernel_shape {list(k)} must have {n} values, one per spatial axis")
    return k


@op("MaxPool", half=HALF_EXACT, window=True)
@op("AveragePool", half=HALF_ACCUMULATE, window=True)
@op("LpPool", window=True)
def pool(ctx: InferCtx):
    x = _input(ctx)
    y = TensorType(ctx.dtype(0), (x[0], x[1], *window_dims(ctx, x[2:], _kernel(ctx, len(x) - 2))))
    if ctx.node.op == "MaxPool" and ctx.num_outputs > 1:
        return [y, y.with_dtype(DType.INT64)]  # flat indices of the maxima
    return y


@op("GlobalAveragePool", half=HALF_ACCUMULATE)
@op("GlobalMaxPool", half=HALF_EXACT)
@op("GlobalLpPool")
def global_pool(ctx: InferCtx):
    x = _input(ctx, 2)
    return TensorType(ctx.dtype(0), (x[0], x[1]) + (1,) * (len(x) - 2))


@op("MaxUnpool")
def max_unpool(ctx: InferCtx):
    x = _input(ctx)
    if tuple(ctx.shape(1)) != tuple(x) and all(isinstance(d, int) for d in (*x, *ctx.shape(1))):
        ctx.fail(f"indices shape {list(ctx.shape(1))} differs from input shape {list(x)}")
    if ctx.has_input(2):  # explicit output shape: needs known contents
        out = ctx.sym(2)
        if out is None:
            ctx.fail("output_shape must be a constant or computable from input shapes")
        if len(out) != len(x):
            ctx.fail(f"output_shape {list(out)} must have {len(x)} values")
        return TensorType(ctx.dtype(0), out)
    n = len(x) - 2
    kernel, strides, pads = _kernel(ctx, n), ints(ctx, "strides", n, 1), ints(ctx, "pads", 2 * n, 0)
    spatial = tuple(s * (h - 1) + k - pads[i] - pads[i + n]
                    for i, (h, k, s) in enumerate(zip(x[2:], kernel, strides)))
    return TensorType(ctx.dtype(0), (x[0], x[1], *spatial))


def _rois(ctx: InferCtx, cols: int):
    r = ctx.shape(1)
    if len(r) != 2 or (isinstance(r[1], int) and r[1] != cols):
        ctx.fail(f"rois must have shape [num_rois, {cols}], got {list(r)}")
    return r[0]


@op("MaxRoiPool")
def max_roi_pool(ctx: InferCtx):
    x = _input(ctx, 4)
    ps = ctx.attr("pooled_shape")
    if not ps or len(ps) != len(x) - 2:
        ctx.fail(f"attribute pooled_shape must have {len(x) - 2} values, got {ps}")
    return TensorType(ctx.dtype(0), (_rois(ctx, 5), x[1], *ps))  # rois rows: (batch index, x1, y1, x2, y2)


@op("RoiAlign")
def roi_align(ctx: InferCtx):
    x = _input(ctx, 4)
    if len(x) != 4:
        ctx.fail(f"input must be 4-D (N, C, H, W), got shape {list(x)}")
    n = _rois(ctx, 4)
    bi = ctx.shape(2)
    if len(bi) != 1 or (isinstance(bi[0], int) and isinstance(n, int) and bi[0] != n):
        ctx.fail(f"batch_indices shape {list(bi)} must be [{n}]")
    n = bi[0] if isinstance(bi[0], int) else n
    return TensorType(ctx.dtype(0), (n, x[1], ctx.attr("output_height"), ctx.attr("output_width")))
