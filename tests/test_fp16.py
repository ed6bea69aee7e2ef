"""Half precision on the GPU (``--enable-fp16``): the graph pass (which tensors become float16, float32 at the
boundaries, LRN kept in float32, weights converted at compile time), the bundle (ptxas accepts it, the manifest
lists the tensors), the numerical drift measured on the CPU through onnx.reference, the CLI flag, and the x86
target's refusal."""
import os

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from cuvil import Pipeline
from cuvil.cli import main as cli_main
from cuvil.errors import CuvilError
from cuvil.ir.dtype import DType
from cuvil.frontend import export_model
from cuvil.reference import run_reference
from cuvil.rewrite_rules.precision import to_half
from cuvil.targets.ptx import find_libdevice, find_ptxas
from cuvil.targets.ptx.bundle import read_bundle
from cuvil.testing import light_model

TARGET = "nvptx64-nvidia-cuda"
needs_libdevice = pytest.mark.skipif(find_libdevice() is None, reason="libdevice.10.bc not found")
needs_ptxas = pytest.mark.skipif(find_ptxas() is None, reason="ptxas not found (no CUDA toolkit)")


def lrn_cnn():
    rng = np.random.default_rng(0)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 12, 12])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 10])
    w = numpy_helper.from_array((0.3 * rng.standard_normal((8, 3, 3, 3))).astype(np.float32), "w")
    b = numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), "b")
    fw = numpy_helper.from_array((0.1 * rng.standard_normal((10, 8))).astype(np.float32), "fw")
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("LRN", ["r"], ["l"], size=3),
             helper.make_node("MaxPool", ["l"], ["m"], kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("GlobalAveragePool", ["m"], ["g"]),
             helper.make_node("Flatten", ["g"], ["f"]),
             helper.make_node("Gemm", ["f", "fw"], ["y"], transB=1)]
    g = helper.make_graph(nodes, "lrn_cnn", [x], [y], [w, b, fw])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@pytest.fixture(scope="module")
def small():
    return Pipeline.from_onnx(lrn_cnn()).optimize()


def test_graph_pass_types(small):
    g, names = to_half(small.graph)
    ops = {n.op: n for n in g.nodes}
    assert [v.dtype for v in g.inputs] == [DType.FLOAT] and [v.dtype for v in g.outputs] == [DType.FLOAT]
    assert ops["Conv"].outputs[0].dtype == DType.FLOAT16 and ops["Gemm"].outputs[0].dtype == DType.FLOAT16
    # weights converted at compile time: the Conv reads float16 constants
    assert all(v.const.dtype == np.float16 for v in ops["Conv"].inputs[1:])
    # LRN's sum of squares would overflow half: it stays float32, between two Casts
    assert ops["LRN"].outputs[0].dtype == DType.FLOAT
    assert ops["LRN"].inputs[0].producer.op == "Cast"
    assert sum(n.op == "Cast" for n in g.nodes) == 4      # input, around LRN (2), output
    assert ops["Conv"].outputs[0].name in names and any(n.endswith("_f16") for n in names)
    assert small.graph.nodes[0].outputs[0].dtype == DType.FLOAT, "the pass works on a copy"


def test_reference_drift_is_small(small):
    x = np.random.default_rng(1).standard_normal((1, 3, 12, 12)).astype(np.float32)
    ref = small.run_reference({"x": x})["y"]
    half = run_reference(export_model(to_half(small.graph, reference=True)[0]), {"x": x})[0]
    assert half.dtype == np.float32 and half.shape == ref.shape
    err = np.max(np.abs(half - ref)) / np.max(np.abs(ref))
    assert 0 < err < 1e-2, err


