"""bf16 convolutions as Winograd F(2x2, 3x3) on the vdpbf16ps kernels (``X86Tuning.bf16_winograd``; CPUs with
AVX512_BF16 and no AMX tiles in use): the input transform ``V = Bt d B`` in float32, ``V`` and the transformed
weights ``U = G g Gt`` rounded to bfloat16 into the 16 GEMMs (float32 sums), the output transform in float32.

Error bound (checked elementwise against the float64 convolution of the unrounded values). With ``|M|`` the
matrix of absolute values, ``Vabs = |Bt| |d| |B|`` and ``Uabs = |G| |g| |Gt|`` bound what float32 computes and
bf16 rounds: each rounded ``U``, ``V`` element is off by at most ``e = 2^-8 + 2^-22`` times its ``abs`` form
(bf16's half ulp, after float32's own error of a sum of at most 4 terms), so each product by at most
``(2e + e^2) Uabs Vabs``; the float32 sums over C channels and the output transform's 4-term sums add
``(C + 16) 2^-23`` of the same magnitudes. Hence, with ``mag = |At| (sum over c of Uabs Vabs) |A|``,

    |y - exact| <= (2^-7 + 2^-14 + (C + 16) 2^-23) mag + 2^-23 |bias|

(unlike the direct bf16 kernel's bound, tests/test_x86_bf16.py, the magnitudes are the transforms' own: F(2x2)'s
sums of up to 4 inputs and weights). Skipped, with the reason, on CPUs without AVX512_BF16.
"""
import ml_dtypes
import numpy as np
import pytest
from onnx import numpy_helper

from cuvil import Pipeline
from cuvil.ir.ops.winograd import matrices_f64
from cuvil.targets.x86 import codegen as x86_codegen
from cuvil.targets.x86.choose import best_bf16_tile, best_tile
from cuvil.targets.x86.cpu import cpu_label, host_cpu
from cuvil.targets.x86.gemm import tile_shapes
from cuvil.targets.x86.gemm_bf16 import narrow_formats
from cuvil.targets.x86.tuning import X86Tuning
from cuvil.testing.conv_models import conv_epilogue_model

HAS_BF16 = "bf16" in narrow_formats(host_cpu())
needs_bf16 = pytest.mark.skipif(not HAS_BF16, reason=f"no AVX512_BF16 on this CPU ({cpu_label()}): the bf16 "
                                                     "kernels cannot run here")


def compile_bf16(model, **tuning):
    """``model`` narrowed by ``--precision bf16`` (input declared in ±8) on the vdpbf16ps kernels."""
    return Pipeline.from_onnx(model).optimize().compile(
        precision="bf16", input_ranges={"x": (-8.0, 8.0)}, cache=False, tuning=X86Tuning(amx=False, **tuning))


def kinds(art):
    return [(s["kernel"], s.get("precision")) for s in art.manifest["steps"]]


