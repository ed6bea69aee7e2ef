"""Batch slices: a library whose rows along the batch symbol are computed on their own runs a batch that is a
multiple of the symbol's opt value as that many calls of its opt-point kernels, one slice after another
(cuvil.kernels.batch_rows, runtime.c's run); ``batch_slices=False`` / ``--no-batch-slices`` keeps the
generic kernels over the whole batch."""
import json
import os

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from cuvil import Pipeline
from cuvil.cli import main as cli_main
from cuvil.kernels.batch_rows import batch_row_symbol
from cuvil.testing.artifacts import close_and_remove, compile_and_load
from cuvil.testing.models import SYMBOLIC_CNN_PROFILE, TRANSFORMER_PROFILE, symbolic_batch_cnn, transformer_block
from cuvil.testing.oracles import max_rel_error, ort_session


def _graph(model):
    return Pipeline.from_onnx(model).optimize().graph


def _mixing_model(node, out_shape):
    """x[N, 4, 6] -> Relu -> ``node`` (input "r", output "y") -> y; the constant "c" is a [1, 4, 6] tensor."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4, 6])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)
    c = numpy_helper.from_array(np.ones((1, 4, 6), np.float32), "c")
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["r"]), node], "m", [x], [y], [c])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_rows_of_a_cnn_are_independent_along_its_batch():
    assert batch_row_symbol(_graph(symbolic_batch_cnn())) == "N"


@pytest.mark.parametrize("node, out_shape", [
    (helper.make_node("ReduceSum", ["r"], ["y"], keepdims=1, axes=None), [1, 1, 1]),        # sums over rows
    (helper.make_node("Transpose", ["r"], ["y"], perm=[1, 0, 2]), [4, "N", 6]),              # moves the batch
    (helper.make_node("Softmax", ["r"], ["y"], axis=0), ["N", 4, 6]),                        # normalises over rows
    (helper.make_node("CumSum", ["r", "ax"], ["y"]), ["N", 4, 6]),                           # an op not known per row
])
def test_ops_that_mix_rows_are_refused(node, out_shape):
    m = _mixing_model(node, out_shape)
    if node.op_type == "CumSum":
        m.graph.initializer.append(numpy_helper.from_array(np.array(0, np.int64), "ax"))
    assert batch_row_symbol(_graph(m)) is None


def test_a_constant_broadcast_over_the_rows_is_per_row():
    m = _mixing_model(helper.make_node("Add", ["r", "c"], ["y"]), ["N", 4, 6])
    assert batch_row_symbol(_graph(m)) == "N"


def test_a_constant_with_a_full_leading_dim_is_not_per_row():
    """y = r + c with c[N', 4, 6] a constant of batch 3: only N = 3 is valid, and row i adds c[i]."""
    m = _mixing_model(helper.make_node("Add", ["r", "c"], ["y"]), ["N", 4, 6])
    m.graph.initializer[0].CopyFrom(numpy_helper.from_array(np.ones((3, 4, 6), np.float32), "c"))
    g = Pipeline.from_onnx(m).optimize().graph
    assert batch_row_symbol(g) is None


@pytest.fixture(scope="module")
def cnn():
    model = symbolic_batch_cnn()
    art, m = compile_and_load(model, SYMBOLIC_CNN_PROFILE)      # N in [1, 16], opt 4
    yield model, art, m, ort_session(model)
    close_and_remove(art, m)


def test_manifest_names_the_sliced_symbol(cnn):
    _, art, _, _ = cnn
    assert art.manifest["batch_slices"] == "N"
    with open(art.path[:-3] + ".manifest.json") as f:
        assert json.load(f)["batch_slices"] == "N"


def test_a_multiple_of_opt_runs_the_opt_kernels_slice_by_slice(cnn):
    """N = 8 and 16 (opt 4): each slice of 4 rows is bit for bit the opt point's run of those rows, and the
    whole matches onnxruntime; N = 6 (not a multiple) runs the generic kernels, also right."""
    _, _, m, sess = cnn
    for n in (8, 16, 6):
        x = np.random.default_rng(n).standard_normal((n, 3, 16, 16)).astype(np.float32)
        (y,) = m.run(x)
        assert max_rel_error(y, sess.run(None, {"x": x})[0]) <= 1e-4
        if n % 4 == 0:
            for k in range(0, n, 4):
                np.testing.assert_array_equal(y[k:k + 4], m.run(np.ascontiguousarray(x[k:k + 4]))[0])


def test_the_profile_counts_each_slice(cnn):
    """The step profiler times the opt steps once per slice: N = 8 is two slices of the opt point."""
    _, art, m, _ = cnn
    x = np.random.default_rng(0).standard_normal((8, 3, 16, 16)).astype(np.float32)
    steps = art.manifest["steps"]
    opt = [i for i, s in enumerate(steps) if s.get("variant") == "opt"]
    generic = [i for i, s in enumerate(steps) if s.get("variant") == "generic"]
    assert opt and generic
    t = m.profile(x, runs=3)
    assert all(t[i] > 0 for i in opt) and all(t[i] == 0 for i in generic)


def test_batch_slices_off(tmp_path):
    out = tmp_path / "libcnn.so"
    model = tmp_path / "cnn.onnx"
    import onnx
    onnx.save(symbolic_batch_cnn(), model)
    assert cli_main(["compile", str(model), "-o", str(out), "--input-shape", "x=1x3x16x16:4x3x16x16:16x3x16x16",
                     "--no-batch-slices"]) == 0
    with open(str(out)[:-3] + ".manifest.json") as f:
        assert json.load(f)["batch_slices"] is None
    art = Pipeline.from_onnx(symbolic_batch_cnn()).optimize().compile(shape_profiles=SYMBOLIC_CNN_PROFILE,
                                                                      batch_slices=False)
    assert art.manifest["batch_slices"] is None
    x = np.random.default_rng(3).standard_normal((8, 3, 16, 16)).astype(np.float32)
    with art.model() as m:
        assert max_rel_error(m.run(x)[0], ort_session(symbolic_batch_cnn()).run(None, {"x": x})[0]) <= 1e-4
    assert os.path.exists(out)


def test_a_transformer_slices_along_its_batch_only_at_the_other_symbols_opt():
    """B and S symbolic (B opt 2, S opt 16): B = 4 at S = 16 runs two slices of the opt kernels, each bit for bit
    the opt point's run of its rows; B = 4 at S = 20 runs the generic kernels; both match onnxruntime."""
    model = transformer_block()
    assert batch_row_symbol(_graph(model)) == "B"
    art, m = compile_and_load(model, TRANSFORMER_PROFILE)
    try:
        assert art.manifest["batch_slices"] == "B"
        sess = ort_session(model)
        for s in (16, 20):
            x = np.random.default_rng(s).standard_normal((4, s, 32)).astype(np.float32)
            (y,) = m.run(x)
            assert max_rel_error(y, sess.run(None, {"x": x})[0]) <= 1e-4
            if s == 16:
                for k in (0, 2):
                    np.testing.assert_array_equal(y[k:k + 2], m.run(np.ascontiguousarray(x[k:k + 2]))[0])
    finally:
        close_and_remove(art, m)