def test_kv_cache_passes_through_in_float32():
    """A decode step's ``present = Concat(past, new)`` (and the keys' transpose read from it) stays float32: the
    cache is not rounded to half on every call nor converted twice; only the new row is computed in half. Run
    through onnx.reference: the presents' old rows are the past bit for bit, the new row within half's drift."""
    from cuvil.rewrite_rules.specialize import specialize_graph
    from cuvil.testing.hf_models import gpt2_decode_model
    p = Pipeline.from_onnx(gpt2_decode_model(vocab=211, hidden=64, layers=2, heads=4, ffn=128, max_pos=32)).optimize()
    g, _ = specialize_graph(p.graph, {"batch": 1, "past_sequence": 5, "total_sequence": 6})
    h, _ = to_half(g)
    concats = [n for n in h.nodes if n.op == "Concat"]
    assert len(concats) == 4 and all(n.outputs[0].dtype == DType.FLOAT for n in concats)
    assert all(n.inputs[0] in h.inputs for n in concats)          # the past read as it is, no Cast
    assert all(n.inputs[1].producer.op == "Cast" for n in concats)  # the new row widened (exact)
    assert not any(n.op == "Cast" and n.inputs[0] in h.inputs and n.inputs[0].name.startswith("past") for n in h.nodes)
    assert any(n.op == "MatMul" and n.outputs[0].dtype == DType.FLOAT16 for n in h.nodes)   # the rest is half
    rng = np.random.default_rng(3)
    feeds = {v.name: rng.standard_normal(v.shape).astype(np.float32) for v in g.inputs if v.name.startswith("past")}
    feeds.update(input_ids=np.array([[7]], np.int64), attention_mask=np.ones((1, 6), np.int64))
    names = [v.name for v in g.outputs]
    ref = dict(zip(names, run_reference(export_model(g), feeds)))
    half = dict(zip(names, run_reference(export_model(to_half(g, reference=True)[0]), feeds)))
    for n in names:
        if n.startswith("present."):
            past = feeds[n.replace("present", "past_key_values")]
            assert half[n].dtype == np.float32 and np.array_equal(half[n][:, :, :5], past)
            assert np.abs(half[n][:, :, 5:] - ref[n][:, :, 5:]).max() <= 1e-2 * np.abs(ref[n]).max()


@needs_libdevice
def test_bundle_lists_float16_tensors(small):
    b = small.compile(TARGET, cache=False, enable_fp16=True)
    plan, man = read_bundle(b.path)
    assert man["enable_fp16"] is True and man["float16_tensors"]
    assert man["float16_reductions_widened"] >= 2          # conv, global average pool, gemm
    assert plan["inputs"][0]["dtype"] == "float32" and plan["outputs"][0]["dtype"] == "float32"
    ptx = open(os.path.join(b.path, "kernels.ptx")).read()
    assert "ld.global.nc.b16" in ptx and "st.global.b16" in ptx
    if find_ptxas():
        assert man["ptxas"]["kernels"]
    # half weights: the bundle's weights take about half the float32 bundle's bytes
    full = small.compile(TARGET, cache=False)
    assert man["weights_bytes"] < 0.75 * full.manifest["weights_bytes"]


@needs_libdevice
@needs_ptxas
def test_light_model_fp16_assembles():
    p = Pipeline.from_onnx(light_model("squeezenet")).optimize()
    b = p.compile(TARGET, cache=False, enable_fp16=True)
    _, man = read_bundle(b.path)
    assert len(man["float16_tensors"]) > 50 and set(man["ptxas"]["kernels"]) and man["kernels"] > 10
    assert man["kernel_rules"]["fma_contract"]["applied"] > 0


def test_x86_rejects_fp16(small, tmp_path, capsys):
    with pytest.raises(CuvilError, match="enable_fp16.*nvptx64-nvidia-cuda target only"):
        small.compile("x86_64-linux-gnu", enable_fp16=True)
    import onnx
    onnx.save(lrn_cnn(), str(tmp_path / "m.onnx"))
    rc = cli_main(["compile", "--input", str(tmp_path / "m.onnx"), "--enable-fp16", "--output", str(tmp_path / "libm.so")])
    assert rc == 2
    assert "--enable-fp16 applies to --target nvptx64-nvidia-cuda only (float16 compute" in capsys.readouterr().err


@needs_libdevice
def test_cli_enable_fp16_and_no_fma(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("CUVIL_CACHE_DIR", str(tmp_path / "cache"))
    import onnx
    onnx.save(lrn_cnn(), str(tmp_path / "m.onnx"))
    out = tmp_path / "m.cuvil"
    assert cli_main(["compile", "--input", str(tmp_path / "m.onnx"), "--target", TARGET, "--enable-fp16",
                     "--no-fma", "--output", str(out)]) == 0
    text = capsys.readouterr().out
    assert "float16:" in text and "(--no-fma)" in text
    _, man = read_bundle(str(out))
    assert man["enable_fp16"] and man["fma"] is False and man["float16_tensors"]
    assert all(v["obligation"] == "exact" for v in man["kernel_rules"].values())
