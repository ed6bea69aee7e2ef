"""Convolutions through the packed-GEMM micro-kernels (cuvil.targets.x86.gemm) against onnxruntime:
geometries that exercise every edge (positions not a multiple of the tile width, channels not a multiple
of the 6-row panel, both loop orders, groups, strides, dilations, asymmetric pads, 1-D and 3-D), fused
epilogues, and the step profiler."""
import re

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from cuvil import Pipeline
from cuvil.targets.x86.cpu import host_cpu
from cuvil.targets.x86.cpu import CpuDescription
from cuvil.targets.x86.gemm import matmul_tile, tile_cols
from cuvil.targets.x86.tuning import X86Tuning
from cuvil.testing.conv_models import conv_epilogue_model


def check(model, x, gemm_stages, cpu=None, tile=None):
    """Compiled (direct convolutions when ``tile`` is given: the register tile of every gemm step) vs
    onnxruntime, at 1 and 2 threads."""
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    art = Pipeline.from_onnx(model).optimize().compile(opt_level=3, cpu=cpu, winograd=tile is None)
    kinds = [s["kernel"] for s in art.manifest["steps"]]
    assert kinds.count("gemm") == gemm_stages, art.manifest["steps"]
    if tile is not None:
        assert {s["tile"] for s in art.manifest["steps"] if s["kernel"] == "gemm"} == {tile}
    m = art.model()
    y1 = m.run(x, num_threads=1)[0]
    y2 = m.run(x, num_threads=2)[0]
    np.testing.assert_array_equal(y1, y2)
    scale = max(float(np.abs(want).max()), 1.0)
    assert float(np.abs(y1 - want).max()) <= 1e-4 * scale
    return art


CASES = [
    # x shape, w shape, attrs
    ((1, 16, 10, 10), (24, 16, 3, 3), dict(pads=[1, 1, 1, 1])),                       # panel order, P=100
    ((1, 64, 3, 3), (70, 64, 3, 3), dict(pads=[1, 1, 1, 1])),                         # weights order (M > P)
    ((2, 8, 9, 11), (13, 8, 3, 3), dict(strides=[2, 2], pads=[1, 0, 2, 1])),         # N=2, odd sizes
    ((1, 12, 12, 12), (12, 4, 3, 3), dict(group=3, pads=[1, 1, 1, 1])),               # groups
    ((1, 8, 15, 15), (9, 8, 3, 3), dict(dilations=[2, 2], pads=[2, 2, 2, 2])),        # dilation
    ((1, 32, 16, 16), (40, 32, 1, 1), {}),                                            # 1x1 direct
    ((1, 32, 16, 16), (40, 32, 1, 1), dict(strides=[2, 2])),                          # 1x1 strided
    ((1, 3, 31, 31), (16, 3, 7, 7), dict(strides=[2, 2], pads=[3, 3, 3, 3])),         # stem-like, K=147
    ((1, 8, 40), (10, 8, 5), dict(pads=[2, 2])),                                      # 1-D
    ((1, 4, 5, 6, 7), (6, 4, 3, 3, 3), dict(pads=[1, 1, 1, 1, 1, 1])),                # 3-D
    ((1, 160, 6, 6), (8, 160, 3, 3), dict(pads=[1, 1, 1, 1])),                        # K=1440: k-blocks
    ((1, 160, 3, 3), (20, 160, 3, 3), dict(pads=[1, 1, 1, 1])),                       # k-blocks, weights order
    ((1, 24, 20, 20), (112, 6, 1, 1), dict(group=4)),                                 # K=6 (ShuffleNet), groups
    ((2, 5, 9, 9), (12, 5, 1, 1), {}),                                                # K=5, N=2, panel order
    ((1, 4, 3, 3), (40, 4, 1, 1), {}),                                                # K=4, weights order
    ((2, 1024, 14, 14), (16, 1024, 1, 1), {}),                                        # in place, two k-blocks
    ((1, 24, 14, 14), (40, 24, 1, 1), dict(pads=[1, 1, 1, 1])),                       # in place from a padded copy
]
# full panels across output rows (16- to 64-wide panels), packed run by run: strides 1-4, dilation
RUN_CASES = [
    ((1, 8, 26, 26), (16, 8, 3, 3), dict(pads=[1, 1, 1, 1])),
    ((1, 8, 50, 50), (16, 8, 3, 3), dict(strides=[2, 2], pads=[1, 1, 1, 1])),
    ((1, 4, 61, 61), (8, 4, 3, 3), dict(strides=[3, 3])),
    ((1, 4, 80, 83), (8, 4, 4, 4), dict(strides=[4, 4], pads=[0, 1, 0, 2])),
    ((1, 8, 30, 30), (9, 8, 3, 3), dict(dilations=[2, 2], pads=[2, 2, 2, 2])),
    ((1, 8, 5, 50, 50), (6, 8, 1, 3, 3), dict(strides=[1, 2, 2], pads=[0, 1, 1, 0, 1, 1])),   # 3-D, strided
]
# one convolution for each AVX-512 register tile (choose_tile below): 12x32, 8x48, 6x64
TILE_CASES = [((1, 16, 14, 14), (24, 16, 3, 3), dict(pads=[1, 1, 1, 1])),
              ((1, 16, 28, 28), (16, 16, 3, 3), dict(pads=[1, 1, 1, 1])),
              ((1, 16, 8, 8), (30, 16, 3, 3), dict(pads=[1, 1, 1, 1]))]
# one for each AVX-512 channel-lane tile: 48x7 (7x7 map, K = 576: two k-blocks), 64x6 (6x6), 32x7 (14x14,
# 1x1); then a 48x7 tile over 40 channels (a partial channel block) of a strided convolution, one over 100
# positions (a partial panel) and a 64x6 tile on 17-wide rows (the spilled epilogue's runs along rows)
CHANNEL_CASES = [((1, 64, 7, 7), (48, 64, 3, 3), dict(pads=[1, 1, 1, 1])),
                 ((1, 32, 6, 6), (64, 32, 3, 3), dict(pads=[1, 1, 1, 1])),
                 ((1, 256, 14, 14), (32, 256, 1, 1), {}),
                 ((1, 32, 14, 14), (40, 32, 3, 3), dict(strides=[2, 2], pads=[1, 1, 1, 1])),
                 ((1, 32, 10, 10), (45, 32, 3, 3), dict(pads=[1, 1, 1, 1])),
                 ((1, 32, 17, 17), (64, 32, 3, 3), dict(pads=[1, 1, 1, 1])),
                 ((1, 256, 4, 4), (32, 256, 1, 1), {}),          # 32x8: 16 positions, one panel each half
                 ((1, 256, 6, 6), (32, 256, 1, 1), {})]          # 32x8 over 36 positions: a partial last panel
CHANNEL_TILES = ["48x7c", "64x6c", "32x7c", "48x7c", "48x7c", "64x6c", "32x8c", "32x8c"]
CASES += RUN_CASES + TILE_CASES + CHANNEL_CASES


