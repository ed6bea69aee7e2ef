"""bf16 convolutions on AMX tiles over channels-last rows (cuvil.kernels.contraction_nhwc,
cuvil.targets.x86.gemm_nhwc), the default on a CPU with AMX-BF16: every window form they take (pads, asymmetric
pads, strides through phase planes, dilations, 5x5 and non-square kernels, channels that do not fill the last block
of 32, output channels past whole blocks, dropped wide columns, batch 2) against a float64 numpy convolution of
the bfloat16-rounded operands within the bound of float32 sums; the rows copy from every kind of input (a
channel-planar float32 graph input, a channel-planar bfloat16 pool output, a channels-last bfloat16 or float32
value); the layout choice (values stored channels-last between such convolutions, read in place by a 1x1 reader,
one rows copy shared by two readers); the vector and the element epilogues against the channel-planar build; the
forms that keep the other kernels. Skipped, with the reason printed, on a CPU without AMX-BF16."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from cuvil import Pipeline
from cuvil.kernels.contraction_nhwc import channels_last_pitch, is_channels_last, pack_nhwc_weights
from cuvil.kernels.texpr import Buf
from cuvil.ir.dtype import DType
from cuvil.targets.x86.amx import has_amx
from cuvil.targets.x86.cpu import cpu_label, host_cpu
from cuvil.targets.x86.tuning import X86Tuning
from cuvil.testing.conv_models import conv_epilogue_model
from test_x86_bf16 import bf16, resnet_like
from test_x86_bf16_planes import check_rounded_conv

HAS_AMX = has_amx(host_cpu().features)
needs_amx = pytest.mark.skipif(not HAS_AMX, reason=f"no AMX-BF16 on this CPU ({cpu_label()}): the tile kernels "
                                                   "cannot run here")
PLANAR = X86Tuning(channels_last=False)


def narrowed(model, **compile_kw):
    ranges = {vi.name: (-8.0, 8.0) for vi in model.graph.input}
    return Pipeline.from_onnx(model).optimize().compile(precision="bf16", input_ranges=ranges, **compile_kw)


def kernels(art):
    return [s["kernel"] for s in art.manifest["steps"]]


def test_weight_layout():
    """B tiles per (output block of 32, tap, step of 32 input channels): 16 rows of channel pairs by 32 output
    channels, zero past M and past C; a channels-last value's strides."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((40, 45, 3, 2)).astype(np.float32)
    p = pack_nhwc_weights(w).view(np.uint16)
    assert p.shape == (2, 6, 2, 16, 32, 2)                    # MB 2, T 6, S 2 (45 -> 64 channels)
    want = bf16(w).astype(np.float32).view(np.uint32) >> 16   # [M, C, KH, KW]
    for mb, t, s, r, col, i in [(0, 0, 0, 0, 0, 0), (1, 5, 1, 6, 7, 0), (0, 3, 0, 15, 31, 1), (1, 2, 1, 6, 3, 1)]:
        m, c = mb * 32 + col, s * 32 + 2 * r + i
        assert p[mb, t, s, r, col, i] == (want[m, c, t // 2, t % 2] if m < 40 and c < 45 else 0)
    assert not p[1, :, :, :, 8:].any() and not p[:, :, 1, 7:].any() and not p[:, :, 1, 6, :, 1].any()
    b = Buf("v", DType.BFLOAT16, (2, 64, 5, 7), 0, 0, pitch=channels_last_pitch((2, 64, 5, 7)))
    assert b.strides == (5 * 7 * 64, 1, 7 * 64, 64) and is_channels_last(b)
    assert not is_channels_last(Buf("u", DType.BFLOAT16, (2, 64, 5, 7), 0, 0))


CASES = [
    ((1, 64, 16, 16), (64, 64, 3, 3), dict(pads=[1, 1, 1, 1])),                     # 2 dropped columns a row
    ((2, 96, 12, 20), (80, 96, 3, 3), dict(pads=[1, 2, 1, 0])),                     # asymmetric pads, M % 32 = 16
    ((1, 120, 15, 15), (40, 120, 3, 3), dict(strides=[2, 2], pads=[1, 1, 1, 1])),  # 4 phases, 8 zero channels
    ((1, 64, 19, 19), (48, 64, 3, 3), dict(pads=[2, 2, 2, 2], dilations=[2, 2])),   # dilated
    ((1, 256, 24, 24), (128, 256, 1, 1), dict(strides=[2, 2])),                     # strided 1x1: one phase
    ((1, 32, 20, 20), (48, 32, 5, 5), dict(pads=[2, 2, 2, 2])),                     # 25 taps
    ((1, 64, 11, 13), (64, 64, 3, 1), dict(pads=[1, 0, 1, 0])),                     # 3x1, odd sizes
    ((1, 64, 16, 16), (64, 64, 1, 1), {}),                                          # 1x1: the rows are the input
    ((2, 24, 9, 10), (40, 24, 3, 3), dict(pads=[1, 1, 1, 1])),                      # 24 of a block's 32 channels
    ((2, 64, 19, 8), (32, 64, 1, 2), dict(strides=[1, 2], pads=[0, 1, 0, 1], dilations=[1, 2])),
    ((1, 64, 7, 7), (512, 64, 3, 3), dict(pads=[1, 1, 1, 1])),                      # 16 blocks, 2 units an image
    ((1, 64, 14, 14), (40, 64, 1, 1), {}),         # a channel-planar output from transposed tiles, 8 of a block's 32
    ((2, 96, 11, 11), (48, 96, 1, 1), dict(strides=[2, 2])),                        # the same at stride 2, batch 2
]


@needs_amx
@pytest.mark.parametrize("xs,ws,attrs", CASES, ids=[f"nhwc{i}" for i in range(len(CASES))])
def test_conv_on_channels_last_rows(xs, ws, attrs):
    model = conv_epilogue_model(xs, ws, epilogue=None, **attrs)
    art = narrowed(model)
    assert kernels(art) == ["nhwc_rows", "bf16_nhwc_amx"], art.manifest["steps"]
    assert art.manifest["steps"][1]["path"] == "amx_bf16"
    check_rounded_conv(model, art, xs, ws, attrs)


def _conv(nodes, inits, rng, name, x, cin, cout, k, stride=1, relu=True):
    w = (rng.standard_normal((cout, cin, k, k)) / np.sqrt(cin * k * k)).astype(np.float32)
    b = (0.1 * rng.standard_normal(cout)).astype(np.float32)
    inits += [numpy_helper.from_array(w, name + "_w"), numpy_helper.from_array(b, name + "_b")]
    nodes.append(helper.make_node("Conv", [x, name + "_w", name + "_b"], [name], kernel_shape=[k, k],
                                  strides=[stride, stride], pads=[k // 2] * 4))
    if relu:
        nodes.append(helper.make_node("Relu", [name], [name + "_r"]))
        return name + "_r"
    return name


def _bottlenecks(act="Relu", hw=14, pool=True):
    """A pool, then two bottlenecks (1x1, 3x3, 1x1 plus the skip path, ``act``), the first with a projection,
    then a strided 3x3; the output float32 [1, 64, hw/2, hw/2]."""
    rng = np.random.default_rng(7)
    nodes, inits = [], []
    x = "x"
    if pool:
        nodes.append(helper.make_node("MaxPool", ["x"], ["p"], kernel_shape=[3, 3], strides=[1, 1], pads=[1] * 4))
        x = "p"
    proj = _conv(nodes, inits, rng, "proj", x, 32, 64, 1, relu=False)
    a = _conv(nodes, inits, rng, "a1", x, 32, 32, 1)
    bb = _conv(nodes, inits, rng, "b1", a, 32, 32, 3)
    c = _conv(nodes, inits, rng, "c1", bb, 32, 64, 1, relu=False)
    nodes += [helper.make_node("Add", [c, proj], ["s1"]), helper.make_node(act, ["s1"], ["o1"])]
    a = _conv(nodes, inits, rng, "a2", "o1", 64, 32, 1)
    bb = _conv(nodes, inits, rng, "b2", a, 32, 32, 3)
    c = _conv(nodes, inits, rng, "c2", bb, 32, 64, 1, relu=False)
    nodes += [helper.make_node("Add", [c, "o1"], ["s2"]), helper.make_node(act, ["s2"], ["o2"])]
    out = _conv(nodes, inits, rng, "d", "o2", 64, 64, 3, stride=2)
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 32, hw, hw])],
                          [helper.make_tensor_value_info(out, TensorProto.FLOAT, None)], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@needs_amx
@pytest.mark.parametrize("act", ["Relu", "Sigmoid"])
def test_bottlenecks_match_the_planar_build(act):
    """Two bottleneck blocks: the values between the channels-last convolutions are stored channels-last (the
    3x3 readers' inputs, the block outputs read by a 1x1 reader and by the next skip Add, the float32 output of
    one of the two convolutions the first Add sums), the 1x1 readers of a channels-last bfloat16 value read it in place (no rows copy), the
    pool's output is copied once for its two readers; Relu's epilogue runs on channel vectors, Sigmoid's element
    by element. Against the channel-planar build: the same values up to the order of the float32 sums and the
    one bfloat16 step a rounded intermediate may take where those sums differ in their last bit."""
    model = _bottlenecks(act)
    art = narrowed(model, tuning=X86Tuning(conv_sum=False))      # (fused: tests/test_conv_sum.py)
    planar = narrowed(model, tuning=PLANAR)
    cl = art.manifest.get("channels_last_activations", [])
    assert {"a1_r", "b1_r", "o1", "a2_r", "b2_r"} <= set(cl) and ({"proj", "c1"} & set(cl)), cl
    assert "channels_last_activations" not in planar.manifest
    # the second block's output written over its skip input (o1, read last by that Add; c1 and proj were summed
    # in float32 into o1, so the first block's output has no bfloat16 residual of its own dtype to take)
    assert art.manifest.get("outputs_over_residuals") == {"o2": "o1"}, art.manifest.get("outputs_over_residuals")
    steps = art.manifest["steps"]
    assert "bf16_nhwc_amx" in kernels(art) and not any(k.startswith("bf16_planes") for k in kernels(art))
    rows = [s["stage"] for s in steps if s["kernel"] == "nhwc_rows"]
    # one copy of the pool's output (for proj and a1), the two 3x3 inputs, o1 for the strided... none for a2 (o1
    # in place) and the c convolutions (b in place): 1 + 2 + 1 (d reads o2, a float32 value at stride 2)
    assert len(rows) == 4, rows
    check_bottlenecks(model, art, planar)


def check_bottlenecks(model, art, planar):
    """``_bottlenecks``' library ``art`` within bf16's error of the ``planar`` build and of float32, bf16 in effect
    (shared with tests/test_conv_sum.py)."""
    x = np.random.default_rng(8).standard_normal((1, 32, 14, 14)).astype(np.float32)
    got = art.model().run(x)[0].astype(np.float64)
    want = planar.model().run(x)[0].astype(np.float64)
    exact = Pipeline.from_onnx(model).optimize().compile().model().run(x)[0]
    scale = float(np.abs(exact).max())
    assert float(np.abs(got - want).max()) <= 2e-2 * scale
    assert float(np.abs(got - exact).max()) <= 2e-2 * scale
    assert float(np.abs(got - exact).max()) > 0           # bf16 in effect


@pytest.mark.parametrize("pool", ["GlobalAveragePool", "MaxPool"])
@needs_amx
def test_graph_output_and_other_readers(pool):
    """A channels-last convolution whose output is a graph output (channel-planar: transposed tiles, or element
    by element through its strides) and one whose value is also read by a pool: stored channels-last for a
    global average pool (its loop nest reads it through its strides), kept channel-planar for a 3x3 max pool (a
    reader that is not a channels-last convolution, a skip Add or a pool over the whole map)."""
    rng = np.random.default_rng(9)
    nodes, inits = [], []
    a = _conv(nodes, inits, rng, "a", "x", 64, 64, 3)
    bb = _conv(nodes, inits, rng, "b", a, 64, 64, 1)
    kw = {"kernel_shape": [3, 3], "pads": [1] * 4} if pool == "MaxPool" else {}
    nodes.append(helper.make_node(pool, [a], ["gap"], **kw))
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64, 12, 12])],
                          [helper.make_tensor_value_info(bb, TensorProto.FLOAT, None),
                           helper.make_tensor_value_info("gap", TensorProto.FLOAT, None)], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    art = narrowed(model)
    assert kernels(art).count("bf16_nhwc_amx") == 2
    assert ("a_r" in art.manifest.get("channels_last_activations", [])) == (pool == "GlobalAveragePool")
    assert ("nhwc_mean" in kernels(art)) == (pool == "GlobalAveragePool")     # on vectors of channels
    x = rng.standard_normal((1, 64, 12, 12)).astype(np.float32)
    got = art.model().run(x)
    want = narrowed(model, tuning=PLANAR).model().run(x)
    for g_, w_ in zip(got, want):
        assert float(np.abs(g_ - w_).max()) <= 1e-2 * float(np.abs(w_).max())


