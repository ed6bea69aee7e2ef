"""Hand-built graphs of the shape computations Hugging Face text models carry once exported by torch.onnx, over
symbolic batch ``B`` and sequence ``S`` (and past length ``P``): each small enough to compile in seconds, each
one pattern the real exports repeat per layer. :data:`HF_PATTERNS` maps a name to its builder,
:data:`HF_PROFILE` is the shape profile the tests compile them for (one library for every shape in it), and
:func:`hf_feeds` gives seeded inputs at a (B, S) point, attention masks padded row by row.
"""
from __future__ import annotations

from typing import Callable, Dict

import numpy as np
import onnx
from onnx import TensorProto as TP
from onnx import helper as h
from onnx import numpy_helper

HF_PROFILE = {"B": (1, 2, 8), "S": (1, 16, 512), "P": (1, 8, 300)}
_FMIN = np.finfo(np.float32).min


def _c(name, arr):
    return numpy_helper.from_array(np.asarray(arr), name)


def _i64(name, *vals):
    return _c(name, np.array(list(vals), np.int64))


def _model(name, nodes, inputs, inits) -> onnx.ModelProto:
    g = h.make_graph(nodes, name, inputs, [h.make_tensor_value_info("y", TP.FLOAT, None)], inits)
    return h.make_model(g, opset_imports=[h.make_opsetid("", 17)])


def _in(name, dtype, dims):
    return h.make_tensor_value_info(name, dtype, dims)


def position_ids(d: int = 16, max_pos: int = 512) -> onnx.ModelProto:
    """``word_emb[ids] + pos_emb[position_ids[:, :S]]`` with ``S = Shape(ids)[1]`` (BERT's embeddings): a Slice
    whose end is computed from a shape."""
    rng = np.random.default_rng(0)
    nodes = [h.make_node("Shape", ["ids"], ["sh"]),
             h.make_node("Gather", ["sh", "one"], ["seq"], axis=0),
             h.make_node("Unsqueeze", ["seq", "ax0"], ["seq1"]),
             h.make_node("Slice", ["pos_ids", "zero1", "seq1", "ax1", "one1"], ["pids"], name="pids"),
             h.make_node("Gather", ["wemb", "ids"], ["we"], axis=0),
             h.make_node("Gather", ["pemb", "pids"], ["pe"], axis=0),
             h.make_node("Add", ["we", "pe"], ["y"])]
    inits = [_c("one", np.array(1, np.int64)), _i64("ax0", 0), _i64("zero1", 0), _i64("ax1", 1), _i64("one1", 1),
             _c("pos_ids", np.arange(max_pos, dtype=np.int64)[None]),
             _c("wemb", rng.standard_normal((50, d)).astype(np.float32)),
             _c("pemb", rng.standard_normal((max_pos, d)).astype(np.float32))]
    return _model("position_ids", nodes, [_in("ids", TP.INT64, ["B", "S"])], inits)


def extended_mask() -> onnx.ModelProto:
    """``softmax(scores + (1 - mask[:, None, None, :]) * finfo.min)``: the extended attention mask."""
    nodes = [h.make_node("Unsqueeze", ["mask", "ax12"], ["m4"]),
             h.make_node("Cast", ["m4"], ["mf"], to=TP.FLOAT),
             h.make_node("Sub", ["onef", "mf"], ["inv"]),
             h.make_node("Mul", ["inv", "fmin"], ["ext"]),
             h.make_node("Add", ["scores", "ext"], ["s2"]),
             h.make_node("Softmax", ["s2"], ["y"], axis=-1)]
    inits = [_i64("ax12", 1, 2), _c("onef", np.array(1.0, np.float32)), _c("fmin", np.array(_FMIN, np.float32))]
    return _model("extended_mask", nodes, [_in("mask", TP.INT64, ["B", "S"]),
                                           _in("scores", TP.FLOAT, ["B", 2, "S", "S"])], inits)


