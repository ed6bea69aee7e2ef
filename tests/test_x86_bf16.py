"""bf16 contractions on x86 (cuvil.targets.x86.gemm_bf16: vdpbf16ps micro-kernels for Conv, MatMul and Gemm
nodes whose ``precision`` is "bf16") against numpy references.

The nodes are narrowed by the precision policy (``Pipeline.compile(precision="bf16", input_ranges=...)``,
cuvil.precision), which narrows a Conv / MatMul / Gemm where x86's ``precision_ops`` lists it and its ranges are
certified; the tests check that it did. Skipped, with the reason, on CPUs without AVX512_BF16.

Error bounds. A narrowed node rounds its inputs to bfloat16 (8 significant bits, nearest even: relative
error at most u = 2^-8 each) and sums their exact products in float32. Against the reference that rounds the inputs the
same way and sums in float64, only the float32 sums differ: elementwise at most ``K * 2^-24 * (|a| @ |b|)``
(``K`` terms; checked with a factor 2 for the bias add and the epilogue). Against the exact float32 product
the rounding of both inputs adds at most ``(2u + u^2) * (|a| @ |b|)``, about ``2^-7 * (|a| @ |b|)``: the
tests check ``(2^-7 + 2^-16 + K * 2^-23) * (|a| @ |b|)`` elementwise. End to end (a ResNet-like and a BERT-like model),
the relative error against the float32 library is stated per test.
"""
import attrs
import ml_dtypes
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from cuvil import Pipeline
from cuvil.errors import CuvilError
from cuvil.targets.x86 import cpu as cpu_mod
from cuvil.targets.x86.cpu import cpu_label, host_cpu
from cuvil.targets.x86.gemm_bf16 import narrow_formats
from cuvil.targets.x86.tuning import X86Tuning
from cuvil.testing.bert_block import bert_block
from cuvil.testing.conv_models import conv_epilogue_model
from cuvil.testing.matmul_models import check_narrowed_product, constant_weight_matmul, rounded

HAS_BF16 = "bf16" in narrow_formats(host_cpu())
#: the direct vdpbf16ps kernels (bf16 Winograd, which a stride-1 3x3 convolution may otherwise take on a CPU without
#: AMX: tests/test_x86_bf16_winograd.py)
VDPBF16PS = X86Tuning(amx=False, bf16_winograd=False)
if not HAS_BF16:
    print(f"test_x86_bf16: skipped, this CPU has no AVX512_BF16 ({cpu_label()})")
pytestmark = pytest.mark.skipif(not HAS_BF16, reason=f"no AVX512_BF16 on this CPU ({cpu_label()}): the bf16 "
                                                     "kernels cannot run here")


def narrowed(model, ranges=None, **compile_kw):
    """``model`` compiled at ``precision="bf16"``, its float inputs declared within ``ranges`` (default every
    input ±8: the tests' standard normal samples), on the vdpbf16ps kernels even where the CPU has AMX (the AMX
    tiles: tests/test_x86_amx.py)."""
    if ranges is None:
        ranges = {vi.name: (-8.0, 8.0) for vi in model.graph.input}
    compile_kw.setdefault("tuning", VDPBF16PS)
    art = Pipeline.from_onnx(model).optimize().compile(precision="bf16", input_ranges=ranges, **compile_kw)
    nodes = art.manifest["precision"]["nodes"]
    assert any(v["format"] == "bf16" for v in nodes.values()), nodes
    return art


def bf16(a):
    return rounded(a, "bf16")


def bf16_steps(art):
    return [s for s in art.manifest["steps"] if s.get("precision") == "bf16"]


def check_rounded_conv(model, art, xs, ws, seed, strides=(1, 1), pads=(0, 0, 0, 0), dilations=(1, 1), group=1):
    """``art`` (``model``'s Conv, weights "w" and bias "b", narrowed to bf16) on a seeded standard normal input:
    the same bits at 1 and 2 threads, and within float32 summation error of a float64 convolution of the
    bfloat16-rounded operands (the property tests of the channel-lane and AMX kernels)."""
    x = np.random.default_rng(seed).standard_normal(xs).astype(np.float32)
    mod = art.model()
    y = mod.run(x, num_threads=1)[0].astype(np.float64)
    np.testing.assert_array_equal(y, mod.run(x, num_threads=2)[0])
    w = numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == "w"))
    b = numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == "b"))
    want, mag = conv_ref(bf16(x), bf16(w), b.astype(np.float64), list(strides), list(pads), list(dilations), group)
    k = ws[1] * ws[2] * ws[3]
    bias = np.abs(b).reshape(1, -1, 1, 1) * 2.0 ** -23
    assert np.all(np.abs(y - want) <= 2 * k * 2.0 ** -24 * mag + bias), float(np.abs(y - want).max())