@needs_amx
def test_rows_written_in_place():
    """X86Tuning(rows_in_place=True) (opt-in): the bottlenecks' 1x1 outputs read only by a 3x3's rows copy are
    written by their convolution straight into the rows' interior (a view, positions Wq * C apart), the copy left
    writing the zeros around it: the same bits as the copies, on 1 and 2 threads, proved in bounds."""
    model = _bottlenecks("Relu")
    art = narrowed(model, tuning=X86Tuning(rows_in_place=True))
    copied = narrowed(model, tuning=X86Tuning(rows_in_place=False))
    assert set(art.manifest.get("pads_in_place", [])) == {"a1_r", "a2_r"}, art.manifest.get("pads_in_place")
    assert "pads_in_place" not in copied.manifest
    assert not art.manifest["memory_safety"]["guarded"]
    x = np.random.default_rng(12).standard_normal((1, 32, 14, 14)).astype(np.float32)
    want = copied.model().run(x)[0]
    np.testing.assert_array_equal(art.model().run(x, num_threads=1)[0], want)
    np.testing.assert_array_equal(art.model().run(x, num_threads=2)[0], want)


@needs_amx
@pytest.mark.parametrize("channels", [48, 128, 40])
def test_mean_over_a_channels_last_map(channels):
    """A classifier's pool over a channels-last value, as an AveragePool whose window is the map and as a
    GlobalAveragePool: vectors of 16 channels summed position by position (48 and 40 channels: a unit's last
    vectors past C masked), against the channel-planar build (the same convolution up to the order of its float32
    sums), proved in bounds."""
    rng = np.random.default_rng(11)
    nodes, inits = [], []
    a = _conv(nodes, inits, rng, "a", "x", 64, channels, 3)
    nodes += [helper.make_node("AveragePool", [a], ["avg"], kernel_shape=[12, 12]),
              helper.make_node("GlobalAveragePool", [a], ["gap"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64, 12, 12])],
                          [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("avg", "gap")], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    art = narrowed(model)
    assert "a_r" in art.manifest.get("channels_last_activations", [])
    assert kernels(art).count("nhwc_mean") == 2, kernels(art)
    assert not art.manifest["memory_safety"]["guarded"]
    x = rng.standard_normal((2, 64, 12, 12)).astype(np.float32)
    got = art.model().run(x)
    want = narrowed(model, tuning=PLANAR).model().run(x)
    np.testing.assert_array_equal(got[0], got[1])         # the same sums in the same order
    for g_, w_ in zip(got, want):
        assert g_.shape == w_.shape == (2, channels, 1, 1)
        assert float(np.abs(g_ - w_).max()) <= 1e-4 * float(np.abs(w_).max())


