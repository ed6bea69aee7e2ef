"""The memory-safety certificate of GPU bundles (targets/ptx/bounds_patterns.py), without a GPU: every kernel
of the demo CNN and of a transformer block proved in bounds, the implicit-GEMM convolution's stated access
pattern (weight panels, window, tile stores, split-K partials) refuted when widened by one, and a kernel
whose pattern is not proved guarded: emitted by the plain kernels and listed."""
import os

import onnx
import pytest

from cuvil import Pipeline
from cuvil.kernels.bounds import BoundsProver, stage_accesses
from cuvil.targets.ptx import bounds_patterns, find_libdevice
from cuvil.targets.ptx.bundle import read_bundle
from cuvil.targets.ptx.codegen import PtxKernelModule, build_ptx, gpu_schedule, target_machine
from cuvil.targets.ptx.conv import conv_node
from cuvil.targets.ptx.tuning import PtxTuning
from cuvil.testing import small_cnn
from cuvil.testing.conv_models import conv_relu_model
from cuvil.testing.models import transformer_block

TARGET = "nvptx64-nvidia-cuda"
DEMO = os.path.join(os.path.dirname(__file__), "..", "src", "cuvil", "data", "demo_cnn.onnx")
needs_libdevice = pytest.mark.skipif(find_libdevice() is None, reason="libdevice.10.bc not found (no CUDA toolkit)")


def _certificate(model, tmp_path):
    b = Pipeline.from_onnx(model).optimize().compile(TARGET, arch="sm_90", cache=False)
    _, man = read_bundle(b.save(str(tmp_path / "m.cuvil")))
    return man["memory_safety"]


def demo_cnn_static(batch: int = 2) -> onnx.ModelProto:
    """The demo CNN with its batch fixed (GPU bundles have static shapes)."""
    m = onnx.load(DEMO)
    m.graph.input[0].type.tensor_type.shape.dim[0].dim_value = batch
    return m


@needs_libdevice
@pytest.mark.parametrize("model", [demo_cnn_static, small_cnn])
def test_cnn_bundle_every_kernel_proved(model, tmp_path):
    ms = _certificate(model(), tmp_path)
    assert ms["kernels_proved"] == ms["kernels"] > 0 and ms["guarded"] == []
    assert {k["status"] for k in ms["per_kernel"]} == {"proved"}
    assert ms["accesses"] > ms["kernels"]


@needs_libdevice
def test_transformer_block_bundle_every_kernel_proved(tmp_path):
    ms = _certificate(transformer_block(batch=1, seq=8), tmp_path)
    assert ms["kernels_proved"] == ms["kernels"] >= 10 and ms["guarded"] == []


def _conv_stage(x_shape, w_shape, fused_splitk=False, **kw):
    s = gpu_schedule(Pipeline.from_onnx(conv_relu_model(x_shape, w_shape, **kw)).optimize().graph)
    km = PtxKernelModule("t", target_machine(), scratch_offset=s.arena_bytes, fused_splitk=fused_splitk)
    km.plan_scratch(s.stages)
    st, = [st for st in s.stages if conv_node(st) is not None]
    return s, km, st


@pytest.mark.parametrize("shapes", [
    dict(x_shape=(1, 16, 14, 14), w_shape=(32, 16, 3, 3)),                      # padded, one slice
    dict(x_shape=(1, 16, 14, 14), w_shape=(32, 16, 1, 1), pads=(0, 0, 0, 0)),    # unpadded 1x1
    dict(x_shape=(1, 256, 7, 7), w_shape=(256, 256, 3, 3)),                     # split-K partials + sum kernel
])
def test_conv_pattern_proved_and_refuted_when_widened(shapes):
    s, km, st = _conv_stage(**shapes)
    for widen, expect in ((0, True), (1, False)):
        accs = [a for a in stage_accesses(st, bounds_patterns.GpuPatterns(km, widen)) if a.kind.startswith("family")]
        kinds = {a.buf.name for a in accs}
        assert {"x"} <= kinds and len(accs) >= 3
        prover = BoundsProver()
        verdicts = [prover.check(a, s.ranges) is None for a in accs]
        assert verdicts == [expect] * len(accs), (widen, [a.buf.name for a in accs], verdicts)
    if km.conv_plan(st, conv_node(st)).splits > 1:
        assert "splitk" in kinds


