"""Winograd convolution (rules/winograd.rule, cuvil.ir.ops.winograd, targets/x86/winograd.py): the proof
obligation is real (a wrong matrix is refuted), the reference and the compiled kernels agree with
onnxruntime's direct convolution, the cost model picks per layer, and ``winograd=False`` opts out.

Tolerance: Winograd reassociates and scales sums (F(4x4) multiplies by up to 8 and divides by 24), so
results are not the direct convolution's rounding; measured normwise errors are 1e-6 to 4e-6 for F(4x4)
and below 1e-6 for F(2x2) (bench/winograd_layers.py), checked here at 2e-5."""
from fractions import Fraction
from unittest import mock

import numpy as np
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

from cuvil import Pipeline
from cuvil.dsl.parser import load_rules
from cuvil.ir.ops import winograd as W
from cuvil.rewrite_rules.prove import prove_rule
from cuvil.rewrite_rules.verdicts import builtin_rules_dir
from cuvil.targets.x86 import choose
from cuvil.targets.x86.gemm import tile_shapes

TOL = 2e-5


def conv_model(c, k, h, w, pads, bias=True, residual=False, batch=1):
    rng = np.random.default_rng(c * 1000 + k * 10 + h)
    inits = [numpy_helper.from_array((rng.standard_normal((k, c, 3, 3)) / np.sqrt(9 * c)).astype(np.float32), "w")]
    ins = ["x", "w"]
    if bias:
        inits.append(numpy_helper.from_array(rng.standard_normal(k).astype(np.float32) * 0.1, "b"))
        ins.append("b")
    nodes = [helper.make_node("Conv", ins, ["c"], pads=pads, kernel_shape=[3, 3])]
    oh, ow = h + pads[0] + pads[2] - 2, w + pads[1] + pads[3] - 2
    inputs = [helper.make_tensor_value_info("x", 1, [batch, c, h, w])]
    if residual:
        inputs.append(helper.make_tensor_value_info("r", 1, [batch, k, oh, ow]))
        nodes.append(helper.make_node("Add", ["c", "r"], ["s"]))
        nodes.append(helper.make_node("Relu", ["s"], ["y"]))
    else:
        nodes.append(helper.make_node("Relu", ["c"], ["y"]))
    g = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("y", 1, [batch, k, oh, ow])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def feeds_for(m, seed=0):
    rng = np.random.default_rng(seed)
    return {vi.name: rng.standard_normal([d.dim_value for d in vi.type.tensor_type.shape.dim]).astype(np.float32)
            for vi in m.graph.input}


def normwise(a, b):
    """||a - b|| / ||b||; ||a - b|| when b is all zeros (a Relu can zero a small output)."""
    diff, ref = np.linalg.norm(a.astype(np.float64) - b), np.linalg.norm(b)
    return float(diff / ref) if ref > 0 else float(diff)


def ort_run(m, feeds):
    return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def compile_with_tile(m, tile):
    with mock.patch.object(choose, "best_tile", lambda *a: tile):
        return Pipeline.from_onnx(m).optimize().compile(cache=False)


@pytest.mark.parametrize("tile", [2, 4])
def test_a_wrong_transform_matrix_is_refuted(tile, monkeypatch):
    rules = {r.name: r for r in load_rules(f"{builtin_rules_dir()}/winograd.rule")}
    rule = rules[f"winograd_f{tile}x{tile}_3x3"]
    assert prove_rule(rule).status in ("proved", "bounded")  # bounded: Z3 on drawn instances, not every shape
    bt, g, at = W.MATRICES[tile]
    bad = [list(r) for r in g]
    bad[1][1] += Fraction(1, 100)
    monkeypatch.setitem(W.MATRICES, tile, (bt, tuple(tuple(r) for r in bad), at))
    v = prove_rule(rule)
    assert v.status == "refuted" and "lhs[" in v.counterexample and "rhs[" in v.counterexample


@pytest.mark.parametrize("tile", [2, 4])
@pytest.mark.parametrize("h,w,pads", [(8, 8, [1, 1, 1, 1]), (7, 9, [1, 0, 1, 2]), (5, 6, [0, 0, 0, 0]), (13, 11, [2, 1, 0, 1])])
def test_reference_matches_direct_convolution(tile, h, w, pads):
    rng = np.random.default_rng(h * w)
    x = rng.standard_normal((2, 3, h, w)).astype(np.float32)
    wt = rng.standard_normal((5, 3, 3, 3)).astype(np.float32)
    b = rng.standard_normal(5).astype(np.float32)
    m = conv_model(3, 5, h, w, pads, batch=2)
    m.graph.initializer[0].CopyFrom(numpy_helper.from_array(wt, "w"))
    m.graph.initializer[1].CopyFrom(numpy_helper.from_array(b, "b"))
    want = ort_run(m, {"x": x})
    got = np.maximum(W.winograd_conv_reference(x, W.kernel_transform(wt, tile), b, tile, pads), 0)
    assert got.shape == want.shape
    assert normwise(got, want) < TOL


