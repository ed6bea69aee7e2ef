"""Hostile or malformed models: every failure is a one-line CuvilError, and what imports computes what
onnxruntime computes (sparse initializers, duplicate names, deep graphs, unfoldable constants)."""

import re

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from cuvil import (CuvilError, GraphError, InvalidAttributeError, ModelLoadError, Pipeline, ShapeError,
                   UnsupportedTypeError)
from cuvil.frontend import export_model
from cuvil.ir import Graph
from cuvil.ir.hash import structural_hash
from cuvil.ir.printer import print_graph
from cuvil.ir.types import TensorType
from cuvil.rewrite_rules.cse import eliminate_common_subexpressions
from cuvil.rewrite_rules.dce import eliminate_dead_code
from cuvil.rewrite_rules.fold import fold_constants
from cuvil.rewrite_rules.shape_prop import propagate_shapes
from cuvil.testing.oracles import ort_run

X = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
Y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)


def model(nodes, inputs=(X,), outputs=(Y,), inits=(), sparse=(), opset=17, **kw):
    g = helper.make_graph(nodes, "g", list(inputs), list(outputs), list(inits), sparse_initializer=list(sparse))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], **kw)


def add_w(**kw):
    return model([helper.make_node("Add", ["x", "w"], ["y"])], **kw)


def one_line_error(cls, source, match=None):
    with pytest.raises(cls, match=match) as e:
        Pipeline.from_onnx(source).optimize()
    assert "\n" not in e.value.message and e.value.hint   # one line, and the next step
    return e.value.message


# --- sparse initializers --------------------------------------------------------------------------------

SPARSE_VALUES = np.array([1.5, -2.0, 4.0], np.float32)


@pytest.mark.parametrize("indices", [np.array([1, 5, 3], np.int64),                       # linearized [NNZ]
                                     np.array([[0, 1], [1, 2], [1, 0]], np.int64)])      # coordinates [NNZ, rank]
def test_sparse_initializer_index_forms_match_onnxruntime(indices):
    sp = helper.make_sparse_tensor(numpy_helper.from_array(SPARSE_VALUES, "w"),
                                   numpy_helper.from_array(indices, "w_idx"), [2, 3])
    m = add_w(sparse=[sp])
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    got = Pipeline.from_onnx(m).run_reference({"x": x})["y"]
    np.testing.assert_array_equal(got, ort_run(m, {"x": x}))
    assert np.count_nonzero(got - x) == 3


def test_sparse_rank3_coordinates():
    idx = np.array([[0, 1, 2], [1, 0, 0]], np.int64)
    sp = helper.make_sparse_tensor(numpy_helper.from_array(SPARSE_VALUES[:2], "w"),
                                   numpy_helper.from_array(idx, "w_idx"), [2, 2, 3])
    x3 = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 2, 3])
    m = add_w(sparse=[sp], inputs=[x3])
    x = np.zeros((2, 2, 3), np.float32)
    np.testing.assert_array_equal(Pipeline.from_onnx(m).run_reference({"x": x})["y"], ort_run(m, {"x": x}))


@pytest.mark.parametrize("indices,match", [(np.array([1, 6, 3], np.int64), "outside"),
                                           (np.array([[0, 1], [2, 0], [1, 0]], np.int64), "outside"),
                                           (np.array([[0, 1, 0]], np.int64), "fit neither")])
def test_sparse_indices_out_of_range_or_misshaped(indices, match):
    sp = helper.make_sparse_tensor(numpy_helper.from_array(SPARSE_VALUES, "w"),
                                   numpy_helper.from_array(indices, "w_idx"), [2, 3])
    one_line_error(ModelLoadError, add_w(sparse=[sp]), match)


# --- duplicate names --------------------------------------------------------------------------------------

def test_duplicate_initializers_are_refused():
    # onnxruntime warns and takes the last one; the spec forbids them, so Cuvil names the problem instead.
    a, b = numpy_helper.from_array(np.ones((2, 3), np.float32), "w"), numpy_helper.from_array(np.zeros((2, 3), np.float32), "w")
    one_line_error(ModelLoadError, add_w(inits=[a, b]), "initializer 'w' is defined twice")
    sp = helper.make_sparse_tensor(numpy_helper.from_array(SPARSE_VALUES, "w"),
                                   numpy_helper.from_array(np.array([0, 1, 2], np.int64), "w_idx"), [2, 3])
    one_line_error(ModelLoadError, add_w(inits=[a], sparse=[sp]), "initializer 'w' is defined twice")


