"""A BERT-style encoder block built with ``onnx.helper``: the README's dynamic-shape example model
(``cuvil zoo bert-block -o bert_block.onnx``).

Post-norm, as BERT has it: ``h = LayerNorm(x + Attention(x, mask))``, ``y = LayerNorm(h + FFN(h))``, where
the attention is multi-head (Q/K/V as MatMul + Add, heads split by Reshape/Transpose, scores scaled by
1/sqrt(Dh), an additive padding mask, Softmax) and the FFN is MatMul + Add, GELU in its Erf form, MatMul + Add.
Inputs ``x[B, S, D]`` (float32) and ``attention_mask[B, S]`` (int64, 1 = token, 0 = padding, as BERT's
tokenizers give it); output ``y[B, S, D]``. ``B`` and ``S`` are symbols; weights are seeded random.
"""
from __future__ import annotations

from typing import List

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

#: The profile the README compiles it for (min, opt, max of each symbol).
BERT_BLOCK_PROFILE = {"B": (1, 1, 8), "S": (1, 128, 512)}

#: What a padded position adds to its attention scores before the Softmax (BERT's own constant).
MASKED_SCORE = -10000.0


class _Graph:
    """Nodes and initializers of one graph, each node named after its single output."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.nodes: List[onnx.NodeProto] = []
        self.inits: List[onnx.TensorProto] = []

    def const(self, name: str, values, dtype=np.float32) -> str:
        self.inits.append(numpy_helper.from_array(np.asarray(values, dtype=dtype), name))
        return name

    def weight(self, name: str, shape, scale: float) -> str:
        return self.const(name, self.rng.standard_normal(shape) * scale)

    def node(self, op: str, inputs, output: str, **attrs) -> str:
        self.nodes.append(helper.make_node(op, list(inputs), [output], name=output, **attrs))
        return output

    def dense(self, x: str, name: str, d_in: int, d_out: int) -> str:
        y = self.node("MatMul", [x, self.weight(f"{name}_w", (d_in, d_out), 1.0 / np.sqrt(d_in))], f"{name}_mm")
        return self.node("Add", [y, self.weight(f"{name}_b", (d_out,), 0.1)], name)

    def layer_norm(self, x: str, name: str, d: int) -> str:
        gamma = self.const(f"{name}_g", 1 + 0.1 * self.rng.standard_normal(d))
        beta = self.const(f"{name}_beta", 0.1 * self.rng.standard_normal(d))
        return self.node("LayerNormalization", [x, gamma, beta], name, axis=-1, epsilon=1e-12)


def bert_block(d_model: int = 64, heads: int = 4, d_ff: int = 256, batch="B", seq="S",
               seed: int = 0) -> onnx.ModelProto:
    """The encoder block described in the module docstring, opset 17 (LayerNormalization is an op there)."""
    if d_model % heads:
        raise ValueError(f"d_model {d_model} is not a multiple of heads {heads}")
    dh = d_model // heads
    g = _Graph(seed)
    split = g.const("heads_shape", [0, 0, heads, dh], np.int64)
    merge = g.const("model_shape", [0, 0, d_model], np.int64)

    # attention_mask [B, S] -> additive [B, 1, 1, S]: 0 where a token is, MASKED_SCORE where padding is
    keep = g.node("Cast", ["attention_mask"], "mask_f", to=TensorProto.FLOAT)
    pad = g.node("Sub", [g.const("one", 1.0), keep], "mask_pad")
    additive = g.node("Mul", [pad, g.const("masked_score", MASKED_SCORE)], "mask_add")
    additive = g.node("Unsqueeze", [additive, g.const("mask_axes", [1, 2], np.int64)], "mask_b11s")

    q, k, v = (g.node("Reshape", [g.dense("x", n, d_model, d_model), split], f"{n}_heads") for n in ("q", "k", "v"))
    q = g.node("Transpose", [q], "q_t", perm=[0, 2, 1, 3])        # [B, H, S, Dh]
    k = g.node("Transpose", [k], "k_t", perm=[0, 2, 3, 1])        # [B, H, Dh, S]
    v = g.node("Transpose", [v], "v_t", perm=[0, 2, 1, 3])
    scores = g.node("Mul", [g.node("MatMul", [q, k], "qk"), g.const("scale", 1.0 / np.sqrt(dh))], "scores")
    attn = g.node("Softmax", [g.node("Add", [scores, additive], "scores_masked")], "attn", axis=-1)
    ctx = g.node("Transpose", [g.node("MatMul", [attn, v], "ctx_h")], "ctx_t", perm=[0, 2, 1, 3])
    ctx = g.node("Reshape", [ctx, merge], "ctx")
    h = g.layer_norm(g.node("Add", ["x", g.dense(ctx, "proj", d_model, d_model)], "res1"), "ln1", d_model)

    f = g.dense(h, "ff1", d_model, d_ff)
    erf = g.node("Erf", [g.node("Mul", [f, g.const("inv_sqrt2", 1 / np.sqrt(2))], "ff_s")], "ff_erf")
    gelu = g.node("Mul", [g.node("Mul", [f, g.const("half", 0.5)], "ff_half"),
                          g.node("Add", [erf, "one"], "ff_1p")], "gelu")
    res2 = g.node("Add", [h, g.dense(gelu, "ff2", d_ff, d_model)], "res2")
    g.layer_norm(res2, "y", d_model)

    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, seq, d_model]),
              helper.make_tensor_value_info("attention_mask", TensorProto.INT64, [batch, seq])]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, seq, d_model])]
    graph = helper.make_graph(g.nodes, "bert_block", inputs, outputs, g.inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
