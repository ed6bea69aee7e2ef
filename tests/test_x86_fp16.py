"""float16 products on x86 (cuvil.targets.x86.gemm_fp16: MatMul / Gemm nodes whose ``precision`` is "fp16" on
float16 weight panels, widened as loaded, float32 sums) against numpy references.

The nodes are narrowed by the precision policy (``Pipeline.compile(precision="fp16", input_ranges=...)``),
which narrows a MatMul / Gemm where x86's ``precision_ops`` lists it (CPUs with F16C) and its ranges are
certified for float16; the tests check that it did. Skipped, with the reason, on CPUs without F16C.

Error bounds. A narrowed node rounds its inputs to float16 (11 significant bits, nearest even: relative error
at most u = 2^-11 each) and sums their exact products in float32. Against the reference that rounds the inputs
the same way and sums in float64, only the float32 sums differ: elementwise at most ``K * 2^-24 * (|a| @ |b|)``
(checked with a factor 2 for the bias add and the epilogue). Against the exact float32 product the rounding
of both inputs adds at most ``(2u + u^2) * (|a| @ |b|)``: the tests check ``(2^-10 + 2^-22 + K * 2^-23) *
(|a| @ |b|)`` elementwise, and that the rounding is really there (the float32 product is far closer).
"""
import attrs
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from cuvil import Pipeline
from cuvil.errors import CuvilError
from cuvil.precision.policy import auto_order
from cuvil.targets.x86 import cpu as cpu_mod
from cuvil.targets.x86.cpu import cpu_label, host_cpu
from cuvil.targets.x86.gemm_fp16 import FP16_OPS, fp16_formats, fp16_isa_checks
from cuvil.targets.x86.target import TARGET as X86
from cuvil.testing.conv_models import conv_epilogue_model
from cuvil.testing.matmul_models import check_narrowed_product, constant_weight_matmul, rounded

HAS_FP16 = "fp16" in fp16_formats(host_cpu())
if not HAS_FP16:
    print(f"test_x86_fp16: kernel tests skipped, this CPU has no F16C ({cpu_label()})")
needs_fp16 = pytest.mark.skipif(not HAS_FP16, reason=f"no F16C on this CPU ({cpu_label()}): the fp16 kernels "
                                                     "cannot run here")


def narrowed(model, ranges=None, **compile_kw):
    """``model`` compiled at ``precision="fp16"``, its float inputs declared within ``ranges`` (default ±8)."""
    if ranges is None:
        ranges = {vi.name: (-8.0, 8.0) for vi in model.graph.input}
    art = Pipeline.from_onnx(model).optimize().compile(precision="fp16", input_ranges=ranges, **compile_kw)
    nodes = art.manifest["precision"]["nodes"]
    assert any(v["format"] == "fp16" for v in nodes.values()), nodes
    return art


def fp16(a):
    return rounded(a, "fp16")


def fp16_steps(art):
    return [s for s in art.manifest["steps"] if s.get("precision") == "fp16"]


def check_product(y, a, w, k, extra=0.0):
    """The float16 bounds of :func:`cuvil.testing.matmul_models.check_narrowed_product` (module docstring)."""
    check_narrowed_product(y, a, w, k, "fp16", extra)


def test_formats_offered():
    """fp16 is offered for MatMul / Gemm exactly where the CPU has F16C and AVX2 or AVX-512; never for Conv."""
    real = host_cpu()
    with_f16c = attrs.evolve(real, features=frozenset(real.features | {"f16c", "avx2"}))
    assert fp16_formats(with_f16c) == (("fp16",) if with_f16c.vector_bits >= 256 else ())
    assert fp16_formats(attrs.evolve(real, features=frozenset(real.features - {"f16c"}))) == ()
    ops = X86.precision_ops(X86.options_type())
    if HAS_FP16:
        assert ops["fp16"] == FP16_OPS and "Conv" not in ops["fp16"]
    else:
        assert "fp16" not in ops


