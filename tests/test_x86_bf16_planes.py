"""bf16 convolutions read in place from pair planes (cuvil.kernels.contraction_planes,
cuvil.targets.x86.gemm_planes), on AMX tiles and with vdpbf16ps: every window form the planes take (pads,
asymmetric pads, strides, dilations, non-square and 5x5 kernels, strided 1x1, channels that do not fill the last
block of 32, output channels past whole blocks, dropped wide columns, batch 2) against a float64 numpy
convolution of the bfloat16-rounded operands, within the bound of float32 sums; the vector and the spilled-tile
epilogues against the packed-panel build of the same model; the forms that keep the packed panels. Each path is
skipped (with the reason) on a CPU that cannot run it: AMX-BF16 for the tiles, AVX512_BF16 for vdpbf16ps."""
from __future__ import annotations

import attrs
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from cuvil import Pipeline
from cuvil.targets.x86.amx import has_amx
from cuvil.targets.x86.cpu import cpu_label, host_cpu
from cuvil.targets.x86.tuning import X86Tuning
from cuvil.testing.conv_models import conv_epilogue_model
from test_x86_bf16 import bf16, conv_ref

_FEATURES = host_cpu().features
HAS_AMX = has_amx(_FEATURES)
HAS_BF16 = host_cpu().vector_bits >= 512 and "avx512bf16" in _FEATURES
needs_amx = pytest.mark.skipif(not HAS_AMX, reason=f"no AMX-BF16 on this CPU ({cpu_label()}): the tile kernels "
                                                   "cannot run here")
needs_bf16 = pytest.mark.skipif(not HAS_BF16, reason=f"no AVX512_BF16 on this CPU ({cpu_label()}): the bf16 "
                                                     "kernels cannot run here")
pytestmark = needs_bf16
#: the two paths: AMX tiles (the default where the CPU has them) and vdpbf16ps (X86Tuning(amx=False))
PATHS = [pytest.param(True, id="amx", marks=needs_amx), pytest.param(False, id="vdpbf16ps")]
KERNEL = {True: "bf16_planes_amx", False: "bf16_planes_dp"}
PANELS = X86Tuning(bf16_planes=False)


def narrowed(model, amx=True, **compile_kw):
    ranges = {vi.name: (-8.0, 8.0) for vi in model.graph.input}
    # (the planes, not the channels-last kernels that take these windows first on AMX: tests/test_x86_amx_nhwc.py)
    # (and the 3x3 convolutions direct: without AMX they may otherwise take bf16 Winograd, tests/test_x86_bf16_winograd.py)
    compile_kw["tuning"] = attrs.evolve(compile_kw.get("tuning", X86Tuning()), channels_last=False, bf16_winograd=False)
    if not amx:          # (the vdpbf16ps kernel over planes is opt-in: X86Tuning.bf16_planes)
        tuning = compile_kw["tuning"]
        compile_kw["tuning"] = attrs.evolve(tuning, amx=False, bf16_planes=tuning.bf16_planes is not False)
    return Pipeline.from_onnx(model).optimize().compile(precision="bf16", input_ranges=ranges, **compile_kw)


def kernels(art):
    return [s["kernel"] for s in art.manifest["steps"]]


def initializer(model, name):
    return numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == name))


CASES = [
    ((1, 64, 16, 16), (64, 64, 3, 3), dict(pads=[1, 1, 1, 1])),                     # 2 dropped columns a row
    ((2, 96, 12, 20), (80, 96, 3, 3), dict(pads=[1, 2, 1, 0])),                     # asymmetric pads, M % 32 = 16
    ((1, 120, 15, 15), (40, 120, 3, 3), dict(strides=[2, 2], pads=[1, 1, 1, 1])),  # 4 phases, 8 zero channels
    ((1, 64, 19, 19), (64, 64, 3, 3), dict(pads=[2, 2, 2, 2], dilations=[2, 2])),   # dilated
    ((1, 256, 24, 24), (128, 256, 1, 1), dict(strides=[2, 2])),                     # strided 1x1: one phase
    ((1, 32, 20, 20), (48, 32, 5, 5), dict(pads=[2, 2, 2, 2])),                     # 25 taps
    ((1, 64, 11, 13), (64, 64, 3, 1), dict(pads=[1, 0, 1, 0])),                     # 3x1, odd sizes
    # column stride 2 on 8-wide rows (found by tests/property/test_amx_conv_property.py): LLVM's combiner had
    # folded the planes pass's stride pick and pair interleave into one fptrunc of 32 floats, whose instruction
    # selection aborted the process on an assertion (gemm_bf16.to_bf16 now rounds through the intrinsic)
    ((2, 64, 19, 8), (7, 64, 1, 2), dict(strides=[1, 2], pads=[0, 1, 0, 1], dilations=[1, 2])),
]


