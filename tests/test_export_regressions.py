"""Small hand-built graphs that reproduce, one cause each, what went wrong on real exports (issue 19):
each compiles on x86 and matches onnxruntime."""

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from cuvil import CuvilError, Pipeline
from cuvil.dsl.compiler import build, match
from cuvil.dsl.parser import parse_rules
from cuvil.frontend import import_model
from cuvil.testing.oracles import ort_session


def make(nodes, inputs, outputs=("y",), inits=(), opset=18):
    g = helper.make_graph(nodes, "g", inputs, [helper.make_empty_tensor_value_info(o) for o in outputs],
                          list(inits))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def const(name, arr):
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.asarray(arr), name))


def check(model, feeds, rtol=1e-4):
    """Compile for x86, run, compare every output with onnxruntime; the reference oracle must agree too."""
    want = ort_session(model).run(None, feeds)
    p = Pipeline.from_onnx(model)
    ref = p.run_reference(feeds)
    got = p.optimize().compile().run(feeds)
    for name, w in zip([o.name for o in model.graph.output], want):
        np.testing.assert_allclose(ref[name], w, rtol=rtol, atol=rtol * max(1.0, float(np.abs(w).max(initial=0))))
        np.testing.assert_allclose(got[name], w, rtol=rtol, atol=rtol * max(1.0, float(np.abs(w).max(initial=0))))
    return got


# --- GatherElements along a long axis (BERT's token_type_ids, dynamo export) ------------------------------

@pytest.mark.parametrize("axis,data_shape,index_shape", [(1, (1, 512), (1, 16)),   # BERT: buffer[1, 512] gathered by position_ids
                                                         (0, (100, 3), (5, 1)),     # one column: was silently wrong
                                                         (-1, (2, 3, 70), (2, 2, 9))])
def test_gather_elements_along_an_axis_longer_than_np_choose_allows(axis, data_shape, index_shape):
    # onnx.reference's GatherElements (np.choose) breaks past 32/64 choices: folding it raised a raw ValueError.
    rng = np.random.default_rng(0)
    n = data_shape[axis]
    data = rng.integers(-100, 100, data_shape).astype(np.int64)
    idx = rng.integers(-n, n, index_shape).astype(np.int64)
    x = helper.make_tensor_value_info("x", TensorProto.INT64, list(index_shape))
    nodes = [const("d", data), const("i", idx), helper.make_node("GatherElements", ["d", "i"], ["g"], axis=axis),
             helper.make_node("Add", ["x", "g"], ["y"])]
    m = make(nodes, [x])
    p = Pipeline.from_onnx(m).optimize()
    assert "GatherElements" not in [nd.op for nd in p.graph.nodes]  # folded, and folded right:
    check(m, {"x": np.zeros(index_shape, np.int64)})
    # computed at run time too (indices an input), against the same oracle
    xi = helper.make_tensor_value_info("i", TensorProto.INT64, list(index_shape))
    m2 = make([const("d", data), helper.make_node("GatherElements", ["d", "i"], ["y"], axis=axis)], [xi])
    check(m2, {"i": idx})


# --- element types where a rank is unknown (TorchScript exports' attention masks) ---------------------------

