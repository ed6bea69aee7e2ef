import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from cuvil import ModelLoadError, Pipeline, ShapeError, UnsupportedOpError
from cuvil.cli import main as cli_main
from cuvil.errors import DeclaredShapeWarning


def make_model(nodes, inputs, outputs, inits=(), opset=21, ir_version=None):
    g = helper.make_graph(nodes, "t", inputs, outputs, list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = ir_version or helper.find_min_ir_version_for([helper.make_opsetid("", opset)])
    return m


def vi(name, shape, dt=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, dt, shape)


def ort_run(model, feeds):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def test_malformed_bytes_and_missing_file(tmp_path):
    with pytest.raises(ModelLoadError, match="not an ONNX model"):
        Pipeline.from_onnx(b"\x08\x07garbage\xff\xff")
    with pytest.raises(ModelLoadError, match="no such file"):
        Pipeline.from_onnx(tmp_path / "nope.onnx")
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(os.urandom(64) + b"\xff" * 16)
    with pytest.raises(ModelLoadError):
        Pipeline.from_onnx(bad)


def test_unknown_op_names_op_node_and_opset():
    m = make_model([helper.make_node("FancyOp", ["x"], ["y"], name="n3")], [vi("x", [2])], [vi("y", [2])], opset=17)
    with pytest.raises(UnsupportedOpError, match=r"unsupported op FancyOp \(node 'n3', opset 17\)"):
        Pipeline.from_onnx(m)


def test_custom_domain_is_rejected():
    m = make_model([helper.make_node("Foo", ["x"], ["y"], name="c", domain="com.example")], [vi("x", [2])], [vi("y", [2])])
    m.opset_import.append(helper.make_opsetid("com.example", 1))
    with pytest.raises(UnsupportedOpError, match=r"unsupported op com.example::Foo \(node 'c', opset 1\)"):
        Pipeline.from_onnx(m)


def test_inconsistent_declared_shape_warns_and_inference_wins():
    m = make_model([helper.make_node("Relu", ["x"], ["y"], name="r")], [vi("x", [2, 3])], [vi("y", [3, 2])])
    with pytest.warns(DeclaredShapeWarning, match=r"node 'r' \(Relu\) output 'y': the model declares shape \[3, 2\] "
                                                  r"but Cuvil infers f32\[2,3\] from the inputs; using the inferred shape"):
        p = Pipeline.from_onnx(m)
    assert str(p.graph.outputs[0].type) == "f32[2,3]"
    x = np.arange(6, dtype=np.float32).reshape(2, 3) - 2
    np.testing.assert_array_equal(p.compile().run({"x": x})["y"], np.maximum(x, 0))


def test_stale_declared_output_rank_of_a_symbolic_model():
    # As ddddocr's CRNN declares its output: [1, '?'], where the graph computes [W', 1, C]; onnxruntime warns
    # ("Expected shape from model of {1,-1} does not match actual shape") and runs it; so does Cuvil.
    nodes = [helper.make_node("Transpose", ["x"], ["t"], perm=[2, 0, 1], name="tr"),
             helper.make_node("Relu", ["t"], ["y"], name="r")]
    m = make_model(nodes, [vi("x", [1, 5, "W"])], [vi("y", [1, "?"])], opset=17)
    m.graph.value_info.append(vi("t", [1, 5, 7]))    # a stale value_info too (W was 7 when exported)
    with pytest.warns(DeclaredShapeWarning) as rec:
        p = Pipeline.from_onnx(m)
    msgs = [str(w.message) for w in rec]
    assert any("node 'tr' (Transpose) output 't': the model declares shape [1, 5, 7] but Cuvil infers f32[W,1,5]" in w
               for w in msgs), msgs
    assert any("output 'y': the model declares shape [1, '?'] but Cuvil infers f32[W,1,5]" in w for w in msgs), msgs
    art = p.compile(shape_profiles={"W": (1, 4, 16)})
    for w in (1, 7, 16):
        x = np.random.default_rng(w).standard_normal((1, 5, w)).astype(np.float32)
        np.testing.assert_array_equal(art.run({"x": x})["y"], np.maximum(x.transpose(2, 0, 1), 0))


def test_inconsistent_declared_dtype_is_an_error():
    m = make_model([helper.make_node("Relu", ["x"], ["y"], name="r")], [vi("x", [2, 3])],
                   [vi("y", [2, 3], TensorProto.DOUBLE)])
    with pytest.raises(ShapeError, match=r"output 'y': the model declares DOUBLE but Cuvil infers FLOAT"):
        Pipeline.from_onnx(m)


def test_old_opset_is_refused():
    m = make_model([helper.make_node("Relu", ["x"], ["y"])], [vi("x", [2])], [vi("y", [2])], opset=6, ir_version=3)
    with pytest.raises(ModelLoadError, match="opset 6 is older"):
        Pipeline.from_onnx(m)


def test_cli_prints_one_line_errors(tmp_path, capsys):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\xff" * 40)
    assert cli_main(["inspect", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and err[0].startswith("cuvil: error: ") and err[1].startswith("  next: give an .onnx file")


def test_dim_params_become_symbols():
    m = make_model([helper.make_node("Relu", ["x"], ["y"])], [vi("x", ["batch size", 3, None])], [vi("y", None)])
    g = Pipeline.from_onnx(m).graph
    assert str(g.inputs[0].type) == "f32[batch_size,3,x.2]"
    assert set(g.symbols) == {"batch_size", "x.2"}


def test_external_data_is_loaded(tmp_path):
    w = np.arange(12, dtype=np.float32).reshape(3, 4)
    m = make_model([helper.make_node("MatMul", ["x", "w"], ["y"])], [vi("x", [2, 3])], [vi("y", [2, 4])],
                   [numpy_helper.from_array(w, "w")])
    path = tmp_path / "ext.onnx"
    onnx.save(m, path, save_as_external_data=True, all_tensors_to_one_file=True, location="w.bin", size_threshold=0)
    assert (tmp_path / "w.bin").exists()
    p = Pipeline.from_onnx(path)
    x = np.ones((2, 3), np.float32)
    np.testing.assert_array_equal(p.run_reference({"x": x})["y"], x @ w)


def _roundtrip(m, feeds, rtol=1e-6):
    want = ort_run(m, feeds)
    p = Pipeline.from_onnx(m).optimize()
    got = ort_run(p.to_onnx(), feeds)
    ref = p.run_reference(feeds)
    for a, b, c in zip(want, got, ref.values()):
        np.testing.assert_allclose(b, a, rtol=rtol, atol=1e-6)
        np.testing.assert_allclose(c, a, rtol=1e-5, atol=1e-5)
    return p


def test_legacy_softmax_coerces_to_2d():
    m = make_model([helper.make_node("Softmax", ["x"], ["y"], axis=1)], [vi("x", [2, 3, 4])], [vi("y", [2, 3, 4])], opset=11)
    x = np.random.default_rng(0).standard_normal((2, 3, 4)).astype(np.float32)
    p = _roundtrip(m, {"x": x})
    ops = [n.op for n in p.graph.nodes]
    assert "Softmax" in ops and "Flatten" in ops


def test_legacy_upsample_becomes_resize():
    scales = numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "s")
    m = make_model([helper.make_node("Upsample", ["x", "s"], ["y"], mode="nearest")], [vi("x", [1, 2, 3, 3])],
                   [vi("y", [1, 2, 6, 6])], [scales], opset=9)
    x = np.random.default_rng(0).standard_normal((1, 2, 3, 3)).astype(np.float32)
    p = _roundtrip(m, {"x": x})
    assert [n.op for n in p.graph.nodes] == ["Resize"]
    assert p.graph.nodes[0].attrs["scales"] == [1.0, 1.0, 2.0, 2.0]


def test_legacy_pad_and_dropout_attributes():
    m = make_model([helper.make_node("Pad", ["x"], ["p"], pads=[0, 1, 0, 1], value=2.5),
                    helper.make_node("Dropout", ["p"], ["y"], ratio=0.3)],
                   [vi("x", [2, 3])], [vi("y", [2, 5])], opset=10)
    x = np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)
    _roundtrip(m, {"x": x})


def test_constant_inputs_are_lifted_and_exported_back():
    axes = numpy_helper.from_array(np.array([0], np.int64), "axes")
    shape = numpy_helper.from_array(np.array([3, -1], np.int64), "shape")
    m = make_model([helper.make_node("Unsqueeze", ["x", "axes"], ["u"]),
                    helper.make_node("Reshape", ["u", "shape"], ["y"])],
                   [vi("x", [6, 2])], [vi("y", [3, 4])], [axes, shape], opset=13)
    p = Pipeline.from_onnx(m)
    assert p.graph.nodes[0].attrs == {"axes": [0]} and p.graph.nodes[1].attrs == {"shape": [3, -1]}
    assert all(v is not None for n in p.graph.nodes for v in n.inputs)
    x = np.arange(12, dtype=np.float32).reshape(6, 2)
    _roundtrip(m, {"x": x})


def test_symbolic_shape_computation_folds_into_reshape():
    # Reshape(x, Concat(Unsqueeze(Gather(Shape(x), 0)), [-1])) on a symbolic batch gives [N, 12]
    nodes = [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Gather", ["s", "zero"], ["n"], axis=0),
             helper.make_node("Unsqueeze", ["n", "ax"], ["n1"]),
             helper.make_node("Concat", ["n1", "m1"], ["shape"], axis=0),
             helper.make_node("Reshape", ["x", "shape"], ["y"])]
    inits = [numpy_helper.from_array(np.array(0, np.int64), "zero"), numpy_helper.from_array(np.array([0], np.int64), "ax"),
             numpy_helper.from_array(np.array([-1], np.int64), "m1")]
    m = make_model(nodes, [vi("x", ["N", 3, 4])], [vi("y", ["N", 12])], inits, opset=13)
    p = Pipeline.from_onnx(m).optimize()
    assert str(p.graph.outputs[0].type) == "f32[N,12]"
    x = np.random.default_rng(0).standard_normal((5, 3, 4)).astype(np.float32)
    np.testing.assert_array_equal(p.run_reference({"x": x})["y"], x.reshape(5, 12))


def test_run_reference_checks_inputs():
    m = make_model([helper.make_node("Relu", ["x"], ["y"])], [vi("x", ["N", 3])], [vi("y", ["N", 3])])
    p = Pipeline.from_onnx(m)
    with pytest.raises(ShapeError, match="expected float32"):
        p.run_reference({"x": np.zeros((2, 3), np.float64)})
    with pytest.raises(ShapeError, match="expected rank 2"):
        p.run_reference({"x": np.zeros((3,), np.float32)})
    with pytest.raises(ShapeError, match="missing input 'x'"):
        p.run_reference({})
    with pytest.raises(ShapeError, match="unknown input"):
        p.run_reference({"x": np.zeros((2, 3), np.float32), "z": np.zeros(1)})
