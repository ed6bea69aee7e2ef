"""Element type conversion: Cast (to an attribute's dtype) and CastLike (to another input's dtype)."""
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
