"""Scaled dot-product attention as one op: Cuvil's own ``FusedAttention`` (domain ``ai.cuvil``), introduced by
the proved ``on x86`` rules of ``rules/attention.rule`` where an export spells attention out as MatMul /
Mul / Add / Softmax / MatMul (torch's scaled_dot_product_attention as both exporters write it).

``FusedAttention(Q, Kt, V, scale, mask?, zero_nan=0)``:

* ``Q[B, H, Sq, D]``, ``Kt[B, H, D, Sk]`` (the keys already transposed, as the exports hand them to the first
  MatMul: the lowering reads them through the producer's strides, no transposed copy), ``V[B, H, Sk, Dv]``;
  the batch dims B, H broadcast like MatMul's;
* ``scale``: a scalar multiplying every score ``Q·Kt``;
* ``mask``: an additive mask broadcastable to ``[B, H, Sq, Sk]`` (``-inf`` or a very negative number where a
  key is hidden);
* ``zero_nan``: 1 when the export guards the probabilities with ``Where(IsNaN(P), 0, P)`` (a query whose
  every key is masked with ``-inf`` then gets 0, not NaN).

``Y[B, H, Sq, Dv] = P · V`` with ``P = Softmax((Q · Kt) * scale + mask)`` over the last axis (NaN -> 0 when
``zero_nan``). The x86 kernel (:mod:`cuvil.kernels.lower.attention`) never stores ``P``: it walks the keys
in blocks with an online softmax (running max and sum, the accumulator rescaled when the max grows), which
reassociates the softmax's sums: equal over the reals, not bit for bit.
"""
from __future__ import annotations

import numpy as np
import onnx.defs
from onnx import helper

from ..registry import CUSTOM_DOMAIN, InferCtx, broadcast_shapes, op, register_custom_schema
from ..types import TensorType


def _schema():
    S = onnx.defs.OpSchema
    FP = S.FormalParameter
    opt = S.FormalParameterOption.Optional
    return S("FusedAttention", CUSTOM_DOMAIN, 1, "Softmax((Q · Kt) * scale + mask) · V, never storing the scores",
             inputs=[FP("Q", "T"), FP("Kt", "T"), FP("V", "T"), FP("scale", "T"), FP("mask", "T", param_option=opt)],
             outputs=[FP("Y", "T")], type_constraints=[("T", ["tensor(float)"], "float32")],
             attributes=[S.Attribute("zero_nan", helper.make_attribute("zero_nan", 0),
                                     "1: a probability that is NaN counts as 0 (Where(IsNaN(P), 0, P))")])


register_custom_schema(_schema())


@op("FusedAttention", domain=CUSTOM_DOMAIN)
def fused_attention(ctx: InferCtx):
    q, kt, v = ctx.shape(0), ctx.shape(1), ctx.shape(2)
    for name, s in (("Q", q), ("Kt", kt), ("V", v)):
        if len(s) != 4:
            ctx.fail(f"{name} must have rank 4 [B, H, rows, cols], got shape {list(s)}")
    if len(ctx.shape(3)) != 0:
        ctx.fail(f"scale must be a scalar, got shape {list(ctx.shape(3))}")
    ctx.unify(q[3], kt[2], "the head size of Q and Kt")
    ctx.unify(kt[3], v[2], "the key count of Kt and V")
    scores = broadcast_shapes(ctx, q[:2], kt[:2], v[:2]) + (q[2], kt[3])
    if ctx.has_input(4):
        mask = ctx.shape(4)
        if len(mask) > 4:
            ctx.fail(f"mask must have rank 4 at most, got shape {list(mask)}")
        scores = broadcast_shapes(ctx, scores, mask)
        ctx.unify(scores[3], kt[3], "the key count of the mask and Kt")
    return TensorType(ctx.dtype(0), tuple(scores[:3]) + (v[3],))


def fused_attention_reference(q, kt, v, scale, mask=None, zero_nan: int = 0) -> np.ndarray:
    """The composite the op stands for, in float32 as the unfused graph computes it (max-shifted softmax)."""
    s = np.matmul(q, kt) * np.float32(scale)
    if mask is not None:
        s = s + mask
    with np.errstate(invalid="ignore", over="ignore"):
        e = np.exp(s - s.max(axis=-1, keepdims=True))
        p = e / e.sum(axis=-1, keepdims=True)
    if zero_nan:
        p = np.where(np.isnan(p), np.float32(0), p)
    return np.matmul(p, v).astype(np.float32)
