"""Tensor-core MatMul / Gemm kernels (``cuvil.targets.ptx.matmul_mma``): which stages take them and in which
format (strict float32 never; TF32 only with ``allow_tf32``; fp16 / bf16 from the node's precision or from
``enable_fp16``), the kernel's shared-memory indexing and fragment gathering replayed in numpy against the
PTX ISA's fragment layouts (catches index bugs without a GPU), the PTX assembling with ptxas for sm_90 and
sm_80, and on a GPU the results against numpy."""
import numpy as np
import pytest

from cuvil import Pipeline
from cuvil.targets.ptx import assemble
from cuvil.targets.ptx.codegen import build_ptx, gpu_schedule
from cuvil.targets.ptx.matmul_mma import (ELEM_BYTES, FRAGMENTS, TK, MatmulPlan, a_word, b_word, c_coords, load_slots,
                                          matmul_parts, plan_matmul, row_stride, stage_precisions, warp_tiles)
from cuvil.testing.matmul_models import attention_scores, gemm_transb_residual, linear_gelu
from cuvil.testing.requires import needs_gpu, needs_ptxas

TARGET = "nvptx64-nvidia-cuda"


def _sched(model):
    return gpu_schedule(Pipeline.from_onnx(model).optimize().graph)


def _kinds(model, **kw):
    r = build_ptx(_sched(model), "sm_90", fma=True, **kw)
    return [k.kind for k in r.kernels], r


# --- which stages, which format ---------------------------------------------------------------------------

def test_strict_fp32_never_uses_tensor_cores():
    for model, _ in (linear_gelu(), attention_scores(), gemm_transb_residual()):
        kinds, r = _kinds(model)
        assert not any(k.startswith("matmul_") for k in kinds) and "mma.sync" not in r.ptx


def test_tf32_only_when_allowed_and_with_fma():
    model, _ = linear_gelu()
    kinds, r = _kinds(model, allow_tf32=True)
    assert kinds == ["matmul_tf32"]
    assert "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32" in r.ptx and "cvt.rna.tf32.f32" in r.ptx
    # without contraction (fma off) an mma's single rounding is not allowed
    r2 = build_ptx(_sched(model), "sm_90", fma=False, allow_tf32=True)
    assert "mma.sync" not in r2.ptx
    # nor before sm_80
    r3 = build_ptx(_sched(model), "sm_75", fma=True, allow_tf32=True)
    assert "mma.sync" not in r3.ptx


def test_transposed_and_batched_operands_are_recognised():
    model, _ = attention_scores()
    s = _sched(model)
    (st,) = [st for st in s.stages if matmul_parts(st) is not None]
    plan = plan_matmul(st, matmul_parts(st), "fp16")
    assert plan.batch == (2, 3) and (plan.m, plan.n, plan.k) == (40, 40, 32)
    assert plan.a_kfast and plan.b_kfast      # Kᵀ: B is contiguous along k
    model, _ = gemm_transb_residual()
    (st,) = [st for st in _sched(model).stages if matmul_parts(st) is not None]
    plan = plan_matmul(st, matmul_parts(st), "bf16")
    assert plan.batch == () and (plan.m, plan.n, plan.k) == (24, 56, 200)   # (the constant wᵀ is folded)
    model, _ = linear_gelu()
    (st,) = [st for st in _sched(model).stages if matmul_parts(st) is not None]
    plan = plan_matmul(st, matmul_parts(st), "tf32")
    assert plan.a_kfast and not plan.b_kfast  # w[k, n]: B contiguous along n


def test_node_precision_selects_the_format():
    model, _ = gemm_transb_residual()
    p = Pipeline.from_onnx(model).optimize()
    (gemm,) = [n for n in p.graph.nodes if n.op == "Gemm"]
    gemm.precision = "bf16"
    s = gpu_schedule(p.graph)
    prec = stage_precisions(p.graph, s)
    assert list(prec.values()) == ["bf16"]
    r = build_ptx(s, "sm_90", fma=True, precisions=prec)
    assert [k.kind for k in r.kernels] == ["matmul_bf16"]
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in r.ptx and "cvt.rn.bf16.f32" in r.ptx
    gemm.precision = ""
    assert stage_precisions(p.graph, gpu_schedule(p.graph)) == {}


