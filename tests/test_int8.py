"""Quantized models (issue 21, part 4): QDQ models from onnxruntime's quantizer compile to int8 contractions
(cuvil.rewrite_rules.qdq) and, like the integer ops built with onnx.helper, match onnxruntime's int8 results
within one quantization step on every output."""
import numpy as np
import pytest
from onnx import TensorProto

ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnxruntime.quantization")

from cuvil import Pipeline  # noqa: E402
from cuvil.targets.x86.cpu import cpu_label  # noqa: E402
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


def _host_paths():
    from cuvil.targets.x86.cpu import host_cpu
    from cuvil.targets.x86.gemm_int8 import has_amx_int8, has_vnni512
    feats = host_cpu().features
    return has_vnni512(feats), has_amx_int8(feats)


HAS_VNNI, HAS_AMX_INT8 = _host_paths()
if not HAS_AMX_INT8:
    print(f"test_int8: the AMX-INT8 kernel runs are skipped, this CPU has no AMX-INT8 ({cpu_label()})")
if not HAS_VNNI:
    print(f"test_int8: the VNNI kernel runs are skipped, this CPU has no AVX512-VNNI ({cpu_label()})")
needs_amx = pytest.mark.skipif(not HAS_AMX_INT8, reason=f"no AMX-INT8 on this CPU ({cpu_label()}): the tile "
                                                         "kernels cannot run here")
needs_vnni = pytest.mark.skipif(not HAS_VNNI, reason=f"no AVX512-VNNI on this CPU ({cpu_label()})")


def test_int8_dispatch_by_cpu():
    """Which kernels a build takes, from the target CPU's features (compiled, not run: any host): Sapphire
    Rapids AMX tiles (a 3-channel stem stays on VNNI: its tile K would be 4 bytes), Cascade Lake VNNI, Zen 3
    loop nests; the library's C side checks the features the kernels use (and asks for the tile state)."""
    from cuvil.targets.x86.gemm_int8 import int8_isa_checks
    q = qdq_model(qdq_cnn_float(hw=(17, 19)))
    p = Pipeline.from_onnx(q).optimize()
    want = {"sapphirerapids": {"int8_amx", "int8_vnni512", "int8_planes"}, "cascadelake": {"int8_vnni512", "int8_planes"},
            "znver3": set()}
    for cpu, kinds in want.items():
        art = p.compile(opt_level=3, cpu=cpu)
        assert _kinds(art) & {"int8_amx", "int8_vnni512", "int8_planes"} == kinds, cpu
        paths = {s["path"] for s in art.manifest["steps"] if s.get("precision") == "int8"}
        assert paths == ({"amx_int8", "avx512_vnni"} if cpu == "sapphirerapids" else {"avx512_vnni"} if kinds else set())
        with open(art.path, "rb") as f:
            lib = f.read()
        # session_create's checks (__builtin_cpu_supports and the tile permission), by name
        assert (b"amx-int8" in lib and b"ARCH_REQ_XCOMP_PERM" in lib) == (cpu == "sapphirerapids"), cpu
        assert (b"avx512vnni" in lib) == bool(kinds), cpu
    assert int8_isa_checks({"narrow_paths": {"k": "amx_int8"}}, None) == ["avx512vnni", "amx-tile", "amx-int8"]
    assert int8_isa_checks({"narrow_paths": {"k": "avx512_vnni", "j": "avx512_bf16"}}) == ["avx512vnni"]
    assert int8_isa_checks({"narrow_paths": {}}) == []


def test_int8_paths_agree_bit_for_bit():
    """The AMX tiles (the default where the CPU has AMX-INT8), the VNNI kernels (``X86Tuning(amx=False)``) and
    a portable AVX2 build (loop nests over the same planes) compute the same bits, at 1 and 2 threads."""
    from cuvil.targets.x86.tuning import X86Tuning
    q = qdq_model(qdq_cnn_float(hw=(17, 19)), activations="int8")
    p = Pipeline.from_onnx(q).optimize()
    portable = p.compile(opt_level=3, cpu="x86-64-v3")
    assert not {"int8_vnni512", "int8_amx", "int8_planes"} & _kinds(portable)
    feeds = random_feeds(q, seed=11, n=2)
    builds = {}
    if HAS_VNNI:
        builds["vnni"] = p.compile(opt_level=3, tuning=X86Tuning(amx=False))
        assert {"int8_vnni512", "int8_planes"} <= _kinds(builds["vnni"]) and "int8_amx" not in _kinds(builds["vnni"])
    if HAS_AMX_INT8:
        builds["amx"] = p.compile(opt_level=3)
        assert {"int8_amx", "int8_planes"} <= _kinds(builds["amx"])
    if not builds:
        pytest.skip(f"this CPU has neither AVX512-VNNI nor AMX-INT8 ({cpu_label()}): only the portable path runs")
    for f in feeds:
        want = portable.run(f)["y"]
        for name, art in builds.items():
            for th in (1, 2):
                np.testing.assert_array_equal(art.run(f, num_threads=th)["y"], want, err_msg=f"{name}, {th} threads")