def causal_range(d: int = 8) -> onnx.ModelProto:
    """A causal mask built at run time: ``r = Range(0, S)``, ``r[None, :] <= r[:, None]``, Where to 0 / finfo.min,
    Expanded to ``Concat(B, 1, S, S)`` and added to ``x @ x^T``."""
    nodes = [h.make_node("Shape", ["x"], ["sh"]),
             h.make_node("Gather", ["sh", "one"], ["S"], axis=0),
             h.make_node("Gather", ["sh", "zero"], ["B"], axis=0),
             h.make_node("Range", ["zero", "S", "one"], ["r"]),
             h.make_node("Unsqueeze", ["r", "ax0"], ["rrow"]),
             h.make_node("Unsqueeze", ["r", "ax1"], ["rcol"]),
             h.make_node("LessOrEqual", ["rrow", "rcol"], ["causal"]),
             h.make_node("Where", ["causal", "zerof", "fmin"], ["mask2"]),
             h.make_node("Unsqueeze", ["B", "ax0"], ["B1"]),
             h.make_node("Unsqueeze", ["S", "ax0"], ["S1"]),
             h.make_node("Concat", ["B1", "one1", "S1", "S1"], ["eshape"], axis=0),
             h.make_node("Expand", ["mask2", "eshape"], ["mask4"]),
             h.make_node("Transpose", ["x"], ["xt"], perm=[0, 2, 1]),
             h.make_node("MatMul", ["x", "xt"], ["sc"]),
             h.make_node("Unsqueeze", ["sc", "ax1"], ["sc4"]),
             h.make_node("Add", ["sc4", "mask4"], ["s2"]),
             h.make_node("Softmax", ["s2"], ["y"], axis=-1)]
    inits = [_c("one", np.array(1, np.int64)), _c("zero", np.array(0, np.int64)), _i64("ax0", 0), _i64("ax1", 1),
             _i64("one1", 1), _c("zerof", np.array(0.0, np.float32)), _c("fmin", np.array(_FMIN, np.float32))]
    return _model("causal_range", nodes, [_in("x", TP.FLOAT, ["B", "S", d])], inits)


def causal_trilu(d: int = 8) -> onnx.ModelProto:
    """A causal mask from ``Trilu(ConstantOfShape(Concat(S, S), 1))``, cast to bool and used by Where."""
    nodes = [h.make_node("Shape", ["x"], ["sh"]),
             h.make_node("Gather", ["sh", "one1"], ["S1"], axis=0),
             h.make_node("Concat", ["S1", "S1"], ["ss"], axis=0),
             h.make_node("ConstantOfShape", ["ss"], ["ones"], value=h.make_tensor("v", TP.FLOAT, [1], [1.0])),
             h.make_node("Trilu", ["ones"], ["tri"], upper=0),
             h.make_node("Cast", ["tri"], ["tb"], to=TP.BOOL),
             h.make_node("Transpose", ["x"], ["xt"], perm=[0, 2, 1]),
             h.make_node("MatMul", ["x", "xt"], ["sc"]),
             h.make_node("Where", ["tb", "sc", "fmin"], ["s2"]),
             h.make_node("Softmax", ["s2"], ["y"], axis=-1)]
    inits = [_i64("one1", 1), _c("fmin", np.array(_FMIN, np.float32))]
    return _model("causal_trilu", nodes, [_in("x", TP.FLOAT, ["B", "S", d])], inits)


def head_split(heads: int = 2, dh: int = 4) -> onnx.ModelProto:
    """Heads split by ``Reshape(x, Concat(Shape(x)[0], Shape(x)[1], H, Dh))`` and merged back by a Reshape to
    ``Concat(Shape(xt)[:1], Shape(x, start=1, end=2), -1)``."""
    nodes = [h.make_node("Shape", ["x"], ["sh"]),
             h.make_node("Gather", ["sh", "zero"], ["b"], axis=0),
             h.make_node("Gather", ["sh", "one"], ["s"], axis=0),
             h.make_node("Unsqueeze", ["b", "ax0"], ["b1"]),
             h.make_node("Unsqueeze", ["s", "ax0"], ["s1"]),
             h.make_node("Concat", ["b1", "s1", "hh", "dd"], ["shp"], axis=0),
             h.make_node("Reshape", ["x", "shp"], ["xr"]),
             h.make_node("Transpose", ["xr"], ["xt"], perm=[0, 2, 1, 3]),
             h.make_node("Shape", ["xt"], ["sh2"]),
             h.make_node("Slice", ["sh2", "zero1", "one1", "zero1"], ["b_"]),
             h.make_node("Shape", ["x"], ["sh3"], start=1, end=2),
             h.make_node("Concat", ["b_", "sh3", "m1"], ["shp2"], axis=0),
             h.make_node("Transpose", ["xt"], ["xb"], perm=[0, 2, 1, 3]),
             h.make_node("Reshape", ["xb", "shp2"], ["y0"]),
             h.make_node("Mul", ["y0", "two"], ["y"])]
    inits = [_c("zero", np.array(0, np.int64)), _c("one", np.array(1, np.int64)), _i64("ax0", 0), _i64("hh", heads),
             _i64("dd", dh), _i64("zero1", 0), _i64("one1", 1), _i64("m1", -1), _c("two", np.array(2.0, np.float32))]
    return _model("head_split", nodes, [_in("x", TP.FLOAT, ["B", "S", heads * dh])], inits)