def _torchscript_mask(scores_shape=("B", "H", "S", "S")):
    """The TorchScript exporter's extended attention mask: the Expand target comes out of a Where over a
    shape vector, which Cuvil cannot evaluate before the symbols are fixed, so the Expand's rank is unknown
    and everything after it must get its element type without shapes."""
    mask = helper.make_tensor_value_info("mask", TensorProto.INT64, ["B", "S"])
    scores = helper.make_tensor_value_info("scores", TensorProto.FLOAT, list(scores_shape))
    i64 = lambda name, v: const(name, np.array(v, np.int64))
    nodes = [
        helper.make_node("Cast", ["mask"], ["mb"], to=TensorProto.BOOL),
        i64("ax", [1, 2]), helper.make_node("Unsqueeze", ["mb", "ax"], ["m4"]),             # [B, 1, 1, S]
        helper.make_node("Shape", ["scores"], ["ss"]),
        i64("neg", -1), helper.make_node("Equal", ["ss", "neg"], ["is_neg"]),
        helper.make_node("Shape", ["ss"], ["ss_len"]),
        helper.make_node("ConstantOfShape", ["ss_len"], ["ones"], value=numpy_helper.from_array(np.array([1], np.int64))),
        helper.make_node("Where", ["is_neg", "ones", "ss"], ["target"]),
        helper.make_node("Expand", ["m4", "target"], ["mx"]),                               # rank unknown to Cuvil
        helper.make_node("Not", ["mx"], ["pad"]),
        helper.make_node("Cast", ["pad"], ["padf"], to=TensorProto.FLOAT),
        const("zero", np.array([0.0], np.float32)), const("ninf", np.array([-1e9], np.float32)),
        helper.make_node("Where", ["mx", "zero", "ninf"], ["bias"]),                        # float, not bool
        helper.make_node("Add", ["scores", "bias"], ["s2"]),
        helper.make_node("Add", ["s2", "padf"], ["y"]),
        helper.make_node("Identity", ["pad"], ["pad_out"]),
    ]
    return make(nodes, [mask, scores], outputs=("y", "pad_out"), opset=17)


def test_dtypes_survive_an_unknown_rank():
    m = _torchscript_mask()
    g = Pipeline.from_onnx(m).graph
    by_name = {v.name: v for v in g.values()}
    assert by_name["target"].dtype.name == "INT64"
    assert by_name["bias"].dtype.name == "FLOAT" and by_name["pad"].dtype.name == "BOOL"
    assert by_name["padf"].dtype.name == "FLOAT"


@pytest.mark.parametrize("B,S", [(1, 1), (2, 5), (3, 8)])
def test_torchscript_mask_pattern_matches_onnxruntime(B, S):
    m = _torchscript_mask()
    rng = np.random.default_rng(B * 10 + S)
    mask = np.ones((B, S), np.int64)
    mask[-1, 1:] = 0                                  # the last row mostly padding
    feeds = {"mask": mask, "scores": rng.standard_normal((B, 2, S, S)).astype(np.float32)}
    want = ort_session(m).run(None, feeds)
    got = Pipeline.from_onnx(m).optimize().compile(fixed={"B": B, "S": S, "H": 2}).run(feeds)
    np.testing.assert_allclose(got["y"], want[0], rtol=1e-6)
    np.testing.assert_array_equal(got["pad_out"], want[1])


# --- Concat of shape values along an inner axis (dynamo exports' padding-mask index, B = 1) -----------------

def _dynamo_mask_index():
    """``mask[batch_idx, kv_idx]`` as torch.onnx's dynamo exporter writes it: two aranges broadcast against
    each other (Expand to the Shape of their Max), Unsqueeze(-1), Concat on the last axis, GatherND. At
    B = 1 every index element is known at compile time, and Concat's symbolic evaluation joined the
    inputs' elements whole instead of pair by pair: the mask was read at wrong positions."""
    mask = helper.make_tensor_value_info("mask", TensorProto.INT64, ["B", "S"])
    i64 = lambda name, v: const(name, np.array(v, np.int64))
    nodes = [
        i64("zero", 0), i64("one", 1), i64("ax12", [1, 2]), i64("ax3", [3]), i64("ax01", [0, 1]), i64("ax2", [2]),
        i64("last", [-1]),
        helper.make_node("Shape", ["mask"], ["b_"], start=0, end=1), helper.make_node("Squeeze", ["b_"], ["b"]),
        helper.make_node("Shape", ["mask"], ["s_"], start=1, end=2), helper.make_node("Squeeze", ["s_"], ["s"]),
        helper.make_node("Range", ["zero", "b", "one"], ["bi"]),
        helper.make_node("Unsqueeze", ["bi", "ax12"], ["bi3"]), helper.make_node("Unsqueeze", ["bi3", "ax3"], ["bi4"]),
        helper.make_node("Range", ["zero", "s", "one"], ["si"]),
        helper.make_node("Unsqueeze", ["si", "ax01"], ["si3"]), helper.make_node("Unsqueeze", ["si3", "ax2"], ["si4"]),
        helper.make_node("Max", ["bi4", "si4"], ["mx"]), helper.make_node("Shape", ["mx"], ["target"]),
        helper.make_node("Expand", ["bi4", "target"], ["bx"]), helper.make_node("Unsqueeze", ["bx", "last"], ["bx5"]),
        helper.make_node("Expand", ["si4", "target"], ["sx"]), helper.make_node("Unsqueeze", ["sx", "last"], ["sx5"]),
        helper.make_node("Concat", ["bx5", "sx5"], ["idx"], axis=-1),                       # [B, 1, 1, S, 2]
        helper.make_node("Cast", ["mask"], ["mb"], to=TensorProto.BOOL),
        helper.make_node("GatherND", ["mb", "idx"], ["picked"]),
        helper.make_node("Cast", ["picked"], ["y"], to=TensorProto.FLOAT),
    ]
    return make(nodes, [mask])