# odd shapes of every kind the planes take: channel counts off whole groups of four and tile K blocks (130: 33
# groups, padded to 48), output channels off the 32-channel blocks, rows shorter and longer than 16 wide
# positions, strides, dilations, asymmetric and no padding, 1x1, a 7x7 stem, batch 2, int8 activations
ODD_CONVS = [
    ((1, 64, 14, 14), (70, 64, 3, 3), {}),
    ((1, 64, 15, 13), (33, 64, 3, 3), {"strides": (2, 2), "x_type": I8}),
    ((2, 100, 9, 10), (40, 100, 1, 1), {"pads": (0, 0, 0, 0), "strides": (2, 2)}),
    ((1, 3, 30, 31), (20, 3, 7, 7), {"pads": (3, 3, 3, 3), "strides": (2, 2)}),
    ((1, 96, 7, 7), (50, 96, 3, 3), {"dilations": (2, 2), "pads": (2, 2, 2, 2)}),
    ((1, 130, 5, 6), (17, 130, 3, 3), {"pads": (1, 0, 2, 1)}),
    ((1, 32, 20, 37), (64, 32, 1, 1), {"pads": (0, 0, 0, 0), "per_channel": False}),
    ((2, 24, 12, 11), (48, 24, 3, 3), {"strides": (1, 2), "x_type": I8}),
    ((1, 32, 23, 25), (16, 32, 4, 4), {"strides": (4, 4), "pads": (0, 0, 0, 0)}),
    ((1, 32, 23, 25), (16, 32, 5, 5), {"strides": (5, 5), "pads": (2, 2, 2, 2)}),   # planes as a loop nest
    ((1, 64, 1, 1), (16, 64, 3, 3), {}),
    ((1, 20, 41), (8, 20, 3), {"pads": (1, 1), "strides": (3,), "dilations": (1,)}),   # 1-D
]


@pytest.mark.parametrize("x_shape,w_shape,kw", ODD_CONVS)
def test_int8_kernels_on_odd_shapes(x_shape, w_shape, kw):
    """Each odd shape within one step of onnxruntime on the host's int8 path (AMX where the CPU has it), at 1
    and 2 threads; where AMX runs, the VNNI build too."""
    from cuvil.targets.x86.tuning import X86Tuning
    model = qlinear_conv_model(x_shape, w_shape, **kw)
    p = Pipeline.from_onnx(model).optimize()
    builds = [p.compile(opt_level=3)] + ([p.compile(opt_level=3, tuning=X86Tuning(amx=False))] if HAS_AMX_INT8 else [])
    if HAS_VNNI:
        assert _kinds(builds[0]) & {"int8_vnni512", "int8_amx"}
    for art in builds:   # every access of the planes and the kernels proved in bounds: nothing guarded
        assert art.manifest["memory_safety"]["kernels_proved"] == art.manifest["memory_safety"]["kernels"]
    for seed in range(2):
        feeds = quantized_feeds(model, seed)
        want = _ort(model, feeds)[0].astype(np.int64)
        for art in builds:
            for th in (1, 2):
                got = list(art.run(feeds, num_threads=th).values())[0]
                assert got.dtype == _ort(model, feeds)[0].dtype and got.shape == want.shape
                assert np.abs(got.astype(np.int64) - want).max() <= 1


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


def test_planes_too_short_for_the_last_panel_are_caught_by_the_bounds_proof(monkeypatch):
    """The kernels' reads of the phase planes are proved in bounds (cuvil.kernels.bounds): planes cut at the grid,
    without room for the last panel's shifted reads, leave the contraction unproved, so it runs guarded (its
    plain expression, clamped loads) and is listed, still matching onnxruntime."""
    import cuvil.kernels.lower.qgemm as qgemm
    monkeypatch.setattr(qgemm, "plane_positions", lambda grid, out_h, max_shift: grid[0] * grid[1])
    model = qlinear_conv_model((1, 32, 14, 14), (16, 32, 3, 3))
    art = Pipeline.from_onnx(model).optimize().compile(opt_level=3, cache=False)   # not a library built unpatched
    ms = art.manifest["memory_safety"]
    assert ms["kernels_proved"] == ms["kernels"] - 1
    (bad,) = ms["guarded"]
    assert "family:qgemm" in bad["unproved"][0] and "planes" in bad["unproved"][0]
    assert not {"int8_amx", "int8_vnni512"} & _kinds(art)
    feeds = quantized_feeds(model, 0)
    got = list(art.run(feeds).values())[0].astype(np.int64)
    assert np.abs(got - _ort(model, feeds)[0].astype(np.int64)).max() <= 1
