"""Z3 semantics of ops (cuvil.rewrite_rules.semantics): small proofs, refutations, and bit-for-bit agreement
of the float32 semantics with numpy / onnx.reference on concrete inputs (NaN, +-0, +-inf, subnormals)."""
from __future__ import annotations

import numpy as np
import pytest
import z3
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from cuvil.errors import UnsupportedOpError
from cuvil.rewrite_rules.semantics import (FP_FORMATS, SEMANTICS, FP32Domain, FPDomain, RealDomain, constant_tensor,
                                           element_equalities, evaluate, symbolic, tensors_equal)

f32 = np.float32
SUB = f32(1e-45)  # smallest subnormal
SPECIAL = np.array([0.0, -0.0, 1.0, -1.5, 2.5, -2.5, 0.5, 3.75, np.inf, -np.inf, np.nan, SUB, -SUB,
                    f32(1.1754942e-38), f32(3.4028235e38), f32(-7.25e-3)], dtype=f32)


# --- helpers --------------------------------------------------------------------------------------

def ev(dom, op, *inputs, n=None, **attrs):
    return evaluate(dom, op, list(inputs), attrs, num_outputs=n)


def check(dom, lhs, rhs, premises=None, timeout_ms=15000):
    """('proved', None) or ('refuted', model) for lhs == rhs, element by element, under ``premises``
    (default: all of dom's side conditions) and dom's axioms.

    Each query runs in a fresh Z3 context: in the shared one, the terms earlier tests of the same worker
    created change the solver's search, and sqrt(x)*sqrt(x) == x once ran past 15 s in CI (0.2 s alone)."""
    for eq in element_equalities(dom, lhs, rhs):
        ctx = z3.Context()
        s = z3.Solver(ctx=ctx)
        s.set("timeout", timeout_ms)
        for f in (*(dom.side if premises is None else premises), *dom.axioms, z3.Not(eq)):
            s.add(f.translate(ctx))
        r = s.check()
        assert r != z3.unknown, s.reason_unknown()
        if r == z3.sat:
            return "refuted", s.model().translate(z3.main_ctx())
    return "proved", None


def implied(dom, premises, goals):
    s = z3.Solver()
    s.add(*premises, *dom.axioms)
    s.add(z3.Not(z3.And(goals or [z3.BoolVal(True)])))
    return s.check() == z3.unsat


def bits(a):
    a = np.asarray(a, dtype=f32)
    return np.where(np.isnan(a), np.uint32(0x7FC00000), a.view(np.uint32))


def assert_bitwise(got, want):
    got, want = np.asarray(got, dtype=f32), np.asarray(want, dtype=f32)
    assert got.shape == want.shape, (got.shape, want.shape)
    bad = bits(got) != bits(want)
    assert not bad.any(), f"mismatch at {np.argwhere(bad)[:5].tolist()}: got {got[bad][:5]} want {want[bad][:5]}"


def run_fp(op, *arrays, n=None, **attrs):
    """Evaluate the float32 semantics on concrete arrays (None = absent input) and read the values back."""
    dom = FP32Domain()
    ins = [None if a is None else a if a.dtype.kind in "iu" else constant_tensor(dom, a) for a in arrays]
    outs = evaluate(dom, op, ins, attrs, num_outputs=n)
    conv = []
    for o in outs:
        vals = np.empty(o.shape, dtype=object)
        for i in np.ndindex(*o.shape):
            vals[i] = dom.value_of(None, o[i])
        conv.append(vals.astype(bool) if o.size and isinstance(vals.reshape(-1)[0], bool) else vals.astype(f32))
    return conv


def ref(op, inputs, n_out=1, **attrs):
    """onnx.reference on one node; inputs are arrays (float32 inputs, int64 constants) or None."""
    names, vis, feeds = [], [], {}
    for i, a in enumerate(inputs):
        if a is None:
            names.append("")
            continue
        names.append(f"i{i}")
        feeds[f"i{i}"] = a
        vis.append(helper.make_tensor_value_info(f"i{i}", helper.np_dtype_to_tensor_dtype(a.dtype), list(a.shape)))
    outs = [f"y{k}" for k in range(n_out)]
    node = helper.make_node(op, names, outs, **attrs)
    g = helper.make_graph([node], "g", vis,
                          [helper.make_tensor_value_info(o, TensorProto.UNDEFINED, None) for o in outs])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    return ReferenceEvaluator(m).run(None, feeds)


def ort(op, inputs, n_out=1, **attrs):
    """onnxruntime (CPU) on one node, for what onnx.reference gets wrong or lacks; skipped if absent."""
    ortmod = pytest.importorskip("onnxruntime")
    names, vis, feeds = [], [], {}
    for i, a in enumerate(inputs):
        if a is None:
            names.append("")
            continue
        names.append(f"i{i}")
        feeds[f"i{i}"] = a
        vis.append(helper.make_tensor_value_info(f"i{i}", helper.np_dtype_to_tensor_dtype(a.dtype), list(a.shape)))
    outs = [f"y{k}" for k in range(n_out)]
    g = helper.make_graph([helper.make_node(op, names, outs, **attrs)], "g", vis,
                          [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outs])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    m.ir_version = 10
    sess = ortmod.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def rng_f32(seed, shape):
    return np.random.default_rng(seed).standard_normal(shape).astype(f32)


