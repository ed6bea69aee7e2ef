"""ConvTranspose whose kernel equals its stride (rules/layout.rule, ``convtranspose_stride_kernel_as_conv`` and its
``_bias_`` twin) runs as a 1x1 Conv giving s*s channels per output channel, then DepthToSpace, and the 4x4,
stride-2, padding-1 upsampling (``convtranspose_k4_s2_p1_as_conv``, ``..._bias_...``) as a 3x3 Conv giving 4 phase
channels and the 3x3, stride-2, padding-1, output-padding-1 one (``convtranspose_k3_s2_p1_op1_...``) as a 2x2 Conv
giving 4, each then DepthToSpace: against
onnxruntime on both forms of the rule, several strides, batch, odd and symbolic sizes, the PP-OCR detector
head's pattern (bias as an Add, BatchNorm as Mul/Add, Relu, a second ConvTranspose, Sigmoid), and the forms the
rule must leave alone (padding, an overlapping kernel, groups)."""
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from cuvil import Pipeline
from cuvil.targets.ptx import find_ptxas
from cuvil.targets.ptx.codegen import build_ptx, gpu_schedule
from cuvil.testing.oracles import max_rel_error, ort_session
from cuvil.testing.requires import needs_gpu

RULES = {"convtranspose_stride_kernel_as_conv", "convtranspose_stride_kernel_bias_as_conv",
         "convtranspose_k4_s2_p1_as_conv", "convtranspose_k4_s2_p1_bias_as_conv",
         "convtranspose_k3_s2_p1_op1_as_conv", "convtranspose_k3_s2_p1_op1_bias_as_conv"}