@needs_amx
def test_resnet_like_end_to_end():
    """tests/test_x86_bf16.py's small ResNet (stem, a bottleneck with a projection, pool, classifier) within
    1e-2 of float32, and within bf16's error of the channel-planar build."""
    model = resnet_like()
    x = np.random.default_rng(5).standard_normal((1, 3, 40, 40)).astype(np.float32)
    want = Pipeline.from_onnx(model).optimize().compile().model().run(x)[0]
    art = narrowed(model)
    assert "bf16_nhwc_amx" in kernels(art)
    got = art.model().run(x)[0]
    assert float(np.abs(got - want).max() / np.abs(want).max()) < 1e-2


@needs_amx
@pytest.mark.parametrize("xs,ws,attrs,taken", [
    ((1, 64, 5, 5), (64, 64, 3, 3), dict(pads=[1, 1, 1, 1]), True),       # 33 wide positions: a last unit overlapping
    ((1, 40, 16, 16), (64, 40, 3, 3), dict(pads=[1, 1, 1, 1]), False),    # 40 of 64 channels: too many zeros
    ((1, 64, 16, 16), (64, 32, 3, 3), dict(pads=[1, 1, 1, 1], group=2), False),   # groups
    ((1, 64, 4, 4), (64, 64, 3, 3), dict(pads=[1, 1, 1, 1]), False),      # 22 wide positions: not one unit
    ((1, 64, 16, 16), (8, 64, 3, 3), dict(pads=[1, 1, 1, 1]), False),     # 8 output channels
], ids=["5x5-map", "40-channels", "groups", "4x4-map", "8-outputs"])
def test_which_forms_take_channels_last_rows(xs, ws, attrs, taken):
    model = conv_epilogue_model(xs, ws, epilogue=None, **attrs)
    art = narrowed(model)
    assert ("bf16_nhwc_amx" in kernels(art)) == taken, art.manifest["steps"]
    x = np.random.default_rng(4).standard_normal(xs).astype(np.float32)
    want = Pipeline.from_onnx(model).optimize().compile().model().run(x)[0]
    got = art.model().run(x)[0]
    assert float(np.abs(got - want).max()) < 2e-2 * float(np.abs(want).max())


