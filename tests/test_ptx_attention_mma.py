"""Float16 attention of many query rows on tensor cores (``PtxTuning.attention_mma``,
:mod:`cuvil.targets.ptx.attention_mma`; no GPU needed): which nodes the flash kernel takes and how it lays them
over the GPU, that a float16 BERT layer at S = 128 computes its attention in that one kernel instead of the
scores / softmax / P.V kernels, that float32 builds and other shapes keep their kernels, that every kernel is
proved in bounds and assembles without spills. Numbers on a GPU: test_gpu_attention.py."""
import collections
import json

import pytest

from cuvil import Pipeline
from cuvil.rewrite_rules.precision import to_half
from cuvil.rewrite_rules.specialize import specialize_graph
from cuvil.targets.ptx import assemble, find_ptxas
from cuvil.targets.ptx.attention import MAX_ROWS, attention_in_half, fuse_attention
from cuvil.targets.ptx.attention_mma import SMEM_LIMIT, flash_shapes, plan_flash, smem_halves
from cuvil.targets.ptx.codegen import build_ptx, gpu_schedule
from cuvil.targets.ptx.tuning import PtxTuning
from cuvil.testing.hf_models import bert_model

from test_ptx_attention import attention_model

PTXAS = find_ptxas()
ON = PtxTuning(fused_attention=True)


def _build(graph, fp16=True, wide=True, tuning=ON, arch="sm_90"):
    graph, report = fuse_attention(graph, also=flash_shapes if wide else None)
    if fp16:
        graph, _ = to_half(graph)
        attention_in_half(graph)
    sched = gpu_schedule(graph, tuning=tuning)
    return sched, build_ptx(sched, arch, fma=True, tuning=tuning), report


def _kinds(r):
    return collections.Counter(d.kind for d in r.kernels)


def _attention_spec(model, fp16=True):
    """The lowered FusedAttention of ``model`` (fused whatever its row count)."""
    g, _ = fuse_attention(Pipeline.from_onnx(model).optimize().graph, max_rows=1 << 30)
    if fp16:
        g, _ = to_half(g)
        attention_in_half(g)
    (st,) = [s for s in gpu_schedule(g, tuning=ON).stages if s.expr.op == "attention"]
    return st.expr.attr


def test_plan_takes_float16_heads_of_16s_and_many_rows():
    spec = _attention_spec(attention_model(2, 3, 100, 77, 64))
    plan = plan_flash(spec, 90, 264)
    # 2 x 3 heads x ceil(100 / 16) query tiles: too few blocks for 264, so one warp a block (the most blocks)
    assert plan is not None and (plan.warps, plan.bk, plan.tiles, plan.units) == (1, 64, 7, 42)
    assert plan.q_async and plan.k_async and plan.v_async        # contiguous, 16-byte aligned head rows
    assert plan_flash(spec, 75, 264) is None                      # no mma.sync m16n8k16 / cp.async before sm_80
    assert plan_flash(spec, 90, 8).warps == 4                     # enough blocks: 4 warps share K and V copies
    assert plan_flash(_attention_spec(attention_model(2, 3, 100, 77, 64), fp16=False), 90, 264) is None  # float32
    assert plan_flash(_attention_spec(attention_model(2, 3, 100, 77, 24)), 90, 264) is None     # D not 16k
    assert plan_flash(_attention_spec(attention_model(2, 3, MAX_ROWS, 77, 64)), 90, 264) is None  # a decode's few rows
    wide = plan_flash(_attention_spec(attention_model(1, 2, 40, 65, 128)), 90, 1)
    assert wide.bk == 32 and 2 * wide.smem_halves <= SMEM_LIMIT and wide.warps == 2   # 4 warps would not fit
    assert 2 * smem_halves(4, 32, 128, 128) > SMEM_LIMIT


@pytest.mark.skipif(not PTXAS, reason="needs ptxas (the CUDA toolkit) to assemble")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_four_warps_assemble_without_spills(arch):
    """The plan of a big grid (4 warps a block, as BERT-base at batch >= 22 takes): every register a thread may
    have (``maxnreg``), no spill on sm_80 (review of session 39: capped, it spilled 12 bytes there)."""
    g = Pipeline.from_onnx(attention_model(2, 3, 100, 77, 64)).optimize().graph
    tuning = PtxTuning(fused_attention=True, target_blocks=8)
    _, r, _ = _build(g, arch=arch, tuning=tuning)
    (d,) = [d_ for d_ in r.kernels if d_.kind == "attention_mma"]
    assert d.block == 128
    _, info = assemble(r.ptx, arch)
    assert info[d.name].stack_frame == 0 and info[d.name].spill_stores == 0