def check_product(y, a, w, k, extra=0.0):
    """The bfloat16 bounds of :func:`cuvil.testing.matmul_models.check_narrowed_product` (module docstring)."""
    check_narrowed_product(y, a, w, k, "bf16", extra, effect=1e3)


@pytest.mark.parametrize("k,m", [(77, 100), (64, 64), (300, 33), (8, 130)], ids=["odd-K-col-tail", "exact", "long-K", "K8"])
def test_matmul_symbolic_rows(k, m):
    """Rows symbolic (N: 1..64, partial row tiles), K odd (a zero pair), M past whole 64-column panels."""
    model, w, b = constant_weight_matmul(k, m)
    art = narrowed(model, shape_profiles={"N": (1, 8, 64)})
    steps = bf16_steps(art)
    assert steps and all(s["path"] == "avx512_bf16" and s["kernel"] == "gemm" for s in steps), art.manifest["steps"]
    mod = art.model()
    rng = np.random.default_rng(1)
    for n in (1, 7, 13, 64):
        x = rng.standard_normal((n, k)).astype(np.float32)
        y1 = mod.run(x, num_threads=1)[0]
        np.testing.assert_array_equal(y1, mod.run(x, num_threads=2)[0])
        check_product(y1.astype(np.float64), x, w, k, b)


def test_gemm_trans_b_3d_matmul():
    """Gemm with transB and a bias C; a 3-D MatMul (batch x sequence rows, both symbolic)."""
    rng = np.random.default_rng(2)
    k, m = 96, 70
    wt = rng.standard_normal((m, k)).astype(np.float32)
    c = rng.standard_normal(m).astype(np.float32)
    g = helper.make_graph([helper.make_node("Gemm", ["x", "w", "c"], ["y"], transB=1)], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", m])],
                          [numpy_helper.from_array(wt, "w"), numpy_helper.from_array(c, "c")])
    art = narrowed(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), shape_profiles={"N": (1, 4, 32)})
    assert bf16_steps(art)
    x = rng.standard_normal((5, k)).astype(np.float32)
    check_product(art.model().run(x)[0].astype(np.float64), x, wt.T, k, c)

    model, w, b = constant_weight_matmul(40, 48, batch_dims=("B", "S"))
    art = narrowed(model, shape_profiles={"B": (1, 2, 4), "S": (1, 5, 16)})
    assert bf16_steps(art)
    x = rng.standard_normal((3, 7, 40)).astype(np.float32)
    y = art.model().run(x)[0].astype(np.float64)
    check_product(y.reshape(21, 48), x.reshape(21, 40), w, 40, b)


def conv_ref(x, w, b, strides, pads, dilations, group):
    """float64 convolution (numpy, im2col) of already-rounded ``x`` and ``w``; also |x| * |w| for the bound."""
    n, c, h, wd = x.shape
    m, cg, kh, kw = w.shape
    sh, sw = strides
    dh, dw = dilations
    xp = np.pad(x, ((0, 0), (0, 0), (pads[0], pads[2]), (pads[1], pads[3])))
    oh = (xp.shape[2] - (kh - 1) * dh - 1) // sh + 1
    ow = (xp.shape[3] - (kw - 1) * dw - 1) // sw + 1
    out = np.zeros((n, m, oh, ow))
    mag = np.zeros((n, m, oh, ow))
    mg = m // group
    for g in range(group):
        cols = np.stack([xp[:, g * cg:(g + 1) * cg, i * dh:i * dh + sh * oh:sh, j * dw:j * dw + sw * ow:sw]
                         for i in range(kh) for j in range(kw)], axis=2)     # n, cg, kh*kw, oh, ow
        cols = cols.reshape(n, cg * kh * kw, oh * ow)
        wg = w[g * mg:(g + 1) * mg].reshape(mg, -1)
        out[:, g * mg:(g + 1) * mg] = np.einsum("mk,nkp->nmp", wg, cols).reshape(n, mg, oh, ow)
        mag[:, g * mg:(g + 1) * mg] = np.einsum("mk,nkp->nmp", np.abs(wg), np.abs(cols)).reshape(n, mg, oh, ow)
    return out + (b.reshape(1, -1, 1, 1) if b is not None else 0), mag