def test_input_shadowing_an_initializer_is_its_default():
    w = numpy_helper.from_array(np.full((2, 3), 3.0, np.float32), "w")
    m = add_w(inits=[w], inputs=[X, helper.make_tensor_value_info("w", TensorProto.FLOAT, [2, 3])])
    x = np.ones((2, 3), np.float32)
    np.testing.assert_array_equal(Pipeline.from_onnx(m).run_reference({"x": x})["y"], ort_run(m, {"x": x}))


def test_value_defined_twice_is_refused():
    nodes = [helper.make_node("Relu", ["x"], ["t"]), helper.make_node("Neg", ["x"], ["t"]),
             helper.make_node("Abs", ["t"], ["y"])]
    one_line_error(ModelLoadError, model(nodes), "'t', which is already defined")
    w = numpy_helper.from_array(np.ones((2, 3), np.float32), "w")
    one_line_error(ModelLoadError, model([helper.make_node("Relu", ["x"], ["w"]), helper.make_node("Add", ["x", "w"], ["y"])],
                                         inits=[w]), "already defined")
    one_line_error(ModelLoadError, model([helper.make_node("Relu", ["x"], ["y"])], inputs=[X, X]), "listed twice")
    split = helper.make_node("Split", ["x"], ["y", "y"], axis=0, num_outputs=2)
    one_line_error(ModelLoadError, model([split], opset=18), "'y', which is already defined")


# --- attributes -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("op,name,value", [("Transpose", "perm", 1.5), ("Flatten", "axis", "abc"),
                                           ("Softmax", "axis", [1, 2]), ("LeakyRelu", "alpha", "x"),
                                           ("Gemm", "transA", 1.0)])
def test_attribute_of_the_wrong_type_on_import(op, name, value):
    n = helper.make_node(op, ["x", "x"] if op == "Gemm" else ["x"], ["y"])
    n.attribute.append(helper.make_attribute(name, value))
    msg = one_line_error(InvalidAttributeError, model([n]), f"attribute '{name}' is")
    assert op in msg


@pytest.mark.parametrize("op,attrs", [("Transpose", {"perm": 1.5}), ("Flatten", {"axis": "1"}),
                                      ("Concat", {"axis": [0]}), ("Reshape", {"shape": [2.5, 1]}),
                                      ("Squeeze", {"axes": [[0]]}), ("Cast", {"to": "float"}),
                                      ("Einsum", {"equation": 3}), ("Einsum", {})])
def test_attribute_access_is_type_checked_in_the_registry(op, attrs):
    g = Graph()
    x = g.add_input("x", TensorType(1, [2, 3]))
    with pytest.raises(InvalidAttributeError, match=f"node '.*' \\({op}\\): (attribute|missing required)"):
        g.add_node(op, [x], attrs)



@pytest.mark.parametrize("op,name,value", [("ReduceMax", "keepdims", -1), ("ReduceSum", "keepdims", 3),
                                           ("Gemm", "transB", 2), ("ArgMax", "select_last_index", -1),
                                           ("CumSum", "reverse", 5)])
def test_a_flag_attribute_is_0_or_1(op, name, value):
    """A flag set to another value is refused, not read as true (found by the onnx_structure fuzz: Cuvil kept
    the axis for keepdims = -1 where the oracle dropped it, a silent wrong shape)."""
    inputs = {"Gemm": ["x", "x"], "CumSum": ["x", "ax"]}.get(op, ["x"])
    n = helper.make_node(op, inputs, ["y"], **{name: value})
    inits = [numpy_helper.from_array(np.array(1, np.int64), "ax")] if op == "CumSum" else []
    y = helper.make_tensor_value_info("y", TensorProto.INT64 if op == "ArgMax" else TensorProto.FLOAT, None)
    msg = one_line_error(InvalidAttributeError, model([n], outputs=[y], inits=inits),
                         f"attribute '{name}' must be 0 or 1")
    assert op in msg and str(value) in msg
    n = helper.make_node(op, inputs, ["y"], **{name: 1})
    Pipeline.from_onnx(model([n], outputs=[y], inits=inits))        # the same node with the flag set imports

