"""Normalisations: output Y has the input's type; per-channel or per-feature parameters are validated.

BatchNormalization's training form and LayerNormalization also produce statistics as extra outputs.
"""
from __future__ import annotations

from typing import Sequence

from ..dim import Dim
from ..dtype import DType
from ..registry import HALF_COMPUTE, HALF_FLOAT32, PER_CHANNEL, InferCtx, op
from ..types import TensorType


def _param(ctx: InferCtx, i: int, what: str, want: Sequence[Dim]):
    """Input ``i`` must have shape ``want`` wherever both are static."""
    if not ctx.has_input(i):
        return
    got = ctx.shape(i)
    if len(got) != len(want) or any(isinstance(a, int) and isinstance(b, int) and a != b for a, b in zip(got, want)):
        ctx.fail(f"{what} shape [{','.join(map(str, got))}] must be [{','.join(map(str, want))}]")


def _broadcastable_to(ctx: InferCtx, i: int, what: str, target: Sequence[Dim]):
    """Input ``i`` must broadcast unidirectionally to ``target`` (trailing-aligned, static dims 1 or equal)."""
    if not ctx.has_input(i):
        return
    got = ctx.shape(i)
    tail = target[len(target) - len(got):] if len(got) <= len(target) else None
    if tail is None or any(isinstance(a, int) and isinstance(b, int) and a not in (1, b) for a, b in zip(got, tail)):
        ctx.fail(f"{what} shape [{','.join(map(str, got))}] does not broadcast to [{','.join(map(str, target))}]")


def _channels(ctx: InferCtx, min_rank: int = 2) -> Dim:
    x = ctx.shape(0)
    if len(x) < min_rank:
        ctx.fail(f"input must have rank >= {min_rank} (N, C, ...), got shape {list(x)}")
    return x[1]


@op("BatchNormalization", elementwise=PER_CHANNEL, half=HALF_COMPUTE)
def batch_norm(ctx: InferCtx):
    x = ctx.shape(0)
    c = x[1] if len(x) > 1 else 1
    for i, what in enumerate(("scale", "B", "input_mean", "input_var"), 1):
        _param(ctx, i, what, (c,))
    cs = [c] + [ctx.shape(i)[0] for i in range(1, 5)]
    c = next((d for d in cs if isinstance(d, int)), c)  # prefer a static channel count
    y = ctx.type(0)
    if not ctx.attr("training_mode") or ctx.num_outputs == 1:
        return y
    # training form: running mean and variance, in the dtypes of the given statistics
    return [y, TensorType(ctx.dtype(3), (c,)), TensorType(ctx.dtype(4), (c,))][:ctx.num_outputs]


@op("InstanceNormalization", half=HALF_FLOAT32)  # its variance overflows half
def instance_norm(ctx: InferCtx):
    c = _channels(ctx, 3)
    _param(ctx, 1, "scale", (c,))
    _param(ctx, 2, "B", (c,))
    return ctx.type(0)


@op("GroupNormalization")
def group_norm(ctx: InferCtx):
    c, g = _channels(ctx), ctx.attr("num_groups")
    if g is None or g < 1:
        ctx.fail(f"attribute num_groups must be a positive integer, got {g}")
    if isinstance(c, int) and c % g:
        ctx.fail(f"{c} channels do not divide into {g} groups")
    _param(ctx, 1, "scale", (c,))  # opset 21: one scale and bias per channel
    _param(ctx, 2, "bias", (c,))
    return ctx.type(0)


@op("LayerNormalization", half=HALF_FLOAT32)  # its variance overflows half
def layer_norm(ctx: InferCtx):
    x = ctx.shape(0)
    axis = ctx.axis(ctx.attr("axis"), len(x))
    _broadcastable_to(ctx, 1, "Scale", x[axis:])
    _broadcastable_to(ctx, 2, "B", x[axis:])
    # Mean and InvStdDev keep the reduced axes as 1s and are computed in stash_type.
    stat = TensorType(_stash(ctx), (*x[:axis], *(1,) * (len(x) - axis)))
    return [ctx.type(0), stat, stat][:max(1, ctx.num_outputs)]


@op("RMSNormalization")
def rms_norm(ctx: InferCtx):
    x = ctx.shape(0)
    _broadcastable_to(ctx, 1, "scale", x[ctx.axis(ctx.attr("axis"), len(x)):])
    return ctx.type(0)


def _stash(ctx: InferCtx) -> DType:
    try:
        return DType(ctx.attr("stash_type"))
    except ValueError:
        ctx.fail(f"stash_type {ctx.attr('stash_type')} is not a known element type")


@op("LRN", half=HALF_FLOAT32)  # its sum of squares overflows half
def lrn(ctx: InferCtx):
    _channels(ctx, 3)
    if not ctx.has_attr("size") or ctx.attr("size") < 1:
        ctx.fail("attribute size must be a positive integer")
    return ctx.type(0)


@op("LpNormalization")
def lp_norm(ctx: InferCtx):
    ctx.axis(ctx.attr("axis"), ctx.rank(0))
    if ctx.attr("p") not in (1, 2):
        ctx.fail(f"p must be 1 or 2, got {ctx.attr('p')}")
    return ctx.type(0)


@op("MeanVarianceNormalization")
def mvn(ctx: InferCtx):
    r = ctx.rank(0)
    for a in ctx.attr("axes"):
        ctx.axis(a, r, "axes entry")
    return ctx.type(0)