def test_auto_order_follows_the_target():
    """``auto`` tries formats narrowest first and, among formats of one width, in the target's order: x86
    lists its bf16 kernels (faster there) before its float16 weight panels, the GPU fp16 first."""
    x86_like = {"bf16": frozenset({"MatMul"}), "fp16": frozenset({"MatMul"})}
    gpu_like = {"fp16": frozenset({"MatMul"}), "bf16": frozenset({"MatMul"})}
    assert auto_order(x86_like) == ["int8", "bf16", "fp16"]
    assert auto_order(gpu_like) == ["int8", "fp16", "bf16"]
    assert auto_order({}) == ["int8", "fp16", "bf16"]
    assert auto_order({"fp16": frozenset()}) == ["int8", "fp16", "bf16"]


def test_isa_checks():
    """The library's C check names F16C (and AVX512-FP16 where LLVM converts with its vcvtph2psx) when a
    kernel is on the f16c path or the model holds float16 values, never otherwise."""
    real = host_cpu()
    plain = attrs.evolve(real, features=frozenset((real.features | {"f16c"}) - {"avx512fp16"}))
    fp16cpu = attrs.evolve(real, features=frozenset(real.features | {"f16c", "avx512fp16"}))
    used = {"narrow_paths": {"k0": "f16c"}}
    assert fp16_isa_checks(plain, None, {"narrow_paths": {"k0": "avx512_bf16"}}) == []
    assert fp16_isa_checks(plain, used, None) == ["f16c"]
    assert fp16_isa_checks(fp16cpu, None, used) == ["f16c", "avx512fp16"]
    assert fp16_isa_checks(fp16cpu, None, None, half_values=True) == ["f16c", "avx512fp16"]   # a float16 model


@needs_fp16
@pytest.mark.parametrize("k,m", [(77, 100), (64, 64), (768, 200), (8, 130)],
                         ids=["odd-K-col-tail", "exact", "long-K", "K8"])
def test_matmul_symbolic_rows(k, m):
    """Rows symbolic (N: 1..64: the one-row GEMV tile, partial row tiles), M past whole panels; 1 and 2
    threads give the same bits."""
    model, w, b = constant_weight_matmul(k, m)
    art = narrowed(model, shape_profiles={"N": (1, 8, 64)})
    steps = fp16_steps(art)
    assert steps and all(s["path"] == "f16c" and s["kernel"] == "gemm" for s in steps), art.manifest["steps"]
    mod = art.model()
    rng = np.random.default_rng(1)
    for n in (1, 7, 13, 64):
        x = rng.standard_normal((n, k)).astype(np.float32)
        y1 = mod.run(x, num_threads=1)[0]
        np.testing.assert_array_equal(y1, mod.run(x, num_threads=2)[0])
        check_product(y1.astype(np.float64), x, w, k, b)


@needs_fp16
def test_weights_half_the_bytes():
    """The product's weights are stored as float16: the library's weights shrink by about half."""
    model, _, _ = constant_weight_matmul(512, 1024, bias=False)
    f32 = Pipeline.from_onnx(model).optimize().compile(shape_profiles={"N": (1, 1, 8)})
    f16 = narrowed(model, shape_profiles={"N": (1, 1, 8)})
    assert f16.manifest["weights_bytes"] <= 0.55 * f32.manifest["weights_bytes"], \
        (f16.manifest["weights_bytes"], f32.manifest["weights_bytes"])


