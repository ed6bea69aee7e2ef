"""Convolutions: Conv, ConvInteger, DeformConv and ConvTranspose.

The sliding-window arithmetic (:func:`window_dims`) is shared with the pooling family and QLinearConv.
Layout is ONNX's channels-first: X is (N, C, D1..Dn), W is (M, C/group, k1..kn) (ConvTranspose: (C, M/group, ...)).
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

from ..dim import Dim, ceildiv, dmax, dmin, floordiv, product
from ..dtype import DType
from ..registry import HALF_ACCUMULATE, InferCtx, op
from ..types import TensorType


def ints(ctx: InferCtx, name: str, n: int, default: int) -> List[int]:
    """A per-axis integer attribute of length ``n``, or ``default`` repeated when absent."""
    v = ctx.attr(name)
    if v is None or (isinstance(v, (list, tuple)) and not v):
        return [default] * n
    v = [int(x) for x in v]
    if len(v) != n:
        ctx.fail(f"attribute {name} has {len(v)} values, expected {n}")
    return v


def window_dims(ctx: InferCtx, spatial: Sequence[Dim], kernel: Sequence[Dim]) -> Tuple[Dim, ...]:
    """Output spatial dims of a sliding window (strides, dilations, pads, auto_pad, ceil_mode attributes).

    In ceil mode a window that would start in the end padding is dropped (PyTorch's rule, applied by
    onnxruntime and ONNX's reference implementation, though not by onnx 1.23's shape inference). An
    explicit auto_pad wins over ``pads``, as in onnxruntime.
    """
    n = len(spatial)
    if len(kernel) != n:
        ctx.fail(f"kernel has {len(kernel)} spatial dims but the input has {n}")
    strides, dils = ints(ctx, "strides", n, 1), ints(ctx, "dilations", n, 1)
    pads = ints(ctx, "pads", 2 * n, 0)
    auto_pad, ceil = ctx.attr("auto_pad", "NOTSET"), bool(ctx.attr("ceil_mode", 0))
    if auto_pad not in ("NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID"):
        ctx.fail(f"unknown auto_pad {auto_pad!r}")
    if any(s < 1 for s in strides) or any(d < 1 for d in dils):
        ctx.fail(f"strides {strides} and dilations {dils} must be positive")
    out = []
    for i, (h, k, s, d) in enumerate(zip(spatial, kernel, strides, dils)):
        if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            out.append(ceildiv(h, s))
            continue
        dk = d * (k - 1) + 1  # extent of the dilated kernel
        pb, pe = (0, 0) if auto_pad == "VALID" else (pads[i], pads[i + n])
        span = h + pb + pe - dk
        o = (ceildiv(span, s) if ceil else floordiv(span, s)) + 1
        if ceil and isinstance(dk, int):
            # The last window starts in the end padding when (o-1)*s >= h+pb. With e = dk - pe that
            # happens always when e <= 0, never when e >= s, and otherwise exactly when o exceeds
            # ceil((h+pb)/s), so a min() expresses it without knowing h.
            e = dk - pe
            if e <= 0:
                o = o - 1
            elif e < s:
                o = dmin(o, ceildiv(h + pb, s))
        ctx.require("ge", o, 1, f"kernel extent {dk} along spatial axis {i} is larger than the padded input "
                                f"({h} + pads {pb},{pe})")
        out.append(o)
    return tuple(out)


def kernel_of(ctx: InferCtx, w: Sequence[Dim]) -> Sequence[Dim]:
    """kernel_shape, or the weight's spatial dims; the two must agree when both are given."""
    k = ctx.attr("kernel_shape")
    if not k:
        return w[2:]
    if len(k) != len(w) - 2 or any(isinstance(a, int) and a != b for a, b in zip(w[2:], k)):
        ctx.fail(f"kernel_shape {list(k)} does not match the weight's spatial dims {list(w[2:])}")
    return k


def _check_rank(ctx: InferCtx, x, w):
    if len(x) < 3:
        ctx.fail(f"input must have rank >= 3 (N, C, spatial...), got shape {list(x)}")
    if len(w) != len(x):
        ctx.fail(f"weight rank {len(w)} differs from input rank {len(x)}")


def _group(ctx: InferCtx) -> int:
    g = ctx.attr("group", 1)
    if g < 1:
        ctx.fail(f"group must be positive, got {g}")
    return g


def check_bias(ctx: InferCtx, i: int, m: Dim):
    if ctx.has_input(i):
        b = ctx.shape(i)
        if len(b) != 1 or (isinstance(b[0], int) and isinstance(m, int) and b[0] != m):
            ctx.fail(f"bias shape {list(b)} must be [{m}]")


def _check_shape(ctx: InferCtx, i: int, what: str, want: Sequence[Dim]):
    got = ctx.shape(i)
    if len(got) != len(want) or any(isinstance(a, int) and isinstance(b, int) and a != b for a, b in zip(got, want)):
        ctx.fail(f"{what} shape [{','.join(map(str, got))}] must be [{','.join(map(str, want))}]")


def conv_shape(ctx: InferCtx, xi: int = 0, wi: int = 1) -> Tuple[Dim, ...]:
    """Output shape of a convolution of input ``xi`` with weight ``wi``."""
    x, w = ctx.shape(xi), ctx.shape(wi)
    _check_rank(ctx, x, w)
    g = _group(ctx)
    c, m, cg = x[1], w[0], w[1]
    if isinstance(c, int) and isinstance(cg, int) and c != cg * g:
        ctx.fail(f"input has {c} channels but the weight expects {cg * g} ({cg} per group x group {g})")
    if isinstance(m, int) and m % g:
        ctx.fail(f"{m} output channels do not divide into {g} groups")
    return (x[0], m, *window_dims(ctx, x[2:], kernel_of(ctx, w)))