def _model(cin, cout, s, *, bias, x_shape, attrs=None, kernel=None, group=1):
    rng = np.random.default_rng(cin * 100 + cout * 10 + s)
    k = kernel or s
    inits = [numpy_helper.from_array(rng.standard_normal((cin, cout // group, k, k)).astype(np.float32), "w")]
    ins = ["x", "w"]
    if bias:
        inits.append(numpy_helper.from_array(rng.standard_normal(cout).astype(np.float32), "b"))
        ins.append("b")
    node = helper.make_node("ConvTranspose", ins, ["y"], strides=[s, s], group=group, **(attrs or {}))
    g = helper.make_graph([node], "ct", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape))],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _applied(art) -> set:
    return {name for name, rec in art.manifest.get("rules_applied", {}).items() if rec.get("applied")}


def _check(model, feeds, art, rtol=1e-5):
    want = ort_session(model).run(None, feeds)[0]
    got = art.run(feeds)
    got = got[next(iter(got))] if isinstance(got, dict) else got[0]
    assert got.shape == want.shape
    assert max_rel_error(got, want) < rtol, max_rel_error(got, want)


# torch.onnx writes every attribute out, at its default where it is one: the rule matches that form too
TORCH_FORM = {"kernel_shape": [2, 2], "pads": [0, 0, 0, 0], "dilations": [1, 1], "output_padding": [0, 0]}


@pytest.mark.parametrize("s,bias,x_shape,attrs", [(2, False, (1, 3, 5, 7), None), (2, True, (2, 3, 4, 6), None),
                                                  (3, True, (1, 4, 3, 5), None), (4, False, (2, 2, 2, 3), None),
                                                  (2, True, (1, 3, 6, 5), TORCH_FORM),
                                                  (2, False, (1, 3, 5, 7), {"pads": [1, 1, 1, 1], "k": 4}),
                                                  (2, True, (2, 4, 6, 3), {"pads": [1, 1, 1, 1], "k": 4}),
                                                  (2, True, (1, 3, 4, 4), {**TORCH_FORM, "kernel_shape": [4, 4],
                                                                           "pads": [1, 1, 1, 1], "k": 4}),
                                                  (2, False, (1, 3, 5, 7), {"pads": [1, 1, 1, 1], "output_padding": [1, 1],
                                                                            "k": 3}),
                                                  (2, True, (2, 2, 4, 6), {**TORCH_FORM, "kernel_shape": [3, 3],
                                                                           "pads": [1, 1, 1, 1], "output_padding": [1, 1],
                                                                           "k": 3})])
def test_rewritten_and_equal_to_onnxruntime(s, bias, x_shape, attrs):
    attrs = dict(attrs or {})
    k = attrs.pop("k", None)
    model = _model(x_shape[1], 5, s, bias=bias, x_shape=x_shape, attrs=attrs, kernel=k)
    p = Pipeline.from_onnx(model).optimize()
    ops = [n.op for n in p.graph.nodes]
    assert "ConvTranspose" not in ops and "Conv" in ops and "DepthToSpace" in ops, ops
    art = p.compile()
    assert _applied(art) & RULES, art.manifest.get("rules_applied")
    x = np.random.default_rng(1).standard_normal(x_shape).astype(np.float32)
    _check(model, {"x": x}, art)


def test_one_library_for_symbolic_sizes():
    model = _model(4, 6, 2, bias=True, x_shape=("N", 4, "H", "W"))
    art = Pipeline.from_onnx(model).optimize().compile(
        input_shapes={"x": ([1, 4, 1, 1], [1, 4, 8, 8], [3, 4, 20, 24])})
    for shape in ((1, 4, 1, 1), (2, 4, 7, 13), (3, 4, 20, 24)):
        x = np.random.default_rng(sum(shape)).standard_normal(shape).astype(np.float32)
        _check(model, {"x": x}, art)


@pytest.mark.parametrize("case", ["pads", "overlap", "group", "output_padding"])
def test_other_forms_are_left_alone_and_still_right(case):
    kw = dict(pads=dict(attrs={"pads": [1, 1, 1, 1]}, kernel=5), overlap=dict(kernel=3), group=dict(group=2),
              output_padding=dict(attrs={"output_padding": [1, 1]}))[case]
    model = _model(4, 4, 2, bias=True, x_shape=(1, 4, 5, 6), **kw)
    p = Pipeline.from_onnx(model).optimize()
    assert "ConvTranspose" in [n.op for n in p.graph.nodes]
    art = p.compile()
    assert not _applied(art) & RULES
    _check(model, {"x": np.random.default_rng(2).standard_normal((1, 4, 5, 6)).astype(np.float32)}, art)


def _db_head(h, w):
    """The PP-OCR DB detector's head as paddle2onnx exports it: ConvTranspose without bias, its bias as an Add,
    BatchNorm folded to Mul/Add, Relu, a second ConvTranspose to one channel, its bias, Sigmoid."""
    rng = np.random.default_rng(7)
    c = 6
    arr = lambda *shape: rng.standard_normal(shape).astype(np.float32)       # noqa: E731
    inits = {"w0": arr(c, c, 2, 2), "b0": arr(1, c, 1, 1), "s0": arr(c, 1, 1), "t0": arr(c, 1, 1),
             "w1": arr(c, 1, 2, 2), "b1": arr(1, 1, 1, 1)}
    N = helper.make_node
    nodes = [N("ConvTranspose", ["x", "w0"], ["u0"], strides=[2, 2]), N("Add", ["u0", "b0"], ["a0"]),
             N("Mul", ["a0", "s0"], ["m0"]), N("Add", ["m0", "t0"], ["n0"]), N("Relu", ["n0"], ["r0"]),
             N("ConvTranspose", ["r0", "w1"], ["u1"], strides=[2, 2]), N("Add", ["u1", "b1"], ["a1"]),
             N("Sigmoid", ["a1"], ["y"])]
    g = helper.make_graph(nodes, "head", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c, h, w])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                          [numpy_helper.from_array(v, k) for k, v in inits.items()])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_detector_head_pattern():
    model = _db_head(9, 14)
    art = Pipeline.from_onnx(model).optimize().compile()
    assert "convtranspose_stride_kernel_as_conv" in _applied(art)
    x = np.random.default_rng(3).standard_normal((1, 6, 9, 14)).astype(np.float32)
    _check(model, {"x": x}, art)


