"""Split-K tensor-core products (``PtxTuning.mma_sm_groups``, :func:`cuvil.targets.ptx.matmul_mma.plan_slices`)
and vector operand loads (``PtxTuning.mma_vec``, :func:`~cuvil.targets.ptx.matmul_mma.vec_width`): BERT-sized
products (128 rows, long K) split K across blocks, every chunk summed once by one (slice, round, group), the
partial sums added in slice order by a second kernel; float16 operands loaded 8 halves at a time where aligned;
the PTX assembles with ptxas; the defaults (off) emit what they did before; on a GPU the results match numpy
and repeat bit for bit. Both are on by default since session 16's H200 run (bench/gpu/RESULTS.md).
"""
import re

import numpy as np
import pytest

from cuvil import Pipeline
from cuvil.targets.ptx import assemble
from cuvil.targets.ptx.codegen import build_ptx, gpu_schedule
from cuvil.targets.ptx.matmul_mma import SMEM_LIMIT, matmul_parts, plan_matmul, plan_slices, smem_bytes
from cuvil.targets.ptx.tuning import PtxTuning
from cuvil.testing.matmul_models import attention_scores, batched_matmul, gemm_transb_residual, linear_gelu
from cuvil.testing.requires import needs_gpu, needs_ptxas


def _sched(model):
    return gpu_schedule(Pipeline.from_onnx(model).optimize().graph)


def _product(model):
    (st,) = [st for st in _sched(model).stages if matmul_parts(st) is not None]
    return st


@pytest.mark.parametrize("groups", [4, 6, 8])
def test_slices_take_every_chunk_once(groups):
    model, _ = linear_gelu(b=1, m=128, k=3072, n=768)
    st = _product(model)
    for fmt in ("fp16", "tf32"):
        plan = plan_matmul(st, matmul_parts(st), fmt, sm_groups=groups, sms=132)
        assert plan.splits > 1, (groups, plan)
        assert plan.chunks % plan.splits == 0 and plan.slice_chunks >= 2 * plan.ks
        assert groups % plan.ks == 0 and plan.min_ctas == groups // plan.ks
        assert smem_bytes(fmt, plan.bm, plan.bn, plan.ks) <= SMEM_LIMIT
        assert plan.blocks == plan.tiles * plan.splits
        assert plan.scratch_floats == plan.splits * 128 * 768
        # the kernel's chunk: first chunk of slice s, plus round * ks + group, while below the slice's end
        got = sorted(s * plan.slice_chunks + r * plan.ks + g
                     for s in range(plan.splits) for r in range(plan.rounds) for g in range(plan.ks)
                     if r * plan.ks + g < plan.slice_chunks)
        assert got == list(range(plan.chunks))


def test_slice_model_prefers_one_wave_and_no_split_when_tiles_fill_the_gpu():
    # 96 tiles of 96 chunks, 8 groups per SM on 132 SMs: splitting beats one 24-round wave
    ks, splits, ctas = plan_slices("fp16", 32, 32, 96, 96, 4, 8, 132)
    assert splits > 1 and ctas == 8 // ks
    # enough tiles for every group slot: no split (the sum kernel would only cost)
    ks, splits, _ = plan_slices("fp16", 32, 32, 4096, 24, 4, 4, 132)
    assert splits == 1
    # K of one chunk: nothing to split
    assert plan_slices("fp16", 32, 32, 10, 1, 4, 8, 132)[:2] == (1, 1)