@pytest.mark.parametrize("xs,ws,attrs", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_conv_gemm_matches_onnxruntime(xs, ws, attrs):
    x = np.random.default_rng(1).standard_normal(xs).astype(np.float32)
    check(conv_epilogue_model(xs, ws, **attrs), x, gemm_stages=1)


@pytest.mark.parametrize("xs,ws,attrs", RUN_CASES, ids=[f"runs{i}" for i in range(len(RUN_CASES))])
def test_conv_gemm_avx2_panels(xs, ws, attrs):
    """The 16-wide AVX2 micro-kernels, whatever the host (every x86-64 host with AVX-512 runs them too)."""
    x = np.random.default_rng(1).standard_normal(xs).astype(np.float32)
    check(conv_epilogue_model(xs, ws, **attrs), x, gemm_stages=1, cpu="haswell")


# A last position panel that fills fewer of its tile's vectors runs a k-loop of only those (gemm.py, last_live):
# 13x13 maps on 8 x 48 (25 positions, 2 of 3 vectors) over three k-blocks, and read in place (1x1); a 10x10 map on
# 12 x 32 in weights order (200 channels > 100 positions; 4 positions, 1 of 2); 14x14 on 12 x 32. AVX2's 6 x 16
# tiles: the 10x10 and 14x14 maps (4 positions, 1 of 2).
PEEL_CASES = [((1, 80, 13, 13), (40, 80, 3, 3), dict(pads=[1, 1, 1, 1]), "8x48", None),
              ((1, 512, 13, 13), (40, 512, 1, 1), {}, "8x48", None),
              ((1, 8, 10, 10), (200, 8, 3, 3), dict(pads=[1, 1, 1, 1]), "12x32", "6x16"),
              ((1, 24, 14, 14), (20, 24, 3, 3), dict(pads=[1, 1, 1, 1], epilogue="residual"), "12x32", "6x16")]


@pytest.mark.parametrize("xs,ws,attrs,tile,avx2", PEEL_CASES, ids=[f"peel{i}" for i in range(len(PEEL_CASES))])
def test_last_panel_of_fewer_vectors(xs, ws, attrs, tile, avx2):
    from cuvil.targets.x86.gemm import tile_shapes
    rows, cols = (int(v) for v in tile.split("x"))
    p = xs[2] * xs[3]
    assert p > cols and 0 < -(-(p % cols) // 16) < cols // 16          # several panels, the last one short
    x = np.random.default_rng(1).standard_normal(xs).astype(np.float32)
    model = conv_epilogue_model(xs, ws, **attrs)
    check(model, x, gemm_stages=2 if attrs.get("epilogue") == "residual" else 1, tile=tile)
    if avx2 is not None:
        assert tile_shapes(256) == ((6, 16),) and 0 < -(-(p % 16) // 8) < 2
        check(model, x, gemm_stages=2 if attrs.get("epilogue") == "residual" else 1, cpu="haswell", tile=avx2)


def test_register_tile_choice():
    from cuvil.kernels.contraction import CHANNEL_FLOOR_K, CHANNEL_LANES, CHANNEL_MIN_K, channel_lanes, choose_tile
    from cuvil.targets.x86.gemm import tile_shapes
    from cuvil.targets.x86.tuning import DEFAULT_TUNING
    avx512 = tile_shapes(512)
    cost = DEFAULT_TUNING.channel_tile_cost
    want = [(12, 32, 16), (8, 48, 16), (6, 64, 16)]
    for (xs, ws, attrs), tile in zip(TILE_CASES, want):
        assert choose_tile(ws[0], xs[2] * xs[3], avx512, channel_tile_cost=cost) == tile
    for (xs, ws, attrs), tile in zip(CHANNEL_CASES, CHANNEL_TILES):
        out = [(n + sum(attrs.get("pads", [0] * 4)[d::2]) - k) // s + 1
               for d, (n, k, s) in enumerate(zip(xs[2:], ws[2:], attrs.get("strides", [1, 1])))]
        rows, cols = (int(v) for v in tile[:-1].split("x"))
        assert choose_tile(ws[0], out[0] * out[1], avx512, int(np.prod(ws[1:])), cost) == (rows, cols, CHANNEL_LANES)
    # a short reduction keeps position lanes: the transpose and weight re-reads are not amortised
    assert not channel_lanes(choose_tile(512, 49, avx512, 24, cost))
    assert not channel_lanes(choose_tile(512, 49, avx512, CHANNEL_FLOOR_K - 1, cost, min_k=1))
    # ... but from K = 32 they pay where position vectors leave lanes empty (49 positions in 64 lanes:
    # SqueezeNet's 27x27 and 13x13 Winograd GEMMs, K = 32 and 64), and not where they fill 88% of them (its
    # 13x13 1x1 layers, 169 positions at K = 48 / 64) or the Zen 5 layer of CHANNEL_MIN_K's comment
    assert choose_tile(128, 49, avx512, 32, cost) == (32, 7, CHANNEL_LANES)
    assert choose_tile(256, 49, avx512, 64, cost) == (32, 7, CHANNEL_LANES)
    assert not channel_lanes(choose_tile(192, 169, avx512, 48, cost))
    assert not channel_lanes(choose_tile(256, 169, avx512, 64, cost))
    assert not channel_lanes(choose_tile(192, 196, avx512, 64, cost))
    assert choose_tile(512, 49, avx512, channel_tile_cost=cost) == (32, 7, CHANNEL_LANES)   # 12x32 computes 64 of the 49 positions
    # 16 positions: a 12x32 tile would keep one live vector (a weight broadcast per FMA); 8-position channel lanes
    assert choose_tile(512, 16, avx512, channel_tile_cost=cost) == (32, 8, CHANNEL_LANES)
    assert choose_tile(512, 16, avx512, 24, cost) == (12, 32, 16)    # short K: position lanes
    assert choose_tile(512, 16, avx512, CHANNEL_FLOOR_K - 1, cost, min_k=1) == (12, 32, 16)
    assert choose_tile(512, 32, avx512, channel_tile_cost=cost) == (12, 32, 16)     # two live vectors: kept
    # K = 128 (DenseNet's growth layers, ResNet-50's 28x28 Winograd GEMMs) takes channel lanes in the lowering;
    # the algorithm choice prices such a GEMM as before (choose.CHOICE_CHANNEL_MIN_K: no Winograd switch, no
    # larger library)
    from cuvil.targets.x86.choose import CHOICE_CHANNEL_MIN_K
    assert CHANNEL_MIN_K == 128 < CHOICE_CHANNEL_MIN_K
    assert choose_tile(128, 49, avx512, 128, cost) == (32, 7, CHANNEL_LANES)
    assert not channel_lanes(choose_tile(128, 49, avx512, 128, cost, CHOICE_CHANNEL_MIN_K))
    assert tile_shapes(256) == ((6, 16),)


# (c, k, map) -> (float32 Winograd tile, bf16 Winograd tile), None: direct; the cost model's choices at 9012720,
# before the lowering took channel-lane tiles from K = 128, 32 x 8 tiles and one-live-vector panels (session 35):
# the choice still prices those GEMMs as it was fitted (choose.choice_tile), so none of these may move
FITTED_CHOICES = {(256, 32, 4): (2, None), (256, 64, 13): (2, 2), (256, 128, 7): (None, None),
                  (512, 512, 16): (2, 2), (512, 64, 13): (2, 2), (512, 256, 7): (2, None), (512, 128, 7): (None, None),
                  (1024, 256, 14): (2, 2), (128, 32, 56): (4, 2), (128, 32, 28): (2, 2), (128, 32, 14): (2, None),
                  (128, 32, 7): (None, None), (256, 256, 14): (2, 2), (512, 512, 7): (2, 2)}


def test_algorithm_choice_prices_the_fitted_tiles():
    from cuvil.targets.x86.choose import best_bf16_tile, best_tile
    from cuvil.targets.x86.gemm import tile_shapes
    from cuvil.targets.x86.tuning import DEFAULT_TUNING
    shapes = tile_shapes(512, DEFAULT_TUNING)
    got = {(c, k, s): (best_tile(c, k, s, s, shapes, DEFAULT_TUNING), best_bf16_tile(c, k, s, s, shapes, DEFAULT_TUNING))
           for c, k, s in FITTED_CHOICES}
    assert got == FITTED_CHOICES


def _host_bits():
    return host_cpu().vector_bits


avx512_host = pytest.mark.skipif(_host_bits() < 512, reason="channel-lane tiles are AVX-512's")


@avx512_host
@pytest.mark.parametrize("epilogue", ["residual", "sigmoid", None])
@pytest.mark.parametrize("case", [0, 3, 4, 5, 6, 7])
def test_channel_lane_tiles_with_each_epilogue(case, epilogue):
    """Channel-lane tiles (accumulators along channels) through the register epilogue with an operand at
    the output position (residual), the spilled tile (sigmoid) and no epilogue, on full, partial-channel and
    partial-panel tiles."""
    xs, ws, attrs = CHANNEL_CASES[case]
    x = np.random.default_rng(4).standard_normal(xs).astype(np.float32)
    check(conv_epilogue_model(xs, ws, epilogue=epilogue, **attrs), x, 2 if epilogue == "residual" else 1,
          tile=CHANNEL_TILES[case])


@avx512_host
@pytest.mark.parametrize("case", range(len(CHANNEL_CASES)))
def test_channel_lane_tile_kernels(case):
    xs, ws, attrs = CHANNEL_CASES[case]
    x = np.random.default_rng(5).standard_normal(xs).astype(np.float32)
    check(conv_epilogue_model(xs, ws, **attrs), x, 1, tile=CHANNEL_TILES[case])


def test_no_bias_and_no_epilogue():
    x = np.random.default_rng(2).standard_normal((1, 16, 9, 9)).astype(np.float32)
    check(conv_epilogue_model((1, 16, 9, 9), (20, 16, 3, 3), pads=[1, 1, 1, 1], bias=False, epilogue=None), x, 1)


def test_residual_of_two_convolutions_uses_two_micro_kernels():
    # Add(conv, conv2): one conv is stored first, the other keeps Add + Relu as its epilogue
    x = np.random.default_rng(3).standard_normal((1, 16, 12, 12)).astype(np.float32)
    check(conv_epilogue_model((1, 16, 12, 12), (18, 16, 3, 3), pads=[1, 1, 1, 1], epilogue="residual"), x, 2)


DEPTHWISE = [
    ((1, 8, 10, 10), (8, 1, 3, 3), dict(group=8, pads=[1, 1, 1, 1])),
    ((1, 12, 28, 28), (12, 1, 3, 3), dict(group=12, pads=[1, 1, 1, 1], strides=[2, 2])),
    ((2, 5, 9, 23), (5, 1, 3, 5), dict(group=5, pads=[1, 2, 0, 1], strides=[1, 2])),
    ((1, 8, 30, 30), (8, 1, 3, 3), dict(group=8, dilations=[2, 2])),
    ((1, 4, 7, 70), (4, 1, 5, 5), dict(group=4, pads=[2, 2, 2, 2])),     # rows wider than one register block
]


@pytest.mark.parametrize("xs,ws,attrs", DEPTHWISE, ids=[f"dw{i}" for i in range(len(DEPTHWISE))])
def test_depthwise_row_kernel_matches_onnxruntime(xs, ws, attrs):
    x = np.random.default_rng(4).standard_normal(xs).astype(np.float32)
    art = check(conv_epilogue_model(xs, ws, **attrs), x, 0)
    assert [s["kernel"] for s in art.manifest["steps"]].count("dwconv") == 1


def test_channel_multiplier_keeps_the_loop_kernel():
    # two output channels per group: neither a 6-row GEMM panel nor a depthwise window
    x = np.random.default_rng(4).standard_normal((1, 8, 10, 10)).astype(np.float32)
    art = check(conv_epilogue_model((1, 8, 10, 10), (16, 1, 3, 3), group=8, pads=[1, 1, 1, 1]), x, 0)
    assert "dwconv" not in [s["kernel"] for s in art.manifest["steps"]]


def test_gemm_with_constant_transposed_b():
    rng = np.random.default_rng(5)
    w = rng.standard_normal((30, 40)).astype(np.float32)
    g = helper.make_graph([helper.make_node("Gemm", ["x", "w"], ["y"], transB=1)], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 40])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [numpy_helper.from_array(w, "w")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    x = rng.standard_normal((3, 40)).astype(np.float32)
    art = Pipeline.from_onnx(m).compile()
    np.testing.assert_allclose(art.model().run(x)[0], x @ w.T, rtol=1e-5, atol=1e-5)
    # the packed copy (30 columns padded to the host's MatMul panel width) replaces the original
    cols = matmul_tile(host_cpu())[1]
    packed = -(-30 // cols) * cols * 40 * 4
    assert packed <= art.manifest["weights_bytes"] < packed + w.nbytes


def _matmul_model(a_shape, w, *, gemm=None, bias=None, epilogue=True):
    """x @ w (MatMul) or Gemm(x, w, c) with attributes ``gemm``; then + bias and a residual-free GELU-ish
    epilogue (Relu) unless ``epilogue`` is False."""
    inits = [numpy_helper.from_array(w, "w")]
    if gemm is None:
        nodes = [helper.make_node("MatMul", ["x", "w"], ["y"])]
    else:
        ins = ["x", "w"]
        if bias is not None:
            inits.append(numpy_helper.from_array(bias, "c"))
            ins.append("c")
        nodes = [helper.make_node("Gemm", ins, ["y"], **gemm)]
    out = "y"
    if epilogue:
        nodes.append(helper.make_node("Relu", ["y"], ["r"]))
        out = "r"
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(a_shape))],
                          [helper.make_tensor_value_info(out, TensorProto.FLOAT, None)], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("a_shape, k, m", [
    ((1, 7, 40), 40, 30),        # rows not a multiple of 6, columns not of the panel width
    ((2, 13, 64), 64, 16),       # several partial row tiles over a flattened batch
    ((5, 8), 8, 100),            # 2-D, many panels, a partial last panel
    ((3, 4, 6, 24), 24, 33),     # rank 4
    ((1, 1, 40), 40, 70),        # one row (a decode step's GEMV, a classifier at batch 1): the one-row tile
])
def test_matmul_with_constant_weights_uses_the_micro_kernel(a_shape, k, m):
    rng = np.random.default_rng(k + m)
    w = (rng.standard_normal((k, m)) / np.sqrt(k)).astype(np.float32)
    x = rng.standard_normal(a_shape).astype(np.float32)
    check(_matmul_model(a_shape, w), x, gemm_stages=1)


@pytest.mark.parametrize("gemm", [dict(transB=1), dict(alpha=0.5, beta=2.0), dict(transB=1, alpha=-1.5, beta=0.0)])
def test_gemm_with_constant_b_uses_the_micro_kernel(gemm):
    rng = np.random.default_rng(11)
    w = rng.standard_normal((40, 30) if gemm.get("transB") else (30, 40)).astype(np.float32)
    c = rng.standard_normal(40).astype(np.float32)
    x = rng.standard_normal((9, 30)).astype(np.float32)
    check(_matmul_model((9, 30), w, gemm=gemm, bias=c), x, gemm_stages=1)


def test_matmul_micro_kernel_with_symbolic_rows():
    """Rows = batch x sequence, both symbolic: one library, every shape of the profile, partial tiles."""
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((48, 20)) / 7).astype(np.float32)
    model = _matmul_model(("B", "S", 48), w)
    art = Pipeline.from_onnx(model).compile(shape_profiles={"B": (1, 2, 4), "S": (1, 5, 33)}, cache=False)
    generic = [s for s in art.manifest["steps"] if s.get("variant") == "generic"]
    assert [s["kernel"] for s in generic] == ["gemm"]
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    m = art.model()
    for b_, s_ in [(1, 1), (2, 5), (3, 7), (4, 33), (1, 12), (1, 13)]:   # 1 and 13 rows: one-row tiles
        x = rng.standard_normal((b_, s_, 48)).astype(np.float32)
        want = sess.run(None, {"x": x})[0]
        got = m.run(x)[0]
        assert got.shape == want.shape
        assert float(np.abs(got - want).max()) <= 1e-5 * max(1.0, float(np.abs(want).max()))


@pytest.mark.parametrize("tile", [(6, 64), (8, 48), (9, 48), (12, 32)])
def test_matmul_register_tiles_over_symbolic_rows(tile):
    """Each register tile X86Tuning.matmul_tile may name, in one library for S = 1..40: row counts that are
    and are not multiples of its rows (partial and one-row tiles), a partial last panel (100 columns); the
    epilogue (bias + Relu) fused. Runs on any x86 host (an AVX2 one spills the wide tiles, still exact)."""
    rng = np.random.default_rng(tile[0] * tile[1])
    w = (rng.standard_normal((72, 100)) / 8).astype(np.float32)
    model = _matmul_model(("S", 72), w, gemm=dict(), bias=rng.standard_normal(100).astype(np.float32))
    art = Pipeline.from_onnx(model).compile(shape_profiles={"S": (1, 16, 40)}, cache=False,
                                            tuning=X86Tuning(matmul_tile=tile))
    assert [s["kernel"] for s in art.manifest["steps"] if s.get("variant") == "generic"] == ["gemm"]
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    m = art.model()
    for rows in (1, 7, 8, 9, 16, 17, 40):
        x = rng.standard_normal((rows, 72)).astype(np.float32)
        want = sess.run(None, {"x": x})[0]
        for t in (1, 2):
            got = m.run(x, num_threads=t)[0]
            assert float(np.abs(got - want).max()) <= 1e-5 * max(1.0, float(np.abs(want).max())), (tile, rows, t)


def test_matmul_tile_is_chosen_per_cpu():
    """8 x 48 on Intel's AVX-512 cores and Zen 4 (measured there, bench/matmul_tiles.py), MR x the panel width
    elsewhere, the tuning's tile wherever it is set; the choice is in the cache key through the tuning or
    the CPU identity."""
    def cpu(vendor, features, family=None):
        return CpuDescription("x", frozenset(features), True, vendor=vendor, family=family)
    avx512 = {"avx512f", "avx2", "fma"}
    assert matmul_tile(cpu("GenuineIntel", avx512)) == (8, 48)
    assert matmul_tile(cpu("AuthenticAMD", avx512, family=26)) == (6, 64)    # Zen 5
    assert matmul_tile(cpu("AuthenticAMD", avx512, family=25)) == (8, 48)    # Zen 4 (measured there)
    assert matmul_tile(cpu("AuthenticAMD", {"avx2", "fma"}, family=25)) == (6, tile_cols(256))   # Zen 3
    assert matmul_tile(CpuDescription("znver4", frozenset(avx512), False)) == (8, 48)       # named: no cpuid
    assert matmul_tile(CpuDescription("znver5", frozenset(avx512), False)) == (6, 64)
    assert matmul_tile(CpuDescription("sapphirerapids", frozenset(avx512), False)) == (8, 48)
    assert matmul_tile(cpu("GenuineIntel", {"avx2", "fma"})) == (6, tile_cols(256))
    assert matmul_tile(cpu("AuthenticAMD", avx512), X86Tuning(matmul_tile=(9, 48))) == (9, 48)
    with pytest.raises(ValueError):
        X86Tuning(matmul_tile=(0, 48))


def test_profile_times_every_step():
    x = np.random.default_rng(6).standard_normal((1, 16, 12, 12)).astype(np.float32)
    art = Pipeline.from_onnx(conv_epilogue_model((1, 16, 12, 12), (18, 16, 3, 3), pads=[1, 1, 1, 1])).compile(winograd=False)
    m = art.model()
    t = m.profile(x, runs=3, num_threads=1)
    steps = art.manifest["steps"]
    assert len(t) == len(steps) and all(v >= 0 for v in t) and sum(t) > 0
    gemm = [s for s in steps if s["kernel"] == "gemm"]
    assert gemm and gemm[0]["flops"] == 2 * 18 * 16 * 9 * 12 * 12 and gemm[0]["op"] == "Relu"  # the stored op: Conv + Relu fused
    # profiling stops afterwards; runs still give the same answer
    np.testing.assert_array_equal(m.run(x)[0], m.run(x)[0])
    # one run, no warm-up (on a fresh model: the session is made first, outside the timed run)
    cold = art.model().profile(x, runs=1, num_threads=1, warm_up=False)
    assert len(cold) == len(steps) and all(v >= 0 for v in cold) and sum(cold) > 0


def _concat_model(shapes, axis, chain=False):
    ins = [helper.make_tensor_value_info(f"x{k}", TensorProto.FLOAT, list(s)) for k, s in enumerate(shapes)]
    nodes, cur = [], "x0"
    if chain:   # Concat(Concat(Concat(x0, x1), x2), ...): each level inlined into the next
        for k in range(1, len(shapes)):
            nodes.append(helper.make_node("Concat", [cur, f"x{k}"], [f"c{k}"], axis=axis))
            cur = f"c{k}"
    else:
        nodes.append(helper.make_node("Concat", [f"x{k}" for k in range(len(shapes))], ["c"], axis=axis))
        cur = "c"
    nodes.append(helper.make_node("Relu", [cur], ["y"]))
    g = helper.make_graph(nodes, "g", ins, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("axis", [0, 1, 2, 3])
def test_stored_concat_is_split_into_slices(axis):
    rng = np.random.default_rng(7)
    base = [2, 3, 4, 5]
    shapes = []
    for k in range(4):
        s = list(base)
        s[axis] = k + 1
        shapes.append(s)
    xs = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    art = Pipeline.from_onnx(_concat_model(shapes, axis)).compile()
    # one stage per piece, each writing its slice, run as one step (pieces of rows, axis 3: a step each)
    pieces = ["y_0", "y_1", "y_2", "y_3"]
    assert [s.get("stages", s["stage"]) for s in art.manifest["steps"]] == (pieces if axis == 3 else [pieces])
    np.testing.assert_array_equal(art.model().run(*xs, num_threads=2)[0], np.maximum(np.concatenate(xs, axis), 0))


@pytest.mark.parametrize("threads", [1, 2, 3, 5])
def test_concat_pieces_in_one_step_cut_anywhere(threads):
    # DenseNet's pattern: Relu(Concat(...) * scale + shift) over pieces of 8..56 channels, one step whose
    # chunks (rows of 28) begin and end inside pieces; every row must be written once, by its own piece
    rng = np.random.default_rng(11)
    chans = [8, 24, 56, 16, 8]
    shapes = [[1, c, 28, 28] for c in chans]
    xs = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    art = Pipeline.from_onnx(_concat_model(shapes, 1)).compile(cache=False)
    steps = art.manifest["steps"]
    assert len(steps) == 1 and len(steps[0]["stages"]) == len(chans) and steps[0]["shape"] == [1, sum(chans), 28, 28]
    with art.model() as m:
        for _ in range(5):
            np.testing.assert_array_equal(m.run(*xs, num_threads=threads)[0], np.maximum(np.concatenate(xs, 1), 0))


def test_concat_pieces_with_a_symbolic_batch():
    # the generic steps (symbolic extents) run a step per piece, the opt-point steps (N = 2) one for all;
    # both agree with numpy at the opt point and off it
    ins = [helper.make_tensor_value_info(f"x{k}", TensorProto.FLOAT, ["N", c, 6, 6]) for k, c in enumerate((8, 16, 5))]
    g = helper.make_graph([helper.make_node("Concat", ["x0", "x1", "x2"], ["c"], axis=1),
                           helper.make_node("Relu", ["c"], ["y"])], "g", ins,
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    art = Pipeline.from_onnx(m).compile(shape_profiles={"N": (1, 2, 8)}, cache=False)
    steps = art.manifest["steps"]
    generic = [s for s in steps if s.get("variant") == "generic"]
    opt = [s for s in steps if s.get("variant") == "opt"]
    assert len(generic) == 3 and "stages" not in generic[0]
    assert len(opt) == 1 and len(opt[0]["stages"]) == 3
    rng = np.random.default_rng(13)
    with art.model() as mod:
        for n in (2, 1, 7):
            xs = [rng.standard_normal((n, c, 6, 6)).astype(np.float32) for c in (8, 16, 5)]
            for threads in (1, 2, 8):
                np.testing.assert_array_equal(mod.run(*xs, num_threads=threads)[0],
                                              np.maximum(np.concatenate(xs, 1), 0))


def test_long_chain_of_inlined_concats_stays_small():
    # 24 nested concatenations (DenseNet-like growth): the expression must grow linearly, not double per level
    rng = np.random.default_rng(8)
    shapes = [[1, 2, 3, 3]] * 25
    xs = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    art = Pipeline.from_onnx(_concat_model(shapes, 1, chain=True)).compile(cache=False)
    np.testing.assert_array_equal(art.model().run(*xs)[0], np.maximum(np.concatenate(xs, 1), 0))


def test_concat_chain_split_recursively_and_under_reshape():
    # Concat(Concat(x0, x1), x2) stored: three slices; Concat under a Reshape that keeps the axis elsewhere
    rng = np.random.default_rng(9)
    shapes = [[1, 2, 3, 4], [1, 3, 3, 4], [1, 1, 3, 4]]
    xs = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    art = Pipeline.from_onnx(_concat_model(shapes, 1, chain=True)).compile(cache=False)
    assert [len(s.get("stages", [s["stage"]])) for s in art.manifest["steps"]] == [3]
    np.testing.assert_array_equal(art.model().run(*xs)[0], np.maximum(np.concatenate(xs, 1), 0))
    ins = [helper.make_tensor_value_info(f"x{k}", TensorProto.FLOAT, [2, 3, 4]) for k in range(2)]
    g = helper.make_graph([helper.make_node("Concat", ["x0", "x1"], ["c"], axis=2),
                           helper.make_node("Reshape", ["c", "s"], ["y"])], "g", ins,
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                          [numpy_helper.from_array(np.array([6, 8], np.int64), "s")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    xs = [rng.standard_normal((2, 3, 4)).astype(np.float32) for _ in range(2)]
    art = Pipeline.from_onnx(m).compile(cache=False)
    np.testing.assert_array_equal(art.model().run(*xs)[0], np.concatenate(xs, 2).reshape(6, 8))


@pytest.mark.parametrize("xs,kern,strides,pads", [
    ((1, 8, 13, 13), [3, 3], [1, 1], [1, 1, 1, 1]),
    ((2, 4, 55, 55), [3, 3], [2, 2], [0, 0, 0, 0]),
    ((1, 3, 9, 40), [2, 3], [1, 2], [0, 1, 1, 1]),
    ((1, 8, 13, 13), [3, 3], [2, 2], [1, 1, 1, 1]),
    ((1, 4, 112, 112), [3, 3], [2, 2], [1, 1, 1, 1]),    # ResNet's stem pool
])
def test_max_pool_row_kernel(xs, kern, strides, pads):
    """A 2-D max pool reads its input unpadded: the row kernel's masked loads read the padding as -inf (no
    padded copy); exact against onnxruntime."""
    g = helper.make_graph([helper.make_node("MaxPool", ["x"], ["y"], kernel_shape=kern, strides=strides, pads=pads)],
                          "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(xs))],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    x = np.random.default_rng(10).standard_normal(xs).astype(np.float32)
    art = Pipeline.from_onnx(m).compile(cache=False)
    assert [s["kernel"] for s in art.manifest["steps"]] == ["maxpool"]
    model = art.model()
    want = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_array_equal(model.run(x, num_threads=2)[0], want)
    # NaN: ONNX leaves it unspecified (onnx.reference's answer depends on where in the window the NaN sits);
    # Cuvil skips NaN like numpy's fmax, so only an all-NaN window gives NaN
    x.reshape(-1)[::37] = np.nan
    r0, c0 = strides[0] - pads[0], strides[1] - pads[1]   # the window of output (1, 1), inside the input
    x[0, 0, r0:r0 + kern[0], c0:c0 + kern[1]] = np.nan
    xp = np.pad(x, [(0, 0), (0, 0), (pads[0], pads[2]), (pads[1], pads[3])], constant_values=-np.inf)
    win = np.lib.stride_tricks.sliding_window_view(xp, kern, axis=(2, 3))[:, :, ::strides[0], ::strides[1]]
    oh, ow = want.shape[2:]
    expect = np.fmax.reduce(np.fmax.reduce(win[:, :, :oh, :ow], axis=-1), axis=-1)
    got = model.run(x, num_threads=1)[0]
    assert np.isnan(got[0, 0, 1, 1])
    np.testing.assert_array_equal(got, expect)


@pytest.mark.parametrize("attrs", [dict(kernel_shape=[3, 3], strides=[2, 2], pads=[0, 0, 0, 0], ceil_mode=1),
                                   dict(kernel_shape=[3, 2], strides=[1, 2], pads=[2, 0, 1, 1], dilations=[2, 1],
                                        ceil_mode=1)])
def test_max_pool_row_kernel_ceil_mode_and_dilation(attrs):
    """Ceil-mode windows overhanging the input's end and dilated windows: the masks read outside as -inf."""
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["r"]), helper.make_node("MaxPool", ["r"], ["y"], **attrs)],
                          "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 5, 20, 24])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    x = np.random.default_rng(12).standard_normal((1, 5, 20, 24)).astype(np.float32)
    art = Pipeline.from_onnx(m).compile(cache=False)
    assert "maxpool" in [s["kernel"] for s in art.manifest["steps"]]
    assert "pad" not in [s["kernel"] for s in art.manifest["steps"]]
    want = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    for threads in (1, 2):
        np.testing.assert_array_equal(art.model().run(x, num_threads=threads)[0], want)


@pytest.mark.parametrize("op,xs,attrs", [
    ("AveragePool", (1, 2, 5, 6, 7), dict(kernel_shape=[3, 3, 3], pads=[1, 0, 1, 1, 2, 1])),   # 3-D: padded copy
    ("MaxPool", (1, 5, 20), dict(kernel_shape=[3], pads=[2, 1])),                    # 1-D
    ("MaxPool", (1, 2, 5, 6, 7), dict(kernel_shape=[3, 3, 3], pads=[1, 0, 1, 1, 2, 1])),   # 3-D
])
def test_padded_copy_kernel(op, xs, attrs):
    """Padded inputs of windows are written row by row (fill, interior, fill): exact against onnxruntime."""
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["r"]), helper.make_node(op, ["r"], ["y"], **attrs)],
                          "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(xs))],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    x = np.random.default_rng(11).standard_normal(xs).astype(np.float32)
    art = Pipeline.from_onnx(m).compile(cache=False)
    assert "pad" in [s["kernel"] for s in art.manifest["steps"]]
    want = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    for threads in (1, 2):
        np.testing.assert_allclose(art.model().run(x, num_threads=threads)[0], want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("xs,attrs", [
    ((2, 4, 11, 12), dict(kernel_shape=[3, 3], pads=[1, 2, 0, 1])),                      # asymmetric, N=2
    ((1, 24, 56, 56), dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])),     # ShuffleNet's
    ((1, 5, 14, 15), dict(kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1)),            # overhang past the input
    ((1, 7, 16, 16), dict(kernel_shape=[2, 2], strides=[2, 2])),                         # DenseNet's: a constant count
    ((1, 3, 9, 40), dict(kernel_shape=[5, 3], strides=[1, 1], pads=[2, 0, 2, 2])),       # stride 1, long rows
])
def test_average_pool_row_kernel(xs, attrs):
    """2-D float32 average pools (pads not counted) run as a depthwise window of ones, read unpadded,
    divided by each window's count inside the input: against onnxruntime at 1 and 2 threads."""
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["r"]), helper.make_node("AveragePool", ["r"], ["y"], **attrs)],
                          "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(xs))],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 19)])
    x = np.random.default_rng(12).standard_normal(xs).astype(np.float32)
    art = Pipeline.from_onnx(m).compile(cache=False)
    kinds = [s["kernel"] for s in art.manifest["steps"]]
    assert "dwconv" in kinds and "pad" not in kinds, kinds
    want = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    for threads in (1, 2):
        np.testing.assert_allclose(art.model().run(x, num_threads=threads)[0], want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("tail", ["affine_clip_residual", "sigmoid"])
def test_register_epilogue_and_its_fallback(tail):
    """Full tiles of an epilogue of per-channel and same-position operands run on the accumulators (bias,
    per-channel scale, residual input, Clip); other epilogues (Sigmoid: a libm call) spill the tile. Both
    with partial tiles (40 channels, 26x26 positions) and 1 vs 2 threads bit-identical (check)."""
    rng = np.random.default_rng(12)
    w = (rng.standard_normal((40, 16, 3, 3)) / 12).astype(np.float32)
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(rng.standard_normal(40).astype(np.float32), "b"),
             numpy_helper.from_array(rng.standard_normal((40, 1, 1)).astype(np.float32), "s"),
             numpy_helper.from_array(np.float32(0.0), "lo"), numpy_helper.from_array(np.float32(6.0), "hi")]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1])]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, 26, 26])]
    if tail == "sigmoid":
        nodes.append(helper.make_node("Sigmoid", ["c"], ["y"]))
    else:
        inputs.append(helper.make_tensor_value_info("r", TensorProto.FLOAT, [1, 40, 26, 26]))
        nodes += [helper.make_node("Mul", ["c", "s"], ["cs"]), helper.make_node("Add", ["cs", "r"], ["a"]),
                  helper.make_node("Clip", ["a", "lo", "hi"], ["y"])]
    g = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    feeds = {"x": rng.standard_normal((1, 16, 26, 26)).astype(np.float32)}
    if tail != "sigmoid":
        feeds["r"] = rng.standard_normal((1, 40, 26, 26)).astype(np.float32)
    want = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    art = Pipeline.from_onnx(m).optimize().compile(cache=False)
    assert [s["kernel"] for s in art.manifest["steps"]].count("gemm") == 1
    model = art.model()
    y1, y2 = model.run(**feeds, num_threads=1)[0], model.run(**feeds, num_threads=2)[0]
    np.testing.assert_array_equal(y1, y2)
    np.testing.assert_allclose(y1, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cpu", [None, "haswell"])
def test_winograd_reads_nothing_past_the_input(cpu):
    """NaNs right before and right after the caller's input must not reach the outputs: the Winograd input
    transform reads the unpadded input, and its masked-off lanes (the padding) lie outside it. With
    cpu="haswell" LLVM made one part of those masked loads a plain load (NaN outputs on a 26 x 26 map, a
    segfault against an unmapped page); the tile rows at the buffer's ends now load lane by lane."""
    model = conv_epilogue_model((1, 8, 26, 26), (16, 8, 3, 3), pads=[1, 1, 1, 1])
    x = np.random.default_rng(1).standard_normal((1, 8, 26, 26)).astype(np.float32)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    art = Pipeline.from_onnx(model).optimize().compile(opt_level=3, cpu=cpu)
    assert any(s["kernel"] == "winograd_in" for s in art.manifest["steps"]), art.manifest["steps"]   # the vector kernel
    big = np.full(x.size + 8192, np.nan, dtype=np.float32)
    xv = big[4096:4096 + x.size].reshape(x.shape)
    xv[...] = x
    y = art.model().run(xv)[0]
    assert np.isfinite(y).all()
    assert float(np.abs(y - want).max()) <= 1e-4 * max(float(np.abs(want).max()), 1.0)


def _ffn_block(hidden: int, ffn: int, also_read_f: bool = False):
    """A BERT layer's dense half over ``x[B, S, hidden]``: ``f = x @ w1 + b1``, GELU as torch writes it
    (``(f * 0.5) * (Erf(f * 2**-0.5) + 1)``: two uses of f that join), ``@ w2 + b2``, the residual and a
    LayerNormalization. ``also_read_f``: f is also added to the output's first columns through a Slice (a
    use that never joins the GELU's)."""
    rng = np.random.default_rng(hidden + ffn)
    c = lambda name, v: numpy_helper.from_array(np.asarray(v, dtype=np.float32), name)
    inits = [c("w1", rng.standard_normal((hidden, ffn)) / np.sqrt(hidden)), c("b1", 0.1 * rng.standard_normal(ffn)),
             c("w2", rng.standard_normal((ffn, hidden)) / np.sqrt(ffn)), c("b2", 0.1 * rng.standard_normal(hidden)),
             c("half", 0.5), c("is2", 2 ** -0.5), c("one", 1.0),
             c("g", 1 + 0.1 * rng.standard_normal(hidden)), c("bt", 0.1 * rng.standard_normal(hidden))]
    n = helper.make_node
    nodes = [n("MatMul", ["x", "w1"], ["m1"]), n("Add", ["m1", "b1"], ["f"]),
             n("Mul", ["f", "half"], ["fh"]), n("Mul", ["f", "is2"], ["fs"]), n("Erf", ["fs"], ["e"]),
             n("Add", ["e", "one"], ["e1"]), n("Mul", ["fh", "e1"], ["gelu"]),
             n("MatMul", ["gelu", "w2"], ["m2"]), n("Add", ["m2", "b2"], ["d"]), n("Add", ["x", "d"], ["r"]),
             n("LayerNormalization", ["r", "g", "bt"], ["y0"], axis=-1, epsilon=1e-12)]
    if also_read_f:
        inits += [numpy_helper.from_array(np.array(v, np.int64), k) for k, v in
                  (("st", [0]), ("en", [hidden]), ("ax", [2]))]
        nodes += [n("Slice", ["f", "st", "en", "ax"], ["fcut"]), n("Add", ["y0", "fcut"], ["y"])]
    else:
        nodes.append(n("Identity", ["y0"], ["y"]))
    g = helper.make_graph(nodes, "ffn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "S", hidden])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", "S", hidden])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("also_read_f", [False, True])
