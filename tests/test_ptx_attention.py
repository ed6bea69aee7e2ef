"""Attention as one GPU kernel (``PtxTuning.fused_attention``, :mod:`cuvil.targets.ptx.attention`; no GPU needed):
the proved rules fuse an export's MatMul / Softmax / MatMul on the PTX target too, the kernel kind appears for a
GPT-2 decode step and a BERT layer, float16 reads the half operands without a float32 copy, every kernel is proved
in bounds, and ptxas assembles the kernel for sm_80 and sm_90. Numbers on a GPU: test_gpu_attention.py."""
import collections

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from cuvil import Pipeline
from cuvil.rewrite_rules.precision import to_half
from cuvil.rewrite_rules.specialize import specialize_graph
from cuvil.targets.ptx import assemble, find_ptxas
from cuvil.targets.ptx.attention import (MAX_ROWS, attention_in_half, block_threads, fuse_attention, partial_index,
                                         plan_attention)
from cuvil.targets.ptx.codegen import build_ptx, gpu_schedule
from cuvil.targets.ptx.target import PtxOptions
from cuvil.targets.ptx.tuning import DEFAULT_TUNING, PtxTuning
from cuvil.testing.hf_models import bert_model, gpt2_decode_model

PTXAS = find_ptxas()
ON = PtxTuning(fused_attention=True)


