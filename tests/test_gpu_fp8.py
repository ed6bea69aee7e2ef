"""fp8 (E4M3) products on the GPU's tensor cores (issue 21, part 5): ``--precision fp8`` narrows a MatMul /
Gemm only where the policy bounds its inputs (certified from declared ranges, or measured), with a power-of-two
scale per input (:meth:`cuvil.precision.formats.Format.exponent`) that keeps every scaled value within 448 / 2;
``auto`` never picks it; sm_89+ only. Without a GPU: the scales, the policy, the factor-to-input mapping, the
fragment layout (tests/test_gpu_tensor_cores.py replays it for every format) and ptxas. On a GPU: the results
against a numpy emulation of the same roundings (ml_dtypes' E4M3), to float32 sum accuracy."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cuvil import Pipeline
from cuvil.precision.formats import FORMATS, FP8_EXPONENT
from cuvil.precision.interval import Interval
from cuvil.targets.ptx import assemble
from cuvil.targets.ptx.codegen import build_ptx, gpu_schedule
from cuvil.targets.ptx.matmul_mma import stage_precisions, stage_scales
from cuvil.testing.matmul_models import attention_scores, fp8_rounded, gemm_transb_residual, linear_gelu
from cuvil.testing.requires import needs_gpu, needs_ptxas

TARGET = "nvptx64-nvidia-cuda"
FP8 = FORMATS["fp8"]


def _iv(m):
    return Interval.of(-m, m)


@settings(max_examples=300, deadline=None)
@given(st.floats(min_value=1e-30, max_value=FP8.limit * 2.0 ** FP8_EXPONENT, allow_nan=False))
def test_scale_exponent_is_the_smallest_that_fits(m):
    """(ranges past limit * 2^FP8_EXPONENT are refused by check(): test_ranges_beyond_the_largest_scale...)"""
    e = FP8.exponent(_iv(m))
    assert -FP8_EXPONENT <= e <= FP8_EXPONENT
    if e > -FP8_EXPONENT:
        assert m * 2.0 ** -e <= FP8.limit < m * 2.0 ** -(e - 1)      # fits, and e - 1 would not
    else:
        assert m * 2.0 ** -e <= FP8.limit                            # a tiny range: lower on the grid
    # E4M3's largest finite value and saturation: a scaled value within the limit rounds to a finite one
    x = np.float32(m * 2.0 ** -e)
    assert np.isfinite(fp8_rounded(np.array([x]), 0)).all()


def test_ranges_beyond_the_largest_scale_are_refused():
    assert FP8.check(_iv(FP8.limit * 2.0 ** FP8_EXPONENT)) is None
    assert "largest scale" in FP8.check(_iv(FP8.limit * 2.0 ** (FP8_EXPONENT + 1)))
    assert FP8.check(Interval.of(-np.inf, 1.0)) is not None


def _plan(model, mode, ranges):
    p = Pipeline.from_onnx(model).optimize()
    return p, p.compile(TARGET, precision=mode, input_ranges=ranges, cache=False)


def test_policy_narrows_with_scales_and_auto_never_picks_fp8():
    model, _ = linear_gelu()
    _, b = _plan(model, "fp8", {"x": (-3, 3)})
    nodes = {k: v for k, v in b.manifest["precision"]["nodes"].items() if v["format"] != "fp32"}
    (rec,) = nodes.values()
    assert rec["format"] == "fp8" and rec["op"] == "MatMul"
    w_max = float(np.abs(_weight(model, "w")).max())
    assert rec["scale_exponents"] == [FP8.exponent(_iv(3.0)), FP8.exponent(_iv(w_max))] == [-6, rec["scale_exponents"][1]]
    assert "scale 2^-6" in rec["reason"]
    assert b.manifest["tensor_core_kernels"] == {"matmul_fp8": 1}
    _, a = _plan(model, "auto", {"x": (-3, 3)})
    assert {v["format"] for v in a.manifest["precision"]["nodes"].values()} <= {"fp32", "fp16", "bf16"}
    assert "matmul_fp8" not in a.manifest["tensor_core_kernels"]


def _weight(model, name):
    from onnx import numpy_helper
    return next(numpy_helper.to_array(t) for t in model.graph.initializer if t.name == name)


def test_unbounded_inputs_keep_float32():
    model, _ = linear_gelu()
    _, b = _plan(model, "fp8", None)      # no declared range: x is unbounded
    (mm,) = [v for v in b.manifest["precision"]["nodes"].values() if v["op"] == "MatMul"]
    assert mm["format"] == "fp32" and "fp8" in mm["reason"] and "unbounded" in mm["reason"]
    assert b.manifest["tensor_core_kernels"] == {}


def test_x86_has_no_fp8_kernel():
    model, _ = linear_gelu()
    from cuvil.precision.policy import plan_precision
    from cuvil.targets import get_target
    x86 = get_target("x86_64-linux-gnu")
    from cuvil.targets.x86.target import X86Options
    ops = x86.precision_ops(X86Options())
    assert "fp8" not in ops
    plan = plan_precision(Pipeline.from_onnx(model).optimize().graph, "fp8", input_ranges={"x": (-3, 3)},
                          target_ops=ops, target="x86_64-linux-gnu")
    (mm,) = [n for n in plan.nodes if n.op == "MatMul"]
    assert mm.format == "" and "no fp8 kernel for MatMul" in mm.reason


def test_each_factor_takes_its_own_inputs_scale():
    """Q·Kᵀ with Kᵀ a Transpose folded into B's loads: A takes q's exponent, B k's (different ranges)."""
    model, _ = attention_scores()
    p = Pipeline.from_onnx(model).optimize()
    b = p.compile(TARGET, precision="fp8", input_ranges={"q": (-3, 3), "k": (-100, 100)}, cache=False)
    (rec,) = [v for v in b.manifest["precision"]["nodes"].values() if v["format"] == "fp8"]
    eq, ek = FP8.exponent(_iv(3.0)), FP8.exponent(_iv(100.0))
    assert rec["scale_exponents"] == [eq, ek] and eq != ek
    # the same through the stage mapping the kernel uses
    from cuvil.precision.policy import apply_precision, plan_precision
    from cuvil.targets.ptx.target import TARGET as PTX, PtxOptions
    plan = plan_precision(p.graph, "fp8", input_ranges={"q": (-3, 3), "k": (-100, 100)},
                          target_ops=PTX.precision_ops(PtxOptions()))
    g = apply_precision(p.graph, plan)
    s = gpu_schedule(g)
    assert list(stage_precisions(g, s).values()) == ["fp8"]
    assert list(stage_scales(g, s).values()) == [(eq, ek)]
    # swapped operands (B's range declared on q): the mapping follows the inputs, not the order
    plan = plan_precision(p.graph, "fp8", input_ranges={"q": (-100, 100), "k": (-3, 3)},
                          target_ops=PTX.precision_ops(PtxOptions()))
    g = apply_precision(p.graph, plan)
    assert list(stage_scales(g, gpu_schedule(g)).values()) == [(ek, eq)]