@pytest.mark.skipif(find_ptxas() is None, reason="ptxas not found (no CUDA toolkit)")
def test_gpu_builds_the_rewritten_forms():
    upsample = _model(8, 4, 2, bias=True, x_shape=(1, 8, 16, 16), attrs={"pads": [1, 1, 1, 1]}, kernel=4)
    for model, conv in ((_db_head(8, 8), False), (upsample, True)):
        g = Pipeline.from_onnx(model).optimize().graph
        assert "ConvTranspose" not in [n.op for n in g.nodes]
        r = build_ptx(gpu_schedule(g), "sm_90", fma=True)
        kinds = [k.kind for k in r.kernels]
        assert kinds and ".entry" in r.ptx
        if conv:        # the 3x3 phase Conv takes the GPU's convolution kernel (the head's 1x1s are small enough
            assert any(k.startswith("conv") for k in kinds), kinds      # for element kernels)


@needs_gpu
@pytest.mark.parametrize("form", ["db_head", "k4_s2_p1", "k3_s2_p1_op1", "phase_k5_s3"])
def test_gpu_runs_the_rewritten_and_phase_forms(form, tmp_path):
    """On a GPU: the rewritten forms (the detector head's kernel = stride pair, the 4x4 and 3x3 upsamplings, each a
    Conv and a DepthToSpace) and a form left to the phase lowering, run from a PTX bundle, against onnxruntime."""
    from cuvil.testing.ptx_bundles import run_ptx_bundle
    model = {"db_head": lambda: _db_head(12, 10),
             "k4_s2_p1": lambda: _model(8, 4, 2, bias=True, x_shape=(2, 8, 9, 12), attrs={"pads": [1, 1, 1, 1]}, kernel=4),
             "k3_s2_p1_op1": lambda: _model(6, 5, 2, bias=False, x_shape=(1, 6, 7, 10),
                                            attrs={"pads": [1, 1, 1, 1], "output_padding": [1, 1]}, kernel=3),
             "phase_k5_s3": lambda: _model(4, 3, 3, bias=True, x_shape=(1, 4, 6, 5),
                                           attrs={"pads": [2, 1, 0, 2]}, kernel=5)}[form]()
    ops = [n.op for n in Pipeline.from_onnx(model).optimize().graph.nodes]
    assert ("ConvTranspose" in ops) == (form == "phase_k5_s3"), ops
    x = np.random.default_rng(5).standard_normal(
        [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]).astype(np.float32)
    want = ort_session(model).run(None, {"x": x})[0]
    got = run_ptx_bundle(model, [x], tmp_path / form)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * max(1.0, float(np.abs(want).max())))


@pytest.mark.parametrize("k,s,attrs", [(4, 2, {"pads": [2, 1, 2, 1]}), (5, 3, {"pads": [2, 1, 0, 2]}),
                                       (3, 2, {"pads": [1, 1, 1, 1]}), (3, 2, {"pads": [1, 0, 1, 0], "output_padding": [1, 1]}),
                                       (3, 1, {}), (2, 3, {"pads": [0, 1, 1, 0]}),
                                       (3, 2, {"auto_pad": "SAME_UPPER"})])
def test_general_form_by_phase_equals_onnxruntime(k, s, attrs):
    """The forms the rule leaves alone run kernels/lower/conv.py's phase form (each output reads only the taps
    of its phase, ceil(K/s) a dim): kernels that are not a multiple of the stride, asymmetric padding,
    output padding, stride 1, a kernel smaller than the stride, auto_pad."""
    model = _model(3, 4, s, bias=True, x_shape=(2, 3, 5, 7), attrs=attrs, kernel=k)
    art = Pipeline.from_onnx(model).optimize().compile()
    _check(model, {"x": np.random.default_rng(k * 10 + s).standard_normal((2, 3, 5, 7)).astype(np.float32)}, art)