def tiled(x, pads):
    """``x`` zero-padded (``pads`` [t, l, b, r]) and cut into F(2x2)'s 4x4 input tiles ``d[n, c, th, tw, 4, 4]``,
    with the padded input, the output size and a function that puts per-tile 2x2 outputs ``[n, k, th, tw, 2, 2]``
    back as ``[n, k, oh, ow]``."""
    n, c, h, wd = x.shape
    oh, ow = h + pads[0] + pads[2] - 2, wd + pads[1] + pads[3] - 2
    th, tw = -(-oh // 2), -(-ow // 2)
    xp = np.zeros((n, c, 2 * th + 2, 2 * tw + 2))
    xp[:, :, pads[0]:pads[0] + h, pads[1]:pads[1] + wd] = x
    d = np.stack([np.stack([xp[:, :, 2 * i:2 * i + 4, 2 * j:2 * j + 4] for j in range(tw)], 2) for i in range(th)], 2)
    untile = lambda y: y.transpose(0, 1, 2, 4, 3, 5).reshape(n, y.shape[1], 2 * th, 2 * tw)[:, :, :oh, :ow]
    return d, xp, (oh, ow), untile


def winograd_bound(x, w, pads):
    """The exact (float64) convolution of ``x`` and ``w`` (stride 1, ``pads`` [t, l, b, r]) and ``mag`` of the
    module doc for F(2x2)."""
    bt, g, at = matrices_f64(2)
    d, xp, (oh, ow), untile = tiled(x, pads)
    k, c = w.shape[:2]
    v = np.einsum("ap,nctspq,bq->nctsab", np.abs(bt), np.abs(d), np.abs(bt))        # Vabs per tile
    u = np.einsum("ap,kcpq,bq->kcab", np.abs(g), np.abs(w.astype(np.float64)), np.abs(g))   # Uabs
    m = np.einsum("kcab,nctsab->nktsab", u, v)
    mag = untile(np.einsum("ra,nktsab,qb->nktsrq", np.abs(at), m, np.abs(at)))
    cols = np.stack([xp[:, :, i:i + oh, j:j + ow] for i in range(3) for j in range(3)], 2)   # n, c, 9, oh, ow
    exact = np.einsum("kcs,ncsyx->nkyx", w.astype(np.float64).reshape(k, c, 9), cols)
    return exact, mag


CASES = [
    # x shape, w shape, pads
    ((1, 64, 28, 28), (64, 64, 3, 3), [1, 1, 1, 1]),        # a ResNet-like 3x3
    ((2, 24, 13, 9), (40, 24, 3, 3), [1, 0, 2, 1]),         # batch 2, odd sizes: partial tiles, uneven pads
    ((1, 130, 7, 7), (20, 130, 3, 3), [1, 1, 1, 1]),        # 4-lane transform vectors, 65 channel pairs
    ((1, 9, 12, 12), (16, 9, 3, 3), [1, 1, 1, 1]),          # odd channel count: a zero half pair in K
    ((1, 128, 7, 7), (128, 128, 3, 3), [1, 1, 1, 1]),       # V interleaved (winograd_interleaved)
]
IDS = ["resnet", "batch2-odd", "c130", "odd-channels", "interleaved"]


def emulated(x, w, b, pads):
    """The bf16 Winograd F(2x2) convolution as the kernels compute it, up to float32's sums: V in float64 rounded
    to float32 then to bfloat16 (nearest even), U likewise, their products summed in float64, the output transform
    in float64."""
    bt, g, at = matrices_f64(2)
    d, _, _, untile = tiled(x, pads)
    bf = lambda a: a.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)
    v = bf(np.einsum("ap,nctspq,bq->nctsab", bt, d, bt))
    u = bf(np.einsum("ap,kcpq,bq->kcab", g, w.astype(np.float64), g))
    m = np.einsum("kcab,nctsab->nktsab", u, v)
    return untile(np.einsum("ra,nktsab,qb->nktsrq", at, m, at)) + b.reshape(1, -1, 1, 1)