def test_fp8_needs_sm89():
    from cuvil.targets.ptx.target import TARGET as PTX, PtxOptions
    ops = frozenset({"MatMul", "Gemm"})
    assert PTX.precision_ops(PtxOptions())["fp8"] == ops
    assert "fp8" not in PTX.precision_ops(PtxOptions(arch="sm_80"))
    assert PTX.precision_ops(PtxOptions(arch="sm_89"))["fp8"] == ops


def _fp8_build(model, ranges, arch="sm_90"):
    from cuvil.precision.policy import apply_precision, plan_precision
    from cuvil.targets.ptx.target import TARGET as PTX, PtxOptions
    p = Pipeline.from_onnx(model).optimize()
    plan = plan_precision(p.graph, "fp8", input_ranges=ranges, target_ops=PTX.precision_ops(PtxOptions()))
    g = apply_precision(p.graph, plan)
    s = gpu_schedule(g)
    return build_ptx(s, arch, fma=True, precisions=stage_precisions(g, s), precision_scales=stage_scales(g, s))


@needs_ptxas
def test_fp8_kernels_assemble_without_spills():
    for model, ranges in ((linear_gelu()[0], {"x": (-3, 3)}),
                          (attention_scores()[0], {"q": (-3, 3), "k": (-3, 3)}),
                          (gemm_transb_residual()[0], {"x": (-3, 3), "r": (-1, 1)}),
                          (linear_gelu(b=1, m=128, k=3072, n=768)[0], {"x": (-3, 3)})):
        r = _fp8_build(model, ranges)
        assert any(k.kind in ("matmul_fp8", "matmul_splitk_fp8") for k in r.kernels), [k.kind for k in r.kernels]
        assert "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32" in r.ptx
        assert "cvt.rn.satfinite.e4m3x2.f32" in r.ptx and ".version 8.4" in r.ptx
        _, info = assemble(r.ptx, "sm_90")
        for k in r.kernels:
            assert info[k.name].spill_stores == 0, (k.name, info[k.name])
    # a module without fp8 keeps LLVM's own (older) PTX version: older drivers load it
    r = build_ptx(gpu_schedule(Pipeline.from_onnx(linear_gelu()[0]).optimize().graph), "sm_90", fma=True)
    assert ".version 8.4" not in r.ptx


