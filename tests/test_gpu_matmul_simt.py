"""Strict float32 matrix products on the register-tiled SIMT kernel (``cuvil.targets.ptx.matmul_simt``):
which stages take it (float32 MatMul / Gemm that the tensor cores do not), the plans (launchable, the cost
model's choices for BERT-sized products), its PTX assembling with ptxas without spills, and on a GPU the
results against numpy and against the kernels it replaces (bit-identical with one K group: the same fma
chain in the same order) for ragged M/N/K, K not a multiple of the chunk, batch dims and transposed B."""
import numpy as np
import pytest

from cuvil import Pipeline
from cuvil.targets.ptx import assemble
from cuvil.targets.ptx.codegen import build_ptx, gpu_schedule
from cuvil.targets.ptx.matmul_mma import matmul_parts
from cuvil.targets.ptx.matmul_simt import TK, SimtPlan, fits, plan_simt
from cuvil.targets.ptx.tuning import PtxTuning
from cuvil.testing.matmul_models import attention_scores, batched_matmul, gemm_transb_residual, linear_gelu
from cuvil.testing.ptx_bundles import run_ptx_bundle
from cuvil.testing.requires import needs_gpu, needs_ptxas

CASES = {   # ragged M/N/K, K % 16 != 0, batch dims, transposed B, P·V, Gemm(transB) + residual
    "linear_gelu": lambda: linear_gelu(2, 40, 272, 48),
    "ragged_short_k": lambda: linear_gelu(3, 37, 17, 50),
    "long_k": lambda: linear_gelu(1, 130, 3001, 70),
    "qkt": lambda: attention_scores(2, 3, 40, 32),
    "pv": lambda: batched_matmul(2, 3, 40, 45, 33),
    "gemm_transb": lambda: gemm_transb_residual(24, 200, 56),
}


def _sched(model):
    return gpu_schedule(Pipeline.from_onnx(model).optimize().graph)


def _plans(model, force=()):
    return [plan_simt(st, p, force) for st in _sched(model).stages if (p := matmul_parts(st))]


def test_strict_fp32_products_take_the_simt_kernel():
    for make in CASES.values():
        model, _ = make()
        for fma in (True, False):
            r = build_ptx(_sched(model), "sm_90", fma=fma)
            assert [k.kind for k in r.kernels] == ["gemm_fp32"]
            assert "mma.sync" not in r.ptx and "ld.shared.v4" in r.ptx
            # a chunk's 16 terms x 16 outputs are fmas; without contraction separate mul.rn + add.rn (the GELU's
            # libdevice erf keeps its own few fmas)
            fmas, muls = r.ptx.count("fma.rn.f32"), r.ptx.count("mul.rn.f32")
            assert (fmas >= 256) if fma else (fmas < 256 and muls >= 256), (fma, fmas, muls)
        # tensor cores where allowed; the old kernels when the SIMT kernel is off
        tc = [k.kind for k in build_ptx(_sched(model), "sm_90", fma=True, allow_tf32=True).kernels]
        assert tc in (["matmul_tf32"], ["matmul_splitk_tf32", "matmul_sum"]), tc     # split-K: mma_sm_groups
        off = build_ptx(_sched(model), "sm_90", tuning=PtxTuning(simt_matmul=False)).kernels
        assert "gemm_fp32" not in [k.kind for k in off]


def test_vector_products_stay_on_the_plain_kernels():
    model, _ = linear_gelu(1, 1, 64, 48)      # one row
    assert "gemm_fp32" not in [k.kind for k in build_ptx(_sched(model), "sm_90").kernels]


def test_plans_fit_and_cover_the_products():
    for make in CASES.values():
        model, _ = make()
        for p in _plans(model):
            assert fits(p)
            assert p.tiles_m * p.bm >= p.m and p.tiles_n * p.bn >= p.n and p.rounds * p.ks * TK >= p.k
            for which in ("a", "b"):     # every tile element loaded once per chunk
                n, rows, _ = p.load_slots(which)
                assert n * p.group_threads == rows * TK
    (p,) = _plans(attention_scores(2, 3, 40, 32)[0])
    assert p.batch == (2, 3) and (p.m, p.n, p.k) == (40, 40, 32) and p.b_kfast      # Kᵀ: contiguous along k
    (p,) = _plans(batched_matmul(2, 3, 40, 45, 33)[0])
    assert not p.b_kfast                                                           # V: contiguous along n


