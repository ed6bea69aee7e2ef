"""Convolutions under the precision policy on the GPU (issue 21, part 5): a Conv the policy narrows to fp16 or bf16
runs on ``conv_mma.py``'s tensor-core tiles with both operands rounded to that format as they are staged
(``cvt.rn.{f16,bf16}x2.f32``), float32 sums, bias and output; a form without such a kernel (a grouped
convolution) computes in float32 and the manifest records it so. On a GPU: every geometry's results against
numpy's product of the same rounded operands to float32 sum accuracy, and the rounding shown to be the format's."""
import re

import ml_dtypes
import numpy as np
import pytest
from onnx import numpy_helper

from cuvil import Pipeline
from cuvil.targets.ptx import assemble
from cuvil.targets.ptx.codegen import build_ptx, gpu_schedule
from cuvil.targets.ptx.conv_mma import conv_stage_precisions, narrowed_convs, narrowed_convs_run
from cuvil.testing.conv_models import conv_relu_model
from cuvil.testing.requires import needs_gpu, needs_ptxas
from test_x86_bf16 import conv_ref

TARGET = "nvptx64-nvidia-cuda"
ROUND = {"fp16": np.float16, "bf16": ml_dtypes.bfloat16}
MMA = {"fp16": "m16n8k16.row.col.f32.f16.f16.f32", "bf16": "m16n8k16.row.col.f32.bf16.bf16.f32"}
CVT = {"fp16": "cvt.rn.f16x2.f32", "bf16": "cvt.rn.bf16x2.f32"}

GEOMETRIES = [  # x shape, w shape, pads, strides
    ((4, 32, 14, 14), (64, 32, 3, 3), (1, 1, 1, 1), (1, 1)),
    ((3, 20, 9, 9), (64, 20, 3, 3), (1, 1, 1, 1), (2, 2)),           # ragged K (180), odd batch, stride 2
    ((2, 64, 7, 7), (128, 64, 1, 1), (0, 0, 0, 0), (1, 1)),          # pointwise (register-staged: float32 input)
    ((2, 3, 30, 30), (64, 3, 7, 7), (3, 3, 3, 3), (2, 2)),            # the stem's shape
    ((8, 64, 28, 28), (128, 64, 3, 3), (1, 1, 1, 1), (1, 1)),         # 128 x 128 tiles
    ((5, 256, 7, 7), (256, 256, 3, 3), (1, 1, 1, 1), (1, 1)),         # long K: split-K partials and sum kernel
]


def _chain():
    """3x3 Conv (bias) -> Relu -> 1x1 Conv -> grouped 3x3 Conv (4 groups: conv.py's float32 kernels)."""
    from onnx import TensorProto as T, helper as h
    rng = np.random.default_rng(0)
    inits = {"w1": rng.standard_normal((64, 32, 3, 3)) * 0.1, "b1": rng.standard_normal(64) * 0.1,
             "w2": rng.standard_normal((64, 64, 1, 1)) * 0.1, "w3": rng.standard_normal((64, 16, 3, 3)) * 0.1}
    nodes = [h.make_node("Conv", ["x", "w1", "b1"], ["y1"], pads=[1, 1, 1, 1]), h.make_node("Relu", ["y1"], ["r1"]),
             h.make_node("Conv", ["r1", "w2"], ["y2"]),
             h.make_node("Conv", ["y2", "w3"], ["y"], pads=[1, 1, 1, 1], group=4)]
    g = h.make_graph(nodes, "chain", [h.make_tensor_value_info("x", T.FLOAT, [2, 32, 16, 16])],
                     [h.make_tensor_value_info("y", T.FLOAT, [2, 64, 16, 16])],
                     [numpy_helper.from_array(v.astype(np.float32), k) for k, v in inits.items()])
    return h.make_model(g, opset_imports=[h.make_opsetid("", 17)])


def _planned(model, fmt, ranges):
    from cuvil.precision.policy import apply_precision, plan_precision
    from cuvil.targets.ptx.target import TARGET as PTX, PtxOptions
    p = Pipeline.from_onnx(model).optimize()
    plan = plan_precision(p.graph, fmt, input_ranges=ranges, target_ops=PTX.precision_ops(PtxOptions()),
                          stores_bf16=False)
    return apply_precision(p.graph, plan), plan


