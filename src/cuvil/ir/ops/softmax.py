"""Softmax-like ops (opset-13 semantics: normalise along one axis, default -1); shape-preserving."""
from __future__ import annotations

from ..registry import InferCtx, op


@op("Softmax", "LogSoftmax", "Hardmax")
def softmax(ctx: InferCtx):
    ctx.axis(ctx.attr("axis"), ctx.rank(0))
    return ctx.type(0)