def test_einsum_without_equation():
    one_line_error(InvalidAttributeError, model([helper.make_node("Einsum", ["x"], ["y"])]),
                   "missing required attribute 'equation'")


def test_non_utf8_names():
    n = helper.make_node("Flatten", ["x"], ["y"], name="nodeA", axis=1)
    raw = model([n]).SerializeToString()
    one_line_error(ModelLoadError, raw.replace(b"axis", b"ax\xffs"), "attribute name .* is not valid UTF-8")
    one_line_error(ModelLoadError, raw.replace(b"nodeA", b"node\xff"), "node name .* is not valid UTF-8")
    one_line_error(ModelLoadError, raw.replace(b"Flatten", b"Flatte\xff"), "op type .* is not valid UTF-8")
    pad = helper.make_node("Pad", ["x", "p"], ["y"], mode="reflect")
    raw = model([pad], inits=[numpy_helper.from_array(np.zeros(4, np.int64), "p")]).SerializeToString()
    one_line_error(ModelLoadError, raw.replace(b"reflect", b"refle\xfft"), "attribute 'mode' is not valid UTF-8")


# --- element types and sizes ---------------------------------------------------------------------------------

@pytest.mark.parametrize("code", [0, 99])
def test_unknown_element_types(code):
    t = numpy_helper.from_array(np.ones((2, 3), np.float32), "w")
    t.data_type = code
    one_line_error(UnsupportedTypeError, add_w(inits=[t]), "element type")
    xi = helper.make_tensor_value_info("x", code, [2, 3])
    one_line_error(UnsupportedTypeError, model([helper.make_node("Relu", ["x"], ["y"])], inputs=[xi]), "element type")


def huge_tensor(name, raw=b"\0" * 16):
    t = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=[1 << 20, 1 << 20])
    t.raw_data = raw
    return t


def test_tensor_sizes_checked_before_allocation():
    one_line_error(ModelLoadError, add_w(inits=[huge_tensor("w")]), "over Cuvil's limit")
    c = helper.make_node("Constant", [], ["w"], value=huge_tensor("v"))
    one_line_error(ModelLoadError, model([c, helper.make_node("Add", ["x", "w"], ["y"])]), "over Cuvil's limit")
    sp = helper.make_sparse_tensor(numpy_helper.from_array(SPARSE_VALUES[:1], "w"),
                                   numpy_helper.from_array(np.array([0], np.int64), "w_idx"), [1 << 30, 1 << 30])
    one_line_error(ModelLoadError, add_w(sparse=[sp]), "over Cuvil's limit")
    for size in (8, 32):  # raw data shorter or longer than the dims say
        bad = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[2, 3], raw_data=b"\0" * size)
        one_line_error(ModelLoadError, add_w(inits=[bad]), "cannot be read")


def test_huge_constant_outputs_stay_unfolded():
    shape = helper.make_node("Constant", [], ["s"], value=numpy_helper.from_array(np.array([1 << 20, 1 << 20], np.int64)))
    nodes = [shape, helper.make_node("ConstantOfShape", ["s"], ["y"])]
    p = Pipeline.from_onnx(model(nodes)).optimize()
    assert [n.op for n in p.graph.nodes] == ["ConstantOfShape"]
    scalars = [helper.make_node("Constant", [], [k], value=numpy_helper.from_array(np.array(v, np.float32)))
               for k, v in (("a", 0.0), ("b", 1e12), ("d", 1.0))]
    p = Pipeline.from_onnx(model(scalars + [helper.make_node("Range", ["a", "b", "d"], ["y"])])).optimize()
    assert [n.op for n in p.graph.nodes] == ["Range"]
    one = helper.make_node("Constant", [], ["o"], value=numpy_helper.from_array(np.ones((1, 1), np.float32)))
    for op in ("Expand", "Tile"):
        p = Pipeline.from_onnx(model([shape, one, helper.make_node(op, ["o", "s"], ["y"])])).optimize()
        assert [n.op for n in p.graph.nodes] == [op]