@needs_amx
def test_symbolic_batch():
    """A batch profile N 1..4 (opt 2): the generic kernels (the units counted at run time) and the opt point's
    both take the channels-last rows, so they share one packed copy of the weights; every N within bf16's
    error of the float32 build, and the opt point's slices equal to the generic kernels' run."""
    model = conv_epilogue_model(("N", 64, 16, 16), (64, 64, 3, 3), epilogue="relu", pads=[1, 1, 1, 1])
    prof = {"N": (1, 2, 4)}
    art = narrowed(model, shape_profiles=prof)
    steps = art.manifest["steps"]
    assert any(s["kernel"] == "bf16_nhwc_amx" and s["shape"][0] == "N" for s in steps), steps
    assert any(s["kernel"] == "bf16_nhwc_amx" and s["shape"][0] == 2 for s in steps), steps
    assert art.manifest["opt_weights"] == "shared", art.manifest["opt_weights"]
    ref = Pipeline.from_onnx(model).optimize().compile(shape_profiles=prof).model()
    mod = art.model()
    for n in (1, 2, 3, 4):
        x = np.random.default_rng(n).standard_normal((n, 64, 16, 16)).astype(np.float32)
        got, want = mod.run(x)[0], ref.run(x)[0]
        assert float(np.abs(got - want).max()) < 2e-2 * float(np.abs(want).max())
        if n == 4:       # two slices of the opt point's kernels, or one run of the generic ones: the same sums
            np.testing.assert_array_equal(got[:2], mod.run(x[:2])[0])