CONV_CASES = [
    # x shape, w shape, attrs, the register tile the kernel takes
    ((1, 16, 10, 10), (24, 16, 3, 3), dict(pads=[1, 1, 1, 1]), "12x32"),                  # panel order, P=100
    ((1, 64, 3, 3), (70, 64, 3, 3), dict(pads=[1, 1, 1, 1]), "48x7c"),                    # weights order, channel lanes
    ((2, 7, 9, 11), (13, 7, 3, 3), dict(strides=[2, 2], pads=[1, 0, 2, 1]), "8x48"),       # N=2, K=63 odd, odd sizes
    ((1, 12, 12, 12), (12, 4, 3, 3), dict(group=3, pads=[1, 1, 1, 1]), "8x48"),           # groups
    ((1, 32, 16, 16), (40, 32, 1, 1), {}, "6x64"),                                        # 1x1 (not read in place)
    ((1, 3, 31, 31), (16, 3, 7, 7), dict(strides=[2, 2], pads=[3, 3, 3, 3]), "8x48"),     # stem-like, K=147
    ((1, 160, 6, 6), (8, 160, 3, 3), dict(pads=[1, 1, 1, 1]), "8x48"),                   # K=1440: k-blocks
    ((1, 256, 14, 14), (32, 256, 1, 1), {}, "32x7c"),                                     # channel lanes, 1x1
    ((1, 33, 17, 17), (64, 33, 3, 3), dict(pads=[1, 1, 1, 1], dilations=[1, 1]), "64x6c"),  # 17-wide rows
    ((2, 5, 9, 9), (12, 5, 1, 1), {}, "12x32"),                                         # 1x1 K=5, partial panel
    ((1, 256, 4, 4), (32, 256, 1, 1), {}, "32x8c"),                                       # 16 positions: 8-wide lanes
    ((1, 128, 7, 7), (48, 128, 1, 1), {}, "48x7c"),                                       # channel lanes at K=128
    ((1, 80, 13, 13), (40, 80, 3, 3), dict(pads=[1, 1, 1, 1]), "8x48"),   # last panel: 2 of 3 vectors, k-blocks
]


@pytest.mark.parametrize("xs,ws,attrs,tile", CONV_CASES, ids=[f"conv{i}" for i in range(len(CONV_CASES))])
def test_conv(xs, ws, attrs, tile):
    model = conv_epilogue_model(xs, ws, epilogue=None, **attrs)
    art = narrowed(model, opt_level=3)
    steps = bf16_steps(art)
    assert [s["tile"] for s in steps] == [tile] and steps[0]["path"] == "avx512_bf16", art.manifest["steps"]
    rng = np.random.default_rng(3)
    x = rng.standard_normal(xs).astype(np.float32)
    mod = art.model()
    y = mod.run(x, num_threads=2)[0].astype(np.float64)
    np.testing.assert_array_equal(y, mod.run(x, num_threads=1)[0])
    w = numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == "w"))
    b = numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == "b"))
    st, pd, dl = attrs.get("strides", [1, 1]), attrs.get("pads", [0] * 4), attrs.get("dilations", [1, 1])
    want, mag = conv_ref(bf16(x), bf16(w), b.astype(np.float64), st, pd, dl, attrs.get("group", 1))
    exact, _ = conv_ref(x.astype(np.float64), w.astype(np.float64), b.astype(np.float64), st, pd, dl, attrs.get("group", 1))
    k = ws[1] * ws[2] * ws[3]
    bias = np.abs(b).reshape(1, -1, 1, 1) * 2.0 ** -23
    assert np.all(np.abs(y - want) <= 2 * k * 2.0 ** -24 * mag + bias), float(np.abs(y - want).max())
    assert np.all(np.abs(y - exact) <= (2.0 ** -7 + 2.0 ** -16 + k * 2.0 ** -23) * mag + bias)