@needs_fp16
def test_gemm_trans_b_and_3d_matmul():
    """Gemm with transB, alpha and a bias C; a 3-D MatMul (batch x sequence rows, both symbolic) with GELU
    after it (the epilogue on the accumulators)."""
    rng = np.random.default_rng(2)
    k, m = 96, 70
    wt = rng.standard_normal((m, k)).astype(np.float32)
    c = rng.standard_normal(m).astype(np.float32)
    g = helper.make_graph([helper.make_node("Gemm", ["x", "w", "c"], ["y"], transB=1, alpha=0.5)], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", m])],
                          [numpy_helper.from_array(wt, "w"), numpy_helper.from_array(c, "c")])
    art = narrowed(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), shape_profiles={"N": (1, 4, 32)})
    assert fp16_steps(art)
    x = rng.standard_normal((5, k)).astype(np.float32)
    check_product(art.model().run(x)[0].astype(np.float64), 0.5 * x, wt.T, k, c)

    model, w, b = constant_weight_matmul(40, 48, batch_dims=("B", "S"))
    art = narrowed(model, shape_profiles={"B": (1, 2, 4), "S": (1, 5, 16)})
    assert fp16_steps(art)
    x = rng.standard_normal((3, 7, 40)).astype(np.float32)
    y = art.model().run(x)[0].astype(np.float64)
    check_product(y.reshape(21, 48), x.reshape(21, 40), w, 40, b)


@needs_fp16
def test_forms_without_an_fp16_kernel():
    """A narrowed node no float16 kernel takes (a Conv set to fp16 directly, a MatMul of two activations)
    still computes what its precision says: inputs rounded to float16, float32 sums. The policy never
    narrows a Conv to fp16 on x86 (no kernel): it says so."""
    rng = np.random.default_rng(7)
    model = conv_epilogue_model((1, 8, 10, 10), (16, 8, 3, 3), pads=[1, 1, 1, 1], epilogue=None)
    art = Pipeline.from_onnx(model).optimize().compile(precision="fp16", input_ranges={"x": (-8.0, 8.0)})
    rec = art.manifest["precision"]["nodes"]["conv"]
    assert rec["format"] == "fp32" and "no fp16 kernel for Conv" in rec["reason"], rec
    p = Pipeline.from_onnx(model).optimize()
    for n in p.graph.nodes:
        if n.op == "Conv":
            n.precision = "fp16"
    art = p.compile()
    assert not fp16_steps(art)
    x = rng.standard_normal((1, 8, 10, 10)).astype(np.float32)
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    xp = np.pad(fp16(x), [(0, 0), (0, 0), (1, 1), (1, 1)])
    cols = np.stack([xp[0, :, i:i + 10, j:j + 10] for i in range(3) for j in range(3)], 1).reshape(72, 100)
    wr = fp16(inits["w"]).reshape(16, 8, 9).reshape(16, 72)
    want = (wr @ cols + inits["b"].astype(np.float64)[:, None]).reshape(1, 16, 10, 10)
    mag = (np.abs(wr) @ np.abs(cols)).reshape(1, 16, 10, 10)
    y = art.model().run(x)[0].astype(np.float64)
    assert np.all(np.abs(y - want) <= 2 * 72 * 2.0 ** -24 * mag + 1e-6), float(np.abs(y - want).max())
    assert float(np.abs(y - want).max()) < 1e-4

    g = helper.make_graph([helper.make_node("MatMul", ["a", "b"], ["y"])], "g",
                          [helper.make_tensor_value_info("a", TensorProto.FLOAT, [5, 40]),
                           helper.make_tensor_value_info("b", TensorProto.FLOAT, [40, 24])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [5, 24])])
    art = narrowed(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
    a, b = rng.standard_normal((5, 40)).astype(np.float32), rng.standard_normal((40, 24)).astype(np.float32)
    check_product(art.model().run(a, b)[0].astype(np.float64), a, b, 40)


@needs_fp16
def test_auto_on_this_cpu():
    """``auto`` on x86 takes bf16 where this CPU has bf16 kernels (they compute faster), else fp16; the
    manifest says which."""
    model, w, b = constant_weight_matmul(64, 96)
    art = Pipeline.from_onnx(model).optimize().compile(precision="auto", input_ranges={"x": (-8.0, 8.0)},
                                                       shape_profiles={"N": (1, 2, 8)})
    fmts = {v["format"] for v in art.manifest["precision"]["nodes"].values()}
    want = "bf16" if "bf16" in X86.precision_ops(X86.options_type()) else "fp16"
    assert want in fmts, art.manifest["precision"]["nodes"]


@needs_fp16
def test_refused_without_f16c(monkeypatch):
    """A library with fp16 kernels, loaded on a CPU without F16C: a CuvilError that says which kernels need
    it, not SIGILL."""
    model, _, _ = constant_weight_matmul(32, 64, bias=False)
    art = narrowed(model, shape_profiles={"N": (1, 2, 8)})
    assert "f16c" in art.manifest["target"]["isa_features"]
    real = host_cpu()
    monkeypatch.setattr(cpu_mod, "host_cpu", lambda: attrs.evolve(real, features=real.features - {"f16c"}))
    from cuvil.targets.x86.loader import _check_isa
    with pytest.raises(CuvilError) as e:
        _check_isa(art.manifest, art.path)
    text = str(e.value) + " ".join(getattr(e.value, "details", []) or [])
    assert "f16c" in text and "fp16 kernels widen float16 weights" in text


# float16 models (every tensor float16, as `model.half()` exports them): the products run on the same float16
# weight panels (MatMul / Gemm: W as it is, A widened exactly, float32 sums, one rounding to float16), the
# convolutions on the float32 kernels with input and weights widened exactly; before, both were loop nests (a
# 768 x 3072 MatMul at 128 rows: 22.9 ms against 4.0 ms now), and a 3x3 Conv did not compile (Winograd).

def half_model(nodes, inputs, outputs, inits):
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT16, s) for n, s in inputs],
                          [helper.make_tensor_value_info(n, TensorProto.FLOAT16, s) for n, s in outputs],
                          [numpy_helper.from_array(v, k) for k, v in inits.items()])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def within_one_half_ulp(y, want, frac=0.01, carried=0.0):
    """``y`` (float16) against the float64 ``want``: every element within one float16 step of ``want`` rounded
    (the float32 sums' own error can move a value across a rounding boundary) plus ``carried`` (a step of an
    intermediate float16 rounding that the same error can flip), and at most ``frac`` of them not the
    correctly rounded value."""
    r = want.astype(np.float16)
    step = np.abs(np.spacing(np.abs(r).astype(np.float16))).astype(np.float64) + carried
    assert np.all(np.abs(y.astype(np.float64) - r.astype(np.float64)) <= step), \
        float(np.max(np.abs(y.astype(np.float64) - r.astype(np.float64)) / step))
    assert np.mean(y != r) <= frac, float(np.mean(y != r))