def test_async_products_split_only_where_tiles_are_few_and_k_long():
    """The cp.async products' costs (``PtxTuning.mma_async_costs`` = (1, 8): a split costs 8 rounds; session 38,
    an H100): BERT-base's float16 products, 4 groups per SM on 132 SMs, 3 stages. At S = 128 the projections (96
    tiles of 32 x 32, 24 chunks) and the FFN's first product run unsplit (the synchronous costs split them in 2:
    whole BERT-base 1.104 against 1.031 ms with these plans); the FFN's second (K = 3072: 96 chunks) still splits;
    at S = 32 the projections (24 tiles) split in 6 as before (the sweep's own best fit left them unsplit too, and
    whole BERT-base ran 1.09x slower with it); at S = 512 (384 tiles of 64 x 64) the FFN's first product no longer
    splits in 4 (1.85x slower in the sweep)."""
    shipped, sync = PtxTuning().mma_async_costs, (1.0, 1.0)
    assert shipped == (1.0, 8.0)
    proj = dict(fmt="fp16", bm=32, bn=32, tiles=96, chunks=24, max_ks=4, sm_groups=4, sms=132, stages=3)
    assert plan_slices(**proj, async_costs=shipped)[1] == 1
    assert plan_slices(**proj, async_costs=sync)[1] == 2 == plan_slices(**proj)[1]   # the plan before session 38
    staged = {**proj, "stages": 1}                                 # register-staged kernels: always (1, 1)
    assert plan_slices(**staged, async_costs=shipped) == plan_slices(**staged, async_costs=sync)
    assert plan_slices(**{**proj, "chunks": 96}, async_costs=shipped)[1] > 1       # S = 128, K = 3072
    proj_s32 = {**proj, "tiles": 24}
    assert plan_slices(**proj_s32, async_costs=shipped) == plan_slices(**proj_s32, async_costs=sync)
    assert plan_slices(**proj_s32, async_costs=shipped)[1] == 6
    assert plan_slices(**{**proj_s32, "chunks": 96}, async_costs=shipped)[1] == 8  # S = 32, K = 3072
    ffn1_s512 = {**proj, "bm": 64, "bn": 64, "tiles": 384, "chunks": 24}
    assert plan_slices(**ffn1_s512, async_costs=shipped)[1] == 1
    assert plan_slices(**ffn1_s512, async_costs=sync)[1] == 4
    # every BERT-base product at S = 64 (and S = 32 but for the FFN's first) keeps the old plan: bench/gpu/RESULTS.md
    # session 38 (whole BERT-base at S = 32 ran 1.09x slower with those unsplit)
    from cuvil.targets.ptx.matmul_mma import block_tile
    for seq, same in ((64, ("proj", "ffn1", "ffn2")), (32, ("proj", "ffn2"))):
        for name, k, n in (("proj", 768, 768), ("ffn1", 768, 3072), ("ffn2", 3072, 768)):
            bm, bn = block_tile(1, seq, n)
            shape = {**proj, "bm": bm, "bn": bn, "tiles": -(-seq // bm) * -(-n // bn), "chunks": k // 32}
            old, new = plan_slices(**shape, async_costs=sync), plan_slices(**shape, async_costs=shipped)
            assert (old == new) == (name in same), (seq, name, old, new)
    with pytest.raises(ValueError):
        PtxTuning(mma_async_costs=(1.0, 0.0))
    with pytest.raises(ValueError):
        plan_slices("fp16", 32, 32, 10, 0, 4, 4, 132)              # no chunk to plan


def test_grids_that_fill_the_gpu_stay_unsplit_with_the_option():
    """PtxTuning.mma_split_filled=False (session 39, opt-in until timed on a GPU): BERT-base's FFN product at B = 8,
    S = 128 (1,024 x 3,072, 768 tiles of 64 x 64) fills the 132 x 4 group slots of an H200 and stays unsplit (the
    estimate, the default, splits it in two: on an H200 49 us a layer plus a 21 us sum kernel over 25 MB of
    partials); a grid below the slots still splits its long sums (the FFN's second product at B = 8: 192 tiles, 96
    chunks); a forced count still forces; and BERT-base at B = 1 builds the same PTX either way (S = 32 .. 512
    compared, session 39)."""
    ffn1_b8 = dict(fmt="fp16", bm=64, bn=64, tiles=768, chunks=24, max_ks=4, sm_groups=4, sms=132, stages=3,
                   async_costs=PtxTuning().mma_async_costs)
    assert PtxTuning().mma_split_filled is True
    assert plan_slices(**ffn1_b8, split_filled=False)[1] == 1 and plan_slices(**ffn1_b8)[1] == 2
    assert plan_slices(**{**ffn1_b8, "tiles": 192, "chunks": 96}, split_filled=False)[1] == 8   # below the slots
    assert plan_slices(**ffn1_b8, only=2, split_filled=False)[1] == 2           # mma_splits forces
    from cuvil.testing.hf_models import bert_model
    from cuvil.rewrite_rules.precision import to_half
    from cuvil.rewrite_rules.specialize import specialize_graph
    p = Pipeline.from_onnx(bert_model(vocab=101, hidden=768, layers=1, heads=12, ffn=3072, max_pos=512)).optimize()
    for batch, differs in ((1, False), (8, True)):
        g, _ = to_half(specialize_graph(p.graph, {"batch": batch, "sequence": 128})[0])
        ptx = [build_ptx(gpu_schedule(g, tuning=t), "sm_90", fma=True, tuning=t).ptx
               for t in (PtxTuning(), PtxTuning(mma_split_filled=False))]
        assert (ptx[0] != ptx[1]) == differs, batch


def _fp16_kinds(model, tuning):
    """The kernel kinds of a model's float16 build (every float32 tensor computed in float16, as enable_fp16)."""
    from cuvil.rewrite_rules.precision import to_half
    g, _ = to_half(Pipeline.from_onnx(model).optimize().graph)
    return [k.kind for k in build_ptx(gpu_schedule(g, tuning=tuning), "sm_90", fma=True, tuning=tuning).kernels]


def test_costs_and_forced_slices_reach_the_kernels():
    """The tuning reaches the emitted kernels: BERT's 128 x 768 x 768 projection in float16 (cp.async) unsplit
    with the shipped costs, split with the synchronous ones, and at a forced count."""
    model, _ = linear_gelu(b=1, m=128, k=768, n=768)
    shipped = _fp16_kinds(model, PtxTuning())
    assert "matmul_fp16" in shipped and "matmul_sum" not in shipped
    for tuning in (PtxTuning(mma_async_costs=(1.0, 1.0)), PtxTuning(mma_splits=3)):
        kinds = _fp16_kinds(model, tuning)
        assert "matmul_splitk_fp16" in kinds and "matmul_sum" in kinds, (tuning, kinds)


def test_forced_slices_where_the_chunks_allow_them():
    """``PtxTuning.mma_splits`` (the sweep's knob): that many slices where they divide the chunks and leave each
    K group two; any other count falls back to the estimate's plan."""
    proj = dict(fmt="fp16", bm=32, bn=32, tiles=96, chunks=24, max_ks=4, sm_groups=4, sms=132, stages=3)
    for n in (1, 2, 3, 4, 6, 8, 12):
        ks, splits, ctas = plan_slices(**proj, only=n)
        assert splits == n and (24 // n >= 2 * ks or (ks, n) == (1, 1)), (n, ks, splits)
        assert ctas == 4 // ks
    assert plan_slices(**proj, only=5) == plan_slices(**proj)       # 5 does not divide 24
    assert plan_slices(**proj, only=24) == plan_slices(**proj)      # one chunk a slice
    model, _ = linear_gelu(b=1, m=128, k=768, n=768)
    st = _product(model)
    for n in (1, 3, 8):
        plan = plan_matmul(st, matmul_parts(st), "fp16", sm_groups=4, sms=132, splits=n)
        assert plan.splits == n and plan.chunks % n == 0
    with pytest.raises(ValueError):
        PtxTuning(mma_splits=-1)


def test_off_emits_no_split_products():
    model, _ = linear_gelu(b=1, m=128, k=3072, n=768)
    r = build_ptx(_sched(model), "sm_90", fma=True, allow_tf32=True, tuning=PtxTuning(mma_sm_groups=0))
    kinds = [k.kind for k in r.kernels]
    assert "matmul_tf32" in kinds and not any("splitk" in k or k == "matmul_sum" for k in kinds)
    assert r.scratch_bytes == 0


@needs_ptxas
@pytest.mark.parametrize("groups", [4, 8])
def test_split_products_assemble(groups):
    tuning = PtxTuning(mma_sm_groups=groups)
    for model, _ in (linear_gelu(b=1, m=128, k=3072, n=768), gemm_transb_residual(m=128, k=768, n=256),
                     batched_matmul(b=1, h=4, m=64, k=512, n=64)):
        s = _sched(model)
        for fmt in ("fp16", "tf32"):
            prec = {st.name: fmt for st in s.stages} if fmt != "tf32" else None
            r = build_ptx(s, "sm_90", fma=True, allow_tf32=True, precisions=prec, tuning=tuning)
            kinds = [k.kind for k in r.kernels]
            assert f"matmul_splitk_{fmt}" in kinds and "matmul_sum" in kinds, kinds
            assert r.scratch_bytes > 0
            _, info = assemble(r.ptx, "sm_90")
            if groups == 4:      # at 8 groups ptxas caps the products at 64 registers and spills (measured)
                for k in r.kernels:
                    assert info[k.name].spill_stores == 0, (k.name, info[k.name])


@needs_ptxas
@pytest.mark.parametrize("fmt", ["fp16", "bf16", "tf32", "fp8"])
def test_fused_split_products_need_no_sum_kernel_and_assemble(fmt):
    """``mma_fused_splitk``: one kernel per split product (the last slice of a tile adds the partials), a
    counter per output tile reserved first in the scratch area, the partials read back through L2."""
    from cuvil.targets.ptx.matmul_mma import stage_scales
    tuning = PtxTuning(mma_sm_groups=4, mma_fused_splitk=True)
    for model, _ in (linear_gelu(b=1, m=128, k=3072, n=768), gemm_transb_residual(m=128, k=768, n=256),
                     batched_matmul(b=2, h=4, m=64, k=512, n=64)):
        s = _sched(model)
        prec = {st.name: fmt for st in s.stages} if fmt != "tf32" else None
        scales = {st.name: (-2, -3) for st in s.stages} if fmt == "fp8" else None
        r = build_ptx(s, "sm_90", fma=True, allow_tf32=True, precisions=prec, precision_scales=scales, tuning=tuning)
        kinds = [k.kind for k in r.kernels]
        assert f"matmul_splitk_{fmt}" in kinds and "matmul_sum" not in kinds, kinds
        plain = build_ptx(s, "sm_90", fma=True, allow_tf32=True, precisions=prec, precision_scales=scales,
                          tuning=PtxTuning(mma_sm_groups=4))
        (split,) = [k for k in r.kernels if k.kind.startswith("matmul_splitk")]
        (split0,) = [k for k in plain.kernels if k.kind.startswith("matmul_splitk")]
        assert split.n_elements == split0.n_elements and r.counter_bytes > 0 == plain.counter_bytes
        assert r.scratch_bytes >= r.counter_bytes + plain.scratch_bytes
        entry = re.search(rf"\.entry {split.name}\(.*?\n\}}\n", r.ptx, re.S).group(0)
        assert "atom.global.add.u32" in entry and "ld.global.cg.f32" in entry and "membar.gl" in entry
        _, info = assemble(r.ptx, "sm_90")
        assert info[split.name].spill_stores == 0, info[split.name]


def _fp16_bundle(model, tmp_path, tuning):
    from cuvil.targets.ptx.bundle import compile_bundle
    path = str(tmp_path / "b.cuvil")
    man = compile_bundle(Pipeline.from_onnx(model).optimize().graph, path, enable_fp16=True, tuning=tuning)
    with open(f"{path}/kernels.ptx") as f:
        return man, f.read()


@needs_ptxas
def test_vector_loads_where_aligned(tmp_path):
    model, _ = linear_gelu(b=1, m=128, k=3072, n=768)
    man, ptx = _fp16_bundle(model, tmp_path, PtxTuning(mma_vec=True, mma_sm_groups=8, mma_async=0))
    assert "ld.global.nc.v4.b32" in ptx           # 8 halves per load, both operands
    assert all(k.get("spill_stores", 0) == 0 for k in man["ptxas"]["kernels"].values())
    _, plain = _fp16_bundle(model, tmp_path, PtxTuning(mma_vec=False, mma_async=0))
    assert "ld.global.nc.v4.b32" not in plain
    # K = 272 is no multiple of the chunk (A's vectors would cross K) and N = 48 of the 32-column tile (B's rows
    # would be clamped): scalar loads
    model, _ = linear_gelu(b=2, m=40, k=272, n=48)
    _, ptx = _fp16_bundle(model, tmp_path, PtxTuning(mma_vec=True, mma_sm_groups=0, mma_async=0))
    assert "ld.global.nc.v4.b32" not in ptx and "ld.global.nc.v2.b32" not in ptx


def test_vector_width_rules():
    from cuvil.kernels.texpr import Buf, cast, load, var
    from cuvil.ir.dtype import DType
    from cuvil.targets.ptx.matmul_mma import vec_width
    m, k = var("m"), var("k")
    for offset, stride, const, want in ((0, 768, 0, 8), (8, 768, 0, 4), (0, 772, 0, 4), (0, 768, 2, 2),
                                        (2, 768, 0, 1), (0, 768, 1, 1)):
        buf = Buf("x", DType.FLOAT16, (128, 768), offset=offset, pitch=(stride, 1))
        f = cast(load(buf, [m, k + const] if const else [m, k]), DType.FLOAT)
        assert vec_width(f, "fp16", True, k.attr, m.attr, [], 768, 128, 32) == want, (offset, stride, const)
    f = cast(load(Buf("x", DType.FLOAT16, (128, 768)), [m, k]), DType.FLOAT)
    assert vec_width(f, "tf32", True, k.attr, m.attr, [], 768, 128, 32) == 1      # float16 operands only
    assert vec_width(f, "fp16", True, k.attr, m.attr, [], 784, 128, 32) == 1      # K not a multiple of TK
    # row-contiguous vectors (m fastest) past K would be neither clamped nor zeroed: scalar loads too
    ft = cast(load(Buf("x", DType.FLOAT16, (784, 128)), [k, m]), DType.FLOAT)
    assert vec_width(ft, "fp16", False, k.attr, m.attr, [], 768, 128, 32) == 8
    assert vec_width(ft, "fp16", False, k.attr, m.attr, [], 784, 128, 32) == 1


# --- on a GPU ------------------------------------------------------------------------------------------------

def _run_bundle(model, feeds, tmp_path, name, tuning, **kw):
    import cuvil
    from cuvil.targets.ptx.bundle import compile_bundle
    g = Pipeline.from_onnx(model).optimize().graph
    path = str(tmp_path / f"{name}.cuvil")
    man = compile_bundle(g, path, tuning=tuning, **kw)
    m = cuvil.load(path)
    return [m.run(*feeds)[0] for _ in range(2)], man


@needs_gpu
@pytest.mark.parametrize("mode,vec", [("tf32", False), ("fp16", False), ("fp16", True)])
@pytest.mark.parametrize("groups", [0, 4, 8])
def test_gpu_split_products_match_numpy_and_repeat(tmp_path, mode, vec, groups):
    rng = np.random.default_rng(0)
    kw = {"allow_tf32": True} if mode == "tf32" else {"enable_fp16": True}
    tol = 3e-3 if mode == "tf32" else 3e-2       # test_gpu_tensor_cores.py's bounds
    cases = [(linear_gelu(b=1, m=128, k=3072, n=768), [rng.standard_normal((1, 128, 3072)).astype(np.float32)]),
             (linear_gelu(b=2, m=40, k=1024, n=48), [rng.standard_normal((2, 40, 1024)).astype(np.float32)]),
             (gemm_transb_residual(m=128, k=768, n=256), [rng.standard_normal((128, 768)).astype(np.float32),
                                                         rng.standard_normal((128, 256)).astype(np.float32)]),
             (batched_matmul(b=1, h=4, m=64, k=512, n=64),
              [rng.standard_normal((1, 4, 64, 512)).astype(np.float32),
               rng.standard_normal((1, 4, 512, 64)).astype(np.float32)]),
             (attention_scores(b=1, h=12, s=128, d=64),
              [rng.standard_normal((1, 12, 128, 64)).astype(np.float32) for _ in range(2)])]
    split_seen = False
    for i, ((model, ref), feeds) in enumerate(cases):
        tuning = PtxTuning(mma_sm_groups=groups, mma_vec=vec, mma_async=0)
        (y1, y2), man = _run_bundle(model, feeds, tmp_path, f"c{i}", tuning, **kw)
        split_seen |= man.get("splitk_scratch_bytes", 0) > 0
        assert np.array_equal(y1, y2), "split-K sums must repeat bit for bit"
        want = ref(*feeds)
        err = np.abs(y1 - want).max() / np.abs(want).max()
        assert err < tol, (mode, groups, i, err)
    assert split_seen == (groups > 0)


@needs_gpu
@pytest.mark.parametrize("splits", [1, 3, 8, 32])
def test_gpu_forced_slices_of_async_products_match_numpy_and_repeat(tmp_path, splits):
    """The cp.async float16 products at every slice count the sweep times (``PtxTuning.mma_splits``): BERT's
    FFN products and a ragged one against numpy, bit for bit run to run."""
    rng = np.random.default_rng(2)
    cases = [(linear_gelu(b=1, m=128, k=3072, n=768), [rng.standard_normal((1, 128, 3072)).astype(np.float32)]),
             (linear_gelu(b=1, m=32, k=768, n=3072), [rng.standard_normal((1, 32, 768)).astype(np.float32)]),
             (linear_gelu(b=2, m=40, k=1024, n=48), [rng.standard_normal((2, 40, 1024)).astype(np.float32)])]
    for i, ((model, ref), feeds) in enumerate(cases):
        (y1, y2), man = _run_bundle(model, feeds, tmp_path, f"s{splits}_{i}", PtxTuning(mma_splits=splits),
                                    enable_fp16=True)
        kinds = man["tensor_core_kernels"]
        if (splits, i) in ((1, 0), (1, 1), (1, 2), (3, 0), (3, 1), (8, 0), (8, 1), (8, 2), (32, 0)):
            assert any(k.startswith("matmul_splitk") for k in kinds) == (splits > 1), (splits, i, kinds)
        assert np.array_equal(y1, y2), (splits, i)
        want = ref(*feeds)
        err = np.abs(y1 - want).max() / np.abs(want).max()
        assert err < 3e-2, (splits, i, err)


@needs_gpu
@pytest.mark.parametrize("mode", ["tf32", "fp16", "bf16"])
def test_gpu_fused_split_products_equal_the_sum_kernel(tmp_path, mode):
    """The last-arrival combine adds the same partials in the same order as the sum kernel: the same bits, run
    after run (the counters reset themselves and are zeroed before each run)."""
    import cuvil
    from cuvil.targets.ptx.bundle import compile_bundle
    rng = np.random.default_rng(1)
    kw = {"allow_tf32": True} if mode == "tf32" else {"enable_fp16": True} if mode == "fp16" else {}
    cases = [(linear_gelu(b=1, m=128, k=3072, n=768), [rng.standard_normal((1, 128, 3072)).astype(np.float32)]),
             (gemm_transb_residual(m=128, k=768, n=256), [rng.standard_normal((128, 768)).astype(np.float32),
                                                         rng.standard_normal((128, 256)).astype(np.float32)]),
             (batched_matmul(b=2, h=4, m=64, k=512, n=64),
              [rng.standard_normal((2, 4, 64, 512)).astype(np.float32),
               rng.standard_normal((2, 4, 512, 64)).astype(np.float32)])]
    for i, ((model, _), feeds) in enumerate(cases):
        g = Pipeline.from_onnx(model).optimize().graph
        if mode == "bf16":
            for nd in g.nodes:
                if nd.op in ("MatMul", "Gemm"):
                    nd.precision = "bf16"
        outs = {}
        for fused in (False, True):
            path = str(tmp_path / f"c{i}_{fused}.cuvil")
            # 4 slices forced: float16's cp.async estimate leaves the 768-deep product unsplit (session 38)
            man = compile_bundle(g, path, tuning=PtxTuning(mma_sm_groups=4, mma_fused_splitk=fused, mma_splits=4),
                                 **kw)
            kinds = man["tensor_core_kernels"]
            assert any(k.startswith("matmul_splitk_") for k in kinds) and ("matmul_sum" in kinds) != fused, kinds
            m = cuvil.load(path)
            outs[fused] = [m.run(*feeds)[0] for _ in range(3)]
        for y in outs[True]:
            assert np.array_equal(y, outs[False][0]), (mode, i, float(np.abs(y - outs[False][0]).max()))


@pytest.mark.parametrize("which", ["matmul", "conv"])
def test_fused_split_counters_are_proved_and_refuted_when_too_few(monkeypatch, which):
    """The fused split kernels' counter accesses are stated to the bounds prover: proved with the counters
    plan_scratch reserves, refuted (the kernel guarded) with fewer (the session-24 review's case)."""
    from cuvil.targets.ptx.codegen import PtxKernelModule
    from cuvil.testing.conv_models import conv_relu_model
    if which == "matmul":
        model, tuning = linear_gelu(b=1, m=128, k=3072, n=768)[0], PtxTuning(mma_fused_splitk=True)
    else:
        model, tuning = conv_relu_model((1, 256, 7, 7), (256, 256, 3, 3)), PtxTuning(conv_mma_fused_splitk=True)
    s = _sched(model)
    res = build_ptx(s, "sm_90", fma=True, allow_tf32=True, tuning=tuning)
    assert res.memory_safety.guarded == [] and res.counter_bytes > 0
    assert any(k.kind.startswith(("matmul_splitk", "conv_splitk_mma")) for k in res.kernels)
    orig = PtxKernelModule.plan_scratch

    def one_counter(self, stages):
        orig(self, stages)
        if self.counter_bytes:
            self.counter_bytes = 4
    monkeypatch.setattr(PtxKernelModule, "plan_scratch", one_counter)
    res = build_ptx(s, "sm_90", fma=True, allow_tf32=True, tuning=tuning)
    (k,) = res.memory_safety.guarded
    assert "splitk counters" in k.failures[0]


def test_counters_reserved_only_for_split_products():
    """No tensor cores (mma off): no split product, no counters, nothing zeroed past the arena."""
    model, _ = linear_gelu(b=1, m=128, k=3072, n=768)
    res = build_ptx(_sched(model), "sm_90", fma=True, allow_tf32=True,
                    tuning=PtxTuning(mma=False, mma_fused_splitk=True))
    assert res.counter_bytes == 0 and res.scratch_bytes == 0