@needs_ptxas
@pytest.mark.parametrize("fmt", ["fp16", "bf16"])
def test_policy_narrows_convs_onto_tensor_cores(fmt):
    b = Pipeline.from_onnx(_chain()).optimize().compile(TARGET, precision=fmt, input_ranges={"x": (-3, 3)},
                                                        cache=False)
    nodes = {k: v for k, v in b.manifest["precision"]["nodes"].items() if v["op"] == "Conv"}
    assert {k: v["format"] for k, v in nodes.items()} == {"y1": fmt, "y2": fmt, "y": "fp32"}
    assert nodes["y"]["policy_format"] == fmt and "grouped" in nodes["y"]["reason"]
    kinds = b.manifest["tensor_core_kernels"]
    assert sum(n for k, n in kinds.items() if k.endswith(f"_mma_{fmt}")) == 2, kinds
    # no bf16 storage planned on the GPU (its kernels read float32 activations)
    assert "bf16_stored" not in b.manifest["precision"] and "bf16_residual" not in b.manifest["precision"]


@needs_ptxas
@pytest.mark.parametrize("fmt", ["fp16", "bf16"])
def test_policy_conv_kernels_round_when_staged_and_assemble_without_spills(fmt):
    for xs, ws, pads, strides in GEOMETRIES:
        g, _ = _planned(conv_relu_model(xs, ws, pads=pads, strides=strides), fmt, {"x": (-4, 4)})
        s = gpu_schedule(g)
        precisions = conv_stage_precisions(g, s)
        assert list(precisions.values()) == [fmt], precisions
        for arch in ("sm_90", "sm_80"):
            r = build_ptx(s, arch, fma=True, precisions=precisions)
            (k,) = [d for d in r.kernels if "_mma_" in d.kind]
            assert k.kind.endswith(f"_mma_{fmt}"), k.kind
            entry = re.search(rf"\.entry {k.name}\(.*?\n\}}\n", r.ptx, re.S).group(0)
            assert CVT[fmt] in entry and MMA[fmt] in entry and "ldmatrix.sync.aligned.m8n8.x4.shared.b16" in entry
            assert re.search(r"ld\.global(\.nc)?\.v4\.[bf]32", entry)     # float32 weights, 16 bytes a load
            assert not narrowed_convs_run(g, s, r.kernels)
            _, info = assemble(r.ptx, arch)
            assert info[k.name].spill_stores == 0, (xs, ws, arch, info[k.name])


def test_only_the_policys_convs_are_mapped_and_float32_stays_strict():
    model = conv_relu_model((2, 32, 14, 14), (64, 32, 3, 3))
    g = Pipeline.from_onnx(model).optimize().graph
    s = gpu_schedule(g)
    assert narrowed_convs(g, s) == {}
    r = build_ptx(s, "sm_90", fma=True, precisions=conv_stage_precisions(g, s))
    assert "mma.sync" not in r.ptx          # strict float32 without a policy
    g2, plan = _planned(model, "fp16", {"x": (-4, 4)})
    s2 = gpu_schedule(g2)
    (nd,) = narrowed_convs(g2, s2).values()
    assert nd.op == "Conv" and nd.precision == "fp16"
    # no fma contraction: no tensor cores, and the Conv is then recorded as float32
    r = build_ptx(s2, "sm_90", fma=False, precisions=conv_stage_precisions(g2, s2))
    assert "mma.sync" not in r.ptx and narrowed_convs_run(g2, s2, r.kernels) == [nd.name]


def test_bf16_storage_is_planned_only_where_the_target_stores_it():
    from cuvil.precision.policy import plan_precision
    from cuvil.targets.base import stores_bf16
    from cuvil.targets.ptx.target import TARGET as PTX, PtxOptions
    from cuvil.targets.x86.target import TARGET as X86
    g = Pipeline.from_onnx(_chain()).optimize().graph
    ops = PTX.precision_ops(PtxOptions())
    assert "Conv" in ops["bf16"] and "Conv" in ops["fp16"] and "Conv" not in ops.get("fp8", ())
    assert not stores_bf16(PTX) and stores_bf16(X86)
    gpu = plan_precision(g, "bf16", input_ranges={"x": (-3, 3)}, target_ops=ops, stores_bf16=False)
    assert gpu.bf16_stored == {} and {n.format for n in gpu.nodes if n.op == "Conv"} == {"bf16"}
    cpu = plan_precision(g, "bf16", input_ranges={"x": (-3, 3)}, target_ops=ops)
    assert cpu.bf16_stored        # the same plan where a target stores bfloat16 between bf16 convolutions


