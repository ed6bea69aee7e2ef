"""Lowerings of Cast and CastLike."""
from __future__ import annotations

from ...ir.dtype import DType
from ..texpr import cast
from .core import elementwise, lowering


@lowering("Cast")
def _cast(ctx):
    to = DType(ctx.attr("to"))
    return elementwise(ctx, lambda x: cast(x, to), dtype=to)


@lowering("CastLike")
def _castlike(ctx):
    to = ctx.out_dtype()
    return elementwise(ctx, lambda x: cast(x, to), [ctx.input(0)], dtype=to)