# --- exact (float32) proofs and refutations -------------------------------------------------------

def test_exact_relu_idempotent():
    d = FP32Domain()
    x = symbolic(d, "x", [2, 2])
    assert check(d, ev(d, "Relu", ev(d, "Relu", x)[0])[0], ev(d, "Relu", x)[0])[0] == "proved"


def test_tensors_equal_whole_tensor():
    d = FP32Domain()
    x = symbolic(d, "x", [2, 2])
    s = z3.Solver()
    s.add(z3.Not(tensors_equal(d, ev(d, "Transpose", ev(d, "Transpose", x)[0])[0], x)))
    assert s.check() == z3.unsat
    assert z3.is_false(tensors_equal(d, x, ev(d, "Reshape", x, shape=[4])[0]))


def test_exact_add_zero_refuted_with_negative_zero():
    d = FP32Domain()
    x = symbolic(d, "x", [])
    res, model = check(d, ev(d, "Add", x, constant_tensor(d, f32(0.0)))[0], x)
    assert res == "refuted"
    v = d.value_of(model, x[()])
    assert v == 0.0 and np.signbit(v)  # x = -0.0: -0 + 0 = +0


def test_exact_mul_one_and_double_negation_proved():
    d = FP32Domain()
    x = symbolic(d, "x", [3])
    assert check(d, ev(d, "Mul", x, constant_tensor(d, f32(1.0)))[0], x)[0] == "proved"
    assert check(d, ev(d, "Neg", ev(d, "Neg", x)[0])[0], x)[0] == "proved"


def test_exact_sub_self_refuted_by_nan_or_inf():
    d = FP32Domain()
    x = symbolic(d, "x", [])
    res, model = check(d, ev(d, "Sub", x, x)[0], constant_tensor(d, f32(0.0)))
    assert res == "refuted"
    v = d.value_of(model, x[()])
    assert np.isnan(v) or np.isinf(v)


def test_exact_sqrt_squared_refuted():
    d = FP32Domain()
    x = symbolic(d, "x", [])
    s = ev(d, "Sqrt", x)[0]
    res, model = check(d, ev(d, "Mul", s, s)[0], x)
    assert res == "refuted"
    v = f32(d.value_of(model, x[()]))
    with np.errstate(invalid="ignore"):
        assert bits(np.sqrt(v) * np.sqrt(v)) != bits(v)  # the counterexample is real


def test_exact_max_zero_is_relu_but_clip_is_not():
    d = FP32Domain()
    x = symbolic(d, "x", [])
    zero = constant_tensor(d, f32(0.0))
    assert check(d, ev(d, "Max", x, zero)[0], ev(d, "Relu", x)[0])[0] == "proved"
    res, model = check(d, ev(d, "Clip", x, min=0.0)[0], ev(d, "Relu", x)[0])
    assert res == "refuted"  # Clip keeps -0.0, Relu gives +0.0 (or Clip clamps +inf to FLT_MAX)


def test_exact_uninterpreted_functions_shared_across_sides():
    d = FP32Domain()
    x = symbolic(d, "x", [2])
    # Exp(x) is the same function on both sides; Softsign has no transcendental at all.
    assert check(d, ev(d, "Exp", x)[0], ev(d, "Exp", x)[0])[0] == "proved"
    sig = ev(d, "Sigmoid", x)[0]
    one = constant_tensor(d, f32(1))
    body = ev(d, "Div", one, ev(d, "Add", one, ev(d, "Exp", ev(d, "Neg", x)[0])[0])[0])[0]
    assert check(d, sig, body)[0] == "proved"
    assert check(d, ev(d, "Exp", x)[0], ev(d, "Tanh", x)[0])[0] == "refuted"


def test_exact_symbolic_attribute():
    d = FP32Domain()
    x, alpha = symbolic(d, "x", [2]), d.var("alpha")
    lhs = ev(d, "LeakyRelu", x, alpha=alpha)[0]
    rhs = ev(d, "Where", ev(d, "Less", x, constant_tensor(d, f32(0)))[0], ev(d, "Mul", x, alpha)[0], x)[0]
    assert check(d, lhs, rhs)[0] == "proved"


# --- real proofs and refutations ------------------------------------------------------------------

def test_real_add_zero_proved():
    d = RealDomain()
    x = symbolic(d, "x", [2])
    assert check(d, ev(d, "Add", x, constant_tensor(d, 0.0))[0], x)[0] == "proved"


def test_real_relu_not_additive():
    d = RealDomain()
    a, b = symbolic(d, "a", []), symbolic(d, "b", [])
    lhs = ev(d, "Relu", ev(d, "Add", a, b)[0])[0]
    rhs = ev(d, "Add", ev(d, "Relu", a)[0], ev(d, "Relu", b)[0])[0]
    res, model = check(d, lhs, rhs)
    assert res == "refuted"
    va, vb = d.value_of(model, a[()]), d.value_of(model, b[()])
    assert max(va + vb, 0) != max(va, 0) + max(vb, 0)


