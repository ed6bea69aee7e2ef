"""Spatial resampling: Resize (Upsample is rewritten to Resize by the frontend) and GridSample."""
from __future__ import annotations

import numpy as np

from ..dim import floordiv
from ..registry import HALF_COMPUTE, InferCtx, op
from ..types import TensorType
from .shape import dims, fmt, ints, present, text, unify

_MODES = ("nearest", "linear", "cubic")
_COORD = ("half_pixel", "half_pixel_symmetric", "pytorch_half_pixel", "align_corners", "asymmetric",
          "tf_crop_and_resize")
_NEAREST = ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil")
_POLICIES = ("stretch", "not_larger", "not_smaller")


def _choice(ctx: InferCtx, name: str, allowed):
    v = text(ctx.attr(name))
    if v not in allowed:
        ctx.fail(f"{name} must be one of {', '.join(allowed)}, got {v!r}")
    return v


def _scaled(ctx: InferCtx, d, f: float):
    """floor(d * f), computed in float32 as ONNX and onnxruntime do; symbolic dims need exact scales."""
    if f <= 0:
        ctx.fail(f"scales must be positive, got {f}")
    if isinstance(d, int):
        return int(np.floor(np.float32(d) * np.float32(f)))
    if float(f).is_integer():
        return d * int(f)
    inv = 1 / f
    if inv.is_integer() and int(inv) & (int(inv) - 1) == 0:  # 1/2^k is exact in floating point
        return floordiv(d, int(inv))
    ctx.fail(f"cannot scale symbolic dim {d} by non-integer scale {f}: the output size would not be exact")


@op("Resize", half=HALF_COMPUTE, lifted=(("roi", 1, "f32"), ("scales", 2, "f32"), ("sizes", 3, "i64")))
def resize(ctx: InferCtx):
    s = ctx.shape(0)
    _choice(ctx, "mode", _MODES)
    _choice(ctx, "coordinate_transformation_mode", _COORD)
    _choice(ctx, "nearest_mode", _NEAREST)
    policy = _choice(ctx, "keep_aspect_ratio_policy", _POLICIES)
    axes = ctx.attr("axes")
    axes = list(range(len(s))) if axes is None else [ctx.axis(a, len(s)) for a in axes]
    if len(set(axes)) != len(axes):
        ctx.fail(f"axes {axes} repeat an axis")
    has_scales, has_sizes = present(ctx, "scales", 2), present(ctx, "sizes", 3)
    if has_scales == has_sizes:
        ctx.fail("exactly one of scales and sizes must be given")
    name, idx = ("sizes", 3) if has_sizes else ("scales", 2)
    v = ctx.attr_or_input(name, idx)
    if v is None:
        return TensorType(ctx.dtype(0), None)  # scales/sizes computed from data at run time
    v = dims(v) if has_sizes else [float(f) for f in np.asarray(v, dtype=np.float64).reshape(-1)]
    if len(v) != len(axes):
        ctx.fail(f"{name} {fmt(v)} must have one entry per resized axis ({len(axes)})")
    out = list(s)
    if has_scales:
        for a, f in zip(axes, v):
            out[a] = _scaled(ctx, s[a], f)
    elif policy == "stretch":
        for a, n in zip(axes, v):
            out[a] = n
    else:
        if ints(v) is None or not all(isinstance(s[a], int) for a in axes):
            ctx.fail(f"keep_aspect_ratio_policy={policy!r} needs static sizes and input dims on the resized axes")
        ratios = [n / s[a] for a, n in zip(axes, v)]
        scale = min(ratios) if policy == "not_larger" else max(ratios)
        for a in axes:
            out[a] = int(scale * s[a] + 0.5)  # round half up, as the ONNX reference does
    return TensorType(ctx.dtype(0), out)


@op("GridSample")
def grid_sample(ctx: InferCtx):
    x, g = ctx.shape(0), ctx.shape(1)
    _choice(ctx, "mode", _MODES)
    _choice(ctx, "padding_mode", ("zeros", "border", "reflection"))
    if len(x) < 3:
        ctx.fail(f"X must be (N, C, D1, ..., Dr), got rank {len(x)}")
    r = len(x) - 2
    if len(g) != r + 2 or (isinstance(g[-1], int) and g[-1] != r):
        ctx.fail(f"grid must be (N, D1_out, ..., Dr_out, {r}) for a rank-{len(x)} X, got {fmt(g)}")
    if not ctx.dtype(1).is_float:
        ctx.fail(f"grid must be a float tensor, got {ctx.dtype(1).name}")
    n = unify(ctx, x[0], g[0], "batch of X and grid")
    return TensorType(ctx.dtype(0), (n, x[1]) + g[1:-1])


@op("AffineGrid", lifted=(("size", 1, "i64"),))
def affine_grid(ctx: InferCtx):
    """theta (N, 2, 3) or (N, 3, 4) applied to a grid of normalised positions: (N, H, W, 2) or (N, D, H, W, 3)."""
    t = ctx.shape(0)
    size = dims(ctx.attr_or_input("size", 1))
    if size is None:
        ctx.fail("size must be a constant (N, C, H, W) or (N, C, D, H, W)")
    if len(size) not in (4, 5):
        ctx.fail(f"size must have 4 or 5 elements, got {fmt(size)}")
    k = len(size) - 2
    if len(t) != 3:
        ctx.fail(f"theta must be (N, {k}, {k + 1}), got {fmt(t)}")
    unify(ctx, t[0], size[0], "theta's batch and size[0]")
    unify(ctx, t[1], k, f"theta's dim 1 for a {k}-D grid")
    unify(ctx, t[2], k + 1, f"theta's dim 2 for a {k}-D grid")
    return TensorType(ctx.dtype(0), (t[0], *size[2:], k))