@pytest.mark.parametrize("tile", [2, 4])
@pytest.mark.parametrize("c,k,h,w,pads,bias,residual", [
    (16, 16, 8, 8, [1, 1, 1, 1], True, False),
    (8, 12, 7, 9, [1, 0, 1, 2], True, True),        # partial tiles, asymmetric pads, K not a multiple of 6
    (24, 8, 30, 17, [1, 1, 1, 1], False, True),     # no bias; several vector blocks of tiles, a partial one
    (8, 16, 6, 6, [0, 0, 0, 0], True, False),       # no padding: the input is read in place
])
def test_compiled_matches_onnxruntime(tile, c, k, h, w, pads, bias, residual):
    m = conv_model(c, k, h, w, pads, bias=bias, residual=residual)
    feeds = feeds_for(m)
    want = ort_run(m, feeds)
    art = compile_with_tile(m, tile)
    applied = art.manifest["rules_applied"]
    assert applied[f"winograd_f{tile}x{tile}_3x3" + ("" if bias else "_nobias")]["applied"] == 1
    kinds = [s["kernel"] for s in art.manifest["steps"]]
    assert "winograd_in" in kinds and "winograd_out" in kinds and "gemm" in kinds
    got1 = art.run(feeds, num_threads=1)["y"]
    got2 = art.run(feeds, num_threads=2)["y"]
    assert normwise(got1, want) < TOL
    np.testing.assert_array_equal(got1, got2)


def test_symbolic_batch():
    m = conv_model(16, 16, 10, 10, [1, 1, 1, 1], batch=1)
    m.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "N"
    m.graph.output[0].type.tensor_type.shape.dim[0].dim_param = "N"
    with mock.patch.object(choose, "best_tile", lambda *a: 4):
        art = Pipeline.from_onnx(m).optimize().compile(cache=False, shape_profiles={"N": (1, 2, 3)})
    assert "winograd_f4x4_3x3" in art.manifest["rules_applied"]
    mod = art.model()
    for n in (1, 2, 3):
        x = np.random.default_rng(n).standard_normal((n, 16, 10, 10)).astype(np.float32)
        assert normwise(mod.run(x)[0], ort_run(m, {"x": x})) < TOL


def test_cost_model_choices():
    # AVX2 micro-kernels, 16 positions wide
    assert choose.best_tile(128, 128, 28, 28) == 4      # ResNet-50 stage 2
    assert choose.best_tile(256, 256, 14, 14) == 4
    assert choose.best_tile(512, 512, 7, 7) == 2        # 4x4 tiles of a 7x7 map are mostly padding
    assert choose.best_tile(3, 64, 224, 224) is None    # a first layer: too few input channels
    assert choose.direct_cost(64, 64, 56, 56) > choose.winograd_cost(64, 64, 56, 56, 4)
    # AVX-512 tiles, 32-64 wide: F(4x4)'s 16 tiles of a 14x14 map fill half of a 32-wide panel
    avx512 = tile_shapes(512)
    assert choose.best_tile(128, 128, 28, 28, avx512) == 4
    assert choose.best_tile(256, 256, 14, 14, avx512) == 2
    assert choose.best_tile(512, 512, 7, 7, avx512) == 2
    assert choose.best_tile(3, 64, 224, 224, avx512) is None
    # DenseNet-121's growth convolutions at 14x14: F(4x4)'s 36 GEMMs of 16 positions pack more than they
    # compute (0.106 ms against F(2x2)'s 0.073, direct 0.080)
    assert choose.best_tile(128, 32, 14, 14, avx512) == 2
    assert choose.best_tile(128, 32, 28, 28, avx512) == 2     # F(4x4): 7 tiles a row in 16 lanes (0.245 vs 0.199 ms)
    assert choose.best_tile(128, 32, 7, 7, avx512) is None