# --- on a GPU ------------------------------------------------------------------------------------------------

def _check(y, a, w, ea, eb, k, extra=0.0):
    """``y`` against the emulated fp8 product (each operand scaled, rounded to E4M3, scaled back) to float32
    sum accuracy, and against the float64 product within E4M3's rounding of both operands."""
    a8, w8 = fp8_rounded(a, ea), fp8_rounded(w, eb)
    near = a8 @ w8 + extra
    mag = np.abs(a8) @ np.abs(w8) + np.abs(extra)
    assert np.all(np.abs(y - near) <= 2 * k * 2.0 ** -24 * mag + 1e-30), float((np.abs(y - near) / mag).max())
    exact = np.asarray(a, np.float64) @ np.asarray(w, np.float64) + extra
    sub = 2.0 ** -9 * 2.0 ** ea * np.abs(w).sum(0) + 2.0 ** -9 * 2.0 ** eb * np.abs(a).sum(-1)[..., None]
    u = 2.0 ** -4
    assert np.all(np.abs(y - exact) <= (2 * u + u * u) * (np.abs(a) @ np.abs(w)) + sub + 1e-5 * mag)
    far, close = float(np.abs(y - exact).max()), float(np.abs(y - near).max())
    assert far > 30 * close, (far, close)     # the rounding is really E4M3's


@needs_gpu
def test_gpu_fp8_products_match_the_emulation(tmp_path):
    import cuvil
    rng = np.random.default_rng(0)
    # Gemm(transB) + residual, and a BERT-sized product (split-K / K groups)
    for model, ranges, feeds, w in (
            (gemm_transb_residual()[0], {"x": (-3, 3), "r": (-1, 1)},
             [rng.uniform(-3, 3, (24, 200)).astype(np.float32), rng.uniform(-1, 1, (24, 56)).astype(np.float32)],
             "w"),
            (_plain_matmul(128, 3072, 768), {"x": (-4, 4)}, [rng.uniform(-4, 4, (1, 128, 3072)).astype(np.float32)],
             "w")):
        b = Pipeline.from_onnx(model).optimize().compile(TARGET, precision="fp8", input_ranges=ranges, cache=False)
        (rec,) = [v for v in b.manifest["precision"]["nodes"].values() if v["format"] == "fp8"]
        ea, eb = rec["scale_exponents"][:2]
        (y,) = cuvil.load(b.save(str(tmp_path / "m.cuvil"))).run(*feeds)
        W = _weight(model, w).astype(np.float64)
        if rec["op"] == "Gemm":
            c = _weight(model, "c").astype(np.float64)
            _check(y, feeds[0], W.T, ea, eb, W.shape[1], extra=c + feeds[1])
        else:
            _check(y[0], feeds[0][0], W, ea, eb, W.shape[0])
    # both operands activations (Q·Kᵀ), ranges apart
    model, _ = attention_scores()
    q = rng.uniform(-3, 3, (2, 3, 40, 32)).astype(np.float32)
    k = rng.uniform(-100, 100, (2, 3, 40, 32)).astype(np.float32)
    b = Pipeline.from_onnx(model).optimize().compile(TARGET, precision="fp8",
                                                     input_ranges={"q": (-3, 3), "k": (-100, 100)}, cache=False)
    (rec,) = [v for v in b.manifest["precision"]["nodes"].values() if v["format"] == "fp8"]
    (y,) = cuvil.load(b.save(str(tmp_path / "q.cuvil"))).run(q, k)
    for i in range(2):
        for h in range(3):
            _check(y[i, h], q[i, h], k[i, h].T, *rec["scale_exponents"][:2], 32)