def test_real_conv_batchnorm_fold():
    d = RealDomain()
    x, w, b = symbolic(d, "x", [1, 1, 2, 2]), symbolic(d, "w", [2, 1, 1, 1]), symbolic(d, "b", [2])
    s, beta, mean, var = (symbolic(d, n, [2]) for n in ("s", "beta", "mean", "var"))
    eps = d.var("eps")
    m0 = d.mark()
    lhs = ev(d, "BatchNormalization", ev(d, "Conv", x, w, b)[0], s, beta, mean, var, epsilon=eps)[0]
    lhs_side = d.side_since(m0)
    m1 = d.mark()
    # Conv(x, w * Unsqueeze(s / Sqrt(var + eps), axes=[1,2,3]), (b - mean) * s / Sqrt(var + eps) + beta)
    k = ev(d, "Div", s, ev(d, "Sqrt", ev(d, "Add", var, eps)[0])[0])[0]
    w2 = ev(d, "Mul", w, ev(d, "Unsqueeze", k, axes=[1, 2, 3])[0])[0]
    b2 = ev(d, "Add", ev(d, "Div", ev(d, "Mul", ev(d, "Sub", b, mean)[0], s)[0],
                         ev(d, "Sqrt", ev(d, "Add", var, eps)[0])[0])[0], beta)[0]
    rhs = ev(d, "Conv", x, w2, b2)[0]
    rhs_side = d.side_since(m1)
    assert lhs_side and rhs_side
    assert check(d, lhs, rhs, premises=lhs_side)[0] == "proved"
    assert implied(d, lhs_side, rhs_side)
    # without the definedness conditions the division by zero is unconstrained: not provable
    assert check(d, lhs, rhs, premises=[])[0] == "refuted"


def test_real_sqrt_axioms_and_division_side_conditions():
    d = RealDomain()
    x = symbolic(d, "x", [])
    sq = ev(d, "Sqrt", x)[0]
    assert check(d, ev(d, "Mul", sq, sq)[0], x)[0] == "proved"  # under x >= 0
    d2 = RealDomain()
    y = symbolic(d2, "y", [])
    assert check(d2, ev(d2, "Div", y, y)[0], constant_tensor(d2, 1.0))[0] == "proved"  # under y != 0
    assert any(z3.eq(c, z3.simplify(y[()] != 0)) for c in d2.side)


def test_real_training_dropout_removal_refuted():
    d = RealDomain()
    x = symbolic(d, "x", [2])
    y = ev(d, "Dropout", x, constant_tensor(d, 0.5), np.array(True))[0]
    assert check(d, y, x)[0] == "refuted"
    y_inf = ev(d, "Dropout", x, constant_tensor(d, 0.5), np.array(False))[0]
    assert check(d, y_inf, x)[0] == "proved"
    out, mask = ev(d, "Dropout", x, n=2)
    assert check(d, out, x)[0] == "proved" and all(z3.is_true(m) for m in mask)
    # symbolic training_mode: still refuted (the model picks training mode)
    t = np.empty((), dtype=object)
    t[()] = z3.Bool("tm")
    assert check(d, ev(d, "Dropout", x, constant_tensor(d, 0.5), t)[0], x)[0] == "refuted"


def test_real_softmax_is_exp_over_sum():
    d = RealDomain()
    x = symbolic(d, "x", [3])
    e = ev(d, "Exp", x)[0]
    rhs = ev(d, "Div", e, ev(d, "ReduceSum", e, axes=[-1], keepdims=1)[0])[0]
    assert check(d, ev(d, "Softmax", x)[0], rhs)[0] == "proved"
    assert check(d, ev(d, "Log", ev(d, "Softmax", x)[0])[0], ev(d, "LogSoftmax", x)[0])[0] == "proved"


def test_real_layernorm_decomposition():
    d = RealDomain()
    x, s = symbolic(d, "x", [1, 2]), symbolic(d, "s", [2])
    lhs = ev(d, "LayerNormalization", x, s, axis=-1, epsilon=1e-5)[0]
    mu = ev(d, "ReduceMean", x, axes=[-1])[0]
    dev = ev(d, "Sub", x, mu)[0]
    var = ev(d, "ReduceMean", ev(d, "Mul", dev, dev)[0], axes=[-1])[0]
    std = ev(d, "Sqrt", ev(d, "Add", var, constant_tensor(d, 1e-5))[0])[0]
    rhs = ev(d, "Mul", ev(d, "Div", dev, std)[0], s)[0]
    assert check(d, lhs, rhs)[0] == "proved"


def test_unsupported():
    d = FP32Domain()
    x = symbolic(d, "x", [2])
    with pytest.raises(UnsupportedOpError, match="no Z3 semantics"):
        ev(d, "NonZero", x)
    with pytest.raises(UnsupportedOpError):
        ev(d, "Cast", x, to=TensorProto.INT32)
    assert "Conv" in SEMANTICS and "Softmax" in SEMANTICS