def test_enable_fp16_products_take_fp16_tensor_cores():
    from cuvil.rewrite_rules.precision import to_half
    model, _ = linear_gelu()
    g, _ = to_half(Pipeline.from_onnx(model).optimize().graph)
    r = build_ptx(gpu_schedule(g), "sm_90", fma=True)
    kinds = [k.kind for k in r.kernels if k.kind.startswith("matmul")]
    # (the split-K plan may cut K into slices: the product kernel is then matmul_splitk_fp16 beside matmul_sum)
    assert kinds in (["matmul_fp16"], ["matmul_splitk_fp16", "matmul_sum"]), kinds
    assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in r.ptx


# --- the fragment mapping, replayed in numpy ----------------------------------------------------------------

def _isa_a(fmt, g, t, i):
    """(row, col) of element i of lane (g, t)'s A fragment, as the PTX ISA tabulates it."""
    if fmt == "tf32":          # m16n8k8 .tf32: a0 (g, t), a1 (g+8, t), a2 (g, t+4), a3 (g+8, t+4)
        return g + 8 * (i & 1), t + 4 * (i >> 1)
    if fmt == "fp8":           # m16n8k32 .e4m3: a0..a15: rows g (a0-a3, a8-a11) / g+8; cols 4t + (i & 3) (+16 for a8..)
        return g + 8 * ((i >> 2) & 1), 4 * t + (i & 3) + 16 * (i >> 3)
    # m16n8k16 .f16/.bf16: a0..a7: rows g (a0,a1,a4,a5) / g+8; cols 2t + (i & 1) (+8 for a4..a7)
    return g + 8 * ((i >> 1) & 1), 2 * t + (i & 1) + 8 * (i >> 2)


def _isa_b(fmt, g, t, i):
    """(k, col) of element i of lane (g, t)'s B fragment."""
    if fmt == "tf32":          # b0 (t, g), b1 (t+4, g)
        return t + 4 * i, g
    if fmt == "fp8":           # b0..b7: k = 4t + (i & 3) (+16 for b4..b7), column g
        return 4 * t + (i & 3) + 16 * (i >> 2), g
    return 2 * t + (i & 1) + 8 * (i >> 1), g


def _isa_c(g, t, i):
    return g + 8 * (i >> 1), 2 * t + (i & 1)