@needs_bf16
@pytest.mark.parametrize("form", ["kernels", "generic-transforms", "float32-V"])
@pytest.mark.parametrize("xs,ws,pads", CASES, ids=IDS)
def test_winograd_bf16_within_bound(xs, ws, pads, form, monkeypatch):
    """``generic-transforms``: the transforms as plain loop nests instead of their kernels (V stored as bfloat16
    by the loop nest's rounding store); ``float32-V``: V stored as float32 (``X86Tuning(bf16_storage=False)``),
    rounded as the GEMM packs it. Each within the module doc's bound of the exact convolution, and close to
    :func:`emulated` (the error that remains is float32's sums and V's double rounding, not the algorithm's)."""
    if form == "generic-transforms":
        monkeypatch.setattr(x86_codegen, "emit_winograd_input", lambda *a: None)   # the names codegen calls
        monkeypatch.setattr(x86_codegen, "emit_winograd_output", lambda *a: None)
    model = conv_epilogue_model(xs, ws, pads=pads, epilogue=None)
    art = compile_bf16(model, bf16_winograd=True, bf16_storage=form != "float32-V")
    assert [k for k in kinds(art) if k[0] == "gemm"] == [("gemm", "bf16")], kinds(art)
    assert len(art.manifest["steps"]) == 3, kinds(art)
    transforms = {("winograd_in", None), ("winograd_out", None)}
    assert transforms.isdisjoint(kinds(art)) if form == "generic-transforms" else transforms <= set(kinds(art))
    rec = art.manifest["precision"]["nodes"]["conv"]
    assert rec["format"] == "bf16" and "Winograd F(2x2, 3x3) in bf16" in rec["computed_as"], rec
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    rng = np.random.default_rng(7)
    x = rng.standard_normal(xs).astype(np.float32)
    mod = art.model()
    y = mod.run(x, num_threads=2)[0].astype(np.float64)
    np.testing.assert_array_equal(y, mod.run(x, num_threads=1)[0])
    exact, mag = winograd_bound(x.astype(np.float64), inits["w"], pads)
    exact += inits["b"].reshape(1, -1, 1, 1)
    bound = (2.0 ** -7 + 2.0 ** -14 + (xs[1] + 16) * 2.0 ** -23) * mag + 2.0 ** -23 * np.abs(inits["b"]).reshape(1, -1, 1, 1)
    err = np.abs(y - exact)
    assert np.all(err <= bound), float((err / bound).max())
    rel = float(err.max() / np.abs(exact).max())
    emu = emulated(x.astype(np.float64), inits["w"], inits["b"].astype(np.float64), pads)
    off = float(np.abs(y - emu).max() / np.abs(emu - exact).max())
    print(f"bf16 Winograd F(2x2) {xs} -> {ws[0]}: relative error {rel:.2e}, worst error / bound "
          f"{float((err / bound).max()):.3f}, off the emulation by {off:.3f} of its own error")
    assert rel > 1e-5        # the GEMMs really round
    assert off < 0.1         # the kernels compute what the emulation does (a lost channel pair, truncation: >> 0.1)

    if form != "kernels":
        return
    direct = compile_bf16(model, bf16_winograd=False)       # the opt-out: the direct bf16 kernel
    assert ("winograd_in", None) not in kinds(direct) and ("gemm", "bf16") in kinds(direct), kinds(direct)
    assert "computed_as" not in direct.manifest["precision"]["nodes"]["conv"]


@needs_bf16
@pytest.mark.parametrize("value,storage", [(1e38, True), (8.5e37, True), (8.5e37, False)],
                         ids=["V-overflows", "V-rounds-to-inf", "V-rounds-to-inf-in-the-GEMM"])
def test_non_finite_tiles_fall_back_to_the_direct_sum(value, storage):
    """Tiles whose Winograd values are not finite are computed again directly from W' = G+ bf16(U) G+^T (W
    rebuilt out of U's bfloat16 pair panels), so the output is finite where the direct sum is (weights of about
    1e-4). Inputs of 1e38 overflow Bt d B (a sum of 4) in float32 already; inputs of 8.5e37 give V = 3.4e38,
    finite in float32 but past bfloat16's largest value (3.39e38), so only its rounding makes it inf: as the
    transform stores V, or (``storage`` False) as the GEMM packs float32 V. Tolerance, per output channel:
    |W' - w| summed over the taps is at most e * sum over taps of (h_p h_q |w_pq|), h the column sums of
    |G+| |G| (at most 2.5), e = 2^-8 + 2^-22 (U's rounding), times the largest |x|; plus float32's sum of 9 C terms."""
    xs, ws = (1, 16, 8, 8), (16, 16, 3, 3)
    model = conv_epilogue_model(xs, ws, pads=[1, 1, 1, 1], epilogue=None, bias=False)
    init = next(i for i in model.graph.initializer if i.name == "w")
    w = numpy_helper.to_array(init) * np.float32(1e-3)
    init.CopyFrom(numpy_helper.from_array(w, "w"))
    art = Pipeline.from_onnx(model).optimize().compile(
        precision="bf16", input_ranges={"x": (-value, value)}, cache=False,
        tuning=X86Tuning(amx=False, bf16_winograd=True, bf16_storage=storage))
    assert art.manifest["precision"]["nodes"]["conv"]["format"] == "bf16"
    assert kinds(art) == [("winograd_in", None), ("gemm", "bf16"), ("winograd_out", None)], kinds(art)
    x = np.full(xs, value, np.float32)
    if value == 1e38:
        x[:, 1::2] *= -1      # odd channels negative: every tile's V overflows, of both signs
    w64 = w.astype(np.float64)
    exact, _ = winograd_bound(x.astype(np.float64), w64, [1, 1, 1, 1])
    assert np.abs(exact).max() > 1e34 and np.abs(exact).max() < 3e38
    y = art.model().run(x)[0].astype(np.float64)
    assert np.all(np.isfinite(y))
    _, g, _ = matrices_f64(2)
    h = (np.abs(np.linalg.pinv(g)) @ np.abs(g)).sum(axis=0)          # column sums of |G+| |G|
    e = 2.0 ** -8 + 2.0 ** -22
    tol = (e * np.einsum("p,q,kcpq->k", h, h, np.abs(w64)) + 9 * xs[1] * 2.0 ** -23 * np.abs(w64).sum((1, 2, 3))) * value
    assert h.max() <= 2.5 + 1e-12
    worst = float((np.abs(y - exact) / tol.reshape(1, -1, 1, 1)).max())
    assert worst <= 1.0, worst
    assert worst > 1e-3       # W' really is rebuilt from the rounded U


