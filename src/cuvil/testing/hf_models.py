"""Whole Hugging Face text models built with ``onnx.helper``, no torch needed: BERT (``BertModel``) and one
GPT-2 decode step with a KV cache (``GPT2LMHeadModel`` called with ``past_key_values``), with the inputs,
outputs, symbolic dims and compute ops that ``torch.onnx.export`` writes for them
(``bench/models/export_transformers.py``; ``tests/fixtures/exports/`` holds small exports), and seeded random
weights. The benchmark (``bench/run_all.py --section transformer``) builds these at full size when it is given
no exported file.

What matches the TorchScript export (transformers 5, SDPA attention): input and output names and dims
(``batch``, ``sequence``; ``past_sequence``, ``total_sequence``), embeddings as Gathers of the word, position
(``position_ids[:, :S]``, a Slice whose end comes from a Shape; a decode step's position is the past length)
and token-type tables, post-norm (BERT) or pre-norm (GPT-2) LayerNormalization, dense layers as MatMul + Add,
attention as the exporter writes ``scaled_dot_product_attention`` (Q and Kᵀ each scaled by ``d**-0.25``, the
mask added as ``Where(mask, 0, -inf)``, Softmax, ``Where(IsNaN(p), 0, p)``), erf GELU (BERT) and tanh GELU
with ``Pow`` (GPT-2), BERT's pooler (first token, Gemm, Tanh), GPT-2's ``Concat(past, new)`` per layer and the
tied LM head as a MatMul with the transposed word table. What differs: the export's shape arithmetic around
these (Shape/Gather/Concat chains feeding Reshape and Expand, the causal-mask construction) is shorter here;
a decode step of one token needs no causal block. The FLOPs and weights are the same.
"""
from __future__ import annotations

from typing import Dict, List

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

#: BERT-base and GPT-2 (124M) as transformers' default configs have them.
BERT_BASE = dict(vocab=30522, hidden=768, layers=12, heads=12, ffn=3072, max_pos=512, type_vocab=2)
GPT2_SMALL = dict(vocab=50257, hidden=768, layers=12, heads=12, ffn=3072, max_pos=1024)

#: One library for every shape the benchmark times: B = 1..8, S = 1..512 (BERT's position table has 512 rows).
BERT_PROFILE = {"batch": (1, 1, 8), "sequence": (1, 128, 512)}
#: A decode step after a past of 1..1023 tokens (GPT-2's 1,024 positions: the new token is position ``past``).
GPT2_DECODE_PROFILE = {"batch": (1, 1, 8), "past_sequence": (1, 128, 1023), "total_sequence": (2, 129, 1024)}


