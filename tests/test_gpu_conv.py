"""The GPU's implicit-GEMM convolutions (``cuvil.targets.ptx.conv``), without a GPU: which stages take them,
tile and split-K plans, the split-K combining stage, the PTX they become (shared tiles, float4 loads,
ptxas), and the lowering they rely on (unpadded contractions with bounds, float16 contractions) checked
against onnxruntime by evaluating the same schedule on the CPU (the x86 backend computes a contraction it
has no micro-kernel for from its reduction, exactly as the GPU's fallback would)."""
import re

import numpy as np
import pytest

import cuvil.targets.x86.compile as x86_compile
from cuvil import Pipeline
from cuvil.ir.dtype import DType
from cuvil.kernels.contraction import Contraction
from cuvil.targets.ptx import assemble, find_ptxas
from cuvil.targets.ptx.codegen import build_ptx, gpu_schedule
from cuvil.targets.ptx.conv import TK, combine_stage, conv_node, plan_conv, scratch_buf
from cuvil.kernels.schedule import schedule
from cuvil.kernels.texpr import nodes
from cuvil.testing.oracles import ort_session
from cuvil.testing import light_model
from cuvil.testing.conv_models import conv_relu_model

needs_ptxas = pytest.mark.skipif(find_ptxas() is None, reason="ptxas not found (no CUDA toolkit)")


def conv_stages(sched):
    return [(st, conv_node(st)) for st in sched.stages if conv_node(st) is not None]


def test_gpu_schedule_lowers_convolutions_to_unpadded_contractions():
    g = Pipeline.from_onnx(conv_relu_model((1, 16, 14, 14), (32, 16, 3, 3))).optimize().graph
    s = gpu_schedule(g)
    (st, node), = conv_stages(s)
    spec = node.attr
    assert isinstance(spec, Contraction) and spec.pads == (1, 1) and spec.mr == 32
    assert tuple(spec.x.shape) == (1, 16, 14, 14)          # the input itself, no padded copy
    assert len(s.stages) == 1 and "pad" not in st.name
    # the packed weights: [G, M / TM, K, TM]
    assert tuple(spec.a.shape) == (1, 1, 16 * 9, 32)
    # the plain schedule (x86 micro-kernels) pads instead
    plain = schedule(g, gemm_cols=64, gemm_tiles=((32, 64),))
    assert any("pad" in x.name for x in plain.stages)


def test_plans_split_small_grids():
    short = Contraction(None, None, 1, 1, 64, 3, (3, 3), (1, 1), (1, 1), (112, 112), 64, 64)
    p = plan_conv(short)                # 27 terms: nothing to split
    assert (p.tm, p.tp, p.splits) == (64, 64, 1) and p.blocks == 196 and p.kchunk == TK
    big = Contraction(None, None, 1, 1, 64, 64, (3, 3), (1, 1), (1, 1), (56, 56), 64, 64)
    p = plan_conv(big)                  # 49 tiles, 576 terms: 4 slices of 160 / 96 terms (>= 128 each on average)
    assert (p.tm, p.tp, p.splits) == (64, 64, 4) and p.blocks == 196 and p.kchunk % TK == 0
    late = Contraction(None, None, 1, 1, 512, 512, (3, 3), (1, 1), (1, 1), (7, 7), 64, 64)
    q = plan_conv(late)                 # 8 tiles of 64 x 64 for 4608 terms: sliced until ~264 blocks
    assert q.tp == 64 and q.splits > 1 and q.blocks >= 200 and q.kchunk % TK == 0
    assert (q.splits - 1) * q.kchunk < 4608 <= q.splits * q.kchunk
    assert q.k // q.splits >= 128
    mid = Contraction(None, None, 1, 1, 256, 256, (3, 3), (1, 1), (1, 1), (14, 14), 64, 64)
    assert plan_conv(mid).tp == 32      # 196 positions: 224 computed with 32-wide tiles, 256 with 64


