"""Small ONNX matrix-product models with numpy references, the kernel families of the GPU's tensor-core
matmul (:mod:`cuvil.targets.ptx.matmul_mma`): a linear layer with bias and erf GELU (batched rows), Q·Kᵀ
(batched heads, the transpose folded into the loads), P·V (:func:`batched_matmul`) and Gemm(transB) with a
residual add. Used by tests/test_gpu_tensor_cores.py, tests/test_gpu_matmul_simt.py and bench/gpu/."""
import numpy as np
from onnx import TensorProto, helper, numpy_helper


def _model(nodes, inputs, outputs, inits):
    g = helper.make_graph(nodes, "mm", inputs, outputs, inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _t(name, shape):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, list(shape))


def linear_gelu(b=2, m=40, k=272, n=48, seed=0):
    """x[b, m, k] @ w[k, n] + bias, then erf GELU (the FFN's first GEMM, epilogue fused)."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    half = numpy_helper.from_array(np.array(0.5, np.float32), "half")
    one = numpy_helper.from_array(np.array(1.0, np.float32), "one")
    rs2 = numpy_helper.from_array(np.array(1 / np.sqrt(2), np.float32), "rs2")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["t"]), helper.make_node("Add", ["t", "bias"], ["u"]),
             helper.make_node("Mul", ["u", "rs2"], ["v"]), helper.make_node("Erf", ["v"], ["e"]),
             helper.make_node("Add", ["e", "one"], ["e1"]), helper.make_node("Mul", ["u", "e1"], ["u1"]),
             helper.make_node("Mul", ["u1", "half"], ["y"])]
    model = _model(nodes, [_t("x", (b, m, k))], [_t("y", (b, m, n))],
                   [numpy_helper.from_array(w, "w"), numpy_helper.from_array(bias, "bias"), half, one, rs2])

    def ref(x):
        from math import erf
        u = x.astype(np.float64) @ w + bias
        return (0.5 * u * (1 + np.vectorize(erf)(u / np.sqrt(2)))).astype(np.float32)
    return model, ref


def attention_scores(b=2, h=3, s=40, d=32):
    """q[b, h, s, d] @ transpose(k[b, h, s, d]) (Q·Kᵀ as torch exports it: the transpose folded into B's loads)."""
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
             helper.make_node("MatMul", ["q", "kt"], ["y"])]
    model = _model(nodes, [_t("q", (b, h, s, d)), _t("k", (b, h, s, d))], [_t("y", (b, h, s, s))], [])
    return model, lambda q, k: (q.astype(np.float64) @ np.swapaxes(k, -1, -2)).astype(np.float32)


def gemm_transb_residual(m=24, k=200, n=56, seed=1):
    """Gemm(transB=1) with bias, plus a residual input (GPT-2 / Linear layers exported as Gemm)."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
    c = rng.standard_normal(n).astype(np.float32)
    nodes = [helper.make_node("Gemm", ["x", "w", "c"], ["t"], transB=1), helper.make_node("Add", ["t", "r"], ["y"])]
    model = _model(nodes, [_t("x", (m, k)), _t("r", (m, n))], [_t("y", (m, n))],
                   [numpy_helper.from_array(w, "w"), numpy_helper.from_array(c, "c")])
    return model, lambda x, r: (x.astype(np.float64) @ w.T + c + r).astype(np.float32)


def batched_matmul(b=2, h=3, m=40, k=40, n=32):
    """p[b, h, m, k] @ v[b, h, k, n] (attention's P·V: both operands inputs, batched over heads)."""
    nodes = [helper.make_node("MatMul", ["p", "v"], ["y"])]
    model = _model(nodes, [_t("p", (b, h, m, k)), _t("v", (b, h, k, n))], [_t("y", (b, h, m, n))], [])
    return model, lambda p, v: (p.astype(np.float64) @ v).astype(np.float32)


FAMILIES = {"linear_gelu": linear_gelu, "attention_scores": attention_scores,
            "gemm_transb_residual": gemm_transb_residual}


# --- x86 narrowed products (tests/test_x86_bf16.py, tests/test_x86_fp16.py) -------------------------------

#: unit roundoff of the formats a narrowed product rounds its operands to
UNIT_ROUNDOFF = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -11}


def rounded(a, fmt: str) -> np.ndarray:
    """``a`` rounded to ``fmt`` ("bf16" or "fp16", nearest even), as float64."""
    from cuvil.kernels.contraction import narrow_values
    return narrow_values(a, fmt).astype(np.float64)


def fp8_rounded(a, e: int) -> np.ndarray:
    """``a`` as a fp8 product reads it (:mod:`cuvil.targets.ptx.matmul_mma`): ``a * 2^-e`` rounded to E4M3
    (nearest even, ml_dtypes' float8_e4m3fn), scaled back by ``2^e``, as float64."""
    import ml_dtypes
    x = (np.asarray(a, np.float64) * 2.0 ** -e).astype(np.float32)
    return x.astype(ml_dtypes.float8_e4m3fn).astype(np.float64) * 2.0 ** e


def constant_weight_matmul(k, m, bias=True, seed=0, batch_dims=("N",)):
    """``x[*batch_dims, k] @ w[k, m]`` (+ ``b[m]``) with ``w`` and ``b`` constant (standard normal): the model, w,
    and b (0.0 without the bias)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((k, m)).astype(np.float32)
    b = rng.standard_normal(m).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y0" if bias else "y"])]
    inits = [numpy_helper.from_array(w, "w")]
    if bias:
        nodes.append(helper.make_node("Add", ["y0", "b"], ["y"]))
        inits.append(numpy_helper.from_array(b, "b"))
    model = _model(nodes, [_t("x", list(batch_dims) + [k])], [_t("y", list(batch_dims) + [m])], inits)
    return model, w, (b if bias else 0.0)


def check_narrowed_product(y, a, w, k, fmt: str, extra=0.0, effect: float = 30.0) -> None:
    """``y`` (a library's ``a @ w`` + ``extra`` with both operands narrowed to ``fmt`` and float32 sums) against
    float64 references: with the operands rounded the same way, within the float32 sums' bound ``2 K 2^-24 (|a|
    @ |w|)`` elementwise (a factor 2 for the bias add and the epilogue); against the unrounded operands within
    the rounding of both, ``(2u + u^2 + K 2^-23) (|a| @ |w|)``; and the rounding really in effect: the error
    against the unrounded product at least ``effect`` times the one against the rounded (or both 0)."""
    u = UNIT_ROUNDOFF[fmt]
    mag = np.abs(a.astype(np.float64)) @ np.abs(w.astype(np.float64))
    near = rounded(a, fmt) @ rounded(w, fmt) + extra
    exact = a.astype(np.float64) @ w.astype(np.float64) + extra
    tiny = 1e-6 * (np.abs(extra) if np.ndim(extra) else abs(extra))
    assert np.all(np.abs(y - near) <= 2 * k * 2.0 ** -24 * mag + tiny + 1e-30), float(np.abs(y - near).max())
    assert np.all(np.abs(y - exact) <= (2 * u + u * u + k * 2.0 ** -23) * mag + tiny + 1e-30)
    far, close = float(np.abs(y - exact).max()), float(np.abs(y - near).max())
    assert far > effect * close or far == 0, (far, close)
