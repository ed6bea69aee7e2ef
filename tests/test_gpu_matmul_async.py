"""The cp.async / ldmatrix tensor-core products (``PtxTuning.mma_async``,
:func:`cuvil.targets.ptx.matmul_mma.async_ok`): float16 operands copied by 16-byte ``cp.async.cg`` into 2-4
shared stages per K group, fragments by ``ldmatrix.x4`` (``.trans`` for an operand that is not k-contiguous).
Here: the fragment addressing replayed in numpy against the PTX ISA's layouts, the eligibility rules, ptxas
(sm_80 / sm_90) accepting the kernels without spills, the bounds statement proved for ragged products and
refuted when widened; on a GPU, ragged M / N / K products against numpy, repeating bit for bit and equal to the
register-staged kernel's sums.
"""
import numpy as np
import pytest

from cuvil import Pipeline
from cuvil.targets.ptx import assemble, bounds_patterns
from cuvil.targets.ptx.codegen import build_ptx, gpu_schedule
from cuvil.targets.ptx.matmul_mma import (ASYNC_PAD, FRAGMENTS, TK, async_ok, async_pieces, async_region,
                                          ldsm_a_half, ldsm_b_half, row_stride,
                                          SMEM_LIMIT, smem_bytes)
from cuvil.targets.ptx.tuning import PtxTuning
from cuvil.testing.matmul_models import attention_scores, batched_matmul, gemm_transb_residual, linear_gelu
from cuvil.testing.requires import needs_gpu, needs_ptxas

# ragged in every way the kernel allows: M not a multiple of the tile, K not a multiple of the chunk (pieces past
# K zero-filled), N not a multiple of the tile; k-contiguous and row-contiguous operands (Gemm transB, MatMul)
RAGGED = [dict(b=2, m=40, k=272, n=48), dict(b=1, m=100, k=200, n=88)]
WIDE = dict(b=1, m=1000, k=200, n=1064)     # enough tiles for 64 x 64 ones (16 x 17), ragged M and K