def test_gemm_work_charges_the_packing_the_kernel_does():
    from cuvil.targets.gemm import choose_tile
    avx512 = tile_shapes(512)
    # panel order with a position-lane tile: full panels in place, only the partial last one packed
    t = choose_tile(32, 100, avx512, 64)
    assert t[1] < 100 and 100 % t[1]
    assert choose._gemm_work(32, 100, 64, avx512, in_place=True) == pytest.approx(
        choose._gemm_work(32, 100, 64, avx512) - choose.PACK_COST * (-(-100 // t[1]) - 1) * t[1])
    # fewer positions than a panel: the one panel is partial, packed whole
    assert choose._gemm_work(8, 16, 64, avx512, in_place=True) == choose._gemm_work(8, 16, 64, avx512)
    # a channel-lane tile never reads in place
    assert len(choose_tile(32, 49, avx512, 1024)) == 3 and choose_tile(32, 49, avx512, 1024)[2] == "c"
    assert choose._gemm_work(32, 49, 1024, avx512, in_place=True) == choose._gemm_work(32, 49, 1024, avx512)


def test_channel_major_v_where_e_major_aliases():
    from cuvil.targets.gemm import winograd_interleaved
    assert winograd_interleaved(128, 16, 4)        # 8 KiB apart: all 36 stores in one L1 set
    assert winograd_interleaved(512, 16, 2)        # ResNet-50's 7x7 F(2x2): 16 stores, one set
    assert not winograd_interleaved(128, 49, 4)    # 8 sets of 12 ways hold 36 stores
    assert not winograd_interleaved(112, 16, 4)    # 7 KiB apart: 64 sets
    assert not winograd_interleaved(100, 49, 2)    # not line-aligned: the streams drift


@pytest.mark.parametrize("c, k, h, tile", [(64, 32, 14, 4), (128, 16, 7, 2), (48, 24, 14, 4), (256, 16, 20, 2),
                                           (1024, 8, 14, 2)])
def test_channel_major_v_matches_onnxruntime(c, k, h, tile):
    # all but (48, 24) store V channel-major; the batch of 2 puts a second image's channels after the first's
    # in either layout. (256, 16, 20) and (1024, 8, 14) run their GEMMs in panel order, full panels read in
    # place from the interleaved V (1024 channels: two k-blocks) and the partial one packed
    from cuvil.targets.gemm import winograd_interleaved
    t = (-(-h // tile)) ** 2
    assert winograd_interleaved(c, t, tile) == (c != 48)
    m = conv_model(c, k, h, h, [1, 1, 1, 1], residual=True, batch=2)
    feeds = feeds_for(m)
    want = ort_run(m, feeds)
    art = compile_with_tile(m, tile)
    assert "winograd_in" in [s["kernel"] for s in art.manifest["steps"]]
    for threads in (1, 2):
        assert normwise(art.model().run(*feeds.values(), num_threads=threads)[0], want) < TOL


def test_cost_model_follows_the_target_cpu():
    m = conv_model(256, 256, 14, 14, [1, 1, 1, 1])
    p = Pipeline.from_onnx(m).optimize()
    assert set(p.choose_algorithms("x86_64-linux-gnu", cpu="znver3").report.applied) == {"winograd_f4x4_3x3"}
    assert set(p.choose_algorithms("x86_64-linux-gnu", cpu="znver4").report.applied) == {"winograd_f2x2_3x3"}


def test_default_compile_chooses_and_opt_out_keeps_direct():
    m = conv_model(64, 64, 28, 28, [1, 1, 1, 1])
    feeds = feeds_for(m)
    want = ort_run(m, feeds)
    p = Pipeline.from_onnx(m).optimize()
    on = p.compile(cache=False)
    off = p.compile(cache=False, winograd=False)
    assert "winograd_f4x4_3x3" in on.manifest["rules_applied"]
    assert not any(k.startswith("winograd") for k in off.manifest["rules_applied"])
    assert "winograd_in" not in [s["kernel"] for s in off.manifest["steps"]]
    assert normwise(on.run(feeds)["y"], want) < TOL
    assert normwise(off.run(feeds)["y"], want) < 1e-6
    low = p.compile(cache=False, opt_level=1)
    assert not any(k.startswith("winograd") for k in low.manifest["rules_applied"])


def test_winograd_ops_have_clear_shape_errors():
    from cuvil.errors import ShapeError
    from cuvil.ir.graph import Graph
    from cuvil.ir.types import TensorType
    g = Graph("g")
    x = g.add_input("x", TensorType(1, (1, 4, 8, 8)))
    u = g.const(np.zeros((36, 5, 3), np.float32), "u")   # 3 input channels, the input has 4
    with pytest.raises(ShapeError, match="input channels"):
        g.add_node("WinogradConv", [x, u], {"tile": 4}, domain="ai.cuvil")