@pytest.mark.parametrize("fmt", ["fp16", "bf16", "tf32", "fp8"])
@pytest.mark.parametrize("bm,bn", [(64, 64), (32, 32), (64, 32), (32, 64)])
def test_fragment_replay_matches_numpy(fmt, bm, bn):
    """The block tile's product as the kernel computes it: A and B stored k-contiguous in shared memory at the
    kernel's indices, each lane's registers read at a_word / b_word, the mma done per the ISA's layouts,
    accumulators scattered at c_coords; equal to A @ B (small integers: exact)."""
    f = FRAGMENTS[fmt]
    sk = row_stride(fmt)
    plan = MatmulPlan(fmt, bm, bn, (), bm, bn, TK, True, False)
    rng = np.random.default_rng(0)
    A = rng.integers(-4, 5, (bm, TK)).astype(np.float64)
    B = rng.integers(-4, 5, (TK, bn)).astype(np.float64)
    sa = np.full(bm * sk, np.nan)
    sb = np.full(bn * sk, np.nan)
    for m in range(bm):
        sa[m * sk:m * sk + TK] = A[m]
    for n in range(bn):
        sb[n * sk:n * sk + TK] = B[:, n]
    D = np.full((bm, bn), np.nan)
    for warp in range(4):
        wm, wn = divmod(warp, 2)
        acc = {(ti, lane): np.zeros(4) for ti in range(len(warp_tiles(plan))) for lane in range(32)}
        for ks in range(0, TK, f.k):
            for ti, (r0, c0) in enumerate(warp_tiles(plan)):
                a_t = np.full((16, f.k), np.nan)
                b_t = np.full((f.k, 8), np.nan)
                for lane in range(32):
                    g, t = divmod(lane, 4)
                    for q in range(4):   # 4 A registers, per_reg elements each
                        w = a_word(fmt, sk, wm * plan.wm + r0, g, t, ks, q)
                        for e in range(f.per_reg):
                            r, c = _isa_a(fmt, g, t, q * f.per_reg + e)
                            a_t[r, c] = sa[w + e]
                    for q in range(2):
                        w = b_word(fmt, sk, wn * plan.wn + c0, g, t, ks, q)
                        for e in range(f.per_reg):
                            kk, c = _isa_b(fmt, g, t, q * f.per_reg + e)
                            b_t[kk, c] = sb[w + e]
                assert not np.isnan(a_t).any() and not np.isnan(b_t).any()
                prod = a_t @ b_t
                for lane in range(32):
                    g, t = divmod(lane, 4)
                    acc[ti, lane] += [prod[_isa_c(g, t, q)] for q in range(4)]
        for ti, (r0, c0) in enumerate(warp_tiles(plan)):
            for lane in range(32):
                g, t = divmod(lane, 4)
                for q in range(4):
                    r, c = c_coords(fmt, wm * plan.wm + r0, wn * plan.wn + c0, g, t, q)
                    assert np.isnan(D[r, c])          # every output written once
                    D[r, c] = acc[ti, lane][q]
    np.testing.assert_array_equal(D, A @ B)