def test_bert_products_fill_the_gpu():
    """128-row products with long sums: the cost model picks tiles and K groups that give at least one
    group of warps per SM (132 on an H200) rather than 24 blocks of 64 x 64."""
    for k, n in ((768, 768), (3072, 768), (768, 3072)):
        (p,) = _plans(gemm_transb_residual(128, k, n)[0])
        assert p.blocks * p.ks >= 132, p
    big = SimtPlan(128, 64, 8, 4, (), 4096, 4096, 4096, True, False, 1)
    assert fits(big) and not fits(SimtPlan(32, 32, 4, 4, (), 128, 768, 3072, True, False, 16))   # 1024 threads


#: Every tile shape on sm_90 with contraction; the register-heaviest ones (128 x 64: 8 x 4 outputs per thread,
#: and the cost model's own pick) also without contraction and on sm_80. Every build is a ptxas run (~0.5 s of
#: CPU): the whole grid on both architectures took 190 s of CPU in CI for no register-pressure case more.
SPILL_GRID = {"sm_90": ([(), (128, 64, 1), (128, 64, 2), (64, 64, 4), (32, 32, 8), (16, 32, 8), (32, 16, 8),
                         (16, 64, 4)], (True,)),
              "sm_90 no fma": ([(), (128, 64, 1), (128, 64, 2)], (False,)),
              "sm_80": ([(), (128, 64, 1), (128, 64, 2)], (True, False))}


@needs_ptxas
@pytest.mark.parametrize("grid", sorted(SPILL_GRID))
def test_simt_kernels_assemble_without_spills(grid):
    arch = grid.split()[0]
    forced, fmas = SPILL_GRID[grid]
    for make in CASES.values():
        model, _ = make()
        s = _sched(model)
        for force in forced:
            for fma in fmas:
                r = build_ptx(s, arch, fma=fma, tuning=PtxTuning(simt_force=force))
                _, info = assemble(r.ptx, arch)
                for k in r.kernels:
                    assert info[k.name].spill_stores == 0, (k.name, force, info[k.name])


# --- on a GPU ------------------------------------------------------------------------------------------------

@needs_gpu
@pytest.mark.parametrize("case", sorted(CASES))
def test_gpu_simt_matches_numpy_and_the_old_kernels(tmp_path, case):
    model, ref = CASES[case]()
    rng = np.random.default_rng(0)
    feeds = [rng.standard_normal([d.dim_value for d in vi.type.tensor_type.shape.dim]).astype(np.float32)
             for vi in model.graph.input]
    want = ref(*feeds).astype(np.float64)
    y = run_ptx_bundle(model, feeds, tmp_path / "new")
    y0 = run_ptx_bundle(model, feeds, tmp_path / "old", simt_matmul=False)
    err = np.abs(y - want).max() / np.abs(want).max()
    assert err < 1e-5, (case, err)
    # with one K group the kernel runs the same fma chain in the same order as the one-thread-per-element
    # kernel: bit-identical where that is what the old path used (not where it split the sum over lanes)
    old_kinds = [k.kind for k in build_ptx(_sched(model), "sm_90", fma=True,
                                           tuning=PtxTuning(simt_matmul=False)).kernels]
    if "split" in old_kinds:
        return
    for force in ((64, 64, 1), (128, 64, 1)):
        (plan,) = _plans(model, force)
        if plan.ks == 1:
            y1 = run_ptx_bundle(model, feeds, tmp_path / ("f%d_%d" % force[:2]), simt_force=force)
            assert np.array_equal(y1.view(np.uint32), y0.view(np.uint32)), (case, force, old_kinds)
