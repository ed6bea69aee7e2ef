"""Constants, identity-like ops, random generators and Det."""
from __future__ import annotations

import numpy as np
import onnx

from ..dtype import DType
from ..registry import BROADCAST, HALF_EXACT, InferCtx, op
from ..types import TensorType
from .shape import same_sym, tensor_attr_array, tensor_attr_dtype


def _dtype(ctx: InferCtx, name: str, default: DType) -> DType:
    dt = ctx.attr(name)
    if dt is None:
        return default
    try:
        return DType(dt)
    except ValueError:
        ctx.fail(f"{name}: ONNX dtype {dt} is not supported")


@op("Identity", elementwise=BROADCAST, half=HALF_EXACT, sym_eval=same_sym)
def identity(ctx: InferCtx):
    return ctx.type(0)


@op("Dropout", elementwise=BROADCAST, half=HALF_EXACT)  # inference: the identity
def dropout(ctx: InferCtx):
    ratio = ctx.const(1)
    if ratio is not None and not (ratio.size == 1 and 0 <= float(ratio.reshape(-1)[0]) < 1):
        ctx.fail(f"ratio must be a scalar in [0, 1), got {ratio.tolist()}")
    for i, what in ((1, "ratio"), (2, "training_mode")):
        if ctx.has_input(i) and ctx.type(i).shape is not None and len(ctx.type(i).shape) != 0:
            ctx.fail(f"{what} must be a scalar, got shape {list(ctx.type(i).shape)}")
    if ctx.has_input(2) and ctx.dtype(2) != DType.BOOL:
        ctx.fail(f"training_mode must be bool, got {ctx.dtype(2).name}")
    out = ctx.type(0)
    # The mask is optional: only nodes that declare it get it.
    return [out, TensorType(DType.BOOL, out.shape)][:max(1, min(2, ctx.num_outputs))]


_CONST_ATTRS = ("value", "value_float", "value_floats", "value_int", "value_ints", "value_string",
                "value_strings", "sparse_value")


def _constant_array(ctx: InferCtx):
    """The constant as a numpy array (None for sparse values), after checking exactly one attribute is set."""
    given = [k for k in _CONST_ATTRS if ctx.has_attr(k)]
    if len(given) != 1:
        ctx.fail(f"exactly one of {', '.join(_CONST_ATTRS)} must be set, got {given or 'none'}")
    k, v = given[0], ctx.attr(given[0])
    if k == "value":
        return tensor_attr_array(v)
    if k == "sparse_value":
        return None
    dt = {"float": np.float32, "int": np.int64, "string": np.object_}[k.split("_")[1].rstrip("s")]
    return np.array(v, dtype=dt)


def _constant_sym(ctx: InferCtx):
    a = _constant_array(ctx)
    return [tuple(int(x) for x in a.reshape(-1))] if a is not None and a.dtype.kind in "iu" and a.size <= 1024 else None


@op("Constant", sym_eval=_constant_sym)
def constant(ctx: InferCtx):
    a = _constant_array(ctx)
    if a is None:
        sp = ctx.attr("sparse_value")
        if not isinstance(sp, onnx.SparseTensorProto):
            ctx.fail(f"sparse_value must be a SparseTensorProto, got {type(sp).__name__}")
        return TensorType(tensor_attr_dtype(ctx, sp.values), tuple(sp.dims))
    v = ctx.attr("value")
    dt = tensor_attr_dtype(ctx, v) if v is not None else DType.STRING if a.dtype.kind == "O" else DType.from_numpy(a.dtype)
    return TensorType(dt, a.shape)


@op("RandomNormal", "RandomUniform", nondeterministic=True)
def random(ctx: InferCtx):
    shape = ctx.attr("shape")
    if shape is None:
        ctx.fail("missing required attribute 'shape'")
    if any(d < 0 for d in shape):
        ctx.fail(f"shape {list(shape)} must not be negative")
    return TensorType(_dtype(ctx, "dtype", DType.FLOAT), shape)


@op("RandomNormalLike", "RandomUniformLike", "Bernoulli", nondeterministic=True)
def random_like(ctx: InferCtx):
    return TensorType(_dtype(ctx, "dtype", ctx.dtype(0)), ctx.type(0).shape)


@op("Multinomial", nondeterministic=True)
def multinomial(ctx: InferCtx):
    dt = _dtype(ctx, "dtype", DType.INT32)
    if dt not in (DType.INT32, DType.INT64):
        ctx.fail(f"dtype must be int32 or int64, got {dt.name}")
    if ctx.type(0).shape is None:
        return TensorType(dt, None)
    s = ctx.shape(0)
    if len(s) != 2:
        ctx.fail(f"input must be [batch_size, class_size], got rank {len(s)}")
    return TensorType(dt, (s[0], ctx.attr("sample_size")))


@op("Det")
def det(ctx: InferCtx):
    s = ctx.shape(0)
    if len(s) < 2:
        ctx.fail(f"input must have rank >= 2, got {len(s)}")
    if isinstance(s[-1], int) and isinstance(s[-2], int) and s[-1] != s[-2]:
        ctx.fail(f"matrices must be square, got {s[-2]}x{s[-1]}")
    return TensorType(ctx.dtype(0), s[:-2])