@pytest.mark.parametrize("amx", PATHS)
@pytest.mark.parametrize("xs,ws,attrs", CASES, ids=[f"planes{i}" for i in range(len(CASES))])
def test_conv_on_planes(xs, ws, attrs, amx):
    model = conv_epilogue_model(xs, ws, epilogue=None, **attrs)
    art = narrowed(model, amx)
    assert kernels(art) == ["bf16_planes", KERNEL[amx]], art.manifest["steps"]
    assert all(s["path"] == ("amx_bf16" if amx else "avx512_bf16") for s in art.manifest["steps"])
    check_rounded_conv(model, art, xs, ws, attrs)


def check_rounded_conv(model, art, xs, ws, attrs):
    """``art`` (``model``: conv_epilogue_model's Conv alone) runs the same bits on 1 and 2 threads and equals a
    float64 convolution of the bfloat16-rounded operands within the bound of float32 sums, far closer than to the
    unrounded one (bf16 rounding in effect). Shared with tests/test_x86_amx_nhwc.py."""
    x = np.random.default_rng(3).standard_normal(xs).astype(np.float32)
    mod = art.model()
    y = mod.run(x, num_threads=2)[0].astype(np.float64)
    np.testing.assert_array_equal(y, mod.run(x, num_threads=1)[0])
    w, b = initializer(model, "w"), initializer(model, "b").astype(np.float64)
    st, pd, dl = attrs.get("strides", [1, 1]), attrs.get("pads", [0] * 4), attrs.get("dilations", [1, 1])
    want, mag = conv_ref(bf16(x), bf16(w), b, st, pd, dl, 1)
    exact, _ = conv_ref(x.astype(np.float64), w.astype(np.float64), b, st, pd, dl, 1)
    assert y.shape == want.shape
    k = int(np.prod(ws[1:]))
    bias = np.abs(b).reshape(1, -1, 1, 1) * 2.0 ** -23
    assert np.all(np.abs(y - want) <= 2 * k * 2.0 ** -24 * mag + bias), float(np.abs(y - want).max())
    assert float(np.abs(y - exact).max()) > 1e3 * float(np.abs(y - want).max())   # bf16 rounding in effect