def past_slice(d: int = 16, max_pos: int = 1024) -> onnx.ModelProto:
    """A decode step with a past of length P: ``pos[:, P:P + S]`` and the causal block ``tri[:, :, P:P + S, :P + S]``
    of a constant lower-triangular buffer (GPT-2's), both Slices with start and end computed from shapes; keys
    are ``Concat(past, new)`` along the sequence."""
    rng = np.random.default_rng(1)
    nodes = [h.make_node("Shape", ["ids"], ["sh"]),
             h.make_node("Shape", ["past"], ["shp"]),
             h.make_node("Gather", ["sh", "one1"], ["S1"], axis=0),
             h.make_node("Gather", ["shp", "two1"], ["P1"], axis=0),
             h.make_node("Add", ["P1", "S1"], ["T1"]),
             h.make_node("Slice", ["pos_ids", "P1", "T1", "ax1"], ["pids"]),
             h.make_node("Gather", ["pemb", "pids"], ["pe"], axis=0),
             h.make_node("Slice", ["tri", "P1", "T1", "ax2"], ["rows"]),
             h.make_node("Slice", ["rows", "zero1", "T1", "ax3"], ["blk"]),
             h.make_node("Cast", ["blk"], ["blkb"], to=TP.BOOL),
             h.make_node("ReduceSum", ["past", "ax1"], ["pk"], keepdims=0),
             h.make_node("Slice", ["pe", "zero1", "four1", "ax2"], ["pe4"]),
             h.make_node("Mul", ["kv", "half"], ["pk4"]),
             h.make_node("Concat", ["pk", "pk4"], ["keys"], axis=1),
             h.make_node("Transpose", ["keys"], ["keys_t"], perm=[0, 2, 1]),
             h.make_node("Add", ["pe4", "kv"], ["q"]),
             h.make_node("MatMul", ["q", "keys_t"], ["sc"]),
             h.make_node("Unsqueeze", ["sc", "ax1"], ["sc4"]),
             h.make_node("Where", ["blkb", "sc4", "fmin"], ["ms"]),
             h.make_node("Softmax", ["ms"], ["y"], axis=-1)]
    inits = [_i64("one1", 1), _i64("two1", 2), _i64("zero1", 0), _i64("four1", 4), _i64("ax1", 1), _i64("ax2", 2),
             _i64("ax3", 3), _c("half", np.array(0.5, np.float32)),
             _c("pos_ids", np.arange(max_pos, dtype=np.int64)[None]),
             _c("pemb", rng.standard_normal((max_pos, d)).astype(np.float32)),
             _c("tri", np.tril(np.ones((max_pos, max_pos), np.uint8))[None, None]),
             _c("fmin", np.array(_FMIN, np.float32))]
    return _model("past_slice", nodes, [_in("ids", TP.INT64, ["B", "S"]), _in("past", TP.FLOAT, ["B", 2, "P", 4]),
                                        _in("kv", TP.FLOAT, ["B", "S", 4])], inits)