@needs_fp16
def test_float16_model_matmul_bias():
    """MatMul + Add (bias) in float16, rows symbolic: the product on the f16c kernel, within a float16 step of
    the double-rounded reference (the product rounded, then the sum rounded, as ONNX computes it)."""
    rng = np.random.default_rng(11)
    k, m = 200, 96
    w = (rng.standard_normal((k, m)) / 8).astype(np.float16)
    bias = rng.standard_normal(m).astype(np.float16)
    model = half_model([helper.make_node("MatMul", ["x", "w"], ["p"]), helper.make_node("Add", ["p", "b"], ["y"])],
                       [("x", ["N", k])], [("y", ["N", m])], {"w": w, "b": bias})
    art = Pipeline.from_onnx(model).optimize().compile(shape_profiles={"N": (1, 8, 64)})
    assert [s["path"] for s in art.manifest["steps"] if s.get("kernel") == "gemm"] and \
        all(s.get("path") == "f16c" for s in art.manifest["steps"] if s.get("kernel") == "gemm"), art.manifest["steps"]
    mod = art.model()
    for n in (1, 5, 64):
        x = rng.standard_normal((n, k)).astype(np.float16)
        y = mod.run(x)[0]
        assert y.dtype == np.float16
        prod = (x.astype(np.float64) @ w.astype(np.float64)).astype(np.float16)
        within_one_half_ulp(y, prod.astype(np.float64) + bias.astype(np.float64),
                            carried=np.spacing(np.abs(prod)).astype(np.float64))