def test_conv_fused_residual_relu():
    """The fp32 epilogue (bias, a second narrowed Conv's output added, Relu) on the bf16 accumulators."""
    model = conv_epilogue_model((1, 24, 12, 12), (32, 24, 3, 3), pads=[1, 1, 1, 1], epilogue="residual")
    art = narrowed(model, opt_level=3, winograd=True)          # narrowed Convs stay direct (no Winograd)
    assert len(bf16_steps(art)) == 2
    assert not any("winograd" in str(s["kernel"]) for s in art.manifest["steps"])
    x = np.random.default_rng(4).standard_normal((1, 24, 12, 12)).astype(np.float32)
    y = art.model().run(x)[0].astype(np.float64)
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    a, _ = conv_ref(bf16(x), bf16(inits["w"]), inits["b"].astype(np.float64), [1, 1], [1] * 4, [1, 1], 1)
    c, mag = conv_ref(bf16(x), bf16(inits["w2"]), inits["b"].astype(np.float64), [1, 1], [1] * 4, [1, 1], 1)
    want = np.maximum(a + c, 0)
    assert np.all(np.abs(y - want) <= 4 * 216 * 2.0 ** -24 * (2 * mag) + 1e-5), float(np.abs(y - want).max())


def test_fp32_default_unchanged():
    """Without narrowed nodes nothing is bf16: no step has a precision, and the library does not check
    AVX512_BF16 at session creation beyond the host's ISA list."""
    model, _, _ = constant_weight_matmul(64, 64)
    art = Pipeline.from_onnx(model).optimize().compile(shape_profiles={"N": (1, 4, 16)})
    assert not bf16_steps(art)


def resnet_like(seed=0):
    """A stem (7x7 stride 2), a bottleneck block with a projection (1x1, 3x3, 1x1, residual add, Relu), a
    global average pool and a classifier Gemm."""
    rng = np.random.default_rng(seed)
    inits, nodes = [], []

    def conv(name, x, cin, cout, k, stride=1, relu=True):
        w = (rng.standard_normal((cout, cin, k, k)) * np.sqrt(2.0 / (cin * k * k))).astype(np.float32)
        b = (0.1 * rng.standard_normal(cout)).astype(np.float32)
        inits.extend([numpy_helper.from_array(w, name + "_w"), numpy_helper.from_array(b, name + "_b")])
        nodes.append(helper.make_node("Conv", [x, name + "_w", name + "_b"], [name], kernel_shape=[k, k],
                                      strides=[stride, stride], pads=[k // 2] * 4))
        if relu:
            nodes.append(helper.make_node("Relu", [name], [name + "_r"]))
            return name + "_r"
        return name
    s = conv("stem", "x", 3, 32, 7, 2)
    a = conv("a", s, 32, 16, 1)
    bb = conv("b", a, 16, 16, 3)
    c = conv("c", bb, 16, 64, 1, relu=False)
    proj = conv("p", s, 32, 64, 1, relu=False)
    nodes += [helper.make_node("Add", [c, proj], ["sum"]), helper.make_node("Relu", ["sum"], ["out"]),
              helper.make_node("GlobalAveragePool", ["out"], ["gap"]), helper.make_node("Flatten", ["gap"], ["flat"])]
    fc = (rng.standard_normal((10, 64)) / 8).astype(np.float32)
    inits += [numpy_helper.from_array(fc, "fc_w"), numpy_helper.from_array(np.zeros(10, np.float32), "fc_b")]
    nodes.append(helper.make_node("Gemm", ["flat", "fc_w", "fc_b"], ["y"], transB=1))
    g = helper.make_graph(nodes, "resnet_like", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 40, 40])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 10])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_resnet_like_end_to_end():
    """Every Conv and the classifier narrowed: relative error against the float32 library below 1e-2
    (measured 2.1e-3: bf16's 2^-8 per product, averaged over K = 147..288 terms and 5 layers)."""
    model = resnet_like()
    x = np.random.default_rng(5).standard_normal((1, 3, 40, 40)).astype(np.float32)
    want = Pipeline.from_onnx(model).optimize().compile().model().run(x)[0]
    art = narrowed(model)
    assert len(bf16_steps(art)) >= 5
    got = art.model().run(x)[0]
    rel = float(np.abs(got - want).max() / np.abs(want).max())
    print(f"resnet-like bf16 vs fp32: relative error {rel:.2e}")
    assert rel < 1e-2
    assert rel > 1e-5       # the narrowed kernels really round