def test_dense_block_with_gelu_epilogue_over_symbolic_rows(also_read_f):
    """One library for B = 1..4, S = 1..40 (rows B x S, not a multiple of the 6-row tile): the GELU's two
    uses of the product join, so it is the product's epilogue (one gemm step computes f and the GELU);
    the second product carries the bias and the residual, and the LayerNorm, stored in the arena, reads
    it. When f is also read elsewhere it is stored once instead (two gemm steps, never three)."""
    model = _ffn_block(40, 72, also_read_f)
    art = Pipeline.from_onnx(model).optimize().compile(shape_profiles={"B": (1, 2, 4), "S": (1, 16, 40)}, cache=False)
    generic = [s for s in art.manifest["steps"] if s.get("variant") == "generic"]
    gemms = [s["stage"] for s in generic if s["kernel"] == "gemm"]
    assert len(gemms) == 2, generic
    if not also_read_f:
        assert not any(s["kernel"] == "loop" and s["op"] in ("Mul", "Erf", "Add") for s in generic), generic
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    m = art.model()
    rng = np.random.default_rng(5)
    for b_, s_ in [(1, 1), (1, 7), (3, 5), (2, 37), (4, 40), (1, 16)]:
        x = rng.standard_normal((b_, s_, 40)).astype(np.float32)
        want = sess.run(None, {"x": x})[0]
        y1, y2 = m.run(x, num_threads=1)[0], m.run(x, num_threads=2)[0]
        np.testing.assert_array_equal(y1, y2)
        assert float(np.abs(y1 - want).max()) <= 1e-5 * max(1.0, float(np.abs(want).max())), (b_, s_)


