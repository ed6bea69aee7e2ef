"""Element type conversion: Cast (to an attribute's dtype), CastLike (to another input's dtype) and BitCast
(the same bits read as another dtype of the same width)."""
from __future__ import annotations

from ..dtype import DType
from ..registry import BROADCAST, InferCtx, op
from ..types import TensorType


def _cast_sym(target):
    """Integer shape values survive a cast to an integer type (shape math often goes through int32)."""

    def ev(ctx: InferCtx):
        return [ctx.sym(0)] if target(ctx).is_int else None

    return ev


def _to(ctx: InferCtx) -> DType:
    to = ctx.attr("to")
    if to is None:
        ctx.fail("missing required attribute 'to'")
    try:
        return DType(to)
    except ValueError:
        ctx.fail(f"cast to ONNX dtype {to} is not supported")


@op("Cast", elementwise=BROADCAST, converts_dtype=True, sym_eval=_cast_sym(_to))
def cast(ctx: InferCtx):
    return TensorType(_to(ctx), ctx.type(0).shape)


@op("CastLike", elementwise=BROADCAST, converts_dtype=True, sym_eval=_cast_sym(lambda ctx: ctx.dtype(1)))
def cast_like(ctx: InferCtx):
    return TensorType(ctx.dtype(1), ctx.type(0).shape)


@op("BitCast", elementwise=BROADCAST, converts_dtype=True)
def bit_cast(ctx: InferCtx):
    to, src = _to(ctx), ctx.dtype(0)
    if to == DType.STRING or src == DType.STRING:
        ctx.fail("strings have no bit pattern to reinterpret")
    if _bit_width(to) != _bit_width(src):
        ctx.fail(f"{src.name} ({_bit_width(src)} bits) and {to.name} ({_bit_width(to)} bits) differ in width")
    return TensorType(to, ctx.type(0).shape)


def _bit_width(dt: DType) -> int:
    return dt.narrow_bits or (4 if dt == DType.FLOAT4E2M1 else 8 * dt.itemsize)