def attention_model(b, h, sq, sk, d, dv=None, seed=0, k_transposed=False):
    """Projections' biases around torch's scaled_dot_product_attention as the exports spell it: ``q + bq``,
    ``k + bk``, ``v + bv`` (q [b, h, sq, d], k [b, h, sk, d], v [b, h, sk, dv]), scores ``(Q * s) @ (Kt * s) + mask``
    (mask [b, 1, 1, sk] an input), Softmax, the NaN guard ``Where(IsNaN(P), 0, P)``, ``P @ V``, then ``+ bo``.
    ``k_transposed``: the input ``k`` is Kᵀ already, [b, h, d, sk] (its bias [d, 1]; no Transpose node), so a
    key's d values are ``sk`` elements apart."""
    dv = dv or d
    rng = np.random.default_rng(seed)
    s = np.float32(d ** -0.25)
    inits = [numpy_helper.from_array(rng.standard_normal(n).astype(np.float32), name)
             for name, n in (("bq", d), ("bk", d), ("bv", dv), ("bo", dv))]
    if k_transposed:
        inits[1] = numpy_helper.from_array(numpy_helper.to_array(inits[1]).reshape(d, 1), "bk")
    inits += [numpy_helper.from_array(np.array(s, np.float32), "s"), numpy_helper.from_array(np.array(0, np.float32), "zero")]
    nodes = [helper.make_node("Add", ["q", "bq"], ["qb"]), helper.make_node("Add", ["k", "bk"], ["kb"]),
             helper.make_node("Add", ["v", "bv"], ["vb"]),
             helper.make_node("Identity", ["kb"], ["kt"]) if k_transposed else
             helper.make_node("Transpose", ["kb"], ["kt"], perm=[0, 1, 3, 2]),
             helper.make_node("Mul", ["qb", "s"], ["qs"]), helper.make_node("Mul", ["kt", "s"], ["kts"]),
             helper.make_node("MatMul", ["qs", "kts"], ["scores"]), helper.make_node("Add", ["scores", "mask"], ["masked"]),
             helper.make_node("Softmax", ["masked"], ["p"], axis=-1), helper.make_node("IsNaN", ["p"], ["nan"]),
             helper.make_node("Where", ["nan", "zero", "p"], ["pz"]), helper.make_node("MatMul", ["pz", "vb"], ["ctx"]),
             helper.make_node("Add", ["ctx", "bo"], ["y"])]
    f = TensorProto.FLOAT
    g = helper.make_graph(nodes, "attention",
                          [helper.make_tensor_value_info("q", f, [b, h, sq, d]),
                           helper.make_tensor_value_info("k", f, [b, h, d, sk] if k_transposed else [b, h, sk, d]),
                           helper.make_tensor_value_info("v", f, [b, h, sk, dv]),
                           helper.make_tensor_value_info("mask", f, [b, 1, 1, sk])],
                          [helper.make_tensor_value_info("y", f, [b, h, sq, dv])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _build(graph, tuning=ON, fp16=False, arch="sm_90"):
    if tuning.fused_attention:
        graph, _ = fuse_attention(graph)
    if fp16:
        graph, _ = to_half(graph)
        if tuning.fused_attention:
            attention_in_half(graph)
    sched = gpu_schedule(graph, tuning=tuning)
    return sched, build_ptx(sched, arch, fma=True, tuning=tuning)


def entries_of(ptx, name):
    """The PTX text of kernel ``name``."""
    k = ptx[ptx.index(f".entry {name}("):]
    return k[:k.index("\n}")]


def _kinds(r):
    return collections.Counter(d.kind for d in r.kernels)


def test_option_is_automatic_by_default_and_reaches_the_tuning():
    assert DEFAULT_TUNING.fused_attention is None and PtxOptions().tuning is DEFAULT_TUNING
    # every build fuses since the keys are split over blocks (session 20: faster in float32 and float16)
    assert DEFAULT_TUNING.resolved(True).fused_attention is True and DEFAULT_TUNING.resolved(False).fused_attention is True
    assert ON.resolved(False).fused_attention is True and PtxTuning(fused_attention=False).resolved(True).fused_attention is False
    assert PtxOptions(fused_attention=True).tuning.fused_attention is True
    assert PtxOptions(fused_attention=True, gemv=False).tuning.gemv is False


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("fp16", [False, True])
def test_one_kernel_proved_and_assembled(arch, fp16):
    g = Pipeline.from_onnx(attention_model(2, 3, 5, 129, 64)).optimize().graph
    sched, r = _build(g, fp16=fp16, arch=arch, tuning=PtxTuning(fused_attention=True, attention_fused_merge=False))
    att = [d for d in r.kernels if d.kind == "attention"]
    assert len(att) == 1 and not any(d.kind in ("split", "matmul_fp16", "gemm_fp32", "row") for d in r.kernels)
    # 30 query rows (2 x 3 x 5) fill fewer than target_blocks: each row's 129 keys split in two (at least
    # attention_split_keys = 64 a split), 65 and 64 keys, a block of 96 threads (65 rounded up to warps); the merge
    # kernel a thread per output (30 x 64)
    assert att[0].grid == 60 and att[0].block == 96
    (merge,) = [d for d in r.kernels if d.kind == "attention_merge"]
    assert merge.n_elements == 30 * 64 and merge.stage == att[0].stage and r.counter_bytes == 0
    # attention_fused_merge (the default since session 22): the last block of a row merges (a counter per row: 30
    # int32 in the zeroed 256 bytes before the partials), no merge kernel
    _, r2 = _build(g, fp16=fp16, arch=arch)
    assert not any(d.kind == "attention_merge" for d in r2.kernels) and r2.counter_bytes == 256
    assert all(k.status == "proved" for k in r2.memory_safety.kernels)
    assert all(k.status == "proved" for k in r.memory_safety.kernels)
    (st,) = [s for s in sched.stages if s.expr.op == "attention"]
    assert st.buf.dtype.name == ("FLOAT16" if fp16 else "FLOAT")
    if fp16:    # the half operands read as they are: no stored float32 copy of Q, K or V
        assert not any(s.buf.dtype.name == "FLOAT" and s.buf.shape in ((2, 3, 129, 64), (2, 3, 64, 129))
                       for s in sched.stages)
    if PTXAS:
        _, info = assemble(r.ptx, arch)
        k = info[att[0].name]
        assert k.stack_frame == 0 and k.spill_stores == 0


def test_split_plan_fills_the_gpu_and_shares_keys_evenly():
    from types import SimpleNamespace as NS
    spec = lambda rows, keys, dv=64, zn=True: NS(batch=1, heads=rows, rows=1, keys=keys, dv=dv, zero_nan=zn)
    # a GPT-2 decode step at past 1023: 12 rows, 1,024 keys: 16 splits of 64 (the minimum) -> 192 blocks
    p = plan_attention(spec(12, 1024), 264, 64)
    assert (p.splits, p.span, p.threads, p.units) == (16, 64, 64, 192)
    # more minimum keys: fewer, longer splits; capped where the grid reaches target_blocks
    assert (plan_attention(spec(12, 1024), 264, 128).splits, plan_attention(spec(12, 4096), 264, 64).splits) == (8, 22)
    p = plan_attention(spec(12, 4096), 264, 64)
    assert p.span == 187 and p.threads == 192 and (p.splits - 1) * p.span < 4096 <= p.splits * p.span
    # enough rows, too few keys, or splitting off: one block per row walks all its keys
    assert plan_attention(spec(300, 1024), 264, 64).splits == 1
    assert plan_attention(spec(12, 100), 264, 64).splits == 1          # 100 keys: not two splits of 64
    p = plan_attention(spec(12, 1024), 264, 0)
    assert (p.splits, p.span, p.threads) == (1, 1024, 512)
    # scratch: (m, l) per unit, then acc and z columns (z only with the NaN guard)
    p = plan_attention(spec(2, 256, dv=8), 264, 64)
    assert p.units == 8 and p.scratch_floats == 8 * (2 + 16)
    assert plan_attention(spec(2, 256, dv=8, zn=False), 264, 64).scratch_floats == 8 * (2 + 8)
    idx = {(part, u, c): partial_index(p, part, u, c) for part in ("m", "l", "acc", "z") for u in range(8)
           for c in (range(8) if part in ("acc", "z") else (0,))}
    assert sorted(idx.values()) == list(range(p.scratch_floats))     # every float once, none outside


@pytest.mark.parametrize("keys, fused_merge", [(0, True), (64, True), (64, False)])
def test_split_keys_off_keeps_one_block_per_row(keys, fused_merge):
    g = Pipeline.from_onnx(attention_model(1, 2, 1, 300, 32)).optimize().graph
    _, r = _build(g, tuning=PtxTuning(fused_attention=True, attention_split_keys=keys,
                                      attention_fused_merge=fused_merge))
    (att,) = [d for d in r.kernels if d.kind == "attention"]
    merges = [d for d in r.kernels if d.kind == "attention_merge"]
    if keys:       # 2 rows, 300 keys: 4 splits of 75 -> 8 blocks of 96 threads, merged by the last or a kernel
        assert (att.grid, att.block, len(merges)) == (8, 96, 0 if fused_merge else 1)
        k = entries_of(r.ptx, att.name)
        assert ("atom.global.add" in k or "red.global.add" in k) is fused_merge and ("ld.global.cg" in k) is fused_merge
    else:
        assert (att.grid, att.block, merges) == (2, 300 // 32 * 32 + 32, [])
    assert all(k.status == "proved" for k in r.memory_safety.kernels)
    if PTXAS:
        assemble(r.ptx, "sm_90")


def test_keys_staged_through_shared_memory_where_they_fit():
    """attention_stage_keys: a chunk of keys is copied to shared memory (rows of D + 1 floats) by the block
    before it is scored, where threads x (D + 1) floats fit STAGE_BYTES: a decode step's 64-key splits; a
    512-thread chunk of head size 64 (no split) does not fit and reads its rows directly."""
    from types import SimpleNamespace as NS
    from cuvil.targets.ptx.attention import STAGE_BYTES
    spec = NS(batch=1, heads=12, rows=1, keys=1024, d=64, dv=64, zero_nan=True)
    assert plan_attention(spec, 264, 64, stage=True).staged
    # head sizes that are not whole warps, or over 64, read their rows directly (the copy would spill)
    for d in (48, 80, 128):
        assert not plan_attention(NS(**{**vars(spec), "d": d}), 264, 64, stage=True).staged
    assert not plan_attention(spec, 264, 0, stage=True).staged and 4 * 512 * 65 > STAGE_BYTES
    assert not plan_attention(spec, 264, 64, stage=False).staged
    g = Pipeline.from_onnx(attention_model(1, 12, 1, 1024, 64)).optimize().graph
    for stage in (True, False):
        _, r = _build(g, tuning=PtxTuning(fused_attention=True, attention_stage_keys=stage, attention_fused_merge=stage))
        (att,) = [d for d in r.kernels if d.kind == "attention"]
        assert (f"{att.name}_k[" in r.ptx) is stage       # the shared array of staged keys
        assert all(x.status == "proved" for x in r.memory_safety.kernels)
        if PTXAS:
            _, info = assemble(r.ptx, "sm_90")
            assert info[att.name].spill_stores == 0 and info[att.name].shared >= (4 * 64 * 65 if stage else 0)


def test_split_partials_proved_and_refuted_when_widened(monkeypatch):
    """The partials' stores and the merge kernel's reads are stated to the bounds prover; widened by one
    they are refuted, and the stage falls back to the plain kernels (guarded), never a split kernel."""
    from cuvil.targets.ptx import bounds_patterns
    g = Pipeline.from_onnx(attention_model(1, 2, 1, 300, 32)).optimize().graph
    tun = PtxTuning(fused_attention=True, attention_fused_merge=True)      # the counters stated too
    _, r = _build(g, tuning=tun)
    assert r.counter_bytes and r.memory_safety.guarded == []
    init = bounds_patterns.GpuPatterns.__init__
    monkeypatch.setattr(bounds_patterns.GpuPatterns, "__init__", lambda self, km, widen=0: init(self, km, 1))
    _, r = _build(g, tuning=tun)
    kinds = _kinds(r)
    assert "attention" not in kinds and "attention_merge" not in kinds
    failures = [f for k in r.memory_safety.guarded for f in k.failures]
    assert any(f.startswith("family:attention attention_partials") for f in failures)
    # the counters are declared one per query row (2), not as the 256 bytes reserved: a row past them fails
    assert any(f.startswith("family:attention attention counters[2]") for f in failures), failures


def test_off_keeps_the_unfused_kernels():
    g = Pipeline.from_onnx(attention_model(1, 2, 3, 40, 16)).optimize().graph
    _, r = _build(g, tuning=PtxTuning(fused_attention=False))
    assert "attention" not in _kinds(r)


def test_threads_cover_keys_and_values():
    from types import SimpleNamespace as NS
    assert block_threads(NS(keys=2, dv=64)) == 64
    assert block_threads(NS(keys=1024, dv=64)) == 512
    assert block_threads(NS(keys=129, dv=64)) == 160
    assert block_threads(NS(keys=3, dv=8)) == 32


@pytest.mark.parametrize("fp16", [False, True])
def test_decode_step_and_bert_layer_take_the_kernel(fp16):
    gpt = Pipeline.from_onnx(gpt2_decode_model(vocab=1001, hidden=96, layers=1, heads=4, ffn=387, max_pos=64)).optimize()
    g, _ = specialize_graph(gpt.graph, {"batch": 1, "past_sequence": 7, "total_sequence": 8})
    _, r = _build(g, fp16=fp16)
    assert _kinds(r)["attention"] == 1 and all(k.status == "proved" for k in r.memory_safety.kernels)
    bert = Pipeline.from_onnx(bert_model(vocab=101, hidden=96, layers=1, heads=4, ffn=192, max_pos=256)).optimize()
    g, _ = specialize_graph(bert.graph, {"batch": 1, "sequence": MAX_ROWS})
    _, r = _build(g, fp16=fp16)
    assert _kinds(r)["attention"] == 1 and all(k.status == "proved" for k in r.memory_safety.kernels)
    if PTXAS:
        assemble(r.ptx, "sm_90")
    # more query rows than MAX_ROWS (BERT's 128): the tensor-core products and row kernels stay
    fused, report = fuse_attention(specialize_graph(bert.graph, {"batch": 1, "sequence": 128})[0])
    assert not any(n.op == "FusedAttention" for n in fused.nodes) and not sum(report.applied.values())


def test_bundle_records_the_rule(tmp_path):
    from cuvil.targets.ptx.bundle import compile_bundle
    g = Pipeline.from_onnx(attention_model(1, 2, 1, 33, 16)).optimize().graph
    man = compile_bundle(g, str(tmp_path / "b"), tuning=ON)
    assert man["rules_applied"]["fused_attention_guarded"]["applied"] == 1
    assert "attention" in [k["kind"] for k in __import__("json").load(open(tmp_path / "b" / "plan.json"))["kernels"]]


@pytest.mark.parametrize("fp16", [False, True])
def test_default_bundle_fuses(tmp_path, fp16):
    import json
    from cuvil.targets.ptx.bundle import compile_bundle
    g = Pipeline.from_onnx(attention_model(1, 2, 1, 33, 16)).optimize().graph
    man = compile_bundle(g, str(tmp_path / "b"), enable_fp16=fp16)
    kinds = [k["kind"] for k in json.load(open(tmp_path / "b" / "plan.json"))["kernels"]]
    assert "attention" in kinds and "fused_attention_guarded" in man.get("rules_applied", {})
    man = compile_bundle(g, str(tmp_path / "c"), enable_fp16=fp16, tuning=PtxTuning(fused_attention=False))
    assert "attention" not in [k["kind"] for k in json.load(open(tmp_path / "c" / "plan.json"))["kernels"]]


@pytest.mark.parametrize("fp16", [False, True])
def test_decode_step_small_views_take_no_kernels(fp16):
    """PtxTuning.inline_views: a decode step's head splits (reshapes of the QKV product's Split), the merge of
    attention's output, the fused node's output (its own buffer, no copy) and the float16 pass's casts of the new
    KV row and of the residual read by LayerNorm take no kernel of their own: a layer is LayerNorm, the QKV GEMV,
    the two cache concatenations, attention, then the projection, LayerNorm, MLP GEMVs (9). Off:
    each view is stored by a small element kernel, the merge of attention's output too unless the fused kernel
    stores its rows where the merge puts them (PtxTuning.attention_heads_merged, AttentionRows.out_heads_inner).
    BERT's merged heads at S = 128 (98,304 elements, over VIEW_INLINE_MAX) stay stored, so that its products read
    contiguous rows; with attention_heads_merged, the attention kernel writes them there."""
    gpt = Pipeline.from_onnx(gpt2_decode_model(vocab=1001, hidden=96, layers=2, heads=4, ffn=387, max_pos=512)).optimize()
    g, _ = specialize_graph(gpt.graph, {"batch": 1, "past_sequence": 300, "total_sequence": 301})
    kernels = {}
    for views in (True, False):
        _, r = _build(g, tuning=PtxTuning(fused_attention=True, inline_views=views, attention_fused_merge=True),
                      fp16=fp16)
        assert all(k.status == "proved" for k in r.memory_safety.kernels)
        kernels[views] = [d.stage for d in r.kernels]
        if PTXAS and views:
            assemble(r.ptx, "sm_90")
    # 2 layers of 9 (attention_fused_merge: the merge in attention's last blocks), the mask, the final LayerNorm and
    # the LM head (float32:
    # the embedding sum too; float16 reads it through the first LayerNorm's widening)
    assert len(kernels[True]) == 2 * 9 + (3 if fp16 else 4), kernels[True]
    assert not any(s.endswith((".q.heads", ".k.heads", ".v.heads", ".merged", ".sdpa.ctx")) for s in kernels[True])
    assert sum(s.endswith((".q.heads", ".k.heads", ".v.heads", ".merged")) for s in kernels[False]) == 8
    _, r = _build(g, tuning=PtxTuning(fused_attention=True, inline_views=False, attention_fused_merge=True,
                                      attention_heads_merged=True), fp16=fp16)
    merged_off = [d.stage for d in r.kernels]
    assert sum(s.endswith((".q.heads", ".k.heads", ".v.heads")) for s in merged_off) == 6
    assert not any(s.endswith(".merged") for s in merged_off) and len(merged_off) == len(kernels[False]) - 2
    from cuvil.kernels.schedule import VIEW_INLINE_MAX
    bert = Pipeline.from_onnx(bert_model(vocab=101, hidden=768, layers=1, heads=12, ffn=3072, max_pos=256)).optimize()
    g, _ = specialize_graph(bert.graph, {"batch": 1, "sequence": 128})
    sched = gpu_schedule(g, tuning=PtxTuning(fused_attention=False))
    merged = [s for s in sched.stages if s.op == "Reshape" and s.buf.shape == (1, 128, 768)]
    assert merged and 128 * 768 > VIEW_INLINE_MAX
    fused = fuse_attention(g, 128)[0]
    sched = gpu_schedule(fused, tuning=PtxTuning(fused_attention=True))
    assert [s for s in sched.stages if s.op == "Reshape" and s.buf.shape == (1, 128, 768)]     # (the default)
    sched = gpu_schedule(fused, tuning=PtxTuning(fused_attention=True, attention_heads_merged=True))
    att = [s for s in sched.stages if s.expr.op == "attention"]
    assert len(att) == 1 and att[0].expr.attr.out_heads_inner and att[0].buf.shape == (1, 128, 12, 64)
    assert not [s for s in sched.stages if s.op == "Reshape" and s.buf.shape == (1, 128, 768)]
    # the output projection reads the attention kernel's buffer (a view of it), no copy between
    proj = [s for s in sched.stages if any(b.storage is att[0].buf.storage for b in s.reads)]
    assert proj and all(s.op == "MatMul" or s.expr.op != "load" for s in proj)