# --- float32 semantics agree with numpy / onnx.reference, bit for bit ----------------------------

def test_np_unary_elementwise():
    x = SPECIAL
    with np.errstate(all="ignore"):
        cases = {"Neg": -x, "Abs": np.abs(x), "Relu": np.maximum(x, f32(0)), "Floor": np.floor(x),
                 "Ceil": np.ceil(x), "Round": np.round(x), "Sign": np.sign(x), "Sqrt": np.sqrt(x),
                 "Reciprocal": f32(1) / x, "Softsign": x / (f32(1) + np.abs(x))}
    for op, want in cases.items():
        assert_bitwise(run_fp(op, x)[0], want)
    assert_bitwise(run_fp("Round", np.array([0.5, 1.5, 2.5, -0.5, -2.5, -0.4], f32))[0],
                   np.array([0.0, 2.0, 2.0, -0.0, -2.0, -0.0], f32))
    assert np.array_equal(run_fp("IsNaN", x)[0], np.isnan(x))
    assert np.array_equal(run_fp("IsInf", x, detect_negative=0)[0], np.isposinf(x))


def test_np_binary_elementwise_with_broadcasting():
    a = SPECIAL.reshape(4, 4)
    b = np.array([-0.0, np.nan, 1.0, -np.inf], f32)
    with np.errstate(all="ignore"):
        cases = {"Add": a + b, "Sub": a - b, "Mul": a * b, "Div": a / b,
                 "Max": np.maximum(a, b), "Min": np.minimum(a, b)}
    for op, want in cases.items():
        assert_bitwise(run_fp(op, a, b)[0], want)
    # ties between -0 and +0 return the second argument, as np.maximum / np.minimum
    z, nz = np.zeros(3, f32), np.full(3, -0.0, f32)
    for p, q in ((z, nz), (nz, z)):
        assert_bitwise(run_fp("Max", p, q)[0], np.maximum(p, q))
        assert_bitwise(run_fp("Min", p, q)[0], np.minimum(p, q))
    c = rng_f32(1, (4, 4))
    assert_bitwise(run_fp("Sum", a, b, c)[0], (a + b) + c)
    assert_bitwise(run_fp("Mean", a, c)[0], (a + c) / f32(2))
    assert_bitwise(run_fp("Max", a, b, c)[0], np.maximum(np.maximum(a, b), c))
    assert np.array_equal(run_fp("Less", a, b)[0], a < b)
    assert np.array_equal(run_fp("Equal", a, b)[0], a == b)
    assert np.array_equal(run_fp("GreaterOrEqual", a, b)[0], a >= b)
    cond = np.array([True, False, True, False])
    dom = FP32Domain()
    w = evaluate(dom, "Where", [cond, constant_tensor(dom, a), constant_tensor(dom, b)], {})[0]
    assert_bitwise(np.array([[dom.value_of(None, v) for v in row] for row in w], f32), np.where(cond, a, b))


def test_np_clip_and_activations():
    x = SPECIAL
    for lo, hi in ((0.0, 6.0), (-0.0, 1.0), (-1.0, -0.0), (np.nan, 1.0), (-1.0, np.nan), (2.0, 1.0)):
        assert_bitwise(run_fp("Clip", x, min=lo, max=hi)[0], np.clip(x, f32(lo), f32(hi)))
    fmax = np.finfo(f32).max
    assert_bitwise(run_fp("Clip", x, max=1.0)[0], np.clip(x, -fmax, f32(1)))  # ONNX default min: lowest()
    assert_bitwise(run_fp("Clip", x)[0], np.clip(x, -fmax, fmax))
    with np.errstate(all="ignore"):
        assert_bitwise(run_fp("LeakyRelu", x, alpha=0.1)[0], np.where(x < 0, f32(0.1) * x, x))
        assert_bitwise(run_fp("HardSigmoid", x)[0],
                       np.maximum(np.minimum(x * f32(0.2) + f32(0.5), f32(1)), f32(0)))
        assert_bitwise(run_fp("HardSwish", x)[0],
                       x * np.maximum(np.minimum(x * f32(1 / 6) + f32(0.5), f32(1)), f32(0)))
        slope = np.array([0.25, -2.0, np.nan, 1.0], f32)
        xs = x.reshape(4, 4)
        got = run_fp("PRelu", xs, slope)[0]
        assert_bitwise(got, np.where(xs < 0, slope * xs, xs))  # the function body: -0.0 stays -0.0
        nz = xs != 0  # onnx.reference computes where(x > 0, x, x * slope): differs only in the sign of zeros
        assert_bitwise(got[nz], ref("PRelu", [xs, slope])[0][nz])