def test_keys_stored_transposed_are_copied_element_by_element():
    spec = _attention_spec(attention_model(1, 2, 40, 72, 64, k_transposed=True))
    plan = plan_flash(spec, 90, 264)
    assert plan.q_async and not plan.k_async and plan.v_async     # a key's d values 72 elements apart


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("shape", [(2, 3, 100, 77, 64, 64, False), (1, 2, 40, 65, 128, 128, False),
                                   (2, 2, 40, 65, 80, 48, False), (1, 2, 40, 72, 64, 64, True)])
def test_one_kernel_proved_and_assembled(arch, shape):
    b, h, sq, sk, d, dv, kt = shape
    g = Pipeline.from_onnx(attention_model(b, h, sq, sk, d, dv, k_transposed=kt)).optimize().graph
    sched, r, report = _build(g, arch=arch)
    assert _kinds(r)["attention_mma"] == 1 and "attention" not in _kinds(r)
    assert not any(d_.kind.startswith("matmul_") or d_.kind == "row" for d_ in r.kernels)
    assert report.applied["fused_attention_guarded"] == 1
    assert all(k.status == "proved" for k in r.memory_safety.kernels)
    (st,) = [s for s in sched.stages if s.expr.op == "attention"]
    assert st.buf.dtype.name == "FLOAT16"
    if PTXAS:
        _, info = assemble(r.ptx, arch)
        (k,) = [info[d_.name] for d_ in r.kernels if d_.kind == "attention_mma"]
        assert k.stack_frame == 0 and k.spill_stores == 0 and k.shared <= SMEM_LIMIT


def _bert_layer(seq=128, batch=1):
    bert = Pipeline.from_onnx(bert_model(vocab=101, hidden=128, layers=1, heads=2, ffn=192, max_pos=512)).optimize()
    return specialize_graph(bert.graph, {"batch": batch, "sequence": seq})[0]


def test_float16_bert_layer_attention_is_one_kernel():
    """At S = 128 the scores product, the softmax row kernel and the P.V product become the flash kernel (the
    head merge is read by the output projection's loads, as before); the mask is stored once for every layer."""
    g = _bert_layer()
    _, off, _ = _build(g, wide=False)
    _, on, report = _build(g)
    assert "attention_mma" not in _kinds(off) and _kinds(on)["attention_mma"] == 1
    assert sum(report.applied.values()) == 1
    assert _kinds(off)["matmul_fp16"] - _kinds(on)["matmul_fp16"] == 2 and _kinds(off)["row"] - _kinds(on)["row"] == 1
    assert all(k.status == "proved" for k in on.memory_safety.kernels)
    if PTXAS:
        _, info = assemble(on.ptx, "sm_90")
        assert all(info[d.name].spill_stores == 0 for d in on.kernels)


def test_float32_and_option_off_keep_the_products():
    g = _bert_layer()
    fused, report = fuse_attention(g)              # float32 (tensor_cores off): more rows than MAX_ROWS stay
    assert not any(n.op == "FusedAttention" for n in fused.nodes)
    # fused by a float16 build whose tuning turns the kernel off: the row kernel computes it
    _, r, _ = _build(g, tuning=PtxTuning(fused_attention=True, attention_mma=False))
    assert "attention_mma" not in _kinds(r) and _kinds(r)["attention"] == 1


@pytest.mark.parametrize("fp16, mma, kind", [(True, True, "attention_mma"), (True, False, None), (False, True, None)])
def test_bundle_takes_the_kernel_in_float16_builds(tmp_path, fp16, mma, kind):
    from cuvil.targets.ptx.bundle import compile_bundle
    man = compile_bundle(_bert_layer(), str(tmp_path / "b"), enable_fp16=fp16, tuning=PtxTuning(attention_mma=mma))
    kinds = [k["kind"] for k in json.load(open(tmp_path / "b" / "plan.json"))["kernels"]]
    assert ("attention_mma" in kinds) == (kind is not None)
    assert ("fused_attention_masked" in man.get("rules_applied", {})
            or "fused_attention_guarded" in man.get("rules_applied", {})) == (kind is not None)
    if kind is None:
        assert "attention" not in kinds       # 128 rows: the products and the softmax row kernel
    # sm_75: no fusion of many rows (the flash kernel needs sm_80)
    if fp16 and mma:
        compile_bundle(_bert_layer(), str(tmp_path / "c"), enable_fp16=True, arch="sm_75")
        assert "attention_mma" not in [k["kind"] for k in json.load(open(tmp_path / "c" / "plan.json"))["kernels"]]