def test_split_k_in_one_kernel(tmp_path):
    """fused_splitk: no sum kernel; the last slice of each tile (an atomic count per tile, read through
    L2) adds the partials, and the plan asks the runtime to zero the counters before each run."""
    from cuvil.targets.ptx.bundle import compile_bundle, read_bundle
    g = Pipeline.from_onnx(conv_relu_model((1, 256, 7, 7), (256, 256, 3, 3))).optimize().graph
    r = build_ptx(gpu_schedule(g), "sm_90", fma=True, fused_splitk=True)
    assert [k.kind for k in r.kernels] == ["conv_splitk"] and r.counter_bytes > 0
    assert "atom.global.add.u32" in r.ptx and "ld.global.cg.f32" in r.ptx and "membar.gl" in r.ptx
    man = compile_bundle(g, str(tmp_path / "f.cuvil"), fused_splitk=True)
    plan, _ = read_bundle(str(tmp_path / "f.cuvil"))
    assert plan["zero"] and plan["zero"][0][1] == r.counter_bytes
    assert plan["arena_bytes"] >= plan["zero"][0][0] + plan["zero"][0][1] and man["kernels"] == 1


def test_split_k_combine_sums_the_slices_in_order():
    g = Pipeline.from_onnx(conv_relu_model((1, 256, 7, 7), (256, 256, 3, 3))).optimize().graph
    s = gpu_schedule(g)
    (st, node), = conv_stages(s)
    plan = plan_conv(node.attr)
    assert plan.splits > 1
    scratch = scratch_buf(plan, 4096)
    assert scratch.shape == (plan.splits, 1, 256, 49) and scratch.offset == 4096
    comb = combine_stage(st, node, plan, scratch)
    assert not any(x.op == "contract" for x in nodes(comb.expr))
    sums = [x for x in nodes(comb.expr) if x.op == "reduce" and x.attr[2] == (plan.splits,)]
    assert len(sums) == 1 and sums[0].args[0].op == "load" and sums[0].args[0].attr is scratch


@needs_ptxas
def test_resnet50_convolutions_become_tile_kernels():
    s = gpu_schedule(Pipeline.from_onnx(light_model("resnet50")).optimize().graph)
    r = build_ptx(s, "sm_90", fma=True)
    kinds = [k.kind for k in r.kernels]
    assert kinds.count("conv") + kinds.count("conv_splitk") == 53        # every convolution
    assert kinds.count("conv_sum") == kinds.count("conv_splitk") > 0     # each split one followed by its sum
    assert r.counter_bytes == 0 and "atom.global" not in r.ptx
    specs = [n.attr for st in s.stages for n in nodes(st.expr) if n.op == "contract" and isinstance(n.attr, Contraction)]
    assert len(specs) == 53 and sum(1 for c in specs if c.pads) == 17    # the 3x3s and the stem read unpadded
    assert sum(1 for st in s.stages if "pad" in st.name) == 1            # only the max-pool's padded copy is left
    assert r.scratch_bytes > 0 and r.scratch_offset >= s.arena_bytes and r.scratch_offset % 256 == 0
    first = next(k.name for k in r.kernels if k.kind == "conv")
    k1 = re.search(rf"\.entry {first}\(.*?\n\}}\n", r.ptx, re.S).group(0)
    assert "bar.sync" in k1 and "ld.global.nc.v4.b32" in k1 and "st.shared.v4.b32" in k1 and "ld.shared.v4.b32" in k1
    assert "fma.rn.f32" in k1
    _, info = assemble(r.ptx, "sm_90", jobs=0)
    assert all(i.spill_stores == 0 and i.stack_frame == 0 for i in info.values())