@pytest.mark.parametrize("rows", ["static", "symbolic"])
def test_single_row_product_splits_over_threads_bit_identically(rows):
    """A decode step's one-row product (1 x 256 @ 256 x 1000: 21 panels of 48 columns, or 16 of 64) is cut by
    weight panels over the threads, each thread streaming its own panels with the one-row tile: every column's
    sum runs in the same order whatever the thread count, so 1 and 2 threads give the same bits."""
    rng = np.random.default_rng(20)
    w = (rng.standard_normal((256, 1000)) / 16).astype(np.float32)
    shape = (1, 1, 256) if rows == "static" else ("B", 1, 256)
    model = _matmul_model(shape, w, epilogue=False)
    art = Pipeline.from_onnx(model).compile(cache=False, **({} if rows == "static" else
                                                            {"shape_profiles": {"B": (1, 1, 4)}}))
    assert "gemm" in [s["kernel"] for s in art.manifest["steps"]]
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    m = art.model()
    x = rng.standard_normal((1, 1, 256)).astype(np.float32)
    one, two = m.run(x, num_threads=1)[0], m.run(x, num_threads=2)[0]
    assert one.tobytes() == two.tobytes()
    want = sess.run(None, {"x": x})[0]
    assert float(np.abs(one - want).max()) <= 1e-5 * max(1.0, float(np.abs(want).max()))


