"""Quantized models (issue 21, part 4): QDQ models from onnxruntime's quantizer compile to int8 contractions
(cuvil.rewrite_rules.qdq) and, like the integer ops built with onnx.helper, match onnxruntime's int8 results
within one quantization step on every output."""
import numpy as np
import pytest
from onnx import TensorProto

ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnxruntime.quantization")

from cuvil import Pipeline  # noqa: E402
from cuvil.testing.quant_models import (conv_integer_model, matmul_block_float, matmul_integer_model,  # noqa: E402
                                        output_step, qdq_cnn_float, qdq_model, qlinear_conv_model, qlinear_matmul_model,
                                        quantized_feeds, random_feeds)

U8, I8 = TensorProto.UINT8, TensorProto.INT8


def _ort(model, feeds):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


def _compile(model):
    return Pipeline.from_onnx(model).optimize().compile(opt_level=3)


@pytest.mark.parametrize("activations,per_channel", [("uint8", True), ("int8", False)])
def test_qdq_cnn_matches_onnxruntime(activations, per_channel):
    q = qdq_model(qdq_cnn_float(), per_channel=per_channel, activations=activations)
    art = _compile(q)
    applied = art.manifest["rules_applied"]
    assert applied["qdq_int8_conv"]["applied"] == 5 and applied["qdq_int8_gemm"]["applied"] == 1
    assert applied["qdq_int8_conv"]["verdict"] == "argued"
    step = output_step(q)
    for feeds in random_feeds(q, seed=7, n=3):
        want = _ort(q, feeds)[0]
        got = art.run(feeds)["y"]
        assert np.std(want) > 10 * step   # the output is not one constant level
        assert np.max(np.abs(got - want)) <= step * 1.0001, np.max(np.abs(got - want)) / step


def test_qdq_matmul_block_matches_onnxruntime():
    q = qdq_model(matmul_block_float())
    art = _compile(q)
    assert art.manifest["rules_applied"]["qdq_int8_matmul"]["applied"] == 2
    step = output_step(q)
    for feeds in random_feeds(q, seed=3, n=2):
        want, got = _ort(q, feeds)[0], art.run(feeds)["y"]
        assert np.max(np.abs(got - want)) <= step * 1.0001


def test_fused_graph_computes_in_integers():
    """After optimize, no float Conv/Gemm/MatMul is left: every contraction reads the quantized tensors."""
    for f in (qdq_cnn_float(), matmul_block_float()):
        ops = [n.op for n in Pipeline.from_onnx(qdq_model(f)).optimize().graph.nodes]
        assert not {"Conv", "Gemm", "MatMul"} & set(ops), ops
        assert {"QLinearConv", "QLinearMatMul"} & set(ops)


def _assert_within_one_step(model, seed=0):
    feeds = quantized_feeds(model, seed)
    want = _ort(model, feeds)[0]
    got = list(_compile(model).run(feeds).values())[0]
    assert got.dtype == want.dtype and got.shape == want.shape
    diff = np.abs(got.astype(np.int64) - want.astype(np.int64))
    info = np.iinfo(want.dtype)
    assert np.mean((want > info.min) & (want < info.max)) > 0.5   # mostly unsaturated
    assert diff.max() <= 1, diff.max()


@pytest.mark.parametrize("x_shape,w_shape,kw", [
    ((1, 5, 9, 7), (6, 5, 3, 3), {}),
    ((2, 8, 11, 10), (16, 8, 3, 3), {"strides": (2, 2), "per_channel": False}),
    ((1, 7, 6, 5), (9, 7, 1, 1), {"pads": (0, 0, 0, 0), "bias": False}),
    ((1, 6, 8, 8), (6, 2, 3, 3), {"group": 3, "x_type": I8}),
    ((1, 4, 9, 9), (5, 4, 3, 3), {"w_type": U8, "dilations": (2, 2), "pads": (2, 2, 2, 2)}),
])
def test_qlinear_conv_matches_onnxruntime(x_shape, w_shape, kw):
    _assert_within_one_step(qlinear_conv_model(x_shape, w_shape, **kw))


@pytest.mark.parametrize("a_shape,b_shape,kw", [
    ((7, 13), (13, 11), {}),
    ((2, 5, 33), (33, 17), {"a_type": I8}),
])
def test_qlinear_matmul_matches_onnxruntime(a_shape, b_shape, kw):
    _assert_within_one_step(qlinear_matmul_model(a_shape, b_shape, **kw))


@pytest.mark.parametrize("build,args", [
    (matmul_integer_model, ((5, 19), (19, 7))),
    (matmul_integer_model, ((2, 3, 9), (9, 4))),
    (conv_integer_model, ((1, 3, 7, 9), (5, 3, 3, 3))),
])
def test_integer_ops_are_exact(build, args):
    m = build(*args)
    feeds = quantized_feeds(m, 1)
    want = _ort(m, feeds)[0]
    got = list(_compile(m).run(feeds).values())[0]
    np.testing.assert_array_equal(got, want)


def _kinds(art):
    return {s["kernel"] for s in art.manifest["steps"]}


def test_vnni_kernels_and_the_portable_build_agree():
    """On a host with AVX512-VNNI the quantized convolutions run the vpdpbusd micro-kernels (the manifest's
    step kinds say so); a portable AVX2 build (no VNNI) runs the same expression as loop nests: same bits."""
    from cuvil.targets.x86.cpu import describe_cpu
    from cuvil.targets.x86.gemm_int8 import has_vnni512
    q = qdq_model(qdq_cnn_float(hw=(17, 19)), activations="int8")
    p = Pipeline.from_onnx(q).optimize()
    portable = p.compile(opt_level=3, cpu="x86-64-v3")
    assert not {"int8_vnni512", "int8_pack"} & _kinds(portable)
    feeds = random_feeds(q, seed=11, n=2)
    if not has_vnni512(describe_cpu().features):
        pytest.skip("this CPU has no AVX512-VNNI: only the portable path runs here")
    native = p.compile(opt_level=3)
    assert {"int8_vnni512", "int8_pack"} <= _kinds(native)
    for f in feeds:
        a, b = native.run(f, num_threads=2)["y"], portable.run(f)["y"]
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(native.run(f, num_threads=1)["y"], a)


@pytest.mark.parametrize("m", [10, 17])
def test_partial_channel_panels_with_two_threads(m):
    """A single position (a classifier as a 1x1 convolution) and channels past the last whole panel of 8:
    each thread's rows are stored exactly (a store wider than its row would clobber the next thread's)."""
    model = qlinear_conv_model((1, 40, 1, 1), (m, 40, 1, 1), pads=(0, 0, 0, 0))
    art = _compile(model)
    for seed in range(5):
        feeds = quantized_feeds(model, seed)
        want = _ort(model, feeds)[0]
        got = list(art.run(feeds, num_threads=2).values())[0]
        assert np.abs(got.astype(int) - want.astype(int)).max() <= 1