def test_unproved_conv_is_guarded_and_emitted_plain(monkeypatch):
    """A convolution whose stated pattern does not prove (here: widened by one) is listed as guarded, and
    the PTX computes it with the plain kernels, not the implicit-GEMM one."""
    s, _, _ = _conv_stage((1, 16, 14, 14), (32, 16, 3, 3))
    res = build_ptx(s, "sm_90", fma=True)
    assert [d.kind for d in res.kernels] == ["conv"] and res.memory_safety.guarded == []
    init = bounds_patterns.GpuPatterns.__init__
    monkeypatch.setattr(bounds_patterns.GpuPatterns, "__init__", lambda self, km, widen=0: init(self, km, 1))
    res = build_ptx(s, "sm_90", fma=True)
    cert = res.memory_safety
    assert [k.status for k in cert.kernels] == ["guarded"] and cert.proved == 0
    assert all(d.kind != "conv" and not d.kind.startswith("conv") for d in res.kernels)
    assert conv_node(s.stages[0]) is not None      # the schedule itself is left as it was
    assert [k["status"] for k in cert.to_json()["guarded"]] == ["guarded"]


def test_fused_splitk_counters_and_readbacks_proved():
    """With the fused split-K variant the last slice reads every partial back and counts per tile: both
    are stated and proved, and the kernel is still emitted as the implicit GEMM."""
    s, km, st = _conv_stage((1, 256, 7, 7), (256, 256, 3, 3), fused_splitk=True)
    accs = [a for a in stage_accesses(st, bounds_patterns.GpuPatterns(km)) if a.kind.startswith("family")]
    assert [a.buf.name for a in accs].count("splitk") == 2 and "splitk counters" in [a.buf.name for a in accs]
    res = build_ptx(s, "sm_90", fma=True, fused_splitk=True)
    assert res.memory_safety.summary() == "1/1 kernels proved in bounds"
    assert [d.kind for d in res.kernels] == ["conv_splitk"]


def test_float16_tensor_core_conv_proved():
    """A float16 convolution with 64-channel panels (the mma kernels on sm_90: the whole-batch one of
    conv_mma.py by default, conv.py's per-image one with conv_mma_batch=False) is proved like the float32 one."""
    from cuvil.rewrite_rules.precision import to_half
    from cuvil.targets.ptx.tuning import PtxTuning
    g, _ = to_half(Pipeline.from_onnx(conv_relu_model((1, 64, 14, 14), (64, 64, 3, 3))).optimize().graph)
    for tuning, kind in ((PtxTuning(), "_mma_fp16"), (PtxTuning(conv_mma_batch=False), "_mma")):
        res = build_ptx(gpu_schedule(g), "sm_90", fma=True, tuning=tuning)
        assert any(d.kind.endswith(kind) for d in res.kernels)
        assert res.memory_safety.proved == len(res.memory_safety.kernels) > 0


# --- tensor-core products (matmul_mma.py): operand loads, vector loads, split-K partials and sum reads --------

def _product_build(model, mode, tuning=None):
    """The PTX of ``model`` with its products on fp16 or TF32 tensor cores, or (``fp32``) the SIMT kernel."""
    from cuvil.rewrite_rules.precision import to_half
    from cuvil.targets.ptx.tuning import DEFAULT_TUNING
    g = Pipeline.from_onnx(model).optimize().graph
    r = build_ptx(gpu_schedule(to_half(g)[0] if mode == "fp16" else g), "sm_90", fma=True,
                  allow_tf32=mode == "tf32", tuning=tuning or DEFAULT_TUNING)
    return r, r.memory_safety


_PRODUCTS = [  # BERT's FFN products (the down projection splits K), a ragged one (M = 100: vectors of clamped
    # rows), a small ragged batched one (K = 272: scalar loads, terms past K clamped)
    dict(b=1, m=128, k=768, n=3072), dict(b=1, m=128, k=3072, n=768), dict(b=1, m=100, k=768, n=3072),
    dict(b=2, m=40, k=272, n=48)]


@pytest.mark.parametrize("mode", ["fp16", "tf32", "fp32"])
@pytest.mark.parametrize("shape", _PRODUCTS, ids=lambda s: "x".join(str(v) for v in s.values()))
def test_products_proved(shape, mode):
    from cuvil.testing.matmul_models import linear_gelu
    from cuvil.targets.ptx.tuning import DEFAULT_TUNING
    assert DEFAULT_TUNING.mma_sm_groups == 4 and DEFAULT_TUNING.mma_vec      # the defaults this covers
    r, cert = _product_build(linear_gelu(**shape)[0], mode)
    kinds = [k.kind for k in r.kernels]
    want = ("gemm_fp32",) if mode == "fp32" else ("matmul_" + mode, "matmul_splitk_" + mode)
    assert any(k.startswith(want) for k in kinds), kinds
    assert cert.proved == len(cert.kernels) and not cert.guarded, cert.to_json()["guarded"]
    if shape["k"] == 3072 and mode != "fp32":
        assert "matmul_sum" in kinds         # split-K: the partials and the sum kernel's reads are stated
    if mode == "fp16":
        assert "cp.async.cg" in r.ptx        # the cp.async copies (mma_async, on by default) are stated
    if mode == "fp16" and shape["k"] % 32 == 0:
        r, cert = _product_build(linear_gelu(**shape)[0], mode, PtxTuning(mma_async=0))
        assert "ld.global.nc.v4" in r.ptx    # vector operand loads are stated
        assert cert.proved == len(cert.kernels) and not cert.guarded, cert.to_json()["guarded"]


