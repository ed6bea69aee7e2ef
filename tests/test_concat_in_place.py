"""X86Tuning.concat_in_place (cuvil.kernels.concat_in_place): a stored value that only one concatenation piece
copies is written into its slice of the concatenation by its producer, and the copy goes. Checked: which values
go in place and which stay copied (a graph input, a value with another reader, a slice that is not contiguous
or not 64-byte aligned), the outputs bit for bit those of the copies, and both within float32 rounding of
onnxruntime, at 1 and 2 threads."""
import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from cuvil import Pipeline
from cuvil.targets.x86.cpu import cpu_label, host_cpu
from cuvil.targets.x86.tuning import X86Tuning


def _model(n: int, hw: int, a_channels: int):
    """x [n, 16, hw, hw]; y1 = Conv(Concat(a, b)), y2 = MaxPool(Concat(s, x)), y3 = Conv(Concat(d, e)),
    y4 = d + x, where a, b, s, d, e are Relu(Conv(x)) (b a 3x3, the others 1x1; a has ``a_channels``)."""
    rng = np.random.default_rng(0)
    inits, nodes = [], []

    def conv(name, x, cin, cout, k):
        w = numpy_helper.from_array(rng.standard_normal((cout, cin, k, k)).astype(np.float32) * 0.2, name + "_w")
        b = numpy_helper.from_array(rng.standard_normal(cout).astype(np.float32) * 0.1, name + "_b")
        inits.extend([w, b])
        nodes.append(helper.make_node("Conv", [x, w.name, b.name], [name + "_c"], pads=[k // 2] * 4))
        nodes.append(helper.make_node("Relu", [name + "_c"], [name]))

    conv("a", "x", 16, a_channels, 1)
    conv("b", "x", 16, 16, 3)
    nodes.append(helper.make_node("Concat", ["a", "b"], ["c"], axis=1))
    conv("y1", "c", a_channels + 16, 8, 1)
    conv("s", "x", 16, 16, 1)
    nodes.append(helper.make_node("Concat", ["s", "x"], ["t"], axis=1))          # x: a graph input, copied
    nodes.append(helper.make_node("MaxPool", ["t"], ["y2"], kernel_shape=[2, 2], strides=[2, 2]))
    conv("d", "x", 16, 16, 1)
    conv("e", "x", 16, 16, 1)
    nodes.append(helper.make_node("Concat", ["d", "e"], ["u"], axis=1))
    conv("y3", "u", 32, 8, 1)
    nodes.append(helper.make_node("Add", ["d", "x"], ["y4"]))                     # d has a second reader
    graph = helper.make_graph(nodes, "concats", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n, 16, hw, hw])],
                              [helper.make_tensor_value_info(k, TensorProto.FLOAT, None) for k in ("y1", "y2", "y3", "y4")],
                              inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("n, hw, a_channels, in_place", [
    (1, 8, 16, ["a", "b", "s", "e"]),
    (1, 5, 3, ["a", "s", "e"]),     # b's slice starts 3 x 25 x 4 = 300 bytes in: not 64-byte aligned, copied
    (2, 8, 16, []),                 # batch 2: an image's slice is not contiguous, every piece copied
])
def test_producers_write_their_slice_and_the_values_do_not_change(n, hw, a_channels, in_place):
    m = _model(n, hw, a_channels)
    x = np.random.default_rng(1).standard_normal((n, 16, hw, hw)).astype(np.float32)
    want = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    pipe = Pipeline.from_onnx(m).optimize()
    art = pipe.compile(opt_level=1, cache=False)
    copied = pipe.compile(opt_level=1, cache=False, tuning=X86Tuning(concat_in_place=False))
    assert art.manifest.get("concats_in_place", []) == in_place
    assert "concats_in_place" not in copied.manifest
    assert art.manifest["kernels"] == copied.manifest["kernels"] - len(in_place)   # one copy stage per value
    base = copied.run({"x": x}, num_threads=1)
    for threads in (1, 2):
        got = art.run({"x": x}, num_threads=threads)
        for name, ref in zip(("y1", "y2", "y3", "y4"), want):
            np.testing.assert_array_equal(got[name], base[name])
            np.testing.assert_allclose(got[name], ref, rtol=1e-5, atol=1e-5)


def test_a_profile_writes_in_place_at_its_opt_point_only():
    """A symbolic batch: the generic kernels' slices are not contiguous (batch > 1), the opt point's (batch 1)
    are; both variants give onnxruntime's values."""
    m = _model(1, 8, 16)
    m.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "N"
    pipe = Pipeline.from_onnx(m).optimize()
    art = pipe.compile(opt_level=1, cache=False, shape_profiles={"N": (1, 1, 3)})
    assert art.manifest["concats_in_place"] == ["a", "b", "s", "e"]
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    for n in (1, 3):
        x = np.random.default_rng(n).standard_normal((n, 16, 8, 8)).astype(np.float32)
        got = art.run({"x": x})
        for name, ref in zip(("y1", "y2", "y3", "y4"), sess.run(None, {"x": x})):
            np.testing.assert_allclose(got[name], ref, rtol=1e-5, atol=1e-5)


def _branches():
    """x [1, 32, 28, 28]: y = Conv1x1(Concat(Relu(Conv3x3(x)), Relu(Conv1x1(x)))): the 3x3 at 28 x 28 runs as
    Winograd (its output transform is the kernel that writes the slice), the 1x1 as a direct GEMM."""
    rng = np.random.default_rng(2)
    inits, nodes = [], []

    def conv(name, x, cin, cout, k):
        w = (rng.standard_normal((cout, cin, k, k)) * np.sqrt(2.0 / (cin * k * k))).astype(np.float32)
        inits.extend([numpy_helper.from_array(w, name + "_w"),
                      numpy_helper.from_array((0.1 * rng.standard_normal(cout)).astype(np.float32), name + "_b")])
        nodes.append(helper.make_node("Conv", [x, name + "_w", name + "_b"], [name + "_c"], pads=[k // 2] * 4))
        nodes.append(helper.make_node("Relu", [name + "_c"], [name]))

    conv("a", "x", 32, 32, 3)
    conv("d", "x", 32, 32, 1)
    nodes.append(helper.make_node("Concat", ["a", "d"], ["c"], axis=1))
    conv("y", "c", 64, 8, 1)
    graph = helper.make_graph(nodes, "branches", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 32, 28, 28])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_a_winograd_output_transform_writes_its_slice():
    m = _branches()
    x = np.random.default_rng(3).standard_normal((1, 32, 28, 28)).astype(np.float32)
    (want,) = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    pipe = Pipeline.from_onnx(m).optimize()
    art = pipe.compile(opt_level=2, cache=False)          # Winograd from O2 (x86 target options)
    copied = pipe.compile(opt_level=2, cache=False, tuning=X86Tuning(concat_in_place=False))
    assert art.manifest["concats_in_place"] == ["a", "d"]
    writers = {s.get("stage"): s.get("kernel") for s in art.manifest["steps"]}
    assert writers.get("a") == "winograd_out", writers
    for threads in (1, 2):
        got = art.run({"x": x}, num_threads=threads)["y"]
        np.testing.assert_array_equal(got, copied.run({"x": x})["y"])
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif("avx512bf16" not in host_cpu().features,
                    reason=f"no AVX512_BF16 on this CPU ({cpu_label()}): no bf16 convolution kernels")
@pytest.mark.parametrize("amx", [True, False], ids=["amx-or-vdpbf16ps", "vdpbf16ps"])
def test_bf16_convolutions_give_the_same_bits_in_place(amx):
    """Every convolution narrowed to bf16 (AMX tiles where the CPU has them, else vdpbf16ps): whatever goes in
    place (the concatenation, read by a bf16 convolution, may be stored as bfloat16, whose pieces then round
    and stay copies), the outputs are the copies' bits."""
    m = _branches()
    x = np.random.default_rng(4).uniform(-1, 1, (1, 32, 28, 28)).astype(np.float32)
    pipe = Pipeline.from_onnx(m).optimize()
    kw = dict(opt_level=2, cache=False, precision="bf16", input_ranges={"x": (-1.0, 1.0)})
    art = pipe.compile(tuning=X86Tuning(amx=amx), **kw)
    copied = pipe.compile(tuning=X86Tuning(amx=amx, concat_in_place=False), **kw)
    (want,) = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    got = art.run({"x": x})["y"]
    np.testing.assert_array_equal(got, copied.run({"x": x})["y"])
    assert float(np.abs(got - want).max()) <= 3e-2 * float(np.abs(want).max())
