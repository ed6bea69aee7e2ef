"""Activation functions: elementwise, shape-preserving, some with parameters."""
from __future__ import annotations

from ..registry import BROADCAST, HALF_COMPUTE, InferCtx, broadcast_shapes, op
from ..types import TensorType


@op("Relu", "LeakyRelu", "Elu", "Selu", "Sigmoid", "HardSigmoid", "Tanh", "Softplus", "Softsign",
    "HardSwish", "Gelu", "Mish", "Celu", elementwise=BROADCAST, half=HALF_COMPUTE)
@op("ThresholdedRelu", "Shrink", elementwise=BROADCAST)
def activation(ctx: InferCtx):
    return ctx.type(0)


@op("Clip", elementwise=BROADCAST, half=HALF_COMPUTE, lifted=(("min", 1, "data"), ("max", 2, "data")))
def clip(ctx: InferCtx):
    return ctx.type(0)


@op("PRelu", elementwise=BROADCAST, half=HALF_COMPUTE)  # the slope broadcasts to the input
def prelu(ctx: InferCtx):
    x, slope = ctx.shape(0), ctx.shape(1)
    out = broadcast_shapes(ctx, x, slope)
    if out != tuple(x):
        ctx.fail(f"slope shape {list(slope)} must broadcast to the input shape {list(x)}")
    return TensorType(ctx.dtype(0), x)