def _ldmatrix(mem, halves, trans):
    """numpy ``ldmatrix.sync.aligned.m8n8.x4(.trans).b16``: lane l gives the row address ``halves[l]`` of row
    l % 8 of matrix l // 8; lane l receives in register j the two halves at row l // 4, columns 2 (l % 4) + {0, 1}
    of matrix j (of its transpose with .trans)."""
    out = np.zeros((32, 4, 2), mem.dtype)
    for j in range(4):
        m = np.stack([mem[halves[8 * j + r]:halves[8 * j + r] + 8] for r in range(8)])
        if trans:
            m = m.T
        for lane in range(32):
            out[lane, j] = m[lane // 4, 2 * (lane % 4):2 * (lane % 4) + 2]
    return out


@pytest.mark.parametrize("kfast", [True, False])
@pytest.mark.parametrize("rows", [32, 64])
def test_ldmatrix_addresses_give_the_isa_fragments(kfast, rows):
    """Values A[row][k] stored as the copies store them (async_pieces), read through ldsm_a_half / ldsm_b_half by
    the emulated ldmatrix, land in the registers FRAGMENTS (the PTX ISA's m16n8k16 layouts) say."""
    f = FRAGMENTS["fp16"]
    tile = np.arange(rows * TK, dtype=np.int64).reshape(rows, TK) + 1        # tile[row][k], all distinct
    mem = np.zeros(async_region(rows, kfast), np.int64)
    for r, kk, off in async_pieces(rows, kfast):          # each piece: 8 halves along the contiguous index
        mem[off:off + 8] = tile[r, kk:kk + 8] if kfast else tile[r:r + 8, kk]
    for row0 in range(0, rows, 16):
        for ks in (0, 16):
            halves = [ldsm_a_half(kfast, rows, row0, l % 8, l // 8 % 2, l // 16, ks) for l in range(32)]
            got = _ldmatrix(mem, halves, not kfast)
            for lane in range(32):
                g, t = lane // 4, lane % 4
                for reg, (dr, dc) in enumerate(f.a):
                    want = [tile[row0 + g + dr, ks + 2 * t + dc + e] for e in (0, 1)]
                    assert list(got[lane, reg]) == want, (row0, ks, lane, reg)
    for col0 in range(0, rows, 16):           # as B (rows = columns n): two 8-column tiles per ldmatrix
        for ks in (0, 16):
            halves = [ldsm_b_half(kfast, rows, col0, l % 8, l // 8 % 2, l // 16, ks) for l in range(32)]
            got = _ldmatrix(mem, halves, not kfast)
            for lane in range(32):
                g, t = lane // 4, lane % 4
                for half_tile in (0, 1):
                    for reg, dk in enumerate(f.b):
                        want = [tile[col0 + 8 * half_tile + g, ks + 2 * t + dk + e] for e in (0, 1)]
                        assert list(got[lane, 2 * half_tile + reg]) == want, (col0, ks, lane, reg)


def test_stage_rows_stay_16_byte_aligned():
    for rows in (32, 64):
        for kfast in (True, False):
            assert all(off % 8 == 0 for _, _, off in async_pieces(rows, kfast))
            assert async_region(rows, kfast) % 8 == 0 and async_region(rows, kfast) <= rows * row_stride("fp16")
    assert (32 + ASYNC_PAD) % 8 == 0


def _plans(model, tuning, monkeypatch):
    """The product plans the code generator makes for ``model`` in float16 (``enable_fp16``'s rewrite)."""
    from cuvil.targets.ptx import codegen
    seen, real = [], codegen.plan_matmul

    def spy(*a, **kw):
        seen.append(real(*a, **kw))
        return seen[-1]
    monkeypatch.setattr(codegen, "plan_matmul", spy)
    _plans.ptx = _fp16_ptx(model, tuning).ptx
    return seen


def test_async_rules(monkeypatch):
    from cuvil.kernels.texpr import Buf, cast, load, var
    from cuvil.ir.dtype import DType
    m, k = var("m"), var("k")

    def fac(offset=0, stride=768, shape=(128, 768)):
        return cast(load(Buf("x", DType.FLOAT16, shape, offset=offset, pitch=(stride, 1)), [m, k]), DType.FLOAT)
    assert async_ok(fac(), "fp16", True, k.attr, m.attr, [], 768, 128)
    assert async_ok(fac(shape=(100, 272), stride=272), "fp16", True, k.attr, m.attr, [], 272, 100)   # ragged: zero-fill
    assert not async_ok(fac(offset=8), "fp16", True, k.attr, m.attr, [], 768, 128)       # 8-byte aligned base
    assert not async_ok(fac(stride=772), "fp16", True, k.attr, m.attr, [], 768, 128)     # rows 8 bytes apart
    assert not async_ok(fac(shape=(128, 764), stride=764), "fp16", True, k.attr, m.attr, [], 764, 128)  # K % 8
    assert not async_ok(fac(), "tf32", True, k.attr, m.attr, [], 768, 128)               # float16 only
    # the row-contiguous direction: rows must be a multiple of 8
    assert not async_ok(fac(shape=(128, 100), stride=100), "fp16", False, m.attr, k.attr, [], 128, 100)
    # off: no stages; on: both operands of a BERT product, and the plan's shared memory fits
    model, _ = linear_gelu(b=1, m=128, k=3072, n=768)
    assert {p.stages for p in _plans(model, PtxTuning(mma_async=0), monkeypatch)} == {1}
    plans = _plans(model, PtxTuning(mma_async=3), monkeypatch)     # (asked again by the bounds statement)
    assert plans and all(p == plans[0] for p in plans)
    p = plans[0]
    assert p.stages == 3 and smem_bytes("fp16", p.bm, p.bn, p.ks, 3) <= SMEM_LIMIT
    # the shared tiles the kernel declares hold every group's stages
    assert f"_t[{smem_bytes('fp16', p.bm, p.bn, p.ks, 3)}]" in _plans.ptx and p.ks > 1
    plan = _plans(linear_gelu(**WIDE)[0], PtxTuning(mma_async=4), monkeypatch)[0]   # GPU cases: 64 x 64 tiles too
    assert (plan.bm, plan.bn, plan.stages) == (64, 64, 4), plan


def _fp16_ptx(model, tuning, arch="sm_90"):
    from cuvil.rewrite_rules.precision import to_half
    g = Pipeline.from_onnx(model).optimize().graph
    return build_ptx(gpu_schedule(to_half(g)[0]), arch, fma=True, tuning=tuning)


def _cases():
    return [linear_gelu(**RAGGED[0])[0], gemm_transb_residual(m=100, k=200, n=88)[0],
            linear_gelu(b=1, m=128, k=3072, n=768)[0], batched_matmul(b=2, h=3, m=40, k=40, n=32)[0],
            attention_scores(b=1, h=12, s=128, d=64)[0], linear_gelu(**WIDE)[0]]


@needs_ptxas
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("stages", [2, 3, 4])
def test_async_products_assemble_without_spills_and_prove(arch, stages):
    for i, model in enumerate(_cases()):
        r = _fp16_ptx(model, PtxTuning(mma_async=stages), arch)
        assert "cp.async.cg.shared.global" in r.ptx and "ldmatrix.sync.aligned.m8n8.x4" in r.ptx, i
        assert r.memory_safety.proved == len(r.memory_safety.kernels) and not r.memory_safety.guarded, i
        _, info = assemble(r.ptx, arch)
        for k in r.kernels:
            assert info[k.name].spill_stores == 0 and info[k.name].spill_loads == 0, (i, k.name, info[k.name])
    # off: the register-staged kernel, as before
    r = _fp16_ptx(_cases()[0], PtxTuning(mma_async=0))
    assert "mma.sync" in r.ptx and "cp.async" not in r.ptx


def test_widened_async_pattern_is_refuted(monkeypatch):
    init = bounds_patterns.GpuPatterns.__init__
    monkeypatch.setattr(bounds_patterns.GpuPatterns, "__init__", lambda self, km, widen=0: init(self, km, 1))
    r = _fp16_ptx(linear_gelu(**RAGGED[0])[0], PtxTuning(mma_async=3))
    assert "cp.async" not in r.ptx and "mma.sync" not in r.ptx
    (g,) = r.memory_safety.guarded
    assert any("family:matmul" in f for f in g.failures), g.failures


def test_zero_fill_is_what_proves_ragged_pieces(monkeypatch):
    """Stated without the select to (0, 0) of a piece past the rows or past K, the ragged product's copies are
    refuted: the statement's selects are the kernel's source-size-0 pieces, not decoration."""
    real = bounds_patterns.select
    monkeypatch.setattr(bounds_patterns, "select",
                        lambda c, a, b: a if getattr(b, "op", "") == "const" and b.attr == 0 else real(c, a, b))
    r = _fp16_ptx(linear_gelu(**RAGGED[0])[0], PtxTuning(mma_async=2))
    assert "cp.async" not in r.ptx
    assert r.memory_safety.guarded


# --- on a GPU ------------------------------------------------------------------------------------------------

def _run(model, feeds, tmp_path, name, tuning):
    import cuvil
    from cuvil.targets.ptx.bundle import compile_bundle
    path = str(tmp_path / f"{name}.cuvil")
    compile_bundle(Pipeline.from_onnx(model).optimize().graph, path, tuning=tuning, enable_fp16=True)
    with open(f"{path}/kernels.ptx") as f:
        ptx = f.read()
    m = cuvil.load(path)
    return [m.run(*feeds)[0] for _ in range(2)], ptx


def _gpu_cases(rng):
    out = []
    for kw in RAGGED:
        out.append((linear_gelu(**kw), [rng.standard_normal((kw["b"], kw["m"], kw["k"])).astype(np.float32)]))
    out.append((gemm_transb_residual(m=100, k=200, n=88), [rng.standard_normal((100, 200)).astype(np.float32),
                                                           rng.standard_normal((100, 88)).astype(np.float32)]))
    out.append((linear_gelu(b=1, m=128, k=3072, n=768), [rng.standard_normal((1, 128, 3072)).astype(np.float32)]))
    out.append((linear_gelu(**WIDE), [rng.standard_normal((1, WIDE["m"], WIDE["k"])).astype(np.float32)]))
    out.append((batched_matmul(b=2, h=3, m=40, k=40, n=32), [rng.standard_normal((2, 3, 40, 40)).astype(np.float32),
                                                             rng.standard_normal((2, 3, 40, 32)).astype(np.float32)]))
    out.append((attention_scores(b=1, h=12, s=128, d=64),
                [rng.standard_normal((1, 12, 128, 64)).astype(np.float32) for _ in range(2)]))
    return out


@needs_gpu
@pytest.mark.parametrize("stages,groups", [(2, 4), (3, 4), (4, 4), (3, 0)])
def test_gpu_async_products_match_numpy_and_repeat(tmp_path, stages, groups):
    rng = np.random.default_rng(0)
    for i, ((model, ref), feeds) in enumerate(_gpu_cases(rng)):
        (y1, y2), ptx = _run(model, feeds, tmp_path, f"c{i}", PtxTuning(mma_async=stages, mma_sm_groups=groups))
        assert "cp.async.cg" in ptx, i
        assert np.array_equal(y1, y2), "the products must repeat bit for bit"
        want = ref(*feeds)
        err = np.abs(y1 - want).max() / np.abs(want).max()
        assert err < 3e-2, (stages, groups, i, err)       # test_gpu_tensor_cores.py's float16 bound


@needs_gpu
@pytest.mark.parametrize("stages", [2, 3])
def test_gpu_async_sums_equal_the_register_staged_kernel(tmp_path, stages):
    """One K group, no split (the same plan either way): the same chunks, mma order and zeroed terms as the
    register-staged kernel, so the same bits. (The session-17 H200 run found case 5, batched 40 x 40 x 32 with
    K = 40, 1 ulp apart: the register-staged side had taken row-contiguous vectors past K, was refuted by the
    prover and ran on the plain kernel; vec_width no longer takes them, and the staged side must be mma.)"""
    rng = np.random.default_rng(1)
    for i, ((model, _), feeds) in enumerate(_gpu_cases(rng)):
        same = dict(mma_sm_groups=0, mma_max_ks=1)
        (a, _), _ = _run(model, feeds, tmp_path, f"a{i}", PtxTuning(mma_async=stages, **same))
        (b, _), ptx = _run(model, feeds, tmp_path, f"b{i}", PtxTuning(mma_async=0, **same))
        assert "cp.async" not in ptx and "mma.sync" in ptx, i
        assert np.array_equal(a, b), (stages, i, np.abs(a - b).max())