def test_fragment_loads_are_bank_conflict_free():
    """The 32 lanes of one fragment load hit 32 different 4-byte banks (shared rows padded)."""
    for fmt in FRAGMENTS:
        sk = row_stride(fmt)
        esize = ELEM_BYTES[fmt]
        for q in range(4):
            banks = {(a_word(fmt, sk, 0, g, t, 0, q) * esize // 4) % 32 for g in range(8) for t in range(4)}
            assert len(banks) == 32, (fmt, q)
        for q in range(2):
            banks = {(b_word(fmt, sk, 0, g, t, 0, q) * esize // 4) % 32 for g in range(8) for t in range(4)}
            assert len(banks) == 32, (fmt, q)


@pytest.mark.parametrize("kfast", [True, False])
def test_load_slots_cover_each_tile_element_once(kfast):
    plan = MatmulPlan("fp16", 64, 32, (), 64, 32, TK, kfast, kfast)
    for which in ("a", "b"):
        n, rows, kf = load_slots(plan, which)
        seen = set()
        for tid in range(128):
            for j in range(n):
                e = tid + j * 128
                seen.add(divmod(e, TK) if kf else (e % rows, e // rows))
        assert seen == {(r, k) for r in range(rows) for k in range(TK)}


# --- ptxas ---------------------------------------------------------------------------------------------------

@needs_ptxas
@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
def test_every_format_assembles(arch):
    for model, _ in (linear_gelu(), attention_scores(), gemm_transb_residual()):
        s = _sched(model)
        for fmt in ("fp16", "bf16", "tf32"):
            prec = {st.name: fmt for st in s.stages} if fmt != "tf32" else None
            r = build_ptx(s, arch, fma=True, allow_tf32=True, precisions=prec)
            assert any(k.kind == f"matmul_{fmt}" for k in r.kernels)
            _, info = assemble(r.ptx, arch)
            for k in r.kernels:
                assert info[k.name].spill_stores == 0, (k.name, info[k.name])


# --- on a GPU ------------------------------------------------------------------------------------------------

def _run(model, feeds, tmp_path, **kw):
    import cuvil
    b = Pipeline.from_onnx(model).optimize().compile(target=TARGET, **kw)
    path = b.save(str(tmp_path / "m.cuvil"))
    return cuvil.load(path).run(*feeds), b.manifest


@needs_gpu
@pytest.mark.parametrize("mode", ["tf32", "fp16"])
def test_gpu_matmuls_match_numpy(tmp_path, mode):
    rng = np.random.default_rng(0)
    kw = {"allow_tf32": True} if mode == "tf32" else {"enable_fp16": True}
    tol = 3e-3 if mode == "tf32" else 3e-2
    cases = [(linear_gelu(), [rng.standard_normal((2, 40, 272)).astype(np.float32)]),
             (attention_scores(), [rng.standard_normal((2, 3, 40, 32)).astype(np.float32) for _ in range(2)]),
             (gemm_transb_residual(), [rng.standard_normal((24, 200)).astype(np.float32),
                                       rng.standard_normal((24, 56)).astype(np.float32)])]
    for (model, ref), feeds in cases:
        (y,), man = _run(model, feeds, tmp_path, **kw)
        assert any(k.startswith("matmul_") for k in man["tensor_core_kernels"])
        want = ref(*feeds)
        err = np.abs(y - want).max() / np.abs(want).max()
        assert err < tol, (mode, err)


def test_k_groups_take_every_chunk_once_and_fit_shared_memory():
    """BERT-sized products (few output tiles, long K) split K over groups of four warps inside a block: the
    groups' chunks cover every chunk once, and tiles plus partial sums fit the static shared memory."""
    from cuvil.targets.ptx.matmul_mma import SMEM_LIMIT, chunk_of, reduction_bytes, smem_bytes
    model, _ = linear_gelu(b=1, m=128, k=3072, n=768)
    (st,) = [st for st in _sched(model).stages if matmul_parts(st) is not None]
    for fmt in ("fp16", "bf16", "tf32"):
        plan = plan_matmul(st, matmul_parts(st), fmt)
        assert plan.ks > 1 and plan.threads == 128 * plan.ks
        assert smem_bytes(fmt, plan.bm, plan.bn, plan.ks) <= SMEM_LIMIT
        assert reduction_bytes(plan.bm, plan.bn, plan.ks) <= smem_bytes(fmt, plan.bm, plan.bn, plan.ks)
        got = sorted(chunk_of(r, g, plan.ks) for r in range(plan.rounds) for g in range(plan.ks)
                     if chunk_of(r, g, plan.ks) < plan.chunks)
        assert got == list(range(plan.chunks)) and plan.chunks >= 2 * plan.ks
    small = attention_scores()[0]     # K = 32: one chunk, one group
    (st,) = [st for st in _sched(small).stages if matmul_parts(st) is not None]
    assert plan_matmul(st, matmul_parts(st), "fp16").ks == 1


def test_precision_ops_hook_and_transposed_operand_precision():
    """The policy's hook (Target.precision_ops): MatMul/Gemm/Conv in fp16 and bf16 on sm_80+, with fma,
    MatMul/Gemm in fp8 on sm_89+; and a product whose
    operand is a Transpose folded into its loads still finds its node's precision."""
    from cuvil.targets.ptx.target import TARGET, PtxOptions
    assert TARGET.precision_ops(PtxOptions()) == {"fp16": frozenset({"MatMul", "Gemm", "Conv"}),
                                                  "bf16": frozenset({"MatMul", "Gemm", "Conv"}),
                                                  "fp8": frozenset({"MatMul", "Gemm"})}    # sm_89+
    assert TARGET.precision_ops(PtxOptions(arch="sm_80"))["fp16"] == frozenset({"MatMul", "Gemm", "Conv"})

    assert TARGET.precision_ops(PtxOptions(arch="sm_75")) == {} == TARGET.precision_ops(PtxOptions(fma=False))
    model, _ = attention_scores()
    p = Pipeline.from_onnx(model).optimize()
    (mm,) = [n for n in p.graph.nodes if n.op == "MatMul"]
    mm.precision = "fp16"
    s = gpu_schedule(p.graph)
    assert list(stage_precisions(p.graph, s).values()) == ["fp16"]


def test_the_precision_policy_drives_the_format():
    """Pipeline.compile(precision=...) narrows the MatMul the target lists (precision_ops) where the declared
    input range is safe: its product takes the tensor cores in that format; a range that overflows float16
    keeps it float32."""
    model, _ = linear_gelu()
    p = Pipeline.from_onnx(model).optimize()
    for fmt in ("bf16", "fp16"):
        b = p.compile(TARGET, precision=fmt, input_ranges={"x": (-3, 3)}, cache=False)
        assert b.manifest["tensor_core_kernels"] == {f"matmul_{fmt}": 1}
    wide = p.compile(TARGET, precision="fp16", input_ranges={"x": (-1e6, 1e6)}, cache=False)
    assert wide.manifest["tensor_core_kernels"] == {}


def test_cli_allow_tf32(tmp_path, capsys):
    import onnx
    from cuvil.cli import main as cli_main
    model, _ = gemm_transb_residual()
    path = str(tmp_path / "g.onnx")
    onnx.save(model, path)
    assert cli_main(["compile", path, "--allow-tf32", "-o", str(tmp_path / "libg.so"), "-q"]) in (1, 2)
    assert "--allow-tf32 applies to --target nvptx64-nvidia-cuda only" in capsys.readouterr().err
    out = str(tmp_path / "g.cuvil")
    assert cli_main(["compile", path, "--target", TARGET, "--allow-tf32", "-o", out, "-q"]) == 0
    import json
    import os
    man = json.load(open(os.path.join(out, "manifest.json")))
    assert man["allow_tf32"] is True and man["tensor_core_kernels"] == {"matmul_tf32": 1}


def test_only_matrix_products_take_the_kernel():
    """Convolutions (their own implicit-GEMM kernels), vector products (a row of 1: the float32 kernels waste
    less) and plain reductions never take the matmul kernel."""
    from cuvil.testing.conv_models import conv_relu_model
    conv = gpu_schedule(Pipeline.from_onnx(conv_relu_model((1, 16, 14, 14), (32, 16, 3, 3))).optimize().graph)
    assert all(matmul_parts(st) is None for st in conv.stages)
    row, _ = gemm_transb_residual(m=1)
    r = build_ptx(_sched(row), "sm_90", fma=True, allow_tf32=True)
    assert "mma.sync" not in r.ptx and [k.kind for k in r.kernels] != ["matmul_tf32"]
    from onnx import TensorProto, helper
    red = helper.make_model(helper.make_graph(
        [helper.make_node("ReduceSum", ["x"], ["y"], keepdims=0)], "r",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [64, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])]), opset_imports=[helper.make_opsetid("", 17)])
    assert all(matmul_parts(st) is None for st in _sched(red).stages)


@needs_ptxas
def test_products_fused_into_attention_are_recorded_float32_with_that_reason():
    """The GPU's attention rules run after the policy: a narrowed product they fuse into the FusedAttention
    kernel computes in float32, and the manifest says so and why."""
    from cuvil.testing.hf_models import bert_model
    p = Pipeline.from_onnx(bert_model(layers=1)).optimize().specialize({"batch": 1, "sequence": 16}).optimize()
    ranges = {"input_ids": (0, 30521), "attention_mask": (0, 1), "token_type_ids": (0, 1)}
    b = p.compile("nvptx64-nvidia-cuda", precision="fp16", input_ranges=ranges, cache=False)
    assert "fused_attention_guarded" in b.manifest["rules_applied"]
    ctx = b.manifest["precision"]["nodes"]["encoder.layer.0.sdpa.ctx"]
    assert ctx["format"] == "fp32" and ctx["policy_format"] == "fp16" and "FusedAttention" in ctx["reason"]
    pooler = b.manifest["precision"]["nodes"]["pooler.dense"]      # one row: the float32 kernels
    assert pooler["format"] == "fp32" and "FusedAttention" not in pooler["reason"]