@pytest.mark.parametrize("B,S", [(1, 7), (1, 16), (2, 5)])
def test_dynamo_mask_index_matches_onnxruntime(B, S):
    m = _dynamo_mask_index()
    mask = np.ones((B, S), np.int64)
    mask[0, S // 2:] = 0
    feeds = {"mask": mask}
    want = ort_session(m).run(None, feeds)[0]
    p = Pipeline.from_onnx(m)
    # The fully specialised graph is what the GPU target compiles (it fixes every symbol): its folded
    # index must be right there too.
    np.testing.assert_array_equal(p.specialize({"B": B, "S": S}).run_reference(feeds)["y"], want)
    np.testing.assert_array_equal(p.optimize().compile(fixed={"B": B, "S": S}).run(feeds)["y"], want)


@pytest.mark.parametrize("axis,shapes", [(-1, [(1, 3, 1), (1, 3, 1)]), (1, [(2, 1), (2, 2)]), (0, [(1, 2), (2, 2)]),
                                         (1, [(2, 2, 1), (2, 1, 1)])])
def test_concat_of_known_elements_folds_in_row_major_order(axis, shapes):
    parts = [np.arange(int(np.prod(s)), dtype=np.int64).reshape(s) + 10 * k for k, s in enumerate(shapes)]
    out_shape = np.concatenate(parts, axis).shape
    x = helper.make_tensor_value_info("x", TensorProto.INT64, list(out_shape))
    # Small integer constants fold through the ops' symbolic evaluation (Concat's), not through onnx.reference.
    nodes = [const(f"p{k}", a) for k, a in enumerate(parts)]
    nodes += [helper.make_node("Concat", [f"p{k}" for k in range(len(parts))], ["c"], axis=axis),
              helper.make_node("Add", ["x", "c"], ["y"])]
    m = make(nodes, [x])
    check(m, {"x": np.zeros(out_shape, np.int64)})


def test_run_time_sized_range_is_a_cuvil_error_or_compiles():
    # A Range whose length comes from data has a size symbol with no range: bounding it raised a raw KeyError.
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 4])
    n = helper.make_tensor_value_info("n", TensorProto.INT64, [])
    nodes = [const("zero", np.array(0, np.int64)), const("one", np.array(1, np.int64)),
             helper.make_node("Range", ["zero", "n", "one"], ["r"]),
             helper.make_node("Cast", ["r"], ["rf"], to=TensorProto.FLOAT),
             helper.make_node("ReduceSum", ["rf"], ["s"], keepdims=0),
             helper.make_node("Add", ["x", "s"], ["y"])]
    m = make(nodes, [x, n])
    try:
        art = Pipeline.from_onnx(m).optimize().compile(shape_profiles={"B": (1, 2, 4)})
    except CuvilError as e:
        assert "\n" not in e.message.strip()   # one line; the next step follows on its own line (e.hint)
        return
    feeds = {"x": np.ones((2, 4), np.float32), "n": np.array(5, np.int64)}
    np.testing.assert_allclose(art.run(feeds)["y"], ort_session(m).run(None, feeds)[0])


