"""The reference oracle: ``onnx.reference.ReferenceEvaluator``, with the few ops whose reference
implementation departs from the ONNX spec's own function body replaced by that body.

Cuvil's op semantics (the prover's, the folder's and the backends') are the spec's: Softplus is
``Log(Exp(X) + 1)``, Sigmoid ``1 / (1 + Exp(-X))``, Mish ``X * Tanh(Softplus(X))``, and Sum folds left
from its first input (onnx.reference uses logaddexp, a two-branch sigmoid, and Python's ``sum`` from 0,
which turns ``Sum(-0.0)`` into +0.0; its Softsign fails on 0-d inputs; its GatherElements is wrong along an
axis longer than numpy's ``np.choose`` limit, and its GlobalAveragePool divides by zero on an empty batch).
Everything else is onnx.reference as it is.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun

from .ir.ops.attention import fused_attention_reference
from .ir.ops.winograd import kernel_transform, winograd_conv_reference


def _softplus(x):
    return np.log(np.exp(x) + np.ones((), x.dtype)).astype(x.dtype)


class Softplus(OpRun):
    op_domain = ""

    def _run(self, x):
        return (_softplus(x),)


class Sigmoid(OpRun):
    op_domain = ""

    def _run(self, x):
        one = np.ones((), x.dtype)
        return ((one / (one + np.exp(-x))).astype(x.dtype),)


class Mish(OpRun):
    op_domain = ""

    def _run(self, x):
        return ((x * np.tanh(_softplus(x))).astype(x.dtype),)


class Softsign(OpRun):
    op_domain = ""

    def _run(self, x):
        x = np.asarray(x)  # onnx.reference's own fails on 0-d inputs
        return ((x / (np.ones((), x.dtype) + np.abs(x))).astype(x.dtype),)


class Sum(OpRun):
    op_domain = ""

    def _run(self, *xs):
        acc = xs[0]
        for t in xs[1:]:
            acc = acc + t
        return (np.asarray(acc).astype(xs[0].dtype),)


class GatherElements(OpRun):
    """onnx.reference's own falls back, past numpy's limit on ``np.choose`` choices (an axis longer than
    32 or 64), to a 2-D path that reads one index per row: a raw ValueError (BERT's token_type_ids gathered
    from a 512-long buffer) or, for indices of one column, silently wrong values."""
    op_domain = ""

    def _run(self, data, indices, axis=0):
        axis = int(axis) % data.ndim
        n = data.shape[axis]
        if indices.size and not (-n <= indices.min() and indices.max() < n):
            raise ValueError(f"GatherElements: indices out of range for axis {axis} of size {n}")
        if any(q > d for k, (q, d) in enumerate(zip(indices.shape, data.shape)) if k != axis):
            raise ValueError(f"GatherElements: indices {indices.shape} longer than data {data.shape} off the axis")
        # take_along_axis broadcasts: data is cut to the indices' extent off the axis first.
        cut = tuple(slice(0, q) if k != axis else slice(None) for k, q in enumerate(indices.shape))
        idx = np.where(indices < 0, indices + n, indices).astype(np.int64)
        return (np.take_along_axis(data[cut], idx, axis),)


class GlobalAveragePool(OpRun):
    """The mean over every axis after the first two. onnx.reference averages with a division by the element
    count that raises ZeroDivisionError on an empty batch or channel axis, where the result is simply empty."""
    op_domain = ""

    def _run(self, x):
        axes = tuple(range(2, x.ndim))
        if x.size == 0:
            return (np.zeros(x.shape[:2] + (1,) * len(axes), dtype=x.dtype),)
        return (np.mean(x, axis=axes, keepdims=True).astype(x.dtype),)


class WinogradKernel(OpRun):
    op_domain = "ai.cuvil"

    def _run(self, w, tile=4):
        return (kernel_transform(w, int(tile)),)


class WinogradConv(OpRun):
    op_domain = "ai.cuvil"

    def _run(self, x, u, b=None, tile=4, pads=None):
        return (winograd_conv_reference(x, u, b, int(tile), list(pads) if pads is not None else [0, 0, 0, 0]),)


class FusedAttention(OpRun):
    op_domain = "ai.cuvil"

    def _run(self, q, kt, v, scale, mask=None, zero_nan=0):
        return (fused_attention_reference(q, kt, v, scale, mask, int(zero_nan)),)


# Cuvil's own ops (domain ai.cuvil, see cuvil.ir.ops.winograd and cuvil.ir.ops.attention)
CUVIL_OPS = [WinogradKernel, WinogradConv, FusedAttention]
SPEC_OPS = [Softplus, Sigmoid, Mish, Softsign, Sum, GatherElements, GlobalAveragePool] + CUVIL_OPS


def reference_evaluator(model: onnx.ModelProto) -> ReferenceEvaluator:
    return ReferenceEvaluator(model, new_ops=SPEC_OPS)


def run_reference(model: onnx.ModelProto, feeds) -> list:
    with np.errstate(all="ignore"):  # IEEE corner cases are inputs like any other here
        return reference_evaluator(model).run(None, feeds)