def test_np_matmul_and_gemm():
    a = rng_f32(2, (2, 3, 4))
    b = rng_f32(3, (4, 5))
    a[0, 0, 1], a[1, 2, 3], b[2, 2] = np.nan, -0.0, np.inf

    def loop(a, b):  # float32, left to right over k
        out = np.empty(a.shape[:-1] + b.shape[-1:], f32)
        for idx in np.ndindex(*out.shape):
            *bi, i, j = idx
            acc = f32(a[tuple(bi) + (i, 0)] * b[0, j])
            for k in range(1, a.shape[-1]):
                acc = f32(acc + f32(a[tuple(bi) + (i, k)] * b[k, j]))
            out[idx] = acc
        return out
    with np.errstate(all="ignore"):
        got = run_fp("MatMul", a, b)[0]
        assert_bitwise(got, loop(a, b))
        fa, fb = rng_f32(4, (3, 4)), rng_f32(5, (4, 5))
        np.testing.assert_allclose(run_fp("MatMul", fa, fb)[0], fa @ fb, rtol=1e-5)
        v = rng_f32(6, (4,))
        np.testing.assert_allclose(run_fp("MatMul", v, fb)[0], v @ fb, rtol=1e-5)
        # Gemm: (A'B') * alpha + C * beta
        A, B, C = rng_f32(7, (4, 3)), rng_f32(8, (5, 4)), rng_f32(9, (5,))
        C[1] = np.inf
        want = loop(A.T, B.T) * f32(0.5) + C * f32(2.0)
        got = run_fp("Gemm", A, B, C, alpha=0.5, beta=2.0, transA=1, transB=1)[0]
        assert_bitwise(got, want)
        np.testing.assert_allclose(got, ref("Gemm", [A, B, C], alpha=0.5, beta=2.0, transA=1, transB=1)[0], rtol=1e-5)
        assert_bitwise(run_fp("Gemm", A.T, B.T, C, beta=0.0)[0], loop(A.T, B.T))  # C skipped: no inf*0


def _conv_loop(x, w, b, pads, strides, dils, group):
    n, c, h, wd = x.shape
    m, cg, kh, kw = w.shape
    xp = np.zeros((n, c, h + pads[0] + pads[2], wd + pads[1] + pads[3]), f32)
    xp[:, :, pads[0]:pads[0] + h, pads[1]:pads[1] + wd] = x
    oh = (xp.shape[2] - (dils[0] * (kh - 1) + 1)) // strides[0] + 1
    ow = (xp.shape[3] - (dils[1] * (kw - 1) + 1)) // strides[1] + 1
    y = np.empty((n, m, oh, ow), f32)
    mg = m // group
    for bi, mi, i, j in np.ndindex(n, m, oh, ow):
        g = mi // mg
        terms = [f32(xp[bi, g * cg + ci, i * strides[0] + p * dils[0], j * strides[1] + q * dils[1]] * w[mi, ci, p, q])
                 for ci in range(cg) for p in range(kh) for q in range(kw)]
        acc = terms[0]
        for t in terms[1:]:
            acc = f32(acc + t)
        y[bi, mi, i, j] = acc if b is None else f32(acc + b[mi])
    return y


def test_np_conv():
    x = rng_f32(10, (1, 2, 4, 4))
    w = rng_f32(11, (4, 1, 2, 2))
    b = rng_f32(12, (4,))
    x[0, 0, 1, 1], x[0, 1, 0, 0], x[0, 1, 3, 3] = np.nan, -0.0, SUB
    with np.errstate(all="ignore"):
        got = run_fp("Conv", x, w, b, group=2, pads=[1, 0, 1, 1], strides=[2, 1])[0]
        assert_bitwise(got, _conv_loop(x, w, b, [1, 0, 1, 1], [2, 1], [1, 1], 2))
        x2 = rng_f32(13, (1, 2, 4, 3))
        w2 = rng_f32(14, (3, 2, 2, 2))
        w2[1, 0, 0, 0] = np.inf  # padding zero * inf = NaN where the tap falls in the padding
        got = run_fp("Conv", x2, w2, None, pads=[1, 1, 0, 0], dilations=[2, 1])[0]
        assert_bitwise(got, _conv_loop(x2, w2, None, [1, 1, 0, 0], [1, 1], [2, 1], 1))
        w2[1, 0, 0, 0] = 1.0
        np.testing.assert_allclose(run_fp("Conv", x2, w2, None, pads=[1, 1, 0, 0], dilations=[2, 1])[0],
                                   ref("Conv", [x2, w2], pads=[1, 1, 0, 0], dilations=[2, 1])[0], rtol=1e-5, atol=1e-6)
        got = run_fp("Conv", x2, w2, None, auto_pad="SAME_UPPER")[0]
        np.testing.assert_allclose(got, ref("Conv", [x2, w2], auto_pad="SAME_UPPER")[0], rtol=1e-5, atol=1e-6)