@needs_fp16
def test_float16_model_gemm():
    rng = np.random.default_rng(12)
    k, m = 64, 40
    wt = (rng.standard_normal((m, k)) / 4).astype(np.float16)
    c = rng.standard_normal(m).astype(np.float16)
    model = half_model([helper.make_node("Gemm", ["x", "w", "c"], ["y"], transB=1, alpha=0.5, beta=2.0)],
                       [("x", [6, k])], [("y", [6, m])], {"w": wt, "c": c})
    art = Pipeline.from_onnx(model).optimize().compile()
    assert any(s.get("path") == "f16c" for s in art.manifest["steps"]), art.manifest["steps"]
    x = rng.standard_normal((6, k)).astype(np.float16)
    want = 0.5 * (x.astype(np.float64) @ wt.T.astype(np.float64)) + 2.0 * c.astype(np.float64)
    within_one_half_ulp(art.model().run(x)[0], want)


@needs_fp16
@pytest.mark.parametrize("ws,attrs", [((32, 16, 3, 3), {"pads": [1, 1, 1, 1]}),
                                      ((24, 16, 1, 1), {"strides": [2, 2]}),
                                      ((16, 4, 3, 3), {"pads": [1, 1, 1, 1], "group": 4})],
                         ids=["3x3", "1x1-stride2", "grouped"])
def test_float16_model_conv(ws, attrs):
    """A float16 Conv (+ Relu) compiles (a 3x3 one did not: the Winograd rewrite took it) and runs on the
    GEMM kernels, within a float16 step of the correctly rounded result."""
    rng = np.random.default_rng(13)
    w = (rng.standard_normal(ws) / np.sqrt(np.prod(ws[1:]))).astype(np.float16)
    b = rng.standard_normal(ws[0]).astype(np.float16)
    model = half_model([helper.make_node("Conv", ["x", "w", "b"], ["c"], **attrs), helper.make_node("Relu", ["c"], ["y"])],
                       [("x", [1, 16, 14, 14])], [("y", None)], {"w": w, "b": b})
    art = Pipeline.from_onnx(model).optimize().compile()
    assert any(s.get("kernel") == "gemm" for s in art.manifest["steps"]), art.manifest["steps"]
    x = rng.standard_normal((1, 16, 14, 14)).astype(np.float16)
    y = art.model().run(x)[0]
    g, s, p = attrs.get("group", 1), attrs.get("strides", [1, 1])[0], attrs.get("pads", [0] * 4)[0]
    xp = np.pad(x.astype(np.float64), [(0, 0), (0, 0), (p, p), (p, p)])
    kh = ws[2]
    oh = (14 + 2 * p - kh) // s + 1
    cg, mg = 16 // g, ws[0] // g
    want = np.zeros((1, ws[0], oh, oh))
    for gi in range(g):
        cols = np.stack([xp[0, gi * cg:(gi + 1) * cg, i:i + s * oh:s, j:j + s * oh:s]
                         for i in range(kh) for j in range(kh)], 1).reshape(cg * kh * kh, oh * oh)
        wg = w[gi * mg:(gi + 1) * mg].astype(np.float64).reshape(mg, cg * kh * kh)
        want[0, gi * mg:(gi + 1) * mg] = (wg @ cols).reshape(mg, oh, oh)
    want = np.maximum(want + b.astype(np.float64)[None, :, None, None], 0)
    within_one_half_ulp(y, want)


EXPORTS = ["bert.torchscript", "bert.dynamo", "distilbert.torchscript", "roberta.dynamo", "vit.torchscript",
           "whisper_encoder.torchscript"]


