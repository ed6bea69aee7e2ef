"""Linear quantisation: (De)QuantizeLinear (per-tensor, per-axis or blocked), DynamicQuantizeLinear,
and the quantised Conv/MatMul, whose output dtype is that of their output zero point."""
from __future__ import annotations

from ...errors import UnsupportedOpError
from ..dim import ceildiv
from ..dtype import DType
from ..registry import InferCtx, op
from ..types import TensorType
from .conv import check_bias, conv_shape
from .matmul import matmul_shape


def _fmt(shape) -> str:
    return "[" + ",".join(map(str, shape)) + "]"


def _check_scale(ctx: InferCtx, i: int, what: str):
    """Scale (and zero point) shape: scalar/[1] per tensor, [C] along ``axis``, or blocked along ``axis``."""
    if not ctx.has_input(i):
        return
    x, s = ctx.shape(0), ctx.shape(i)
    bs = ctx.attr("block_size", 0)
    if bs > 0:
        axis = ctx.axis(ctx.attr("axis"), len(x))
        want = (*x[:axis], ceildiv(x[axis], bs), *x[axis + 1:])
        if len(s) != len(x) or any(isinstance(a, int) and isinstance(b, int) and a != b for a, b in zip(s, want)):
            ctx.fail(f"{what} shape {_fmt(s)} must be {_fmt(want)} for blocks of {bs} along axis {axis}")
    elif len(s) == 1 and s[0] != 1:
        axis = ctx.axis(ctx.attr("axis"), len(x))
        if isinstance(s[0], int) and isinstance(x[axis], int) and s[0] != x[axis]:
            ctx.fail(f"{what} shape {_fmt(s)} must be [{x[axis]}] for per-axis quantisation along axis {axis}")
    elif len(s) > 1:
        ctx.fail(f"{what} shape {_fmt(s)} must be a scalar or 1-D unless block_size is set")


@op("QuantizeLinear")
def quantize(ctx: InferCtx):
    _check_scale(ctx, 1, "y_scale")
    _check_scale(ctx, 2, "y_zero_point")
    if ctx.has_input(2):
        dt = ctx.dtype(2)
    else:  # no zero point: output_dtype, or uint8 when that is unset
        code = ctx.attr("output_dtype") or DType.UINT8
        try:
            dt = DType(code)
        except ValueError:
            raise UnsupportedOpError(ctx.node.op, ctx.node.name, detail=f"output_dtype {code}") from None
    return TensorType(dt, ctx.shape(0))


@op("DequantizeLinear")
def dequantize(ctx: InferCtx):
    _check_scale(ctx, 1, "x_scale")
    _check_scale(ctx, 2, "x_zero_point")
    return TensorType(ctx.dtype(1), ctx.shape(0))  # computed in the scale's dtype


@op("DynamicQuantizeLinear")
def dynamic_quantize(ctx: InferCtx):
    # y, plus the per-tensor scale and zero point it computed
    return [TensorType(DType.UINT8, ctx.shape(0)), TensorType(DType.FLOAT, ()), TensorType(DType.UINT8, ())]


@op("QLinearConv")
def qlinear_conv(ctx: InferCtx):
    shape = conv_shape(ctx, 0, 3)  # inputs: x, x_scale, x_zp, w, w_scale, w_zp, y_scale, y_zp, B
    check_bias(ctx, 8, shape[1])  # int32 bias
    return TensorType(ctx.dtype(7), shape)


@op("QLinearMatMul")
def qlinear_matmul(ctx: InferCtx):
    return TensorType(ctx.dtype(7), matmul_shape(ctx, ctx.shape(0), ctx.shape(3)))