class _G:
    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.nodes: List[onnx.NodeProto] = []
        self.inits: List[onnx.TensorProto] = []

    def const(self, name: str, values, dtype=np.float32) -> str:
        self.inits.append(numpy_helper.from_array(np.asarray(values, dtype=dtype), name))
        return name

    def weight(self, name: str, shape, scale: float) -> str:
        return self.const(name, self.rng.standard_normal(shape, dtype=np.float32) * np.float32(scale))

    def node(self, op: str, inputs, output: str, **attrs) -> str:
        self.nodes.append(helper.make_node(op, list(inputs), [output], name=output, **attrs))
        return output

    def dense(self, x: str, name: str, d_in: int, d_out: int) -> str:
        y = self.node("MatMul", [x, self.weight(f"{name}.weight", (d_in, d_out), d_in ** -0.5)], f"{name}.mm")
        return self.node("Add", [y, self.weight(f"{name}.bias", (d_out,), 0.02)], name)

    def norm(self, x: str, name: str, d: int, eps: float) -> str:
        gamma = self.const(f"{name}.weight", 1 + 0.1 * self.rng.standard_normal(d))
        beta = self.const(f"{name}.bias", 0.1 * self.rng.standard_normal(d))
        return self.node("LayerNormalization", [x, gamma, beta], name, axis=-1, epsilon=eps)

    def attention(self, q: str, kt: str, v: str, additive: str, name: str) -> str:
        """SDPA as the TorchScript exporter writes it: ``q`` [B,H,S,dh], ``kt`` [B,H,dh,T], ``v`` [B,H,T,dh],
        ``additive`` [B,1,1,T] (0 or -inf) -> [B,H,S,dh]."""
        s = self.node("MatMul", [self.node("Mul", [q, "sdpa.root"], f"{name}.qs"),
                                 self.node("Mul", [kt, "sdpa.root"], f"{name}.ks")], f"{name}.qk")
        p = self.node("Softmax", [self.node("Add", [s, additive], f"{name}.scores")], f"{name}.p", axis=-1)
        p = self.node("Where", [self.node("IsNaN", [p], f"{name}.nan"), "sdpa.zero", p], f"{name}.pg")
        return self.node("MatMul", [p, v], f"{name}.ctx")

    def additive_mask(self, dh: int, kv_len: str = "") -> str:
        """``attention_mask`` [B, T] (1 = token) -> ``Where(mask, 0, -inf)`` [B, 1, 1, T], and SDPA's constants.
        ``kv_len`` (a 0-d int64 tensor): the mask is read at key positions ``Range(0, kv_len)``, as transformers'
        mask functions index it with the cache's length (so its length is the keys', not a second symbol)."""
        self.const("sdpa.root", dh ** -0.25)
        self.const("sdpa.zero", 0.0)
        mask = "attention_mask"
        if kv_len:
            kv = self.node("Range", [self.const("mask.r0", 0, np.int64), kv_len, self.const("mask.r1", 1, np.int64)],
                           "mask.kv_idx")
            mask = self.node("Gather", [mask, kv], "mask.kv", axis=1)
        keep = self.node("Unsqueeze", [self.node("Cast", [mask], "mask.bool", to=TensorProto.BOOL),
                                       self.const("mask.axes", [1, 2], np.int64)], "mask.b11t")
        return self.node("Where", [keep, "sdpa.zero", self.const("sdpa.neg_inf", -np.inf)], "mask.additive")

    def model(self, name: str, inputs, outputs) -> onnx.ModelProto:
        g = helper.make_graph(self.nodes, name, inputs, outputs, self.inits)
        # IR version 8 (what opset 17 needs): onnx's newest default is refused by onnxruntimes older than it
        return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _heads(g: _G, x: str, name: str, heads: int, dh: int, perm) -> str:
    r = g.node("Reshape", [x, g.const(f"{name}.split_shape", [0, 0, heads, dh], np.int64)], f"{name}.heads")
    return g.node("Transpose", [r], f"{name}.t", perm=perm)


def _merge(g: _G, ctx: str, name: str, hidden: int) -> str:
    t = g.node("Transpose", [ctx], f"{name}.ctx_t", perm=[0, 2, 1, 3])
    return g.node("Reshape", [t, g.const(f"{name}.merge_shape", [0, 0, hidden], np.int64)], f"{name}.merged")