@needs_fp16
@pytest.mark.parametrize("name", EXPORTS)
def test_float16_exports(name):
    """The torch.onnx exports converted to float16 as users convert them (onnxconverter_common, every tensor
    float16) compile on x86 (before: their attention was fused into FusedAttention, which took float32 only, and
    the build failed) with their products on the GEMM kernels and their attention in the fused kernel (operands
    widened), and agree with onnxruntime's float32 run of the original export and its float16 run of the
    converted one within float16's error."""
    import os
    import warnings
    import onnx
    import onnxruntime as ort
    float16 = pytest.importorskip("onnxconverter_common.float16", reason="pip install onnxconverter-common")
    root = os.path.join(os.path.dirname(__file__), "fixtures", "exports")
    m = onnx.load(os.path.join(root, name + ".onnx"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")        # its notes on truncated tiny constants
        h = float16.convert_float_to_float16(m, keep_io_types=False)
    rng = np.random.default_rng(0)
    feeds = {}
    for i in h.graph.input:
        dims = [d.dim_value or (1 if k == 0 else 16) for k, d in enumerate(i.type.tensor_type.shape.dim)]
        et = i.type.tensor_type.elem_type
        if et == TensorProto.INT64:
            v = np.ones(dims) if "mask" in i.name else np.zeros(dims) if "type" in i.name else rng.integers(0, 100, dims)
            feeds[i.name] = v.astype(np.int64)
        else:
            feeds[i.name] = rng.standard_normal(dims).astype(np.float16)
    if "attention_mask" in feeds:
        feeds["attention_mask"][0, -5:] = 0          # padded keys
    art = Pipeline.from_onnx(h).optimize().compile(input_shapes={k: list(v.shape) for k, v in feeds.items()})
    assert any(s.get("kernel") == "gemm" for s in art.manifest["steps"]), art.manifest["steps"]
    # attention fused into the float32 kernel, the float16 operands widened into it
    assert any(s.get("op") == "FusedAttention" for s in art.manifest["steps"]), art.manifest["steps"]
    got = art.model().run(*[feeds[i.name] for i in h.graph.input])
    assert all(g.dtype == np.float16 for g in got)
    f32 = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {k: v.astype(np.float32) if v.dtype == np.float16 else v for k, v in feeds.items()})
    f16 = ort.InferenceSession(h.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    for g, a, b in zip(got, f32, f16):
        g = np.asarray(g, np.float64)
        scale = float(np.abs(a).max())
        assert np.isfinite(g).all()
        assert float(np.abs(g - a).max()) <= 5e-3 * scale, (name, float(np.abs(g - a).max()) / scale)
        ort16 = float(np.abs(np.asarray(b, np.float64) - a).max())
        assert float(np.abs(g - a).max()) <= 3 * ort16 + 1e-3 * scale, (name, float(np.abs(g - a).max()), ort16)


@needs_fp16
@pytest.mark.parametrize("op", ["GRU", "LSTM", "RNN"])
def test_float16_recurrent_with_bias(op):
    """A float16 GRU / LSTM / RNN with a bias: its input projection takes the float16 panels and the bias is
    added to the float32 sums (it failed to compile: 'Operands must be the same type, got (float, half)');
    against onnxruntime's float16 run."""
    import onnxruntime as ort
    rng = np.random.default_rng(14)
    gates = {"GRU": 3, "LSTM": 4, "RNN": 1}[op]
    h = 8
    w = (rng.standard_normal((1, gates * h, 16)) / 4).astype(np.float16)
    r = (rng.standard_normal((1, gates * h, h)) / 4).astype(np.float16)
    bias = (rng.standard_normal((1, 2 * gates * h)) / 4).astype(np.float16)
    model = half_model([helper.make_node(op, ["x", "w", "r", "b"], ["y"], hidden_size=h)],
                       [("x", [5, 2, 16])], [("y", None)], {"w": w, "r": r, "b": bias})
    art = Pipeline.from_onnx(model).optimize().compile()
    x = rng.standard_normal((5, 2, 16)).astype(np.float16)
    y = art.model().run(x)[0].astype(np.float64)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert float(np.abs(y - want).max()) <= 4e-3, float(np.abs(y - want).max())


def test_isa_check_by_cpuid_bit(tmp_path):
    """F16C and AVX512-FP16 are checked by their cpuid bits, not by __builtin_cpu_supports names that GCC before
    12 does not know: the generated check compiles, and on this CPU names exactly the ones it lacks."""
    import shutil
    import subprocess
    from cuvil.targets.x86.model_c import CPUID_BITS, generate_isa_c
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    src = generate_isa_c("t", ["f16c", "avx512fp16"])
    assert "__builtin_cpu_supports(\"avx512fp16\")" not in src and "cuvil_cpuid_bit(7u, 0u, 3, 23)" in src
    (tmp_path / "isa.c").write_text(src.replace('#include "cuvil_runtime.h"', "#define CUVIL_HIDDEN"))
    (tmp_path / "main.c").write_text('#include <stdio.h>\nconst char *t__missing_isa(void);\n'
                                     'int main(void) { const char *m = t__missing_isa(); puts(m ? m : "-"); return 0; }\n')
    exe = tmp_path / "isa"
    subprocess.run([cc, "-O1", str(tmp_path / "isa.c"), str(tmp_path / "main.c"), "-o", str(exe)], check=True)
    got = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.strip()
    feats = host_cpu().features
    want = next((f for f in ("f16c", "avx512fp16") if f not in feats), "-")
    assert got == want, (got, want, sorted(CPUID_BITS))


@needs_fp16
def test_float16_decode_step_reads_the_cache_in_place():
    """A GPT-2 decode step (cuvil.testing.hf_models' graph, head size 32, 2 layers) as a float16 model:
    attention reads the float16 KV cache's rows in place, widening them as it loads them, instead of copying
    every key into float32 panels each step; within float16's error of onnxruntime's float32 run of the float32
    model, past 1 and 40."""
    import warnings
    import onnxruntime as ort
    from cuvil.testing.hf_models import gpt2_decode_model
    float16 = pytest.importorskip("onnxconverter_common.float16", reason="pip install onnxconverter-common")
    m = gpt2_decode_model(vocab=97, hidden=64, layers=2, heads=2, ffn=128, max_pos=128)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        h = float16.convert_float_to_float16(m, keep_io_types=False)
    art = Pipeline.from_onnx(h).optimize().compile(shape_profiles={
        "batch": (1, 1, 2), "past_sequence": (1, 16, 64), "total_sequence": (2, 17, 65)})
    steps = [s for s in art.manifest["steps"] if s.get("variant", "generic") == "generic"]
    assert any(s.get("op") == "FusedAttention" and s.get("kernel") == "attention" for s in steps), steps
    copies = [s["stage"] for s in steps if s.get("op") == "FusedAttention" and s.get("kernel") != "attention"
              and ("key" in s["stage"] or "value" in s["stage"])]
    assert not copies, copies
    f32 = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    mod = art.model()
    rng = np.random.default_rng(9)
    for past in (1, 40):
        feeds = {}
        for i in h.graph.input:
            dims = [d.dim_value or {"batch": 1, "past_sequence": past, "total_sequence": past + 1}[d.dim_param]
                    for d in i.type.tensor_type.shape.dim]
            if i.name == "input_ids":
                feeds[i.name] = np.full(dims, 7, np.int64)
            elif i.name == "attention_mask":
                feeds[i.name] = np.ones(dims, np.int64)
            else:
                feeds[i.name] = rng.standard_normal(dims).astype(np.float16)
        got = mod.run(*[feeds[i.name] for i in h.graph.input])
        want = f32.run(None, {k: v.astype(np.float32) if v.dtype == np.float16 else v for k, v in feeds.items()})
        for g, w in zip(got, want):
            g = np.asarray(g, np.float64)
            assert float(np.abs(g - w).max()) <= 5e-3 * float(np.abs(w).max()) + 1e-3, float(np.abs(g - w).max())
