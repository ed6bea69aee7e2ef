"""Semantics of FusedAttention: the composite it stands for, built from the semantics of the ops it replaces
(MatMul, Mul, Add, Softmax, IsNaN/Where), so a rule introducing it proves the reassociation of the scale and
nothing more is taken on trust. The online softmax of the x86 kernel is a property of the lowering (tested
against onnxruntime), not of these semantics."""
from __future__ import annotations

from .table import SEMANTICS, _in, sem


@sem("FusedAttention")
def _fused_attention(dom, inputs, attrs):
    q, kt, v, scale, mask = (_in(dom, inputs, i) for i in range(5))
    s = SEMANTICS["Mul"](dom, [SEMANTICS["MatMul"](dom, [q, kt], {})[0], scale], {})[0]
    if mask is not None:
        s = SEMANTICS["Add"](dom, [s, mask], {})[0]
    p = SEMANTICS["Softmax"](dom, [s], {"axis": -1})[0]
    if int(attrs.get("zero_nan", 0)):
        p = SEMANTICS["Where"](dom, [SEMANTICS["IsNaN"](dom, [p], {})[0], dom.const(0.0), p], {})[0]
    return SEMANTICS["MatMul"](dom, [p, v], {})