def test_bert_like_end_to_end():
    """A BERT-like encoder block (d_model 64, 4 heads, ffn 256) with its projections and FFN narrowed, B and S
    symbolic: cosine similarity to the float32 library above 0.9999, max relative error below 2e-2."""
    model = bert_block()
    prof = {"B": (1, 1, 2), "S": (1, 16, 32)}
    want_art = Pipeline.from_onnx(model).optimize().compile(shape_profiles=prof)
    art = narrowed(model, {"x": (-8.0, 8.0), "attention_mask": (0, 1)}, shape_profiles=prof)
    assert len(bf16_steps(art)) >= 4
    rng = np.random.default_rng(6)
    mask = np.ones((2, 11), np.int64)
    mask[1, 8:] = 0                      # the second sequence padded after 8 tokens
    feeds = [rng.standard_normal((2, 11, 64)).astype(np.float32), mask]
    want = want_art.model().run(*feeds)[0].astype(np.float64)
    got = art.model().run(*feeds)[0].astype(np.float64)
    cos = float((want * got).sum() / np.linalg.norm(want) / np.linalg.norm(got))
    rel = float(np.abs(got - want).max() / np.abs(want).max())
    print(f"bert-like bf16 vs fp32: cosine {cos:.6f}, relative error {rel:.2e}")
    assert cos > 0.9999 and rel < 2e-2
    assert rel > 1e-5



def test_manifest_records_what_ran_after_attention_fusion():
    """The policy narrows attention's Q·Kᵀ and P·V MatMuls, then x86 fuses them into a FusedAttention kernel that
    computes float32: the manifest records those two as fp32 (with the format the policy had allowed), the
    projections and FFN as bf16, each matching a bf16 step, the pooler (the output layer) as fp32."""
    from cuvil.testing.hf_models import bert_model
    model = bert_model(vocab=100, hidden=64, layers=1, heads=4, ffn=128, max_pos=64)
    art = Pipeline.from_onnx(model).optimize().compile(
        precision="bf16", input_ranges={"input_ids": (0, 99), "attention_mask": (0, 1), "token_type_ids": (0, 1)},
        shape_profiles={"batch": (1, 1, 2), "sequence": (1, 16, 32)})
    assert any(k.startswith("fused_attention") for k in art.manifest["rules_applied"])
    nodes = art.manifest["precision"]["nodes"]
    fused = {k: v for k, v in nodes.items() if v.get("policy_format") == "bf16"}
    assert sorted(k.rsplit(".", 1)[-1] for k in fused) == ["ctx", "qk"], fused
    assert all(v["format"] == "fp32" and "FusedAttention" in v["reason"] for v in fused.values())
    narrowed = [k for k, v in nodes.items() if v["format"] == "bf16"]
    # the pooler's dense layer is the model's output layer: kept float32 (cuvil.precision.heads)
    assert nodes["pooler.dense"]["format"] == "fp32" and "output layer" in nodes["pooler.dense"]["reason"]
    assert len(narrowed) == 6 and art.manifest["precision"]["counts"]["bf16"] == 6
    assert len(bf16_steps(art)) >= len(narrowed)


def test_refused_without_avx512_bf16(monkeypatch):
    """A library with bf16 kernels, loaded on a CPU without AVX512_BF16: a CuvilError that says which kernels
    need it, not SIGILL."""
    model, _, _ = constant_weight_matmul(32, 64)
    art = narrowed(model, shape_profiles={"N": (1, 2, 8)})
    assert "avx512bf16" in art.manifest["target"]["isa_features"]
    real = host_cpu()
    monkeypatch.setattr(cpu_mod, "host_cpu", lambda: attrs.evolve(real, features=real.features - {"avx512bf16"}))
    from cuvil.targets.x86.loader import _check_isa
    with pytest.raises(CuvilError) as e:
        _check_isa(art.manifest, art.path)
    text = str(e.value) + " ".join(getattr(e.value, "details", []) or [])
    assert "avx512bf16" in text and "bf16 kernels run vdpbf16ps" in text