# --- on a GPU ------------------------------------------------------------------------------------------------

def _rounded(a, fmt):
    return np.asarray(a, np.float32).astype(ROUND[fmt]).astype(np.float64)


@needs_gpu
@pytest.mark.parametrize("fmt", ["fp16", "bf16"])
def test_gpu_policy_convs_match_the_emulation(tmp_path, fmt):
    import cuvil
    rng = np.random.default_rng(0)
    for i, (xs, ws, pads, strides) in enumerate(GEOMETRIES):
        model = conv_relu_model(xs, ws, pads=pads, strides=strides, relu=False)
        b = Pipeline.from_onnx(model).optimize().compile(TARGET, precision=fmt, input_ranges={"x": (-4, 4)},
                                                         cache=False)
        (rec,) = b.manifest["precision"]["nodes"].values()
        assert rec["format"] == fmt, rec
        assert any(k.endswith(f"_mma_{fmt}") for k in b.manifest["tensor_core_kernels"]), b.manifest
        x = rng.uniform(-4, 4, xs).astype(np.float32)
        (y,) = cuvil.load(b.save(str(tmp_path / f"c{i}.cuvil"))).run(x)
        w = numpy_helper.to_array([t for t in model.graph.initializer if t.name == "w"][0])
        bias = numpy_helper.to_array([t for t in model.graph.initializer if t.name == "b"][0]).astype(np.float64)
        near, mag = conv_ref(_rounded(x, fmt), _rounded(w, fmt), bias, strides, pads, (1, 1), 1)
        exact, _ = conv_ref(x.astype(np.float64), w.astype(np.float64), bias, strides, pads, (1, 1), 1)
        k = int(np.prod(ws[1:]))
        bound = 2 * (k + 2) * 2.0 ** -24 * (mag + np.abs(bias).reshape(1, -1, 1, 1))
        assert np.all(np.abs(y - near) <= bound + 1e-30), (xs, ws, float((np.abs(y - near) - bound).max()))
        far, close = float(np.abs(y - exact).max()), float(np.abs(y - near).max())
        assert far > 30 * close, (xs, ws, far, close)       # the rounding is really the format's


@needs_ptxas
def test_a_profile_bundle_records_float32_where_a_bucket_computed_it():
    """Each bucket of a shape-profile bundle reconciles the plan with its own kernels, and the bundle's manifest
    keeps a node narrowed only where every bucket narrowed it (the session-24 review's case: a grouped Conv)."""
    model = _chain()
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "N"
    model.graph.output[0].type.tensor_type.shape.dim[0].dim_param = "N"
    p = Pipeline.from_onnx(model).optimize()
    b = p.compile(TARGET, precision="bf16", input_ranges={"x": (-3, 3)}, shape_profiles={"N": (1, 2, 4)},
                  graph_buckets={"N": [2, 4]}, cache=False)
    nodes = {k: v for k, v in b.manifest["precision"]["nodes"].items() if v["op"] == "Conv"}
    assert {k: v["format"] for k, v in nodes.items()} == {"y1": "bf16", "y2": "bf16", "y": "fp32"}
    assert nodes["y"]["policy_format"] == "bf16" and "bucket N=" in nodes["y"]["reason"]
    assert b.manifest["precision"]["counts"]["bf16"] == 2


def test_enable_fp16_with_a_precision_plan_is_refused():
    from cuvil.errors import CuvilError
    p = Pipeline.from_onnx(_chain()).optimize()
    with pytest.raises(CuvilError, match="enable_fp16 with --precision bf16") as e:
        p.compile(TARGET, precision="bf16", input_ranges={"x": (-3, 3)}, enable_fp16=True, cache=False)
    assert "--enable-fp16 alone" in e.value.hint

