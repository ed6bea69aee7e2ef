"""Softmax-like ops (opset-13 semantics: normalise along one axis, default -1); shape-preserving."""
from __future__ import annotations

from ..registry import HALF_ACCUMULATE, HALF_FLOAT32, InferCtx, op


@op("Softmax", half=HALF_ACCUMULATE)  # the denominator's sum accumulates in float32
@op("LogSoftmax", half=HALF_FLOAT32)  # the log of a sum near 0 loses too much in half
@op("Hardmax")
def softmax(ctx: InferCtx):
    ctx.axis(ctx.attr("axis"), ctx.rank(0))
    return ctx.type(0)