@needs_bf16
def test_the_policy_bounds_and_stores_what_the_winograd_form_computes():
    """The precision plan knows which convolutions x86 makes bf16 Winograd (X86Target.transformed_rounding): it
    re-bounds the narrowed ranges with that form's larger rounding, and plans no bfloat16 copy of their input
    (the transform reads it in float32); with the direct kernels (bf16_winograd=False) the copy is planned."""
    from onnx import TensorProto, helper
    from cuvil.precision import plan_precision
    from cuvil.targets import X86_TARGET, get_target, make_options
    from cuvil.targets.base import precision_ops, transformed_rounding
    from cuvil.targets.x86.choose import BF16_WINOGRAD_UNIT
    rng = np.random.default_rng(2)
    w1 = (rng.standard_normal((64, 32, 1, 1)) / 6).astype(np.float32)
    w2 = (rng.standard_normal((64, 64, 3, 3)) / 24).astype(np.float32)
    g = helper.make_graph(
        [helper.make_node("Conv", ["x", "w1"], ["a"], name="c1"), helper.make_node("Relu", ["a"], ["r"], name="relu"),
         helper.make_node("Conv", ["r", "w2"], ["b"], name="c2", pads=[1, 1, 1, 1]),
         helper.make_node("Relu", ["b"], ["y"], name="out")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 32, 28, 28])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64, 28, 28])],
        [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    x = rng.standard_normal((1, 32, 28, 28)).astype(np.float32)
    built = {}
    for wino in (True, False):
        art = Pipeline.from_onnx(model).optimize().compile(
            precision="bf16", input_ranges={"x": (-4.0, 4.0)}, cache=False, keep_fp32=[],
            tuning=X86Tuning(amx=False, bf16_winograd=wino))
        prec = art.manifest["precision"]
        assert [prec["nodes"][k]["format"] for k in ("c1", "c2")] == ["bf16", "bf16"], prec["nodes"]
        stored = set(art.manifest.get("bf16_activations") or {})       # what the library stores
        assert ("r" in stored) != wino, art.manifest.get("bf16_activations")
        # what the plan (and `cuvil precision report`) says: the same
        p = Pipeline.from_onnx(model).optimize()
        options = make_options(X86_TARGET, tuning=X86Tuning(amx=False, bf16_winograd=wino))
        tgt = get_target(X86_TARGET)
        units = transformed_rounding(tgt, options, p.graph)
        assert units == ({"c2": BF16_WINOGRAD_UNIT} if wino else {}), units
        plan = plan_precision(p.graph, "bf16", input_ranges={"x": (-4.0, 4.0)}, target_ops=precision_ops(tgt, options),
                              keep_fp32=[], transformed=units)
        assert ("r" in plan.bf16_stored) != wino, plan.bf16_stored
        assert (("winograd_in", None) in kinds(art)) == wino, kinds(art)
        built[wino] = art.model().run(x)[0]
    rel = float(np.abs(built[True] - built[False]).max() / np.abs(built[False]).max())
    assert 0 < rel < 2e-2, rel
    assert 16 * ((1 + 2.0 ** -8 + 2.0 ** -22) ** 2 - 1) <= 2.01 * BF16_WINOGRAD_UNIT


def log_after_conv():
    """x in [1, 2], w = 1/144 (sum 1 per output channel), no padding: the conv's float32 range is [1, 2] and
    z = conv - 0.9 lies in [0.1, 1.1]. The direct kernel's rounding widens it by 2.01 * 2^-8 * 2 = 0.016 (z > 0);
    the Winograd bound by 2.01 * BF16_WINOGRAD_UNIT * 2 = 0.25 (z may reach 0: Log's range is lost)."""
    from onnx import TensorProto, helper
    w = np.full((16, 16, 3, 3), 1.0 / 144, np.float32)
    c = np.full((1, 16, 1, 1), 0.9, np.float32)
    g = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["a"], name="c"), helper.make_node("Sub", ["a", "c"], ["z"], name="sub"),
         helper.make_node("Log", ["z"], ["y"], name="log")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, 10, 10])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16, 8, 8])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(c, "c")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("mode", ["bf16", "auto"])
