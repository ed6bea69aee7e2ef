"""Regressions of the soundness review of the range analysis (cuvil.precision.ranges): each model below made a
certified interval miss a value onnxruntime computes for an input inside the declared box, or certify a finite
range where float32 computes NaN or inf. tests/property/test_precision_intervals_property.py searches for more."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper as nh

from cuvil import Pipeline
from cuvil.frontend import export_model
from cuvil.precision.inputs import declared_ranges
from cuvil.precision.ranges import analyze

ort = pytest.importorskip("onnxruntime")


def _model(nodes, inputs, out, inits=(), opset=20, out_type=T.FLOAT):
    g = h.make_graph(nodes, "m", [h.make_tensor_value_info(n, t, s) for n, t, s in inputs],
                     [h.make_tensor_value_info(out, out_type, None)], list(inits))
    return h.make_model(g, opset_imports=[h.make_opsetid("", opset)])


def _ranges_and_values(model, box, feed):
    """(interval, value) of every tensor the optimised graph computes, for the input ``feed``."""
    g = Pipeline.from_onnx(model).optimize().graph
    r = analyze(g, declared_ranges(box, [v.name for v in g.inputs]))
    names = {id(v): v.name for v in g.values()}
    ranges = {names[k]: iv for k, iv in r.items() if k in names}
    m = onnx.shape_inference.infer_shapes(export_model(g))
    types = {v.name: v.type.tensor_type.elem_type for v in m.graph.value_info}
    have = {o.name for o in m.graph.output}
    for n in m.graph.node:
        for o in n.output:
            if o in ranges and o not in have:
                m.graph.output.append(h.make_tensor_value_info(o, types.get(o, T.FLOAT), None))
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    with np.errstate(all="ignore"):
        vals = sess.run(None, feed)
    return {o.name: (ranges[o.name], np.asarray(v, np.float64)) for o, v in zip(sess.get_outputs(), vals)
            if o.name in ranges}


def _assert_sound(pairs):
    for name, (iv, val) in pairs.items():
        lo, hi = np.broadcast_to(iv.lo, val.shape), np.broadcast_to(iv.hi, val.shape)
        unknown = np.isneginf(lo) & np.isposinf(hi)
        ok = ((val >= lo) & (val <= hi)) | unknown
        assert ok.all(), (name, val[~ok][:3], iv.text())


def _unary(op, box, x, **attrs):
    m = _model([h.make_node(op, ["x"], ["y"], **attrs)], [("x", T.FLOAT, [1, len(x)])], "y")
    return _ranges_and_values(m, {"x": box}, {"x": np.asarray([x], np.float32)})


@pytest.mark.parametrize("op,at,want", [("Mish", -1.19237, -0.3088), ("HardSwish", -1.5, -0.375)])
def test_mish_and_hardswish_minima_are_inside(op, at, want):
    # the shared GELU rule had a floor of -0.2785 (SiLU's): Mish reaches -0.309, HardSwish -0.375
    pairs = _unary(op, (-3.0, 3.0), [at, -3.0, 3.0])
    assert pairs["y"][1][0, 0] == pytest.approx(want, abs=1e-3)
    _assert_sound(pairs)


@pytest.mark.parametrize("op", ["Sqrt", "Log"])
def test_sqrt_and_log_below_zero_are_unknown_not_certified(op):
    pairs = _unary(op, (-1.0, 1.0), [-1.0, 0.5])
    iv, val = pairs["y"]
    assert np.isnan(val[0, 0])                       # float32 computes NaN there
    assert not iv.bounded and iv.min == -np.inf and iv.max == np.inf


def test_leaky_relu_with_a_negative_alpha_holds_zero():
    _assert_sound(_unary("LeakyRelu", (-1.0, 1.0), [0.0, -1.0, 1.0], alpha=-0.5))


def test_clip_with_a_computed_max_is_bounded_by_its_low_end():
    # Clip(x, -, m) = min(x, m): the low bound needs m's low bound (it took m's high one)
    m = _model([h.make_node("Clip", ["x", "", "m"], ["y"])], [("x", T.FLOAT, [1, 2]), ("m", T.FLOAT, [])], "y")
    pairs = _ranges_and_values(m, {"x": (0.0, 1.0), "m": (-2.0, -1.0)},
                               {"x": np.array([[0.0, 1.0]], np.float32), "m": np.array(-2.0, np.float32)})
    assert pairs["y"][1].min() == -2.0
    _assert_sound(pairs)


def test_softmax_of_a_row_that_may_be_all_minus_inf_is_unknown():
    # Where(mask, x, -inf) then Softmax: a fully masked row is NaN in float32; the rule said [0, 1]
    nodes = [h.make_node("Cast", ["mask"], ["b"], to=T.BOOL), h.make_node("Where", ["b", "x", "ninf"], ["s"]),
             h.make_node("Softmax", ["s"], ["y"], axis=-1)]
    m = _model(nodes, [("x", T.FLOAT, [2, 4]), ("mask", T.FLOAT, [2, 4])], "y",
               [nh.from_array(np.array(-np.inf, np.float32), "ninf")])
    mask = np.array([[1, 1, 0, 0], [0, 0, 0, 0]], np.float32)
    pairs = _ranges_and_values(m, {"x": (-3.0, 3.0), "mask": (0.0, 1.0)},
                               {"x": np.zeros((2, 4), np.float32), "mask": mask})
    iv, val = pairs["y"]
    assert np.isnan(val[1]).all() and not iv.bounded


def test_layer_norm_of_an_input_that_may_overflow_is_unknown():
    # Exp of [0, 100] overflows float32 (inf), LayerNorm of inf is NaN: its sqrt(N-1) bound does not hold
    nodes = [h.make_node("Exp", ["x"], ["e"]), h.make_node("LayerNormalization", ["e", "g"], ["y"], axis=-1)]
    m = _model(nodes, [("x", T.FLOAT, [1, 4])], "y", [nh.from_array(np.ones(4, np.float32), "g")])
    pairs = _ranges_and_values(m, {"x": (0.0, 100.0)}, {"x": np.array([[100, 0, 0, 0]], np.float32)})
    assert np.isinf(pairs["e"][1]).any() and pairs["e"][0].max == np.inf      # past float32's max: inf
    assert np.isnan(pairs["y"][1]).any() and not pairs["y"][0].bounded


def test_a_product_past_float32s_range_is_not_a_finite_bound():
    m = _model([h.make_node("Mul", ["x", "x"], ["y"])], [("x", T.FLOAT, [1])], "y")
    pairs = _ranges_and_values(m, {"x": (0.0, 1e30)}, {"x": np.array([1e30], np.float32)})
    assert np.isinf(pairs["y"][1]).all() and pairs["y"][0].max == np.inf


def test_a_cancelling_matmul_is_widened_by_the_magnitudes_not_the_result():
    # columns summing to ~0 on inputs near 1000: the real result is tiny, float32's rounding is not
    rng = np.random.default_rng(3)
    w = rng.standard_normal((64, 8)).astype(np.float32)
    w -= w.mean(axis=0, keepdims=True)
    m = _model([h.make_node("MatMul", ["x", "w"], ["y"])], [("x", T.FLOAT, [1, 64])], "y", [nh.from_array(w, "w")])
    x = np.full((1, 64), 1000.3, np.float32)   # a box of one point: the interval's ends are the real result
    lo, hi = float(x.min()), float(x.max())
    pairs = _ranges_and_values(m, {"x": (lo, hi)}, {"x": x})
    _assert_sound(pairs)
    iv, val = pairs["y"]
    exact = x.astype(np.float64) @ w.astype(np.float64)
    assert np.abs(val - exact).max() > 1e-6 * np.abs(exact).max()   # float32 does round here


def test_dequantized_int32_bias_uses_its_values():
    # QDQ models dequantize their int32 biases: the rule assumed int8's [-128, 127]
    # QDQ models dequantize int32 values (biases): the rule assumed int8's [-128, 127] whatever the type
    nodes = [h.make_node("DequantizeLinear", ["q", "s"], ["b"]), h.make_node("Add", ["x", "b"], ["y"])]
    m = _model(nodes, [("x", T.FLOAT, [1, 2]), ("q", T.INT32, [2])], "y",
               [nh.from_array(np.array(1e-3, np.float32), "s")])
    pairs = _ranges_and_values(m, {"x": (-1.0, 1.0), "q": (-5, 100000)},
                               {"x": np.zeros((1, 2), np.float32), "q": np.array([100000, -5], np.int32)})
    assert pairs["b"][1].max() == pytest.approx(100.0)
    _assert_sound(pairs)


def test_cast_to_float16_rounds_and_overflows():
    m = _model([h.make_node("Cast", ["x"], ["y"], to=T.FLOAT16)], [("x", T.FLOAT, [1, 2])], "y",
               out_type=T.FLOAT16)
    x = np.array([[1.0006, 70000.0]], np.float32)
    pairs = _ranges_and_values(m, {"x": (1.0006, 70000.0)}, {"x": x})
    assert pairs["y"][1][0, 0] > 1.0006 and np.isinf(pairs["y"][1][0, 1])
    _assert_sound(pairs)


def test_declared_bounds_hold_their_float32_values():
    # x=-0.1:0.1 is fed as np.float32(0.1) = 0.10000000149 > 0.1; Relu passes it through unchanged
    pairs = _unary("Relu", (-0.1, 0.1), [0.1, -0.1])
    _assert_sound(pairs)


def test_auto_keeps_float32_a_contraction_whose_rounding_would_zero_a_divisor():
    # y = a - c is certified in [0.1, 0.45] in float32, so 1 / y is finite; a bf16 Gemm rounds a = 100.2 to 100
    # and y to 0 (1 / y = inf): auto must not narrow it (the policy re-bounds with each narrowed node's rounding)
    ml_dtypes = pytest.importorskip("ml_dtypes")
    from cuvil.precision import plan_precision
    nodes = [h.make_node("Gemm", ["a", "w", "c"], ["y"]), h.make_node("Div", ["one", "y"], ["z"])]
    m = _model(nodes, [("a", T.FLOAT, [1, 1]), ("c", T.FLOAT, [1, 1])], "z",
               [nh.from_array(np.ones((1, 1), np.float32), "w"), nh.from_array(np.array(1, np.float32), "one")])
    g = Pipeline.from_onnx(m).optimize().graph
    box = {"a": (100.2, 100.45), "c": (-100.1, -100.0)}
    a, c = np.float32(100.2), np.float32(-100.0)
    with np.errstate(divide="ignore"):
        assert np.isfinite(1 / (a + c)) and np.isinf(1 / (np.float32(a.astype(ml_dtypes.bfloat16)) + c))
    plan = plan_precision(g, "auto", input_ranges=box, target_ops={"bf16": frozenset({"Gemm"})})
    gemm = next(n for n in plan.nodes if n.op == "Gemm")
    assert gemm.verdicts["bf16"].status == "safe"          # its own values fit bf16 ...
    assert gemm.format == "" and "downstream" in gemm.reason   # ... but z would not stay finite
    # with a divisor far from 0 the same Gemm is narrowed
    plan = plan_precision(g, "auto", input_ranges={"a": (102.0, 103.0), "c": (-100.1, -100.0)},
                          target_ops={"bf16": frozenset({"Gemm"})})
    assert next(n for n in plan.nodes if n.op == "Gemm").format == "bf16"


def _has_bf16():
    from cuvil.targets.x86.cpu import host_cpu
    from cuvil.targets.x86.gemm_bf16 import narrow_formats
    return "bf16" in narrow_formats(host_cpu())


def _gelu_tanh(x, out, k):
    c = lambda v, n: h.make_node("Constant", [], [f"{out}_{n}"], value=nh.from_array(np.array(v, np.float32)))
    return [c(3.0, "three"), c(0.044715, "a"), c(0.7978845608, "s"), c(1.0, "one"), c(0.5, "half"),
            h.make_node("Pow", [x, f"{out}_three"], [f"{out}_p"]), h.make_node("Mul", [f"{out}_p", f"{out}_a"], [f"{out}_q"]),
            h.make_node("Add", [x, f"{out}_q"], [f"{out}_r"]), h.make_node("Mul", [f"{out}_r", f"{out}_s"], [f"{out}_t"]),
            h.make_node("Tanh", [f"{out}_t"], [f"{out}_u"]), h.make_node("Add", [f"{out}_u", f"{out}_one"], [f"{out}_v"]),
            h.make_node("Mul", [x, f"{out}_v"], [f"{out}_w"]), h.make_node("Mul", [f"{out}_w", f"{out}_half"], [out])]


@pytest.mark.skipif(not _has_bf16(), reason="no AVX512_BF16 on this CPU: the x86 bf16 kernels cannot run here")
@pytest.mark.parametrize("case", ["divisor", "layernorm", "gelu"])
def test_auto_end_to_end_on_the_x86_bf16_kernels_is_finite_where_float32_is(case):
    rng = np.random.default_rng(0)
    if case == "divisor":   # the Gemm -> Div above, compiled
        nodes = [h.make_node("Gemm", ["a", "w", "c"], ["y"]), h.make_node("Div", ["one", "y"], ["z"])]
        m = _model(nodes, [("a", T.FLOAT, [1, 1]), ("c", T.FLOAT, [1, 1])], "z",
                   [nh.from_array(np.ones((1, 1), np.float32), "w"), nh.from_array(np.array(1, np.float32), "one")])
        box = {"a": (100.2, 100.45), "c": (-100.1, -100.0)}
        feeds = [{"a": np.array([[100.2]], np.float32), "c": np.array([[-100.0]], np.float32)}]
    else:                   # the overflow models behind a MatMul (which x86 narrows to bf16)
        w1 = (rng.standard_normal((64, 64)) / 8).astype(np.float32)
        w2 = (rng.standard_normal((64, 8)) / 8).astype(np.float32)
        inits = [nh.from_array(w1, "w1"), nh.from_array(w2, "w2")]
        if case == "layernorm":
            mid = [h.make_node("LayerNormalization", ["h", "g"], ["n"], axis=-1)]
            inits.append(nh.from_array(np.ones(64, np.float32), "g"))
            lim = 1e3
        else:
            mid = _gelu_tanh("h", "n", 64)
            lim = 60.0
        nodes = [h.make_node("MatMul", ["x", "w1"], ["h"])] + mid + [h.make_node("MatMul", ["n", "w2"], ["z"])]
        m = _model(nodes, [("x", T.FLOAT, [1, 4, 64])], "z", inits, opset=17)
        box = {"x": (-lim, lim)}
        feeds = [{"x": np.full((1, 4, 64), s * lim, np.float32)} for s in (-1, 1)]
        feeds += [{"x": np.where(rng.random((1, 4, 64)) < 0.5, -lim, lim).astype(np.float32)} for _ in range(4)]
    g = Pipeline.from_onnx(m).optimize()
    ref = g.compile().model()
    for mode in ("auto", "bf16"):
        art = Pipeline.from_onnx(m).optimize().compile(precision=mode, input_ranges=box)
        fmts = {k: v["format"] for k, v in art.manifest["precision"]["nodes"].items()}
        if case != "divisor":
            assert "bf16" in fmts.values(), fmts          # the MatMuls are narrowed ...
        lib = art.model()
        for feed in feeds:
            want = ref.run(*feed.values())[0]
            got = lib.run(*feed.values())[0]
            assert np.isfinite(want).all()
            assert np.isfinite(got).all(), (case, mode, fmts)   # ... and nothing becomes inf or NaN


def test_sigmoid_far_below_zero_is_padded_for_the_runtimes_approximation():
    # onnxruntime's Sigmoid(-13.2) is 1.848e-6, 1% above the real value: a relative pad of 2^-20 missed it
    _assert_sound(_unary("Sigmoid", (-13.25, -13.15), [-13.2, -13.25, -13.15]))


def test_pooling_a_per_element_range_gives_a_per_channel_one():
    # a range along the last axis (after Transpose -> Mul -> Transpose) went through GlobalAveragePool unchanged:
    # shaped for the input plane, not the pooled one
    c = np.linspace(-1, 1, 5).astype(np.float32).reshape(1, 1, 1, 5)
    nodes = [h.make_node("Mul", ["x", "c"], ["t"]), h.make_node("GlobalAveragePool", ["t"], ["y"])]
    m = _model(nodes, [("x", T.FLOAT, [1, 3, 5, 5])], "y", [nh.from_array(c, "c")])
    pairs = _ranges_and_values(m, {"x": (0.0, 1.0)}, {"x": np.ones((1, 3, 5, 5), np.float32)})
    assert pairs["y"][0].lo.shape in ((), (1, 1, 1, 1), (1, 3, 1, 1))
    _assert_sound(pairs)


def test_instance_norm_of_one_element_is_padded_for_the_fused_formula():
    # N = 1: the output is beta in reals, but x·s + (beta - mean·s) with s = gamma / sqrt(eps) rounds terms of
    # |x|·|gamma| / sqrt(eps) (onnxruntime: 0.0125732 for beta 0.01257302)
    nodes = [h.make_node("InstanceNormalization", ["x", "g", "b"], ["y"])]
    m = _model(nodes, [("x", T.FLOAT, [1, 3, 1, 1])], "y",
               [nh.from_array(np.array([1.3, -0.7, 2.1], np.float32), "g"),
                nh.from_array(np.array([0.01257302, -0.3, 0.7], np.float32), "b")])
    for v in (3.0, -3.0, 1.7):
        _assert_sound(_ranges_and_values(m, {"x": (-3.0, 3.0)}, {"x": np.full((1, 3, 1, 1), v, np.float32)}))


def test_a_nan_guard_after_a_masked_softmax_is_bounded_again():
    # Where(IsNaN(p), 0, p) (BERT's SDPA export): the fully masked row's NaN is replaced, so the guard's output is
    # certified in [0, 1] while p itself is unknown
    nodes = [h.make_node("Cast", ["mask"], ["b"], to=T.BOOL), h.make_node("Where", ["b", "x", "ninf"], ["s"]),
             h.make_node("Softmax", ["s"], ["p"], axis=-1), h.make_node("IsNaN", ["p"], ["isnan"]),
             h.make_node("Where", ["isnan", "zero", "p"], ["y"])]
    m = _model(nodes, [("x", T.FLOAT, [2, 4]), ("mask", T.FLOAT, [2, 4])], "y",
               [nh.from_array(np.array(-np.inf, np.float32), "ninf"), nh.from_array(np.array(0, np.float32), "zero")])
    mask = np.array([[1, 1, 0, 0], [0, 0, 0, 0]], np.float32)
    pairs = _ranges_and_values(m, {"x": (-3.0, 3.0), "mask": (0.0, 1.0)},
                               {"x": np.zeros((2, 4), np.float32), "mask": mask})
    assert np.isnan(pairs["p"][1][1]).all() and not pairs["p"][0].bounded
    assert pairs["y"][0].bounded and pairs["y"][0].max <= 1.0 + 1e-5
    _assert_sound(pairs)


def test_layer_norm_bound_holds_for_the_kernels_on_cancelling_inputs():
    """LayerNormalization's certified bound (beta ± sqrt(N)·|gamma|, padded for rounding) is a bound of
    Cuvil's two-pass computation whatever the input: a large mean with a tiny spread (where a one-pass
    E[x^2] - mean^2 cancels to 0 and reaches |x - mean| / sqrt(eps)) and one outlier among equal values (the
    extreme sqrt(N-1) case), through the compiled x86 library and the GPU's row kernels' order alike."""
    n = 64
    m = _model([h.make_node("LayerNormalization", ["x", "g", "b"], ["y"], axis=-1, epsilon=1e-12)],
               [("x", T.FLOAT, [4, n])], "y",
               [nh.from_array(np.full(n, 1.5, np.float32), "g"), nh.from_array(np.full(n, 0.25, np.float32), "b")])
    box = {"x": (-1e4, 1e4)}
    g = Pipeline.from_onnx(m).optimize()
    iv = analyze(g.graph, declared_ranges(box, ["x"]))
    (y,) = [v for v in g.graph.values() if v.name == "y"]
    bound = iv[id(y)]
    assert bound.max <= 0.25 + 1.5 * np.sqrt(n) * (1 + 1e-5)
    lib = g.compile().model()
    rng = np.random.default_rng(0)
    outlier = np.zeros((4, n), np.float32)
    outlier[:, 0] = [1e4, -1e4, 1e-30, 3.0]
    feeds = [(9e3 + rng.uniform(-1e-3, 1e-3, (4, n))).astype(np.float32),        # mean 9e3, spread 1e-3
             (-7777.7 + rng.choice([0.0, 2.0 ** -10], (4, n))).astype(np.float32),  # spread at the last bits
             outlier, rng.uniform(-1e4, 1e4, (4, n)).astype(np.float32)]
    for x in feeds:
        out = lib.run(x)[0]
        assert np.isfinite(out).all()
        assert (out >= bound.lo).all() and (out <= bound.hi).all(), (float(out.min()), float(out.max()), bound.text())
    # the outlier row reaches sqrt(N-1)·gamma + beta: the bound is tight up to sqrt(N / (N-1))
    assert lib.run(outlier)[0][0, 0] > 0.25 + 1.5 * np.sqrt(n - 1) * (1 - 1e-5)


@pytest.mark.parametrize("guarded", [False, True])
def test_attention_weights_times_values_stay_within_the_values(guarded):
    """P @ V with P a Softmax over the contracted axis (or its Where(IsNaN(p), 0, p) guard, as exporters
    write after a maskable softmax): every output is a convex combination of V's column, so its range is
    V's (times the row sum's rounding), not K times it; sound on random and extreme inputs."""
    k = 128
    nodes = [h.make_node("Softmax", ["s"], ["p"], axis=-1)]
    if guarded:
        nodes += [h.make_node("IsNaN", ["p"], ["nan"]), h.make_node("Where", ["nan", "zero", "p"], ["pg"])]
    nodes.append(h.make_node("MatMul", ["pg" if guarded else "p", "v"], ["y"]))
    m = _model(nodes, [("s", T.FLOAT, [2, 8, k]), ("v", T.FLOAT, [2, k, 16])], "y",
               [nh.from_array(np.zeros((), np.float32), "zero")], opset=17)
    box = {"s": (-30.0, 30.0), "v": (-5.0, 7.0)}
    rng = np.random.default_rng(1)
    g = Pipeline.from_onnx(m).optimize().graph
    iv = analyze(g, declared_ranges(box, ["s", "v"]))
    (y,) = [x for x in g.values() if x.name == "y"]
    assert -5.001 <= iv[id(y)].min <= -5.0 and 7.0 <= iv[id(y)].max <= 7.001     # not 128 x 7
    for s_, v_ in ((rng.uniform(-30, 30, (2, 8, k)), rng.uniform(-5, 7, (2, k, 16))),
                   (np.where(rng.random((2, 8, k)) < 0.01, 30.0, -30.0), np.full((2, k, 16), 7.0)),
                   (np.full((2, 8, k), 30.0), np.full((2, k, 16), -5.0))):
        _assert_sound(_ranges_and_values(m, box, {"s": s_.astype(np.float32), "v": v_.astype(np.float32)}))


@pytest.mark.parametrize("eps,dtype", [(0.0, T.FLOAT), (-1e-3, T.FLOAT), (1e-12, T.FLOAT16)])
def test_layer_norm_without_a_positive_float32_epsilon_is_not_bounded(eps, dtype):
    """The sqrt(N) bound needs var + eps > 0 in the kernels' arithmetic: eps 0 (a constant row is 0/0), a
    negative eps, or a float16 LayerNorm whose eps (BERT's 1e-12) rounds to 0 in half: unbounded, with why."""
    npt = np.float16 if dtype == T.FLOAT16 else np.float32
    m = _model([h.make_node("LayerNormalization", ["x", "g", "b"], ["y"], axis=-1, epsilon=eps)],
               [("x", dtype, [2, 16])], "y",
               [nh.from_array(np.ones(16, npt), "g"), nh.from_array(np.zeros(16, npt), "b")], out_type=dtype)
    g = Pipeline.from_onnx(m).optimize().graph
    iv = analyze(g, declared_ranges({"x": (-3.0, 3.0)}, ["x"]))
    (y,) = [v for v in g.values() if v.name == "y"]
    assert not iv[id(y)].bounded and ("epsilon" in iv[id(y)].why or "float32" in iv[id(y)].why)


def test_a_guard_that_broadcasts_the_probabilities_is_not_convex():
    """Where(IsNaN(p), zeros[K], p) with p a Softmax over a size-1 axis: the guard repeats p's ones over K
    columns, so the rows sum to K, not 1: no convex-combination bound (onnxruntime gives K·max V)."""
    k = 16
    nodes = [h.make_node("Softmax", ["s"], ["p"], axis=-1), h.make_node("IsNaN", ["p"], ["nan"]),
             h.make_node("Where", ["nan", "zero", "p"], ["pg"]), h.make_node("MatMul", ["pg", "v"], ["y"])]
    m = _model(nodes, [("s", T.FLOAT, [2, 4, 1]), ("v", T.FLOAT, [2, k, 8])], "y",
               [nh.from_array(np.zeros(k, np.float32), "zero")], opset=17)
    box = {"s": (-3.0, 3.0), "v": (-5.0, 7.0)}
    pairs = _ranges_and_values(m, box, {"s": np.zeros((2, 4, 1), np.float32), "v": np.full((2, k, 8), 7.0, np.float32)})
    _assert_sound(pairs)
    assert pairs["y"][1].max() == pytest.approx(7.0 * k)
