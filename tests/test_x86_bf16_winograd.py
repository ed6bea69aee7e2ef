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
import numpy as np
import pytest
from onnx import numpy_helper

from cuvil import Pipeline
from cuvil.ir.ops.winograd import matrices_f64
from cuvil.targets.x86 import codegen as x86_codegen
from cuvil.targets.x86.choose import best_tile
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


def winograd_bound(x, w, pads):
    """The exact (float64) convolution of ``x`` and ``w`` (stride 1, ``pads`` [t, l, b, r]) and ``mag`` of the
    module doc for F(2x2)."""
    bt, g, at = matrices_f64(2)
    n, c, h, wd = x.shape
    k = w.shape[0]
    oh, ow = h + pads[0] + pads[2] - 2, wd + pads[1] + pads[3] - 2
    th, tw = -(-oh // 2), -(-ow // 2)
    xp = np.zeros((n, c, 2 * th + 2, 2 * tw + 2))
    xp[:, :, pads[0]:pads[0] + h, pads[1]:pads[1] + wd] = x
    d = np.stack([np.stack([xp[:, :, 2 * i:2 * i + 4, 2 * j:2 * j + 4] for j in range(tw)], 2) for i in range(th)], 2)
    v = np.einsum("ap,nctspq,bq->nctsab", np.abs(bt), np.abs(d), np.abs(bt))        # Vabs per tile
    u = np.einsum("ap,kcpq,bq->kcab", np.abs(g), np.abs(w.astype(np.float64)), np.abs(g))   # Uabs
    m = np.einsum("kcab,nctsab->nktsab", u, v)
    mag = np.einsum("ra,nktsab,qb->nktsrq", np.abs(at), m, np.abs(at))
    mag = mag.transpose(0, 1, 2, 4, 3, 5).reshape(n, k, 2 * th, 2 * tw)[:, :, :oh, :ow]
    cols = np.stack([xp[:, :, i:i + oh, j:j + ow] for i in range(3) for j in range(3)], 2)   # n, c, 9, oh, ow
    exact = np.einsum("kcs,ncsyx->nkyx", w.astype(np.float64).reshape(k, c, 9), cols)
    return exact, mag


CASES = [
    # x shape, w shape, pads
    ((1, 64, 28, 28), (64, 64, 3, 3), [1, 1, 1, 1]),        # a ResNet-like 3x3
    ((2, 24, 13, 9), (40, 24, 3, 3), [1, 0, 2, 1]),         # batch 2, odd sizes: partial tiles, uneven pads
    ((1, 130, 7, 7), (20, 130, 3, 3), [1, 1, 1, 1]),        # odd channel count: a zero pair in K
]


@needs_bf16
@pytest.mark.parametrize("generic", [False, True], ids=["kernels", "generic-transforms"])
@pytest.mark.parametrize("xs,ws,pads", CASES, ids=["resnet", "batch2-odd", "odd-channels"])
def test_winograd_bf16_within_bound(xs, ws, pads, generic, monkeypatch):
    """``generic``: the transforms as plain loop nests instead of their kernels (the input transform's V, stored
    as bfloat16, then rounded by the loop nest's store: the same values)."""
    if generic:
        monkeypatch.setattr(x86_codegen, "emit_winograd_input", lambda *a: None)   # the names codegen calls
        monkeypatch.setattr(x86_codegen, "emit_winograd_output", lambda *a: None)
    model = conv_epilogue_model(xs, ws, pads=pads, epilogue=None)
    art = compile_bf16(model, bf16_winograd=True)
    want = [("winograd_in", None), ("gemm", "bf16"), ("winograd_out", None)]
    if generic:
        want = [k for k in want if k[0] == "gemm"]
    assert [k for k in kinds(art) if not generic or k[0] == "gemm"] == want, kinds(art)
    assert len(art.manifest["steps"]) == 3, kinds(art)
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
    print(f"bf16 Winograd F(2x2) {xs} -> {ws[0]}: relative error {rel:.2e}, worst error / bound "
          f"{float((err / bound).max()):.3f}")
    assert rel > 1e-5        # the GEMMs really round

    if generic:
        return
    direct = compile_bf16(model, bf16_winograd=False)       # the opt-out: the direct bf16 kernel
    assert ("winograd_in", None) not in kinds(direct) and ("gemm", "bf16") in kinds(direct), kinds(direct)
    assert "computed_as" not in direct.manifest["precision"]["nodes"]["conv"]


@needs_bf16
def test_non_finite_tiles_fall_back_to_the_direct_sum():
    """Inputs of 1e38: Bt d B (sums of 4 inputs) overflows float32 in every tile where the direct sum (weights of
    about 1e-4) stays finite; those tiles are computed again directly from W rebuilt out of U's bfloat16 pair
    panels, so the output is finite and within bf16's rounding of the weights of the exact convolution."""
    xs, ws = (1, 16, 8, 8), (16, 16, 3, 3)
    model = conv_epilogue_model(xs, ws, pads=[1, 1, 1, 1], epilogue=None, bias=False)
    init = next(i for i in model.graph.initializer if i.name == "w")
    w = numpy_helper.to_array(init) * np.float32(1e-3)
    init.CopyFrom(numpy_helper.from_array(w, "w"))
    art = Pipeline.from_onnx(model).optimize().compile(
        precision="bf16", input_ranges={"x": (-1e38, 1e38)}, cache=False,
        tuning=X86Tuning(amx=False, bf16_winograd=True))
    assert art.manifest["precision"]["nodes"]["conv"]["format"] == "bf16"
    assert kinds(art) == [("winograd_in", None), ("gemm", "bf16"), ("winograd_out", None)], kinds(art)
    x = np.full(xs, 1e38, np.float32)
    x[:, 1::2] *= -1          # odd channels negative: every tile's V overflows, of both signs
    exact, _ = winograd_bound(x.astype(np.float64), w, [1, 1, 1, 1])
    assert np.abs(exact).max() > 1e34 and np.abs(exact).max() < 3e38
    y = art.model().run(x)[0].astype(np.float64)
    assert np.all(np.isfinite(y))
    scale = np.einsum("kcpq->k", np.abs(w.astype(np.float64))).reshape(1, -1, 1, 1) * 1e38
    assert np.all(np.abs(y - exact) <= (2.0 ** -8 + 2.0 ** -14) * scale), float((np.abs(y - exact) / scale).max())


def test_cost_model_bf16_choices():
    """The bf16 choice weighs the GEMMs and weights at half their float32 cost, the transforms at full: on
    AVX-512 register tiles ResNet-50's stride-1 3x3 layers take F(2x2) at every size (float32 takes F(4x4) at
    56 and 28, which bf16 never does: bench/PRECISION.md measured it 29x less accurate), 16 -> 16 channels at 40x40
    and 130 -> 20 at 7x7 stay direct (the transforms outweigh the halved GEMM); the tuning's override wins."""
    shapes = tile_shapes(512)
    t = X86Tuning()
    for c, hw in ((64, 56), (128, 28), (256, 14), (512, 7)):
        assert best_tile(c, c, hw, hw, shapes, t, bf16=True) == 2, (c, hw)
    assert best_tile(64, 64, 56, 56, shapes, t) == 4        # (float32)
    assert best_tile(16, 16, 40, 40, shapes, t, bf16=True) is None
    assert best_tile(130, 20, 7, 7, shapes, t, bf16=True) is None
    assert best_tile(4, 64, 56, 56, shapes, t, bf16=True) is None
    assert best_tile(130, 20, 7, 7, shapes, X86Tuning(bf16_winograd=True), bf16=True) == 2
    assert best_tile(64, 64, 56, 56, shapes, X86Tuning(bf16_winograd=False), bf16=True) is None