def test_batched_product_pattern_counts_its_accesses():
    """The product's stage states its kernel's accesses besides its own loads and store: the scalar operand
    loads (TF32), the split-K stores and the sum kernel's reads are obligations of the certificate."""
    from cuvil.testing.matmul_models import batched_matmul, linear_gelu
    r, cert = _product_build(batched_matmul(b=2, h=12, m=128, k=64, n=128)[0], "fp16")
    assert "matmul_fp16" in [k.kind for k in r.kernels] and cert.proved == len(cert.kernels)
    _, split = _product_build(linear_gelu(b=1, m=128, k=3072, n=768)[0], "tf32")
    (k,) = split.kernels
    assert k.accesses >= 8        # store + 2 loads + bias + 2 operand patterns + partial stores + sum reads


@pytest.mark.parametrize("mode", ["fp16", "tf32", "fp32"])
def test_widened_product_pattern_is_refuted_and_emitted_plain(monkeypatch, mode):
    """A product whose stated pattern does not prove (widened by one: an off-by-one in every stated index's
    loop) is listed as guarded and falls back to the plain kernels: the bundle never ships an unproved
    tensor-core product."""
    from cuvil.testing.matmul_models import linear_gelu
    init = bounds_patterns.GpuPatterns.__init__
    monkeypatch.setattr(bounds_patterns.GpuPatterns, "__init__", lambda self, km, widen=0: init(self, km, 1))
    r, cert = _product_build(linear_gelu(b=1, m=128, k=3072, n=768)[0], mode)
    kinds = [k.kind for k in r.kernels]
    assert not any(k.startswith(("matmul_", "gemm_fp32")) for k in kinds) and "mma.sync" not in r.ptx, kinds
    (g,) = cert.guarded
    assert g.status == "guarded" and any("family:matmul" in f for f in g.failures), g.failures


def test_unclamped_vector_rows_are_refuted(monkeypatch):
    """The prover sees the vector loads' rows: stated without the clamp of a ragged tile (M = 100, rows up to
    127), the kernel's reads past A are refuted and the product runs on the plain kernels."""
    from cuvil.testing.matmul_models import linear_gelu
    real = bounds_patterns.select

    def no_clamp(c, a, b):    # drops every row clamp the product statement makes (cmp(row, ext) ? row : ext - 1)
        return a if getattr(b, "op", "") == "const" and b.attr == 99 else real(c, a, b)
    monkeypatch.setattr(bounds_patterns, "select", no_clamp)
    # (the register-staged kernel's vectors: cp.async pieces zero-fill instead, test_gpu_matmul_async.py)
    r, cert = _product_build(linear_gelu(b=1, m=100, k=768, n=3072)[0], "fp16", PtxTuning(mma_async=0))
    assert "mma.sync" not in r.ptx
    (g,) = cert.guarded
    assert any("family:matmul x_f16" in f and "out of bounds" in f for f in g.failures), g.failures


# --- one-row products (gemv.py, PtxTuning.gemv): 16-byte weight loads or clamped scalar columns --------------

def _gemv_build(model, widen=0, monkeypatch=None):
    from cuvil.targets.ptx.tuning import PtxTuning
    if widen:
        init = bounds_patterns.GpuPatterns.__init__
        monkeypatch.setattr(bounds_patterns.GpuPatterns, "__init__", lambda self, km, w=0: init(self, km, widen))
    r = build_ptx(gpu_schedule(Pipeline.from_onnx(model).optimize().graph), "sm_90", fma=True,
                  tuning=PtxTuning(gemv=True))
    return [k.kind for k in r.kernels], r.memory_safety


@pytest.mark.parametrize("k, n", [(768, 2304), (300, 1001)], ids=["vector", "scalar"])
def test_gemv_pattern_proved_and_refuted_when_widened(monkeypatch, k, n):
    from test_ptx_gemv import batched_product, row_product
    for model in (row_product(k, n), batched_product(3, k, n)):
        kinds, cert = _gemv_build(model)
        assert "gemv" in kinds and cert.proved == len(cert.kernels), (kinds, cert.to_json()["guarded"])
        kinds, cert = _gemv_build(model, widen=1, monkeypatch=monkeypatch)
        assert "gemv" not in kinds, kinds
        (g,) = cert.guarded
        assert any("family:gemv" in f for f in g.failures), g.failures
        monkeypatch.undo()