def test_narrowed_forms_without_a_bf16_kernel():
    """A narrowed node that no bf16 micro-kernel takes (a depthwise Conv, a MatMul of two activations, a Gemm
    with 4 output columns) still computes what its precision says: inputs rounded to bfloat16, float32 sums."""
    rng = np.random.default_rng(7)
    model = conv_epilogue_model((1, 8, 10, 10), (8, 1, 3, 3), group=8, pads=[1, 1, 1, 1], epilogue=None)
    art = narrowed(model)
    assert art.manifest["precision"]["nodes"]["conv"]["format"] == "bf16" and not bf16_steps(art)
    x = rng.standard_normal((1, 8, 10, 10)).astype(np.float32)
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    want, mag = conv_ref(bf16(x), bf16(inits["w"]), inits["b"].astype(np.float64), [1, 1], [1] * 4, [1, 1], 8)
    y = art.model().run(x)[0].astype(np.float64)
    assert np.all(np.abs(y - want) <= 2 * 9 * 2.0 ** -24 * mag + 1e-6), float(np.abs(y - want).max())

    g = helper.make_graph([helper.make_node("MatMul", ["a", "b"], ["y"])], "g",
                          [helper.make_tensor_value_info("a", TensorProto.FLOAT, [5, 40]),
                           helper.make_tensor_value_info("b", TensorProto.FLOAT, [40, 24])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [5, 24])])
    art = narrowed(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
    a, b = rng.standard_normal((5, 40)).astype(np.float32), rng.standard_normal((40, 24)).astype(np.float32)
    check_product(art.model().run(a, b)[0].astype(np.float64), a, b, 40)

    wt = rng.standard_normal((4, 16)).astype(np.float32)
    g = helper.make_graph([helper.make_node("Gemm", ["x", "w"], ["y"], transB=1)], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 4])], [numpy_helper.from_array(wt, "w")])
    art = narrowed(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
    x = rng.standard_normal((3, 16)).astype(np.float32)
    check_product(art.model().run(x)[0].astype(np.float64), x, wt.T, 16)


# bfloat16 models (every tensor bfloat16, as `model.to(torch.bfloat16)` exports them): a MatMul / Gemm with
# constant bfloat16 weights runs on the bf16 kernels (AMX tiles or vdpbf16ps), W as it is, A widened exactly,
# float32 sums, the output rounded to bfloat16 once. Before, a loop nest: a 768 x 3072 MatMul at 128 rows took
# 23 ms, 0.9 ms now on AMX.

def bf16_tensor(name, a):
    return helper.make_tensor(name, TensorProto.BFLOAT16, a.shape, np.asarray(a, ml_dtypes.bfloat16).view(np.uint16).tobytes(),
                              raw=True)


@pytest.mark.parametrize("tuning", [None, VDPBF16PS], ids=["default", "vdpbf16ps"])
def test_bfloat16_model_matmul_bias_and_gemm(tuning):
    rng = np.random.default_rng(21)
    k, m = 160, 80
    w = (rng.standard_normal((k, m)) / 8).astype(ml_dtypes.bfloat16)
    bias = rng.standard_normal(m).astype(ml_dtypes.bfloat16)
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["p"]), helper.make_node("Add", ["p", "b"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.BFLOAT16, ["N", k])],
                          [helper.make_tensor_value_info("y", TensorProto.BFLOAT16, ["N", m])],
                          [bf16_tensor("w", w), bf16_tensor("b", bias)])
    kw = {} if tuning is None else {"tuning": tuning}
    art = Pipeline.from_onnx(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])).optimize().compile(
        shape_profiles={"N": (1, 8, 64)}, **kw)
    paths = {s.get("path") for s in art.manifest["steps"] if s.get("kernel") == "gemm"}
    assert paths and paths <= {"amx_bf16", "avx512_bf16"}, art.manifest["steps"]
    if tuning is not None:
        assert paths == {"avx512_bf16"}
    mod = art.model()
    for n in (1, 5, 33):
        x = rng.standard_normal((n, k)).astype(ml_dtypes.bfloat16)
        y = np.asarray(mod.run(x)[0], np.float64)
        prod = (x.astype(np.float64) @ w.astype(np.float64)).astype(ml_dtypes.bfloat16)
        want = (prod.astype(np.float64) + bias.astype(np.float64)).astype(ml_dtypes.bfloat16).astype(np.float64)
        step = 2.0 ** -7 * (np.abs(want) + np.abs(prod.astype(np.float64)))    # a step of each rounding
        assert np.all(np.abs(y - want) <= step + 1e-30), float(np.max(np.abs(y - want) / (step + 1e-30)))
        assert np.mean(y != want) < 0.02

    wt = (rng.standard_normal((m, k)) / 8).astype(ml_dtypes.bfloat16)
    g = helper.make_graph([helper.make_node("Gemm", ["x", "w", "c"], ["y"], transB=1)], "g",
                          [helper.make_tensor_value_info("x", TensorProto.BFLOAT16, [4, k])],
                          [helper.make_tensor_value_info("y", TensorProto.BFLOAT16, [4, m])],
                          [bf16_tensor("w", wt), bf16_tensor("c", bias)])
    art = Pipeline.from_onnx(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])).optimize().compile(**kw)
    assert any(s.get("path") in ("amx_bf16", "avx512_bf16") for s in art.manifest["steps"])
    x = rng.standard_normal((4, k)).astype(ml_dtypes.bfloat16)
    want = (x.astype(np.float64) @ wt.T.astype(np.float64) + bias.astype(np.float64))
    y = np.asarray(art.model().run(x)[0], np.float64)
    assert np.all(np.abs(y - want) <= 2.0 ** -8 * np.abs(want) + 1e-6), float(np.max(np.abs(y - want)))