def torchscript_expand() -> onnx.ModelProto:
    """The TorchScript exporter's Expand, to ``Where(Equal(s, -1), 1, s)`` with ``s = Concat(B, 1, S, S)``, and a
    Reshape to ``Concat(B, Max(S, 1), -1)``."""
    nodes = [h.make_node("Shape", ["mask"], ["sh"]),
             h.make_node("Gather", ["sh", "zero1"], ["B1"], axis=0),
             h.make_node("Gather", ["sh", "one1"], ["S1"], axis=0),
             h.make_node("Concat", ["B1", "one1", "S1", "S1"], ["s"], axis=0),
             h.make_node("Equal", ["s", "m1"], ["eq"]),
             h.make_node("ConstantOfShape", ["four1"], ["ones"], value=h.make_tensor("v", TP.INT64, [1], [1])),
             h.make_node("Where", ["eq", "ones", "s"], ["s2"]),
             h.make_node("Unsqueeze", ["mask", "ax12"], ["m4"]),
             h.make_node("Expand", ["m4", "s2"], ["me"]),
             h.make_node("Cast", ["me"], ["mf"], to=TP.FLOAT),
             h.make_node("Max", ["S1", "one1"], ["Smax"]),
             h.make_node("Concat", ["B1", "Smax", "m1"], ["rs"], axis=0),
             h.make_node("Reshape", ["mf", "rs"], ["y"])]
    inits = [_i64("zero1", 0), _i64("one1", 1), _i64("m1", -1), _i64("four1", 4), _i64("ax12", 1, 2)]
    return _model("torchscript_expand", nodes, [_in("mask", TP.INT64, ["B", "S"])], inits)


HF_PATTERNS: Dict[str, Callable[[], onnx.ModelProto]] = {
    f.__name__: f for f in (position_ids, extended_mask, causal_range, causal_trilu, head_split, past_slice,
                            torchscript_expand)}


def hf_feeds(model: onnx.ModelProto, b: int, s: int, seed: int = 0, past: int = 5) -> Dict[str, np.ndarray]:
    """Seeded inputs of a pattern at batch ``b``, sequence ``s`` (past length ``past``): token ids, attention
    masks with row r's last r*s/(b+1) positions padded (row 0 whole), standard-normal floats."""
    rng = np.random.default_rng(seed)
    env = {"B": b, "S": s, "P": past}
    out = {}
    for vi in model.graph.input:
        shape = [env[d.dim_param] if d.dim_param else d.dim_value for d in vi.type.tensor_type.shape.dim]
        if vi.name == "ids":
            out[vi.name] = rng.integers(0, 50, shape).astype(np.int64)
        elif vi.name == "mask":
            m = np.ones(shape, np.int64)
            for r in range(b):
                m[r, s - (r * s) // (b + 1):] = 0
            out[vi.name] = m
        else:
            out[vi.name] = rng.standard_normal(shape).astype(np.float32)
    return out


def topk_from_shape(k_max: int = 4) -> onnx.ModelProto:
    """``TopK(scores, k = Min(S, k_max))`` along the sequence, k computed from a shape (a search over the
    first tokens of a sequence that may be shorter than ``k_max``)."""
    nodes = [h.make_node("Shape", ["x"], ["sh"]),
             h.make_node("Gather", ["sh", "one1"], ["S1"], axis=0),
             h.make_node("Min", ["S1", "kmax"], ["k"]),
             h.make_node("ReduceSum", ["x", "ax2"], ["sc"], keepdims=0),
             h.make_node("TopK", ["sc", "k"], ["v", "i"], axis=1),
             h.make_node("Cast", ["i"], ["fi"], to=TP.FLOAT),
             h.make_node("Add", ["v", "fi"], ["y"])]
    inits = [_i64("one1", 1), _i64("kmax", k_max), _i64("ax2", 2)]
    return _model("topk_from_shape", nodes, [_in("x", TP.FLOAT, ["B", "S", 8])], inits)


HF_PATTERNS["topk_from_shape"] = topk_from_shape


def tail_slice() -> onnx.ModelProto:
    """``keys[:, -S:]`` of ``keys = Concat(past, new)`` along the sequence (a start that counts from the end,
    ``-S``, computed from a shape), scaled and added to the new entries."""
    nodes = [h.make_node("Shape", ["kv"], ["sh"]),
             h.make_node("Gather", ["sh", "one1"], ["S1"], axis=0),
             h.make_node("Neg", ["S1"], ["mS1"]),
             h.make_node("Concat", ["past", "kv"], ["keys"], axis=1),
             h.make_node("Slice", ["keys", "mS1", "big", "one1"], ["tail"]),
             h.make_node("Mul", ["tail", "two"], ["t2"]),
             h.make_node("Add", ["t2", "kv"], ["y"])]
    inits = [_i64("one1", 1), _i64("big", 2**63 - 1), _c("two", np.array(2.0, np.float32))]
    return _model("tail_slice", nodes, [_in("past", TP.FLOAT, ["B", "P", 4]), _in("kv", TP.FLOAT, ["B", "S", 4])],
                  inits)


HF_PATTERNS["tail_slice"] = tail_slice