@pytest.mark.parametrize("k, unroll", [(40, 4), (42, 4), (64, 8)])
def test_matmul_k_loop_unrolled_gives_the_same_bits(monkeypatch, k, unroll):
    """matmul.MATMUL_UNROLL_K (a knob of bench/knobs_ab.py, 1 by default): k steps a trip of the float32 loop,
    the same fma chain in the same order, so the same bits; where it does not divide K (42) the loop stays as it
    is."""
    from cuvil.targets.x86 import matmul
    rng = np.random.default_rng(k)
    w = (rng.standard_normal((k, 70)) / np.sqrt(k)).astype(np.float32)
    x = rng.standard_normal((1, 19, k)).astype(np.float32)
    p = Pipeline.from_onnx(_matmul_model((1, 19, k), w)).optimize()
    art0 = p.compile("x86_64-linux-gnu", cache=False)
    base = art0.run(x)[0]
    monkeypatch.setattr(matmul, "MATMUL_UNROLL_K", unroll)
    art = p.compile("x86_64-linux-gnu", cache=False)
    assert np.array_equal(art.run(x)[0], base)
    assert np.abs(base - np.maximum(x @ w, 0)).max() <= 1e-5 * k
    same_code = open(art0.path, "rb").read() == open(art.path, "rb").read()    # reproducible builds
    assert same_code is (k % unroll != 0)