def test_failed_fold_leaves_the_node(monkeypatch):
    # Whatever the reference raises while folding (its own bugs included), the node stays and compiles.
    def refuse(g, n, inputs=None):
        raise ValueError("cannot reshape array of size 1 into shape (1,16)")
    monkeypatch.setattr("cuvil.rewrite_rules.fold.evaluate_node", refuse)
    nodes = [helper.make_node("Constant", [], ["a"], value=numpy_helper.from_array(np.ones((1, 4), np.float32))),
             helper.make_node("Constant", [], ["i"], value=numpy_helper.from_array(np.zeros((1, 16), np.int64))),
             helper.make_node("GatherElements", ["a", "i"], ["y"], axis=1)]
    p = Pipeline.from_onnx(model(nodes)).optimize()
    assert [n.op for n in p.graph.nodes] == ["GatherElements"]
    np.testing.assert_array_equal(p.compile().run({"x": np.zeros((2, 3), np.float32)})["y"], np.ones((1, 16), np.float32))


def test_gather_elements_indices_longer_than_data_are_refused():
    # Off the axis an output element reads data at its own position: indices (1, 16) on data (1, 1) would
    # read past the data (onnxruntime refuses it too).
    nodes = [helper.make_node("Constant", [], ["a"], value=numpy_helper.from_array(np.ones((1, 1), np.float32))),
             helper.make_node("Constant", [], ["i"], value=numpy_helper.from_array(np.zeros((1, 16), np.int64))),
             helper.make_node("GatherElements", ["a", "i"], ["y"])]
    one_line_error(ShapeError, model(nodes), "longer than data")


# --- external data and local functions ---------------------------------------------------------------------

def external(tmp_path, location, offset=None, data=None):
    t = numpy_helper.from_array(np.ones((2, 3), np.float32), "w")
    t.ClearField("raw_data")
    t.data_location = TensorProto.EXTERNAL
    entries = [("location", location)] + ([("offset", str(offset))] if offset is not None else [])
    for k, v in entries:
        e = t.external_data.add()
        e.key, e.value = k, v
    if data is not None:
        (tmp_path / "w.bin").write_bytes(data)
    path = tmp_path / "m.onnx"
    path.write_bytes(add_w(inits=[t]).SerializeToString())
    return path


@pytest.mark.parametrize("location,offset,data", [("../../etc/passwd", None, None), ("/etc/passwd", None, None),
                                                  ("missing.bin", None, None), ("w.bin", None, b"\0" * 8),
                                                  ("w.bin", 100000, b"\0" * 24)])
def test_hostile_external_data(tmp_path, location, offset, data):
    path = external(tmp_path, location, offset, data)
    one_line_error(ModelLoadError, path, "cannot read external weights|'w' cannot be read")


def test_external_data_in_bytes_is_never_read_from_the_working_directory(tmp_path, monkeypatch):
    path = external(tmp_path, "w.bin", data=np.ones(6, np.float32).tobytes())
    monkeypatch.chdir(tmp_path)
    one_line_error(ModelLoadError, path.read_bytes(), "load the model from its path")
    np.testing.assert_array_equal(Pipeline.from_onnx(path).run_reference({"x": np.zeros((2, 3), np.float32)})["y"],
                                  np.ones((2, 3), np.float32))


@pytest.mark.parametrize("body_op", ["F", "G"])
def test_recursive_or_undefined_local_functions(body_op):
    f = helper.make_function("loc", "F", ["a"], ["b"], [helper.make_node(body_op, ["a"], ["b"], domain="loc")],
                             [helper.make_opsetid("", 17), helper.make_opsetid("loc", 1)])
    m = model([helper.make_node("F", ["x"], ["y"], domain="loc")], functions=[f])
    m.opset_import.append(helper.make_opsetid("loc", 1))
    one_line_error(CuvilError, m)


# --- graph depth ------------------------------------------------------------------------------------------