def _plain_matmul(m, k, n, seed=0):
    from onnx import TensorProto, helper, numpy_helper
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "mm",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, m, k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, m, n])],
                          [numpy_helper.from_array(w, "w")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


# --- the review's cases (session 23): a factor must get its own input's scale, or the product stays float32 ---

def _fp8_graph(nodes, inputs, outputs, inits, ranges):
    from onnx import TensorProto as T, helper as h
    from cuvil.precision.policy import apply_precision, plan_precision
    from cuvil.targets.ptx.target import TARGET as PTX, PtxOptions
    g = h.make_graph(nodes, "m", [h.make_tensor_value_info(n, T.FLOAT, s) for n, s in inputs],
                     [h.make_tensor_value_info(n, T.FLOAT, None) for n in outputs], inits)
    p = Pipeline.from_onnx(h.make_model(g, opset_imports=[h.make_opsetid("", 17)])).optimize()
    plan = plan_precision(p.graph, "fp8", input_ranges=ranges, target_ops=PTX.precision_ops(PtxOptions()))
    gg = apply_precision(p.graph, plan)
    s = gpu_schedule(gg)
    return gg, s, {n.name: n.precision_scales for n in gg.nodes if n.precision == "fp8"}


def test_gemms_sharing_an_input_take_their_own_weights_scales():
    """Two Gemm(x, W, transB=1) reading one x (Q/K/V or a gated MLP's projections): each weight is folded
    transposed under a new name, so only x names the nodes; each stage must still take its own node's scales
    (the first version gave the second Gemm the first one's weight scale: 66% of its weights saturated)."""
    from onnx import helper as h, numpy_helper as nh
    rng = np.random.default_rng(0)
    wg = (rng.standard_normal((256, 128)) * 0.05).astype(np.float32)
    wu = (rng.standard_normal((256, 128)) * 2.0).astype(np.float32)
    g, s, node_scales = _fp8_graph([h.make_node("Gemm", ["x", "wg"], ["g"], transB=1),
                                    h.make_node("Gemm", ["x", "wu"], ["u"], transB=1)],
                                   [("x", [64, 128])], ["g", "u"], [nh.from_array(wg, "wg"), nh.from_array(wu, "wu")],
                                   {"x": (-1, 1)})
    assert node_scales["g"][1] != node_scales["u"][1]
    assert stage_scales(g, s) == {"g": tuple(node_scales["g"][:2]), "u": tuple(node_scales["u"][:2])}


def test_a_factor_computed_from_the_other_operand_stays_float32():
    """MatMul(Mul(x, 100), Transpose(x)): A's loads name only x, which reaches the node as input 1; the scale
    of x (input 1) would saturate A = 100 x. Not a plain read of its input: no fp8, float32, and said so."""
    from onnx import helper as h, numpy_helper as nh
    g, s, node_scales = _fp8_graph([h.make_node("Mul", ["x", "c"], ["q"]),
                                    h.make_node("Transpose", ["x"], ["xt"], perm=[1, 0]),
                                    h.make_node("MatMul", ["q", "xt"], ["y"])],
                                   [("x", [32, 64])], ["y"], [nh.from_array(np.array(100.0, np.float32), "c")],
                                   {"x": (-1, 1)})
    assert "y" in node_scales and stage_scales(g, s) == {} and stage_precisions(g, s) == {}
    from onnx import TensorProto as T
    m = h.make_model(h.make_graph([h.make_node("Mul", ["x", "c"], ["q"]), h.make_node("Transpose", ["x"], ["xt"], perm=[1, 0]),
                                   h.make_node("MatMul", ["q", "xt"], ["y"])], "m",
                                  [h.make_tensor_value_info("x", T.FLOAT, [32, 64])],
                                  [h.make_tensor_value_info("y", T.FLOAT, None)],
                                  [nh.from_array(np.array(100.0, np.float32), "c")]),
                     opset_imports=[h.make_opsetid("", 17)])
    b = Pipeline.from_onnx(m).optimize().compile(TARGET, precision="fp8", input_ranges={"x": (-1, 1)}, cache=False)
    rec = b.manifest["precision"]["nodes"]["y"]
    assert rec["format"] == "fp32" and rec["policy_format"] == "fp8" and b.manifest["tensor_core_kernels"] == {}


def test_subnormal_rounding_is_in_the_narrowed_recheck():
    """E4M3 below 2^-6 (scaled) rounds absolutely, to 0 at worst: a product feeding a divisor must not be
    narrowed where that rounding can make the divisor 0 (weights 1.0 beside 0.49·2^-16 in one tensor: the
    small columns are all below E4M3's grid at the weights' scale)."""
    from onnx import helper as h, numpy_helper as nh
    w = np.full((64, 8), 0.49 * 2.0 ** -16, np.float32)
    w[:, 0] = 1.0
    g, s, node_scales = _fp8_graph([h.make_node("MatMul", ["x", "w"], ["y"]), h.make_node("Reciprocal", ["y"], ["z"])],
                                   [("x", [16, 64])], ["z"], [nh.from_array(w, "w")], {"x": (1, 2)})
    assert node_scales == {}       # kept float32: "its rounding makes a value downstream (z) leave its range"
    assert fp8_rounded(w, FP8.exponent(_iv(1.0)))[0, 1] == 0.0       # (what would have happened)
