"""Errors of float32 math functions in ULPs against float64 references, over sweeps of float32 bit patterns:
what tests/test_vecmath.py asserts and bench/vecmath.py reports for the x86 target's vector math.

The error of a result ``y`` for the exact value ``ref`` (float64) is ``|y - ref| / ulp(ref)``, where
``ulp(ref)`` is the spacing of float32 numbers at ``ref`` (2^-149 in the denormal range): a correctly rounded
result has an error of at most 0.5.
"""
from __future__ import annotations

import math
from typing import Callable, Dict, Tuple

import numpy as np
import onnx
from onnx import TensorProto, helper

_ERF = np.frompyfunc(math.erf, 1, 1)

#: ONNX op -> its float64 reference (numpy, or Python's math for erf: both libm's double functions)
REFERENCES: Dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "Exp": np.exp,
    "Erf": lambda x: _ERF(x).astype(np.float64),
    "Tanh": np.tanh,
    "Log": np.log,
    "Sigmoid": lambda x: 1.0 / (1.0 + np.exp(-x)),
}
FLT_MAX = float(np.finfo(np.float32).max)


def float32_sweep(stride: int, offset: int = 0) -> np.ndarray:
    """Every ``stride``-th float32 bit pattern from ``offset`` (both signs, denormals, infinities), NaNs left out."""
    x = np.arange(offset, 1 << 32, stride, dtype=np.uint64).astype(np.uint32).view(np.float32)
    return x[~np.isnan(x)]


def ulp_of(ref: np.ndarray) -> np.ndarray:
    """The float32 spacing at each (finite, float64) ``ref``, taken at ``ref`` rounded to float32."""
    r = np.minimum(np.abs(ref.astype(np.float32)).astype(np.float64), FLT_MAX)
    exponent = np.frexp(r)[1]
    return np.ldexp(1.0, np.maximum(exponent - 24, -149))


def ulp_errors(y: np.ndarray, ref: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """(errors in ULPs where ``ref`` rounds to a finite float32, mask of the other points). At the other
    points (NaN, or an infinite or overflowing ``ref``) only ``y == float32(ref)`` is acceptable."""
    with np.errstate(all="ignore"):
        r32 = ref.astype(np.float32)
        finite = np.isfinite(r32)
        err = np.abs(y[finite].astype(np.float64) - ref[finite]) / ulp_of(ref[finite])
    return err, ~finite


def mismatched_non_finite(y: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """Indices where ``ref`` is not a finite float32 and ``y`` is not the same inf / NaN."""
    with np.errstate(all="ignore"):
        r32 = ref.astype(np.float32)
    bad = ~np.isfinite(r32) & ~((y == r32) | (np.isnan(y) & np.isnan(r32)))
    return np.nonzero(bad)[0]


def unary_model(op: str, n: int) -> onnx.ModelProto:
    """A one-node float32 model ``y = op(x)`` over a vector of ``n`` elements."""
    node = helper.make_node(op, ["x"], ["y"])
    graph = helper.make_graph([node], f"{op.lower()}_only",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [n])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