def chain(n, reverse):
    nodes = [helper.make_node("Relu" if k % 2 else "Neg", ["x" if k == 0 else f"t{k}"], ["y" if k == n - 1 else f"t{k + 1}"])
             for k in range(n)]
    return nodes[::-1] if reverse else nodes


@pytest.mark.parametrize("reverse", [False, True])
def test_deep_chains_never_recurse(reverse):
    # Python's default recursion limit is 1,000 frames: 5,000 nodes in a line must pass every stage.
    n = 5000
    g = Pipeline.from_onnx(model(chain(n, reverse))).graph.clone()
    g.toposort()
    g.verify()
    propagate_shapes(g)
    fold_constants(g)
    eliminate_common_subexpressions(g)
    eliminate_dead_code(g)
    assert len(g.nodes) == n
    structural_hash(g)
    print_graph(g)
    onnx.checker.check_model(export_model(g))


@pytest.mark.parametrize("reverse", [False, True])
def test_deep_chain_optimizes_and_folds(reverse):
    p = Pipeline.from_onnx(model(chain(1500, reverse))).optimize()
    assert len(p.graph.nodes) == 1500
    # A chain of constants folds link by link.
    const = helper.make_node("Constant", [], ["x"], value=numpy_helper.from_array(np.full((2, 3), -1.0, np.float32)))
    p = Pipeline.from_onnx(model([const] + chain(1500, reverse), inputs=[])).optimize()
    assert not p.graph.nodes and p.graph.outputs[0].const.tolist() == [[0.0] * 3] * 2


def test_graph_error_is_a_cuvil_error():
    g = Graph()
    x = g.add_input("x", TensorType(1, [2]))
    g.add_output(x, "y")
    with pytest.raises(CuvilError, match="already taken"):
        g.add_output(x, "y")
    assert issubclass(GraphError, CuvilError) and issubclass(InvalidAttributeError, ShapeError)


def test_unreadable_sources(tmp_path, monkeypatch):
    one_line_error(ModelLoadError, 42, "give a path, bytes")
    path = tmp_path / "m.onnx"
    path.write_bytes(model([helper.make_node("Relu", ["x"], ["y"])]).SerializeToString())

    def denied(*a, **kw):  # what a mode-000 file gives a user that is not root
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(onnx, "load", denied)
    one_line_error(ModelLoadError, path, "cannot read the file \\(Permission denied\\)")


@pytest.mark.parametrize("node", [helper.make_node("Constant", [], [], value_float=1.0),
                                  helper.make_node("Relu", ["x"], ["y", "z"])], ids=["constant-no-output", "relu-two"])
def test_output_count_outside_the_schema_is_refused(node):
    """Found by the long fuzz run (seed 211395 of onnx_bytes): a Constant whose output list was cut to nothing
    raised IndexError in the opset adapter."""
    nodes = [node] if node.op_type == "Relu" else [node, helper.make_node("Relu", ["x"], ["y"])]
    one_line_error(ModelLoadError, model(nodes), re.escape("output(s); the op has 1 to 1"))


def test_bfloat16_signature_runs_and_a_wrong_dtype_is_a_clean_error():
    """Found by the long fuzz run (onnx_structure seed 208268): numpy has no bfloat16, and DType.numpy raised a
    bare TypeError out of Pipeline.run_reference. bfloat16 is supported now (ml_dtypes' bfloat16 arrays); a
    float32 array where bfloat16 is declared is a clean error, not a TypeError."""
    import ml_dtypes
    xb = helper.make_tensor_value_info("x", TensorProto.BFLOAT16, [4])
    yb = helper.make_tensor_value_info("y", TensorProto.BFLOAT16, [4])
    p = Pipeline.from_onnx(model([helper.make_node("Relu", ["x"], ["y"])], inputs=(xb,), outputs=(yb,))).optimize()
    y = p.run_reference({"x": np.array([-1, 2, 3, -4], ml_dtypes.bfloat16)})["y"]
    np.testing.assert_array_equal(y.astype(np.float32), [0, 2, 3, 0])
    with pytest.raises(ShapeError, match="expected bfloat16"):
        p.run_reference({"x": np.zeros(4, np.float32)})