def test_np_conv_transpose_matches_reference():
    x = rng_f32(15, (1, 2, 3, 3))
    w = rng_f32(16, (2, 2, 2, 2))
    b = rng_f32(17, (4,))
    for attrs in ({"strides": [2, 2]}, {"strides": [2, 1], "pads": [1, 0, 0, 1], "output_padding": [1, 0]},
                  {"group": 2, "dilations": [2, 1]}, {"strides": [2, 2], "auto_pad": "SAME_LOWER"},
                  {"strides": [2, 2], "output_shape": [5, 7]}):
        want = ort("ConvTranspose", [x, w, b if attrs.get("group") == 2 else b[:2]], **attrs)[0]
        got = run_fp("ConvTranspose", x, w, b if attrs.get("group") == 2 else b[:2], **attrs)[0]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_np_batchnorm_and_instancenorm():
    x = rng_f32(18, (2, 3, 2, 2))
    x[0, 1, 0, 0], x[1, 2, 1, 1] = np.nan, -np.inf
    s, b, mean = rng_f32(19, (3,)), rng_f32(20, (3,)), rng_f32(21, (3,))
    var = np.abs(rng_f32(22, (3,)))
    var[2] = -1.0  # negative variance: sqrt gives NaN
    eps = f32(1e-5)
    r = lambda p: p.reshape(3, 1, 1)  # noqa: E731
    with np.errstate(all="ignore"):
        want = (x - r(mean)) / np.sqrt(r(var) + eps) * r(s) + r(b)
        got = run_fp("BatchNormalization", x, s, b, mean, var)[0]
        assert_bitwise(got, want)
        fin = np.isfinite(want)
        np.testing.assert_allclose(got[fin], ref("BatchNormalization", [x, s, b, mean, var])[0][fin], rtol=1e-5)
        x2 = rng_f32(23, (1, 3, 2, 3))
        got = run_fp("InstanceNormalization", x2, s, b, epsilon=1e-3)[0]
        np.testing.assert_allclose(got, ref("InstanceNormalization", [x2, s, b], epsilon=1e-3)[0], rtol=1e-4, atol=1e-5)
        ln_s, ln_b = rng_f32(24, (3,)), rng_f32(25, (3,))
        x3 = rng_f32(26, (2, 3))
        got = run_fp("LayerNormalization", x3, ln_s, ln_b, n=3)
        want = ref("LayerNormalization", [x3, ln_s, ln_b], n_out=3)
        for g, w_ in zip(got, want):
            np.testing.assert_allclose(g, w_, rtol=1e-4, atol=1e-5)


def test_np_data_movement_matches_reference():
    x = SPECIAL.reshape(2, 2, 4)
    i64 = lambda v: np.array(v, np.int64)  # noqa: E731
    assert_bitwise(run_fp("Transpose", x, perm=[2, 0, 1])[0], ref("Transpose", [x], perm=[2, 0, 1])[0])
    assert_bitwise(run_fp("Transpose", x)[0], x.T)
    for pads, mode in (([1, 0, 2, 0, 1, 1], "constant"), ([0, 0, -1, 1, 0, 2], "constant"),
                       ([0, 1, 1, 0, 0, 2], "reflect"), ([1, 0, 1, 0, 1, 1], "edge"), ([0, 0, 2, 0, 1, 3], "wrap")):
        got = run_fp("Pad", x, pads=pads, constant_value=-0.0, mode=mode)[0]
        oracle = ort if min(pads) < 0 else ref  # onnx.reference rejects negative pads
        assert_bitwise(got, oracle("Pad", [x, i64(pads), np.array(-0.0, f32)], mode=mode)[0])
    got = run_fp("Pad", x, pads=[1, 2], axes=[-1])[0]
    assert_bitwise(got, ref("Pad", [x, i64([1, 2]), None, i64([-1])])[0])
    for st, en, ax, sp in (([0, 1], [2, 4], [0, 2], [1, 2]), ([-1, 3], [-100, 0], [1, 2], [-1, -2]),
                           ([1], [2**62], [2], [1])):
        got = run_fp("Slice", x, starts=st, ends=en, axes=ax, steps=sp)[0]
        assert_bitwise(got, ref("Slice", [x, i64(st), i64(en), i64(ax), i64(sp)])[0])
    y = rng_f32(27, (2, 1, 4))
    assert_bitwise(run_fp("Concat", x, y, axis=1)[0], np.concatenate([x, y], axis=1))
    parts = run_fp("Split", x, n=3, axis=2)
    for g, w in zip(parts, ref("Split", [x], n_out=3, axis=2, num_outputs=3)):
        assert_bitwise(g, w)
    parts = run_fp("Split", x, split=[1, 3], axis=-1, n=2)
    for g, w in zip(parts, np.split(x, [1], axis=-1)):
        assert_bitwise(g, w)
    assert_bitwise(run_fp("Reshape", x, shape=[0, -1])[0], x.reshape(2, 8))
    assert_bitwise(run_fp("Flatten", x, axis=2)[0], x.reshape(4, 4))
    assert_bitwise(run_fp("Unsqueeze", x, axes=[0, -1])[0], x[None, ..., None])
    assert_bitwise(run_fp("Squeeze", y, axes=[1])[0], y[:, 0])
    assert_bitwise(run_fp("Expand", y, shape=[3, 2, 2, 1])[0], np.broadcast_to(y, (3, 2, 2, 4)))
    assert_bitwise(run_fp("Tile", y, repeats=[1, 2, 2])[0], np.tile(y, (1, 2, 2)))
    idx = i64([[1, -1], [0, 0]])
    assert_bitwise(run_fp("Gather", x, idx, axis=2)[0], ref("Gather", [x, idx], axis=2)[0])
    assert_bitwise(run_fp("Gather", x, i64(-1), axis=0)[0], x[-1])
    d = rng_f32(28, (1, 8, 2, 2))
    for mode in ("DCR", "CRD"):
        assert_bitwise(run_fp("DepthToSpace", d, blocksize=2, mode=mode)[0],
                       ref("DepthToSpace", [d], blocksize=2, mode=mode)[0])
    assert_bitwise(run_fp("SpaceToDepth", rng_f32(29, (1, 2, 4, 2)), blocksize=2)[0],
                   ref("SpaceToDepth", [rng_f32(29, (1, 2, 4, 2))], blocksize=2)[0])