def bert_model(vocab: int = 30522, hidden: int = 768, layers: int = 12, heads: int = 12, ffn: int = 3072,
               max_pos: int = 512, type_vocab: int = 2, seed: int = 0) -> onnx.ModelProto:
    """``BertModel``: ``input_ids``, ``attention_mask``, ``token_type_ids`` [batch, sequence] (int64) ->
    ``last_hidden_state`` [batch, sequence, hidden], ``pooler_output`` [batch, hidden]. Defaults: BERT-base."""
    if hidden % heads:
        raise ValueError(f"hidden {hidden} is not a multiple of heads {heads}")
    dh = hidden // heads
    g = _G(seed)
    # embeddings: word + token type + position_ids[:, :S] (S from Shape(input_ids)), LayerNorm
    seq = g.node("Unsqueeze", [g.node("Gather", [g.node("Shape", ["input_ids"], "emb.shape"),
                                                 g.const("emb.one", 1, np.int64)], "emb.seq", axis=0),
                               g.const("emb.ax0", [0], np.int64)], "emb.seq1")
    pids = g.node("Slice", [g.const("embeddings.position_ids", np.arange(max_pos)[None], np.int64),
                            g.const("emb.zero1", [0], np.int64), seq, g.const("emb.ax1", [1], np.int64)], "emb.pids")
    we = g.node("Gather", [g.weight("embeddings.word_embeddings.weight", (vocab, hidden), 0.02), "input_ids"],
                "emb.word", axis=0)
    te = g.node("Gather", [g.weight("embeddings.token_type_embeddings.weight", (type_vocab, hidden), 0.02),
                           "token_type_ids"], "emb.type", axis=0)
    pe = g.node("Gather", [g.weight("embeddings.position_embeddings.weight", (max_pos, hidden), 0.02), pids],
                "emb.pos", axis=0)
    x = g.norm(g.node("Add", [g.node("Add", [we, te], "emb.wt"), pe], "emb.sum"), "embeddings.LayerNorm", hidden,
               1e-12)
    mask = g.additive_mask(dh)
    for i in range(layers):
        p = f"encoder.layer.{i}"
        q = _heads(g, g.dense(x, f"{p}.attention.self.query", hidden, hidden), f"{p}.q", heads, dh, [0, 2, 1, 3])
        kt = _heads(g, g.dense(x, f"{p}.attention.self.key", hidden, hidden), f"{p}.k", heads, dh, [0, 2, 3, 1])
        v = _heads(g, g.dense(x, f"{p}.attention.self.value", hidden, hidden), f"{p}.v", heads, dh, [0, 2, 1, 3])
        ctx = _merge(g, g.attention(q, kt, v, mask, f"{p}.sdpa"), p, hidden)
        h = g.node("Add", [g.dense(ctx, f"{p}.attention.output.dense", hidden, hidden), x], f"{p}.res1")
        x = g.norm(h, f"{p}.attention.output.LayerNorm", hidden, 1e-12)
        f = g.dense(x, f"{p}.intermediate.dense", hidden, ffn)
        erf = g.node("Erf", [g.node("Div", [f, g.const(f"{p}.sqrt2", np.sqrt(2.0))], f"{p}.fs")], f"{p}.erf")
        gelu = g.node("Mul", [g.node("Mul", [f, g.node("Add", [erf, g.const(f"{p}.one", 1.0)], f"{p}.f1")],
                                     f"{p}.ff"), g.const(f"{p}.half", 0.5)], f"{p}.gelu")
        h = g.node("Add", [g.dense(gelu, f"{p}.output.dense", ffn, hidden), x], f"{p}.res2")
        x = g.norm(h, f"{p}.output.LayerNorm", hidden, 1e-12)
    g.node("Identity", [x], "last_hidden_state")
    first = g.node("Gather", [x, g.const("pooler.first", 0, np.int64)], "pooler.first_token", axis=1)
    pooled = g.node("Gemm", [first, g.weight("pooler.dense.weight", (hidden, hidden), hidden ** -0.5),
                             g.weight("pooler.dense.bias", (hidden,), 0.02)], "pooler.dense", transB=1)
    g.node("Tanh", [pooled], "pooler_output")
    ins = [helper.make_tensor_value_info(n, TensorProto.INT64, ["batch", "sequence"])
           for n in ("input_ids", "attention_mask", "token_type_ids")]
    outs = [helper.make_tensor_value_info("last_hidden_state", TensorProto.FLOAT, ["batch", "sequence", hidden]),
            helper.make_tensor_value_info("pooler_output", TensorProto.FLOAT, ["batch", hidden])]
    return g.model("bert", ins, outs)