def test_gather_elements_with_symbolic_dims_matches_and_stays_in_bounds():
    # data [N, 4], indices [M, 4]: whether M <= N is known only at run time; the memory-safety prover
    # (kernels/bounds.py) cannot prove the read in bounds, so it clamps it.
    d = helper.make_tensor_value_info("d", TensorProto.FLOAT, ["N", 4])
    i = helper.make_tensor_value_info("i", TensorProto.INT64, ["M", 4])
    m = make([helper.make_node("GatherElements", ["d", "i"], ["y"], axis=1)], [d, i])
    art = Pipeline.from_onnx(m).optimize().compile(shape_profiles={"N": (1, 4, 16), "M": (1, 4, 16)})
    rng = np.random.default_rng(0)
    for n, k in ((5, 3), (4, 4)):
        feeds = {"d": rng.standard_normal((n, 4)).astype(np.float32), "i": rng.integers(-4, 4, (k, 4)).astype(np.int64)}
        np.testing.assert_array_equal(art.run(feeds)["y"], ort_session(m).run(None, feeds)[0])
    # M > N: onnxruntime refuses; the library reads inside the data (rows past N read row N - 1), never past it
    data = np.arange(1, 9, dtype=np.float32).reshape(2, 4)
    got = art.run({"d": data, "i": np.zeros((9, 4), np.int64)})["y"]
    np.testing.assert_array_equal(got, np.repeat(data[[0] + [1] * 8, :1], 4, axis=1))


# --- literals in a rule's replacement take the type of the input they share a type parameter with --------

def test_rule_literal_in_where_takes_the_branch_dtype():
    # Where(c, x, 0): the 0 is a branch (type parameter T, x's), not the bool condition's type.
    (rule,) = parse_rules("rule r\n  Mul(Cast(c, to=1), x) => Where(c, x, 0)\n  prove real\n", "t.rule", validate=False)
    c = helper.make_tensor_value_info("c", TensorProto.BOOL, [3])
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])
    m = make([helper.make_node("Cast", ["c"], ["cf"], to=TensorProto.FLOAT), helper.make_node("Mul", ["cf", "x"], ["y"])],
             [c, x])
    g = import_model(m)
    b = match(rule, g.outputs[0], g)
    assert b is not None
    out = build(rule, b, g, [])
    assert out.producer.op == "Where" and out.dtype.name == "FLOAT"
    assert out.producer.inputs[2].dtype.name == "FLOAT"


def test_unknown_rank_outputs_get_their_ops_dtypes():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, None)   # rank unknown
    k = const("k", np.array([1], np.int64))
    nodes = [k, helper.make_node("Equal", ["x", "x"], ["eq"]), helper.make_node("Not", ["eq"], ["ne"]),
             helper.make_node("Where", ["ne", "x", "x"], ["wh"]), helper.make_node("Cast", ["x"], ["ci"], to=TensorProto.INT32),
             helper.make_node("ArgMax", ["x"], ["am"]), helper.make_node("TopK", ["x", "k"], ["tv", "ti"]),
             helper.make_node("CastLike", ["x", "ci"], ["cl"]), helper.make_node("IsNaN", ["x"], ["nan"])]
    want = {"eq": "BOOL", "ne": "BOOL", "wh": "FLOAT", "ci": "INT32", "am": "INT64", "tv": "FLOAT", "ti": "INT64",
            "cl": "INT32", "nan": "BOOL"}
    m = make(nodes, [x], outputs=tuple(want))
    g = import_model(m)
    got = {v.name: v.dtype.name for v in g.values() if v.name in want}
    assert got == want


@pytest.mark.parametrize("seed", range(12))
def test_concat_folds_like_numpy(seed):
    # Random ranks, axes and part counts: the folded constant (Concat's symbolic evaluation) is numpy's concatenate.
    rng = np.random.default_rng(seed)
    rank = int(rng.integers(1, 5))
    axis = int(rng.integers(-rank, rank))
    base = [int(v) for v in rng.integers(1, 4, rank)]
    parts = []
    for k in range(int(rng.integers(1, 4))):
        shape = list(base)
        shape[axis] = int(rng.integers(1, 4))
        parts.append(rng.integers(-50, 50, shape).astype(np.int64))
    want = np.concatenate(parts, axis)
    nodes = [const(f"p{k}", a) for k, a in enumerate(parts)]
    nodes.append(helper.make_node("Concat", [f"p{k}" for k in range(len(parts))], ["y"], axis=axis))
    g = Pipeline.from_onnx(make(nodes, [])).optimize().graph
    assert not g.nodes                                  # folded
    np.testing.assert_array_equal(g.outputs[0].const, want)