def test_np_reductions_and_pools():
    x = rng_f32(30, (2, 3, 4))
    x[0, 1, 2], x[1, 0, 0], x[1, 2, 3] = np.nan, -0.0, np.inf
    with np.errstate(all="ignore"):
        def seq_sum(a, axes):  # left to right, row-major over the reduced axes
            kept = [i for i in range(a.ndim) if i not in axes]
            t = np.transpose(a, kept + list(axes)).reshape([a.shape[i] for i in kept] + [-1])
            acc = t[..., 0].copy()
            for k in range(1, t.shape[-1]):
                acc = acc + t[..., k]
            return acc
        assert_bitwise(run_fp("ReduceSum", x, axes=[0, 2], keepdims=0)[0], seq_sum(x, [0, 2]))
        assert_bitwise(run_fp("ReduceMean", x, axes=[1])[0], (seq_sum(x, [1]) / f32(3))[:, None, :])
        assert_bitwise(run_fp("ReduceSumSquare", x, axes=[2], keepdims=0)[0], seq_sum(x * x, [2]))
        assert_bitwise(run_fp("ReduceMax", x, axes=[1], keepdims=0)[0], np.max(x, axis=1))
        assert_bitwise(run_fp("ReduceMin", x, keepdims=0)[0], np.min(x))
        assert_bitwise(run_fp("ReduceProd", x, axes=[2], keepdims=0)[0], x[..., 0] * x[..., 1] * x[..., 2] * x[..., 3])
        assert_bitwise(run_fp("ReduceSum", x, noop_with_empty_axes=1)[0], x)
        z = np.array([[0.0, -0.0], [-0.0, 0.0]], f32)
        assert_bitwise(run_fp("ReduceMax", z, axes=[1], keepdims=0)[0], np.max(z, axis=1))
        p = rng_f32(31, (1, 2, 4, 5))
        p[0, 0, 1, 1] = np.nan
        for attrs in ({"kernel_shape": [2, 2]}, {"kernel_shape": [3, 2], "strides": [2, 2], "pads": [1, 0, 1, 1]},
                      {"kernel_shape": [2, 3], "strides": [2, 2], "ceil_mode": 1},
                      {"kernel_shape": [2, 2], "pads": [1, 1, 1, 1], "count_include_pad": 1}):
            got = run_fp("AveragePool", p, **attrs)[0]  # (onnx.reference's AveragePool skips NaNs)
            np.testing.assert_allclose(got, ort("AveragePool", [p], **attrs)[0], rtol=1e-5, equal_nan=True)
            if "count_include_pad" not in attrs:
                got = run_fp("MaxPool", p, **attrs)[0]
                assert_bitwise(got, ref("MaxPool", [p], **attrs)[0])
        assert_bitwise(run_fp("GlobalMaxPool", p)[0], np.max(p, axis=(2, 3), keepdims=True))
        q = rng_f32(32, (1, 2, 2, 2))
        assert_bitwise(run_fp("GlobalAveragePool", q)[0], (seq_sum(q, [2, 3]) / f32(4)).reshape(1, 2, 1, 1))


def test_np_softmax_body_structure():
    # Transcendentals are uninterpreted: check the structure through a domain where exp/log are known.
    class Known(FP32Domain):
        def exp(self, x):
            return self.add(x, self.const(1.0))  # a stand-in that z3 can compute

        def log(self, x):
            return self.mul(x, self.const(2.0))
    d = Known()
    x = np.array([[1.5, -0.25, 3.0]], f32)
    y = evaluate(d, "Softmax", [constant_tensor(d, x)], {})[0]
    t = x - x.max(axis=-1, keepdims=True)
    e = t + f32(1)
    s = (e[:, :1] + e[:, 1:2]) + e[:, 2:]
    assert_bitwise(np.array([[d.value_of(None, v) for v in r] for r in y], f32), e / s)
    y = evaluate(d, "LogSoftmax", [constant_tensor(d, x)], {})[0]
    assert_bitwise(np.array([[d.value_of(None, v) for v in r] for r in y], f32), t - s * f32(2))