def test_the_winograd_rounding_reverts_what_only_the_direct_kernel_keeps(mode):
    """Compile-free: the policy re-bounds with the unit the target states; a value downstream that the direct
    kernel's rounding keeps in range and the Winograd form's does not sends the convolution back to float32."""
    from cuvil.precision import plan_precision
    from cuvil.targets.x86.choose import BF16_WINOGRAD_UNIT
    graph = Pipeline.from_onnx(log_after_conv()).optimize().graph
    fmt = {}
    for units in ({}, {"c": BF16_WINOGRAD_UNIT}):
        plan = plan_precision(graph, mode, input_ranges={"x": (1.0, 2.0)}, keep_fp32=[], search_budget=0,
                              target_ops={"bf16": frozenset({"Conv", "MatMul", "Gemm"})}, transformed=units)
        p = next(p for p in plan.nodes if p.name == "c")
        fmt[bool(units)] = (p.format, p.reason)
    assert fmt[False][0] == "bf16", fmt
    assert fmt[True][0] == "" and "(log)" in fmt[True][1], fmt


@needs_bf16
def test_the_library_keeps_float32_what_it_would_compute_as_winograd():
    model = log_after_conv()
    got = {}
    for wino in (True, False):
        art = Pipeline.from_onnx(model).optimize().compile(
            precision="bf16", input_ranges={"x": (1.0, 2.0)}, keep_fp32=[], cache=False,
            tuning=X86Tuning(amx=False, bf16_winograd=wino))
        got[wino] = art.manifest["precision"]["nodes"]["c"]["format"]
    assert got == {True: "fp32", False: "bf16"}, got


@needs_bf16
def test_the_relative_certificate_names_what_the_winograd_form_bounds():
    """Inputs declared to ±1e37: the absolute range is not certified and an explicit bf16 narrows on the relative
    certificate; its reason states the Winograd form's own bound (relative to the inputs' magnitudes over a 4x4
    tile, 1.1259x), not the direct kernel's (float32's own sum of |products|, 1.0078x)."""
    model = conv_epilogue_model((1, 64, 28, 28), (64, 64, 3, 3), pads=[1, 1, 1, 1], epilogue=None)
    for wino, text in ((True, "4x4 input tile) x (sum of the channel's |weights|)"), (False, "own sum of |products|")):
        art = Pipeline.from_onnx(model).optimize().compile(
            precision="bf16", input_ranges={"x": (-1e37, 1e37)}, keep_fp32=[], cache=False,
            tuning=X86Tuning(amx=False, bf16_winograd=wino))
        rec = art.manifest["precision"]["nodes"]["conv"]
        assert rec["format"] == "bf16" and rec.get("certificate") == "relative to float32", rec
        assert text in rec["reason"], rec["reason"]
        assert (("winograd_in", None) in kinds(art)) == wino, kinds(art)