@needs_amx
def test_phases_and_crops_in_the_padding():
    """A phase whose columns all lie in the begin padding (width 1, column stride 3, left pad 4: the rows copy's
    inside columns start past the grid), and an end pad that crops the input away (a 1x1 with pads 100 / -50), the
    rows buffer placed in front of a live value: every grid row written within its own bytes (this crashed, and
    zeroed 2.9 KB of the next buffer, before the copy clamped its inside columns to the grid; found by review).
    Every output as the float32 build."""
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((32, 32, 1, 3)) / 10).astype(np.float32)
    g = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["y"], kernel_shape=[1, 3], strides=[1, 3],
                                            pads=[0, 4, 0, 0])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 32, 64, 1])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [numpy_helper.from_array(w, "w")])
    first = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    nodes, inits = [], []
    nodes += [helper.make_node("MaxPool", ["z"], ["d"], kernel_shape=[3, 3], pads=[1] * 4),
              helper.make_node("MaxPool", ["z2"], ["p"], kernel_shape=[3, 3], pads=[1] * 4),
              helper.make_node("GlobalAveragePool", ["d"], ["o1"])]
    w2 = (rng.standard_normal((32, 32, 1, 1)) / 6).astype(np.float32)
    inits.append(numpy_helper.from_array(w2, "w2"))
    nodes += [helper.make_node("Conv", ["x", "w2"], ["c"], kernel_shape=[1, 1], pads=[0, 100, 0, -50]),
              helper.make_node("MaxPool", ["p"], ["o2"], kernel_shape=[3, 3], pads=[1] * 4)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in
                                       (("x", [1, 32, 2, 4]), ("z", [1, 27, 8, 8]), ("z2", [1, 16, 8, 8]))],
                          [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in ("o1", "c", "o2")], inits)
    second = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    for model in (first, second):
        art = narrowed(model)
        assert "bf16_nhwc_amx" in kernels(art), art.manifest["steps"]
        feeds = [np.random.default_rng(1).standard_normal([d.dim_value for d in vi.type.tensor_type.shape.dim])
                 .astype(np.float32) for vi in model.graph.input]
        want = Pipeline.from_onnx(model).optimize().compile().model().run(*feeds)
        for threads in (1, 2):
            for got, ref in zip(art.model().run(*feeds, num_threads=threads), want):
                assert got.shape == ref.shape
                assert float(np.abs(got - ref).max()) <= 1e-2 * max(float(np.abs(ref).max()), 1e-3)