@pytest.mark.parametrize("dt", ["float32", "float16"])
@pytest.mark.parametrize("tail", ["Greater", "Cast"])
def test_product_with_a_non_float_consumer_fused(dt, tail):
    """A MatMul whose only reader is a comparison or an integer Cast: the consumer is fused into the GEMM
    stage's spilled-tile epilogue, which stored its i1 / i32 values into the float32 tile and did not compile
    ("cannot store i1 to float*"; float16 models hit it once their products took the GEMM kernels)."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper
    from cuvil import Pipeline
    npdt = np.dtype(dt)
    et = TensorProto.FLOAT if dt == "float32" else TensorProto.FLOAT16
    rng = np.random.default_rng(3)
    w = rng.standard_normal((32, 40)).astype(npdt)
    inits = [numpy_helper.from_array(w, "w")]
    if tail == "Greater":
        nodes = [helper.make_node("Greater", ["p", "z"], ["y"])]
        inits.append(numpy_helper.from_array(np.zeros((), npdt), "z"))
        out_t, ref = TensorProto.BOOL, lambda p: p > 0
    else:
        nodes = [helper.make_node("Cast", ["p"], ["y"], to=TensorProto.INT32)]
        out_t, ref = TensorProto.INT32, lambda p: p.astype(np.int32)
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["p"])] + nodes, "g",
                          [helper.make_tensor_value_info("x", et, ["N", 32])], [helper.make_tensor_value_info("y", out_t, ["N", 40])],
                          inits)
    art = Pipeline.from_onnx(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])).optimize().compile(
        shape_profiles={"N": (1, 4, 16)})
    assert any(s.get("kernel") == "gemm" for s in art.manifest["steps"]), art.manifest["steps"]
    x = rng.standard_normal((7, 32)).astype(npdt)
    p = (x.astype(np.float64) @ w.astype(np.float64)).astype(npdt)
    y = art.model().run(x)[0]
    near = np.abs(p.astype(np.float64)) < 1e-3 * np.abs(p).max()     # a float32 sum may round across 0 there
    assert np.array_equal(y[~near], ref(p)[~near])


@pytest.mark.parametrize("tile", [(6, 64), (8, 48)])
def test_remainder_row_tiles_give_each_row_its_full_tile_bits(tile):
    """The last row tile runs a k-loop of exactly the rows left over (1..MR-1, read from the run-time row
    count; a static count has its one remainder), its sums spilled for one shared epilogue: every row's
    output is bit for bit what it is inside a full tile (same k order, bias + Relu exact either way), at
    every row count, static or symbolic, on 1 and 2 threads."""
    rng = np.random.default_rng(tile[0])
    w = (rng.standard_normal((72, 100)) / 8).astype(np.float32)
    bias = rng.standard_normal(100).astype(np.float32)
    x = rng.standard_normal((48, 72)).astype(np.float32)
    sym = _matmul_model(("S", 72), w, gemm=dict(), bias=bias, epilogue=True)
    # opt 24: a multiple of 6 and 8, so the 48-row reference (run as two opt-point slices of 24 rows) has whole tiles
    art = Pipeline.from_onnx(sym).compile(shape_profiles={"S": (1, 24, 48)}, cache=False,
                                          tuning=X86Tuning(matmul_tile=tile))
    m = art.model()
    full = m.run(x, num_threads=1)[0]
    want = ort.InferenceSession(sym.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert float(np.abs(full - want).max()) <= 1e-5 * max(1.0, float(np.abs(want).max()))
    for rows in range(1, 2 * tile[0] + 1):
        for t in (1, 2):
            np.testing.assert_array_equal(m.run(x[:rows], num_threads=t)[0], full[:rows], err_msg=f"{tile} {rows} {t}")
    for rows in (tile[0] + 1, tile[0] + 2, 3 * tile[0] - 1, tile[0] - 1):   # static: remainders 1, 2, MR - 1; < MR
        fixed = Pipeline.from_onnx(_matmul_model((rows, 72), w, gemm=dict(), bias=bias, epilogue=True)).compile(
            cache=False, tuning=X86Tuning(matmul_tile=tile))
        for t in (1, 2):
            np.testing.assert_array_equal(fixed.model().run(x[:rows], num_threads=t)[0], full[:rows])


def test_tile_row_counts():
    """The row counts a row tile can have: every one up to MR over a symbolic count, the full tiles and the one
    remainder over a static count, one tile of exactly the rows when there are at most MR."""
    from cuvil.ir.dim import SymExpr
    from cuvil.targets.x86.matmul import tile_row_counts
    assert tile_row_counts(SymExpr.symbol("S"), 6) == [6, 1, 2, 3, 4, 5]
    assert tile_row_counts(32, 6) == [6, 2] and tile_row_counts(32, 8) == [8]
    assert tile_row_counts(7, 6) == [6, 1] and tile_row_counts(6, 6) == [6] and tile_row_counts(3, 6) == [3]
    assert tile_row_counts(1, 8) == [1]


@pytest.mark.parametrize("rows, cases, loops", [("S", [1, 2, 3, 4, 5], 5), (14, [2], 2), (13, [1], 2), (12, [], 1),
                                                (4, [], 1)])
def test_remainder_row_tiles_are_k_loops_of_their_own(rows, cases, loops):
    """The kernel's LLVM IR (before optimisation, as process replay captures it): the last row tile switches on
    the run-time row count (every count below MR = 6 for a symbolic count, the one remainder for a static one):
    one row to its own tile, 2..5 rows to sub-tiles of 4, 2 and 1 rows; the k-loops: the full tile's, the one-row
    tile's, one per power of two (symbolic: 1 + 1 + 3); a count of whole tiles or of at most MR rows needs none."""
    from cuvil.testing.replay import _capture
    rng = np.random.default_rng(5)
    w = (rng.standard_normal((64, 128)) / 8).astype(np.float32)
    shape = ("S", 64) if rows == "S" else (rows, 64)
    p = Pipeline.from_onnx(_matmul_model(shape, w, gemm=dict(), bias=rng.standard_normal(128).astype(np.float32)))
    kw = {"shape_profiles": {"S": (1, 6, 40)}} if rows == "S" else {}
    _, ir = _capture(p, "x86", target="x86_64-linux-gnu", cpu="skylake-avx512", tuning=X86Tuning(matmul_tile=(6, 64)), **kw)
    kernel = ir[ir.index("define "):]
    kernel = kernel[:kernel.index("\n}\n")]                       # the first kernel: the product's
    switch = re.search(r'switch i64 %"?[.\w]+"?, label %"rows_full" \[([^\]]*)\]', kernel)
    got = {} if switch is None else {int(v): t for v, t in re.findall(r'i64 (\d+), label %"([\w.]+)"', switch.group(1))}
    assert sorted(got) == cases, got
    assert all(t == ("rows_1" if v == 1 else "rows_partial") for v, t in got.items()), got
    assert len(re.findall(r"^k(\.\d+)?:", kernel, re.M)) == loops