def test_winograd_needs_channels_for_its_gemms():
    """A forced Winograd tile (float32 ``winograd_tile=2``, bf16 ``bf16_winograd=True``) on a convolution with
    fewer than 4 input or output channels stays direct: the Winograd GEMMs would have no micro-kernel (it used
    to fail to compile)."""
    for xs, ws in (((1, 3, 12, 12), (8, 3, 3, 3)), ((1, 16, 12, 12), (2, 16, 3, 3))):
        model = conv_epilogue_model(xs, ws, pads=[1, 1, 1, 1], epilogue=None)
        art = Pipeline.from_onnx(model).optimize().compile(cache=False, tuning=X86Tuning(winograd_tile=2))
        assert "winograd_in" not in [s["kernel"] for s in art.manifest["steps"]]
        if HAS_BF16:
            art = compile_bf16(model, bf16_winograd=True)
            assert ("winograd_in", None) not in kinds(art), kinds(art)


def test_the_algorithm_choice_by_cpu():
    """Compile-free: with the convolution narrowed to bf16, choose_algorithms makes it bf16 Winograd for a CPU with
    AVX512_BF16 and no AMX (znver4), keeps it direct for one with AMX tiles (sapphirerapids) unless the tiles are
    declined (amx=False), and never for a fp16-narrowed one; float32 convolutions take their own Winograd."""
    from cuvil.targets.x86.target import choose_algorithms
    model = conv_epilogue_model((1, 64, 28, 28), (64, 64, 3, 3), pads=[1, 1, 1, 1], epilogue=None)
    base = Pipeline.from_onnx(model).optimize().graph

    def chosen(cpu, fmt, tuning=X86Tuning()):
        g = base.clone()
        for n in g.nodes:
            if n.op == "Conv":
                n.precision = fmt
        out, _ = choose_algorithms(g, cpu, tuning)
        return [(n.op, n.precision, n.attrs.get("tile")) for n in out.nodes if n.op in ("Conv", "WinogradConv")]
    assert chosen("znver4", "bf16") == [("WinogradConv", "bf16", 2)]
    assert chosen("sapphirerapids", "bf16") == [("Conv", "bf16", None)]
    assert chosen("sapphirerapids", "bf16", X86Tuning(amx=False)) == [("WinogradConv", "bf16", 2)]
    assert chosen("znver4", "bf16", X86Tuning(bf16_winograd=False)) == [("Conv", "bf16", None)]
    assert chosen("znver4", "fp16") == [("Conv", "fp16", None)]
    assert chosen("znver4", "")[0][:2] == ("WinogradConv", "")


def test_cost_model_bf16_choices():
    """The bf16 choice weighs the GEMMs and weights at half their float32 cost, the transforms at full: on
    AVX-512 register tiles ResNet-50's stride-1 3x3 layers take F(2x2) at every size (float32 takes F(4x4) at
    56 and 28, which bf16 never does: bench/PRECISION.md measured it 29x less accurate), 16 -> 16 channels at 40x40
    and 130 -> 20 at 7x7 stay direct (the transforms outweigh the halved GEMM); the tuning's override wins."""
    shapes = tile_shapes(512)
    t = X86Tuning()
    for c, hw in ((64, 56), (128, 28), (256, 14), (512, 7)):
        assert best_bf16_tile(c, c, hw, hw, shapes, t) == 2, (c, hw)
    assert best_tile(64, 64, 56, 56, shapes, t) == 4        # (float32)
    assert best_bf16_tile(16, 16, 40, 40, shapes, t) is None
    assert best_bf16_tile(130, 20, 7, 7, shapes, t) is None
    assert best_bf16_tile(4, 64, 56, 56, shapes, t) is None
    assert best_bf16_tile(130, 20, 7, 7, shapes, X86Tuning(bf16_winograd=True)) == 2
    assert best_bf16_tile(64, 64, 56, 56, shapes, X86Tuning(bf16_winograd=False)) is None