def _bfloat16_form(model):
    """``model`` (all float16, from onnxconverter_common) with every float16 tensor, type and Cast retyped as
    bfloat16 (the values rounded): a bfloat16 model, which no converter here makes."""
    from onnx import AttributeProto, numpy_helper as nh

    def retype(t):
        if t.data_type == TensorProto.FLOAT16:
            t.CopyFrom(bf16_tensor(t.name, nh.to_array(t).astype(np.float32).astype(ml_dtypes.bfloat16)))
    for t in model.graph.initializer:
        retype(t)
    for vi in list(model.graph.input) + list(model.graph.output) + list(model.graph.value_info):
        if vi.type.tensor_type.elem_type == TensorProto.FLOAT16:
            vi.type.tensor_type.elem_type = TensorProto.BFLOAT16
    for n in model.graph.node:
        for a in n.attribute:
            if a.name == "to" and a.i == TensorProto.FLOAT16:
                a.i = TensorProto.BFLOAT16
            if a.type == AttributeProto.TENSOR:
                retype(a.t)
    return model


def test_bfloat16_bert_export():
    """BERT (the torch.onnx export) as a bfloat16 model, a padded mask: its products on the bf16 kernels, its
    attention in the fused float32 kernel (operands widened), within 2e-2 relative of onnxruntime's float32
    run of the original (5 bfloat16 steps of 2^-8 over the layers; measured 5e-3 and 7e-3)."""
    import os
    import warnings
    import onnx
    import onnxruntime as ort
    float16 = pytest.importorskip("onnxconverter_common.float16", reason="pip install onnxconverter-common")
    m = onnx.load(os.path.join(os.path.dirname(__file__), "fixtures", "exports", "bert.torchscript.onnx"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        h = _bfloat16_form(float16.convert_float_to_float16(m, keep_io_types=False))
    rng = np.random.default_rng(5)
    feeds = {}
    for i in h.graph.input:
        dims = [d.dim_value or (1 if k == 0 else 16) for k, d in enumerate(i.type.tensor_type.shape.dim)]
        feeds[i.name] = (rng.integers(0, 100, dims) if i.name == "input_ids" else
                         np.ones(dims) if "mask" in i.name else np.zeros(dims)).astype(np.int64)
    feeds["attention_mask"][0, -4:] = 0
    art = Pipeline.from_onnx(h).optimize().compile(input_shapes={k: list(v.shape) for k, v in feeds.items()})
    steps = art.manifest["steps"]
    assert any(s.get("op") == "FusedAttention" for s in steps), steps
    assert any(s.get("path") in ("amx_bf16", "avx512_bf16") for s in steps), steps
    got = art.model().run(*[feeds[i.name] for i in h.graph.input])
    want = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    for g, w in zip(got, want):
        g = np.asarray(g, np.float64)
        assert np.isfinite(g).all()
        assert float(np.abs(g - w).max()) <= 2e-2 * float(np.abs(w).max()), float(np.abs(g - w).max() / np.abs(w).max())