def _residual_block(c, hw, act):
    """3x3 conv (pads 1) + bias, plus a float32 input ``r`` at the output position, then ``act`` (Relu: the
    vector epilogue; Sigmoid: the spilled-tile one)."""
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((c, c, 3, 3)) / np.sqrt(9 * c)).astype(np.float32)
    b = rng.standard_normal(c).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["y"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
             helper.make_node("Add", ["y", "r"], ["s"]), helper.make_node(act, ["s"], ["out"])]
    shape = [1, c, hw, hw]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n in ("x", "r")],
                          [helper.make_tensor_value_info("out", TensorProto.FLOAT, shape)],
                          [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("amx", PATHS)
@pytest.mark.parametrize("act", ["Relu", "Sigmoid"])
@pytest.mark.parametrize("hw", [9, 16, 30])
def test_epilogues_match_packed_panels(act, hw, amx):
    """The fused residual Add and activation on the planes' tiles: the same values as the packed-panel build
    up to the order of the float32 sums (tap-major there, channel-major here)."""
    model = _residual_block(64, hw, act)
    rng = np.random.default_rng(2)
    x, r = (rng.standard_normal((1, 64, hw, hw)).astype(np.float32) for _ in range(2))
    art = narrowed(model, amx)
    assert KERNEL[amx] in kernels(art)
    got = art.model().run(x, r)[0]
    panels = narrowed(model, amx, tuning=PANELS)
    assert not any(k.startswith("bf16_planes") for k in kernels(panels))
    want = panels.model().run(x, r)[0]
    assert float(np.abs(got - want).max()) <= 1e-5 * float(np.abs(want).max())
    assert not np.array_equal(got, np.zeros_like(got))


@pytest.mark.parametrize("amx", PATHS)
def test_chain_of_plane_convolutions(amx):
    """Two plane convolutions in a row (the second reads the first's bfloat16-stored output: planes from a
    bfloat16 input), against the packed panels."""
    rng = np.random.default_rng(4)
    w1 = (rng.standard_normal((64, 64, 3, 3)) / 24).astype(np.float32)
    w2 = (rng.standard_normal((96, 64, 3, 3)) / 24).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w1"], ["a"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["a"], ["ar"]),
             helper.make_node("Conv", ["ar", "w2"], ["out"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64, 20, 20])],
                          [helper.make_tensor_value_info("out", TensorProto.FLOAT, [2, 96, 10, 10])],
                          [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    art = narrowed(model, amx)
    assert kernels(art).count(KERNEL[amx]) == 2, art.manifest["steps"]
    assert "ar" in art.manifest.get("bf16_activations", {}) or any(s.get("stores") == "bf16" for s in art.manifest["steps"])
    x = rng.standard_normal((2, 64, 20, 20)).astype(np.float32)
    got = art.model().run(x)[0].astype(np.float64)
    want = narrowed(model, amx, tuning=PANELS).model().run(x)[0]
    # both round the intermediate to bfloat16 after float32 sums in different orders: where the sums differ in
    # their last bit a rounding may differ by one bfloat16 step (2^-7 relative), so the outputs differ by at most
    # that step of each input of the second convolution, weighted by |w2|
    a, _ = conv_ref(bf16(x), bf16(w1), None, [1, 1], [1, 1, 1, 1], [1, 1], 1)
    _, mag = conv_ref(np.maximum(a, 0), np.abs(bf16(w2)), None, [2, 2], [1, 1, 1, 1], [1, 1], 1)
    assert np.all(np.abs(got - want) <= 2.0 ** -7 * mag + 1e-6)
    exact = Pipeline.from_onnx(model).optimize().compile().model().run(x)[0]
    assert float(np.abs(got - exact).max()) < 1e-2 * float(np.abs(exact).max())


def test_symbolic_spatial_sizes_keep_packed_panels():
    """H and W symbolic (a profile over both): the planes' geometry is fixed at compile time, so the generic
    kernels are not on planes (a loop nest here, as before the planes), the opt point's (H = W = 16) are (their
    weights a copy of their own);
    the build compiles (it raised a TypeError comparing the symbolic position count) and runs at the opt point
    and off it as the float32 build does within bfloat16's error."""
    model = conv_epilogue_model((1, 64, "H", "W"), (64, 64, 3, 3), epilogue="relu", pads=[1, 1, 1, 1])
    prof = {"H": (8, 16, 32), "W": (8, 16, 32)}
    art = narrowed(model, shape_profiles=prof)
    generic = [s["kernel"] for s in art.manifest["steps"] if any(isinstance(d, str) for d in s["shape"])]
    assert generic and not any(k.startswith("bf16_planes") for k in generic), art.manifest["steps"]
    assert "bf16_planes_amx" in kernels(art) or not HAS_AMX
    mod, ref = art.model(), Pipeline.from_onnx(model).optimize().compile(shape_profiles=prof).model()
    for hw in (8, 16, 20):
        x = np.random.default_rng(hw).standard_normal((1, 64, hw, hw)).astype(np.float32)
        got, want = mod.run(x)[0], ref.run(x)[0]
        assert float(np.abs(got - want).max()) < 2e-2 * float(np.abs(want).max())


@pytest.mark.parametrize("xs,ws,attrs,profiles", [
    ((1, 64, 16, 16), (64, 64, 1, 1), {}, None),                         # stride-1 1x1: direct rows
    ((1, 64, 7, 7), (64, 64, 3, 3), dict(pads=[1, 1, 1, 1]), None),      # 49 outputs: few to pack
    ((1, 3, 32, 32), (32, 3, 3, 3), dict(pads=[1, 1, 1, 1]), None),      # 3 channels of a block of 32
    ((1, 64, 40, 40), (64, 64, 3, 3), dict(strides=[1, 5]), None),      # a column stride over 4
], ids=["1x1", "7x7-map", "stem", "stride5"])
def test_forms_that_keep_packed_panels(xs, ws, attrs, profiles):
    model = conv_epilogue_model(xs, ws, epilogue=None, **attrs)
    for amx in (True, False) if HAS_AMX else (False,):
        art = narrowed(model, amx)
        assert not any(k.startswith("bf16_planes") for k in kernels(art)) and "gemm" in kernels(art), art.manifest["steps"]


@needs_amx
def test_symbolic_batch():
    """A batch profile N 1..4 (opt 2): the generic kernels (any N, the units counted at run time) and the opt
    point's (N = 2, run once per slice of 2) both read planes, so they share one packed copy of the weights;
    every N as the packed-panel build, up to the order of the sums."""
    model = conv_epilogue_model(("N", 64, 16, 16), (64, 64, 3, 3), epilogue="relu", pads=[1, 1, 1, 1])
    art = narrowed(model, shape_profiles={"N": (1, 2, 4)})
    steps = art.manifest["steps"]
    assert any(s["kernel"] == "bf16_planes_amx" and s["shape"][0] == "N" for s in steps), steps
    assert any(s["kernel"] == "bf16_planes_amx" and s["shape"][0] == 2 for s in steps), steps
    assert art.manifest["opt_weights"] == "shared", art.manifest["opt_weights"]
    mod = art.model()
    panels = narrowed(model, shape_profiles={"N": (1, 2, 4)}, tuning=PANELS).model()
    rng = np.random.default_rng(6)
    for n in (1, 2, 3, 4):
        x = rng.standard_normal((n, 64, 16, 16)).astype(np.float32)
        got, want = mod.run(x)[0], panels.run(x)[0]
        assert float(np.abs(got - want).max()) <= 1e-5 * float(np.abs(want).max()), n