def _prefill_over_cache(b=1, h=2, sq=32, past=40, d=64):
    """A prefill of ``sq`` rows over a KV cache: K and V are Concat(past, new), the presents are outputs (the float16
    pass keeps such state float32), a per-row additive mask [b, 1, sq, past + sq] (review of session 39)."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper
    rng, f = np.random.default_rng(0), TensorProto.FLOAT
    inits = [numpy_helper.from_array(rng.standard_normal(d).astype(np.float32), n) for n in ("bq", "bk", "bv")]
    inits.append(numpy_helper.from_array(np.array(d ** -0.25, np.float32), "s"))
    nodes = [helper.make_node("Add", ["q", "bq"], ["qb"]), helper.make_node("Add", ["k", "bk"], ["kb"]),
             helper.make_node("Add", ["v", "bv"], ["vb"]),
             helper.make_node("Concat", ["pk", "kb"], ["presk"], axis=2), helper.make_node("Concat", ["pv", "vb"], ["presv"], axis=2),
             helper.make_node("Transpose", ["presk"], ["kt"], perm=[0, 1, 3, 2]),
             helper.make_node("Mul", ["qb", "s"], ["qs"]), helper.make_node("Mul", ["kt", "s"], ["kts"]),
             helper.make_node("MatMul", ["qs", "kts"], ["sc"]), helper.make_node("Add", ["sc", "mask"], ["m"]),
             helper.make_node("Softmax", ["m"], ["p"], axis=-1), helper.make_node("MatMul", ["p", "presv"], ["y"])]
    sk = past + sq
    vi = helper.make_tensor_value_info
    g = helper.make_graph(nodes, "prefill", [vi("q", f, [b, h, sq, d]), vi("k", f, [b, h, sq, d]), vi("v", f, [b, h, sq, d]),
                                             vi("pk", f, [b, h, past, d]), vi("pv", f, [b, h, past, d]),
                                             vi("mask", f, [b, 1, sq, sk])],
                          [vi("y", f, [b, h, sq, d]), vi("presk", f, [b, h, sk, d]), vi("presv", f, [b, h, sk, d])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_prefill_over_a_float32_cache_keeps_the_products(tmp_path):
    """The float16 pass keeps the KV cache (and so K, V) float32: the flash kernel cannot take the node, and the
    row kernel would be slower than the unfused products, so the bundle fuses only few rows (here: none)."""
    from cuvil.targets.ptx.attention_mma import flash_operands_half
    from cuvil.targets.ptx.bundle import compile_bundle
    g = Pipeline.from_onnx(_prefill_over_cache()).optimize().graph
    fused, _ = fuse_attention(g, also=flash_shapes)
    half, _ = to_half(fused)
    attention_in_half(half)
    assert any(n.op == "FusedAttention" for n in half.nodes) and not flash_operands_half(half)
    compile_bundle(g, str(tmp_path / "b"), enable_fp16=True)
    kinds = [k["kind"] for k in json.load(open(tmp_path / "b" / "plan.json"))["kernels"]]
    assert "attention" not in kinds and "attention_mma" not in kinds and kinds.count("matmul_fp16") >= 2


@pytest.mark.skipif(not PTXAS, reason="needs ptxas (the CUDA toolkit) to assemble")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_row_masks_and_heads_of_128_assemble_without_spills(arch):
    """A mask per query row ([b, 1, sq, sk]: a load per score element) with heads of 128 is the kernel's largest
    register need (254 of 255 in session 39's review): no spill, no stack."""
    model = attention_model(1, 2, 40, 65, 128)
    mask = [vi for vi in model.graph.input if vi.name == "mask"][0]
    mask.type.tensor_type.shape.dim[2].dim_value = 40          # [1, 1, 40, 65]: a mask per query row
    g = Pipeline.from_onnx(model).optimize().graph
    sched, r, _ = _build(g, arch=arch)
    assert _kinds(r)["attention_mma"] == 1 and all(k.status == "proved" for k in r.memory_safety.kernels)
    _, info = assemble(r.ptx, arch)
    (d,) = [d_ for d_ in r.kernels if d_.kind == "attention_mma"]
    assert info[d.name].stack_frame == 0 and info[d.name].spill_stores == 0