@op("Conv", half=HALF_ACCUMULATE, window=True)
def conv(ctx: InferCtx):
    shape = conv_shape(ctx)
    check_bias(ctx, 2, shape[1])
    return TensorType(ctx.dtype(0), shape)


@op("ConvInteger", window=True)
def conv_integer(ctx: InferCtx):
    return TensorType(DType.INT32, conv_shape(ctx))  # accumulates 8-bit products in int32


@op("DeformConv")
def deform_conv(ctx: InferCtx):
    shape = conv_shape(ctx)
    check_bias(ctx, 3, shape[1])
    # offset holds one displacement per spatial axis, kernel tap and offset group; mask one value per tap.
    n, taps, og = len(shape) - 2, product(kernel_of(ctx, ctx.shape(1))), ctx.attr("offset_group", 1)
    _check_shape(ctx, 2, "offset", (shape[0], og * taps * n, *shape[2:]))
    if ctx.has_input(4):
        _check_shape(ctx, 4, "mask", (shape[0], og * taps, *shape[2:]))
    return TensorType(ctx.dtype(0), shape)


@op("ConvTranspose", half=HALF_ACCUMULATE, window=True)
def conv_transpose(ctx: InferCtx):
    x, w = ctx.shape(0), ctx.shape(1)
    _check_rank(ctx, x, w)
    g, n = _group(ctx), len(x) - 2
    if isinstance(x[1], int) and isinstance(w[0], int) and x[1] != w[0]:
        ctx.fail(f"input has {x[1]} channels but the weight has {w[0]}")
    m = w[1] * g
    check_bias(ctx, 2, m)
    out_shape = ctx.attr("output_shape")
    if out_shape:
        if len(out_shape) != n:  # spatial dims only; pads are then derived from it
            ctx.fail(f"output_shape {list(out_shape)} must have {n} values, one per spatial axis")
        return TensorType(ctx.dtype(0), (x[0], m, *out_shape))
    kernel = kernel_of(ctx, w)
    strides, dils = ints(ctx, "strides", n, 1), ints(ctx, "dilations", n, 1)
    opad, pads = ints(ctx, "output_padding", n, 0), ints(ctx, "pads", 2 * n, 0)
    auto_pad = ctx.attr("auto_pad", "NOTSET")
    out = []
    for i, (h, k, s, d, op_) in enumerate(zip(x[2:], kernel, strides, dils, opad)):
        if op_ >= s and op_ >= d:
            ctx.fail(f"output_padding {op_} must be smaller than stride {s} or dilation {d}")
        dk = d * (k - 1) + 1
        full = s * (h - 1) + op_ + dk  # output before padding is cropped
        if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            o = full - dmax(0, dk + op_ - s)  # total padding as onnxruntime computes it: s*h when dk+op >= s
        elif auto_pad == "VALID":
            o = full
        else:
            o = full - pads[i] - pads[i + n]
        ctx.require("ge", o, 1, f"pads {pads} crop the whole output along spatial axis {i}")
        out.append(o)
    return TensorType(ctx.dtype(0), (x[0], m, *out))


@op("Col2Im", lifted=(("image_shape", 1, "i64"), ("block_shape", 2, "i64")))
def col2im(ctx: InferCtx):
    """The inverse of im2col: (N, C * prod(block_shape), L) column blocks summed back into an image
    (N, C, *image_shape), L being the number of block positions the image, pads, strides and dilations give."""
    s = ctx.shape(0)
    image, block = ctx.attr_or_input("image_shape", 1), ctx.attr_or_input("block_shape", 2)
    if image is None or block is None:
        ctx.fail("image_shape and block_shape must be constants")
    image, block = [int(d) for d in image], [int(d) for d in block]
    n = len(image)
    if len(block) != n or n == 0:
        ctx.fail(f"image_shape {image} and block_shape {block} must have the same length >= 1")
    if len(s) != 3:
        ctx.fail(f"input must be (N, C * prod(block_shape), L), got rank {len(s)}")
    if any(d < 1 for d in block):
        ctx.fail(f"block_shape {block} must be positive")
    positions = col2im_positions(ctx, image, block)
    k = product(block)
    if isinstance(s[1], int) and s[1] % k:
        ctx.fail(f"input dim 1 ({s[1]}) is not a multiple of prod(block_shape) = {k}")
    ctx.unify(s[2], product(positions), f"input dim 2 ({s[2]}) must be the {product(positions)} block positions")
    c = s[1] // k if isinstance(s[1], int) else floordiv(s[1], k)
    return TensorType(ctx.dtype(0), (s[0], c, *image))


def col2im_positions(ctx: InferCtx, image: Sequence[int], block: Sequence[int]) -> List[int]:
    """Block positions per spatial axis: (image + pads - dilation * (block - 1) - 1) // stride + 1."""
    n = len(image)
    strides, dilations, pads = ints(ctx, "strides", n, 1), ints(ctx, "dilations", n, 1), ints(ctx, "pads", 2 * n, 0)
    out = []
    for a in range(n):
        span = image[a] + pads[a] + pads[n + a] - dilations[a] * (block[a] - 1) - 1
        if strides[a] < 1 or dilations[a] < 1 or span < 0:
            ctx.fail(f"no block of {block} fits the image {list(image)} with pads {pads}, strides {strides} and "
                     f"dilations {dilations}")
        out.append(span // strides[a] + 1)
    return out