@pytest.mark.parametrize("xs,ws,pads,strides,group,dil", [
    ((1, 8, 13, 11), (16, 8, 3, 3), (1, 1, 1, 1), (1, 1), 1, None),
    ((2, 8, 12, 12), (12, 8, 3, 3), (2, 0, 1, 2), (2, 2), 1, None),     # asymmetric pads, strided, 2 images
    ((1, 16, 9, 9), (16, 4, 3, 3), (1, 1, 1, 1), (1, 1), 4, None),      # groups
    ((1, 3, 20, 20), (8, 3, 7, 7), (3, 3, 3, 3), (2, 2), 1, None),      # a stem
    ((1, 8, 11, 11), (8, 8, 3, 3), (0, 0, 2, 1), (1, 1), 1, None),      # end-only pads
    ((1, 8, 12, 12), (8, 8, 3, 3), (2, 2, 2, 2), (1, 1), 1, (2, 2)),    # dilated
    ((2, 8, 30), (8, 8, 5), (2, 1), (2,), 1, None),                     # 1-D
])
def test_unpadded_contraction_lowering_matches_onnxruntime(monkeypatch, xs, ws, pads, strides, group, dil):
    """The GPU lowering's contraction reads the unpadded input through bounds; the x86 backend computes a
    contraction with pads from that same expression (no micro-kernel), so the schedule is checked here."""
    model = conv_relu_model(xs, ws, pads, strides, group, dilations=dil)
    x = np.random.default_rng(1).standard_normal(xs).astype(np.float32)
    want = ort_session(model).run(None, {"x": x})[0]
    real = x86_compile.schedule
    seen = []

    def unpadded(g, **kw):
        sched = real(g, unpadded_contractions=True, **kw)
        seen.extend(n.attr.pads for st in sched.stages for n in nodes(st.expr)
                    if n.op == "contract" and isinstance(n.attr, Contraction))
        return sched
    monkeypatch.setattr(x86_compile, "schedule", unpadded)
    art = Pipeline.from_onnx(model).optimize().compile(opt_level=2, cache=False, winograd=False)
    assert seen and all(p for p in seen)
    y = art.model().run(x)[0]
    np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-4 * max(1.0, float(np.abs(want).max())))


def test_float16_convolutions_take_the_tile_kernels():
    from cuvil.rewrite_rules.precision import to_half
    g, _ = to_half(Pipeline.from_onnx(conv_relu_model((1, 16, 14, 14), (32, 16, 3, 3))).optimize().graph)
    s = gpu_schedule(g)
    (node,) = [n for st in s.stages for n in nodes(st.expr) if n.op == "contract"]
    assert node.dtype == DType.FLOAT16 and node.attr.a.dtype == DType.FLOAT16 and node.attr.x.dtype == DType.FLOAT16
    r = build_ptx(s, "sm_90", fma=True)     # the half sum is widened to float32 first, then the tile kernel
    assert r.widened_reductions >= 1
    (k,) = [k for k in r.kernels if k.kind in ("conv", "conv_splitk")]
    # 32-channel panels: the SIMT tiles, half loaded (16-bit) and widened into float32 shared tiles
    entry = re.search(rf"\.entry {k.name}\(.*?\n\}}\n", r.ptx, re.S).group(0)
    assert "ld.global.nc.b16" in entry and "st.shared.v4.b32" in entry and "mma.sync" not in r.ptx
    if find_ptxas():
        assemble(r.ptx, "sm_90")


def test_float16_convolutions_with_64_channel_panels_use_tensor_cores():
    """conv.py's per-image mma tiles (kept behind ``conv_mma_batch=False``; by default float16 convolutions
    take the whole-batch kernels of conv_mma.py, tests/test_gpu_conv_mma.py)."""
    from cuvil.rewrite_rules.precision import to_half
    from cuvil.targets.ptx.tuning import PtxTuning
    g, _ = to_half(Pipeline.from_onnx(conv_relu_model((1, 32, 14, 14), (64, 32, 3, 3))).optimize().graph)
    s = gpu_schedule(g)
    per_image = PtxTuning(conv_mma_batch=False)
    assert any(k.kind.endswith("_mma_fp16") for k in build_ptx(s, "sm_90", fma=True).kernels)
    r = build_ptx(s, "sm_90", fma=True, tuning=per_image)
    (k,) = [k for k in r.kernels if k.kind.startswith("conv") and k.kind != "conv_sum"]
    assert k.kind.endswith("_mma") and k.block == 64          # a 64 x 32 tile: two warps of 32 x 32
    assert r.ptx.count("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32") >= 8
    # no tensor cores without fma contraction (mma accumulates fused) or before sm_80
    assert "mma.sync" not in build_ptx(s, "sm_90", fma=False, tuning=per_image).ptx
    assert "mma.sync" not in build_ptx(s, "sm_75", fma=True, tuning=per_image).ptx
    if find_ptxas():
        assemble(r.ptx, "sm_90")