def gpt2_decode_model(vocab: int = 50257, hidden: int = 768, layers: int = 12, heads: int = 12, ffn: int = 3072,
                      max_pos: int = 1024, seed: int = 0) -> onnx.ModelProto:
    """One ``GPT2LMHeadModel`` decode step: ``input_ids`` [batch, 1], ``attention_mask`` [batch, total_sequence]
    (int64), ``past_key_values.{i}.key`` / ``.value`` [batch, heads, past_sequence, hidden/heads] ->
    ``logits`` [batch, 1, vocab] and ``present.{i}.key`` / ``.value`` (the past with this token's entries
    appended). The token's position is ``past_sequence``. Defaults: GPT-2 (124M)."""
    if hidden % heads:
        raise ValueError(f"hidden {hidden} is not a multiple of heads {heads}")
    dh = hidden // heads
    g = _G(seed)
    past = g.node("Shape", ["past_key_values.0.key"], "pos.past_shape", start=2, end=3)            # [P]
    end = g.node("Add", [past, g.const("pos.one1", [1], np.int64)], "pos.end")                        # [P + 1]
    pids = g.node("Slice", [g.const("pos.ids", np.arange(max_pos)[None], np.int64), past, end,
                            g.const("pos.ax1", [1], np.int64)], "pos.pids")                          # [1, 1]
    wte = g.weight("transformer.wte.weight", (vocab, hidden), 0.02)
    x = g.node("Add", [g.node("Gather", [wte, "input_ids"], "emb.word", axis=0),
                       g.node("Gather", [g.weight("transformer.wpe.weight", (max_pos, hidden), 0.01), pids],
                              "emb.pos", axis=0)], "emb.sum")
    mask = g.additive_mask(dh, g.node("Squeeze", [end, g.const("pos.ax0", [0], np.int64)], "pos.kv_len"))
    split = g.const("attn.split", [hidden, hidden, hidden], np.int64)
    for i in range(layers):
        p = f"transformer.h.{i}"
        h = g.norm(x, f"{p}.ln_1", hidden, 1e-5)
        qkv = g.dense(h, f"{p}.attn.c_attn", hidden, 3 * hidden)
        g.nodes.append(helper.make_node("Split", [qkv, split], [f"{p}.q_", f"{p}.k_", f"{p}.v_"], name=f"{p}.split",
                                        axis=-1))
        q = _heads(g, f"{p}.q_", f"{p}.q", heads, dh, [0, 2, 1, 3])
        k = _heads(g, f"{p}.k_", f"{p}.k", heads, dh, [0, 2, 1, 3])
        v = _heads(g, f"{p}.v_", f"{p}.v", heads, dh, [0, 2, 1, 3])
        k_all = g.node("Concat", [f"past_key_values.{i}.key", k], f"present.{i}.key", axis=-2)
        v_all = g.node("Concat", [f"past_key_values.{i}.value", v], f"present.{i}.value", axis=-2)
        kt = g.node("Transpose", [k_all], f"{p}.kt", perm=[0, 1, 3, 2])
        ctx = _merge(g, g.attention(q, kt, v_all, mask, f"{p}.sdpa"), p, hidden)
        x = g.node("Add", [x, g.dense(ctx, f"{p}.attn.c_proj", hidden, hidden)], f"{p}.res1")
        f = g.dense(g.norm(x, f"{p}.ln_2", hidden, 1e-5), f"{p}.mlp.c_fc", hidden, ffn)
        cube = g.node("Mul", [g.node("Pow", [f, g.const(f"{p}.three", 3.0)], f"{p}.f3"),
                              g.const(f"{p}.c", 0.044715)], f"{p}.f3c")
        inner = g.node("Mul", [g.node("Add", [f, cube], f"{p}.fin"), g.const(f"{p}.k", np.sqrt(2 / np.pi))],
                       f"{p}.fk")
        t = g.node("Add", [g.const(f"{p}.one", 1.0), g.node("Tanh", [inner], f"{p}.tanh")], f"{p}.t1")
        gelu = g.node("Mul", [g.node("Mul", [g.const(f"{p}.half", 0.5), f], f"{p}.fh"), t], f"{p}.gelu")
        x = g.node("Add", [x, g.dense(gelu, f"{p}.mlp.c_proj", ffn, hidden)], f"{p}.res2")
    x = g.norm(x, "transformer.ln_f", hidden, 1e-5)
    wte_t = numpy_helper.to_array(next(t for t in g.inits if t.name == wte)).T.copy()   # the tied LM head
    g.node("MatMul", [x, g.const("lm_head.weight_t", wte_t)], "logits")
    ins = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", 1]),
           helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "total_sequence"])]
    outs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 1, vocab])]
    for i in range(layers):
        for kv in ("key", "value"):
            ins.append(helper.make_tensor_value_info(f"past_key_values.{i}.{kv}", TensorProto.FLOAT,
                                                     ["batch", heads, "past_sequence", dh]))
            outs.append(helper.make_tensor_value_info(f"present.{i}.{kv}", TensorProto.FLOAT,
                                                      ["batch", heads, "total_sequence", dh]))
    return g.model("gpt2_decode", ins, outs)


def text_feeds(model: onnx.ModelProto, batch: int, seq: int, seed: int = 0) -> Dict[str, np.ndarray]:
    """Seeded inputs of a BERT or GPT-2 decode model (built here or exported): token ids below the smallest
    vocabulary, masks of ones (every token real: the benchmark's case), token types 0, standard-normal past
    keys and values. ``seq``: BERT's sequence length, the decode step's past length."""
    rng = np.random.default_rng(seed)
    env = {"batch": batch, "sequence": seq, "past_sequence": seq, "total_sequence": seq + 1}
    out = {}
    for vi in model.graph.input:
        shape = [env.get(d.dim_param, 1) if d.dim_param else d.dim_value for d in vi.type.tensor_type.shape.dim]
        if vi.name == "input_ids":
            out[vi.name] = rng.integers(3, 500, shape).astype(np.int64)
        elif vi.name == "attention_mask":
            out[vi.name] = np.ones(shape, np.int64)
        elif vi.name == "token_type_ids":
            out[vi.name] = np.zeros(shape, np.int64)
        else:
            out[vi.name] = rng.standard_normal(shape).astype(np.float32)
    return out
