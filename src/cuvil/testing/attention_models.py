"""Masked scaled dot-product attention as the exporters write it (``(Q * a) · (Kt * b) + mask``, Softmax, an optional
NaN guard, ``· V``), with feeds whose batch rows are padded, fully masked, one key masked and unmasked: the models
of tests/test_attention.py and tests/property/test_transformer_property.py (the fused x86 attention kernel against
onnxruntime running the unfused ops). Opset 17, symbolic B and S, H = 3 heads."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

H, D = 3, 8


def attention_model(guard: bool, mask_rank: int, fill: float, D: int = D) -> onnx.ModelProto:
    """Q, K, V [B, H, S, D] and an additive mask (rank 2: [B, S] made [B, 1, 1, S] as BERT does; rank 4:
    [B, H, S, S]) through the exporters' chain: (Q * a) · (Kt * b) + mask, Softmax, [Where(IsNaN)], · V."""
    a = np.float32(D ** -0.25)
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
             helper.make_node("Mul", ["q", "a"], ["qs"]), helper.make_node("Mul", ["kt", "a"], ["kts"]),
             helper.make_node("MatMul", ["qs", "kts"], ["s"])]
    if mask_rank == 2:
        nodes += [helper.make_node("Unsqueeze", ["keep", "axes"], ["keep4"]),
                  helper.make_node("Where", ["keep4", "zero", "fill"], ["m"])]
        mask_in = helper.make_tensor_value_info("keep", TensorProto.BOOL, ["B", "S"])
    else:
        nodes += [helper.make_node("Where", ["keep", "zero", "fill"], ["m"])]
        mask_in = helper.make_tensor_value_info("keep", TensorProto.BOOL, ["B", H, "S", "S"])
    nodes += [helper.make_node("Add", ["s", "m"], ["sm"]), helper.make_node("Softmax", ["sm"], ["p"], axis=-1)]
    if guard:
        nodes += [helper.make_node("IsNaN", ["p"], ["nan"]), helper.make_node("Where", ["nan", "zero", "p"], ["pg"])]
    nodes += [helper.make_node("MatMul", ["pg" if guard else "p", "v"], ["y"])]
    qkv = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["B", H, "S", D]) for n in "qkv"]
    inits = [helper.make_tensor("a", TensorProto.FLOAT, [], [a]),
             helper.make_tensor("zero", TensorProto.FLOAT, [], [0.0]),
             helper.make_tensor("fill", TensorProto.FLOAT, [], [fill]),
             helper.make_tensor("axes", TensorProto.INT64, [2], [1, 2])]
    g = helper.make_graph(nodes, "attention", qkv + [mask_in],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", H, "S", D])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def feeds(batch: int, seq: int, mask_rank: int, seed: int = 0, D: int = D):
    """Row 0 half padded, row 1 every key masked, row 2 one key masked, row 3 none."""
    rng = np.random.default_rng(seed)
    f = {n: rng.standard_normal((batch, H, seq, D)).astype(np.float32) * 2 for n in "qkv"}
    keep = np.ones((batch, seq), bool)
    for b in range(batch):
        if b % 4 == 0:
            keep[b, max(1, seq // 2):] = False
        elif b % 4 == 1:
            keep[b, :] = False
        elif b % 4 == 2:
            keep[b, seq - 1] = seq == 1
    if mask_rank == 4:   # per head and query: a causal mask on head 1
        keep4 = np.broadcast_to(keep[:, None, None, :], (batch, H, seq, seq)).copy()
        keep4[:, 1] &= np.tril(np.ones((seq, seq), bool))
        keep = keep4
    f["keep"] = keep
    return f
