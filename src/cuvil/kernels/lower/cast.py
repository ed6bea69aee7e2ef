"""Lowerings of Cast, CastLike and BitCast."""
from __future__ import annotations

from ...ir.dtype import DType
from ..texpr import E, cast
from .core import elementwise, lowering


@lowering("Cast")
def _cast(ctx):
    to = DType(ctx.attr("to"))
    _check_round_mode(ctx, to)
    sat = bool(ctx.attr("saturate", 1))
    return elementwise(ctx, lambda x: cast(x, to, sat), dtype=to)


@lowering("CastLike")
def _castlike(ctx):
    to = ctx.out_dtype()
    _check_round_mode(ctx, to)
    sat = bool(ctx.attr("saturate", 1))
    return elementwise(ctx, lambda x: cast(x, to, sat), [ctx.input(0)], dtype=to)


def _check_round_mode(ctx, to: DType):
    if to == DType.FLOAT8E8M0 or ctx.input(0).dtype == DType.FLOAT8E8M0:
        ctx.unsupported("casts to and from FLOAT8E8M0 are not supported; cast through float32 elsewhere")


@lowering("BitCast")
def _bitcast(ctx):
    to = ctx.out_dtype()
    return elementwise(ctx, lambda x: E("bitcast", (x,), to), [ctx.input(0)], dtype=to)