class _StandIns(FP32Domain):
    """Float32 semantics with computable stand-ins for the uninterpreted functions, so that the structure of
    composite ops (their function bodies) can be compared with numpy bit for bit."""
    FNS = {"exp": lambda x: x * f32(0.5) + f32(1), "log": lambda x: x * f32(2), "erf": lambda x: x * f32(0.25),
           "tanh": lambda x: x * f32(0.75)}

    def func(self, name, *args):
        k = {"exp": (0.5, 1.0), "log": (2.0, None), "erf": (0.25, None), "tanh": (0.75, None)}[name]
        r = self.mul(args[0], self.const(k[0]))
        return r if k[1] is None else self.add(r, self.const(k[1]))


def test_np_composite_activations_follow_function_bodies():
    d = _StandIns()
    x = SPECIAL
    F = _StandIns.FNS
    one, zero = f32(1), f32(0)

    def run(op, **attrs):
        y = evaluate(d, op, [constant_tensor(d, x)], attrs)[0]
        return np.array([d.value_of(None, v) for v in y], f32)
    with np.errstate(all="ignore"):
        a = f32(0.7)
        cases = {
            "Sigmoid": (one / (one + F["exp"](-x)), {}),
            "Softplus": (F["log"](F["exp"](x) + one), {}),
            "Elu": (np.where(x < 0, a * (F["exp"](x) - one), x), {"alpha": 0.7}),
            "Selu": (np.where(x < 0, f32(1.5) * (a * F["exp"](x) - a), f32(1.5) * x), {"alpha": 0.7, "gamma": 1.5}),
            "Gelu": ((f32(0.5) * x) * (one + F["erf"](x / np.sqrt(f32(2)))), {}),
            "Mish": (x * F["tanh"](F["log"](F["exp"](x) + one)), {}),
            "ThresholdedRelu": (np.where(a < x, x, zero), {"alpha": 0.7}),
            "Tanh": (F["tanh"](x), {}),
        }
        for op, (want, attrs) in cases.items():
            assert_bitwise(run(op, **attrs), want)


def test_real_concrete_values():
    d = RealDomain()
    x = np.array([2.5, -2.5, 0.5, 1.5, -0.4, -1.5, 3.0])
    for op, want in (("Round", [2, -2, 0, 2, 0, -2, 3]), ("Floor", np.floor(x)), ("Ceil", np.ceil(x)),
                     ("Relu", np.maximum(x, 0)), ("Abs", np.abs(x)), ("Sign", np.sign(x))):
        y = evaluate(d, op, [constant_tensor(d, x)], {})[0]
        assert [d.value_of(None, v) for v in y] == list(map(float, want)), op
    xs = rng_f32(40, (1, 2, 3, 3)).astype(np.float64)
    ws = rng_f32(41, (3, 2, 2, 2)).astype(np.float64)
    y = evaluate(d, "Conv", [constant_tensor(d, xs), constant_tensor(d, ws)], {"pads": [1, 1, 0, 0]})[0]
    got = np.vectorize(lambda v: d.value_of(None, v), otypes=[float])(y)
    np.testing.assert_allclose(got, ref("Conv", [xs.astype(f32), ws.astype(f32)], pads=[1, 1, 0, 0])[0], rtol=1e-5)
    y = evaluate(d, "AveragePool", [constant_tensor(d, xs)], {"kernel_shape": [2, 2], "pads": [1, 1, 1, 1]})[0]
    got = np.vectorize(lambda v: d.value_of(None, v), otypes=[float])(y)
    np.testing.assert_allclose(got, ort("AveragePool", [xs.astype(f32)], kernel_shape=[2, 2], pads=[1, 1, 1, 1])[0],
                               rtol=1e-5)


# --- other float formats (exact elementwise rules are proved in each) -------------------------------

@pytest.mark.parametrize("fmt,np_dtype", [("float16", np.float16), ("double", np.float64)])
def test_other_formats_round_constants_and_clip_to_their_own_range(fmt, np_dtype):
    e, m, top = FP_FORMATS[fmt]
    dom = FPDomain(fmt, e, m, top)
    assert dom.value_of(None, dom.const(0.1)) == float(np_dtype(0.1)) or fmt == "double"
    x = constant_tensor(dom, np.float64(np.inf))
    (y,) = evaluate(dom, "Clip", [x], {})
    assert dom.value_of(None, y[()]) == float(np.finfo(np_dtype).max) or fmt == "double"
    a, b = symbolic(dom, "a", ()), symbolic(dom, "b", ())
    (s1,), (s2,) = ev(dom, "Add", a, b), ev(dom, "Add", b, a)
    assert check(dom, s1, s2)[0] == "proved"
    c = symbolic(dom, "c", ())
    (p,) = ev(dom, "Add", ev(dom, "Add", a, b)[0], c)
    (q,) = ev(dom, "Add", a, ev(dom, "Add", b, c)[0])
    # Not associative in this format either: (1 + h) + h rounds to 1 (a tie to even) while 1 + (h + h) = 1 + ulp,
    # with h half an ulp of 1. The witness is given: an open search over float64 can outlast Z3's time limit.
    half_ulp = 2.0 ** -m
    witness = [a[()] == dom.const(1.0), b[()] == dom.const(half_ulp), c[()] == dom.const(half_ulp)]
    assert check(dom, p, q, premises=witness)[0] == "refuted"
