"""Lowerings of Cast, CastLike and BitCast."""
from __future__ import annotations

from ...ir.dtype import DType
from ..texpr import E, cast
from .core import elementwise, lowering


@lowering("Cast")
def _cast(ctx):
    to = DType(ctx.attr("to"))
    sat, mode = bool(ctx.attr("saturate", 1)), ctx.attr("round_mode", "up")
    return elementwise(ctx, lambda x: cast(x, to, sat, mode), dtype=to)


@lowering("CastLike")
def _castlike(ctx):
    to = ctx.out_dtype()
    sat, mode = bool(ctx.attr("saturate", 1)), ctx.attr("round_mode", "up")
    return elementwise(ctx, lambda x: cast(x, to, sat, mode), [ctx.input(0)], dtype=to)


@lowering("BitCast")
def _bitcast(ctx):
    to = ctx.out_dtype()
    return elementwise(ctx, lambda x: E("bitcast", (x,), to), [ctx.input(0)], dtype=to)
