"""MatMul operands that are a value times a constant scalar (attention's ``Q * s`` and ``Kt * s`` as torch's
scaled_dot_product_attention exports them) are multiplied in the product's loads on the GPU instead of stored
by a kernel of their own (``gpu_schedule``'s ``scaled_operands``, :class:`~cuvil.targets.ptx.tuning.PtxTuning`):
which values (only read by MatMuls, a scalar constant), x86 untouched, and on a GPU the same bits as before."""
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from cuvil import Pipeline
from cuvil.kernels.schedule import schedule
from cuvil.targets.ptx.codegen import build_ptx, gpu_schedule
from cuvil.targets.ptx.tuning import PtxTuning
from cuvil.testing.ptx_bundles import run_ptx_bundle
from cuvil.testing.requires import needs_gpu


def scaled_scores(b=1, h=3, s=40, d=32, extra_reader=False):
    """(q * r) @ (transpose(k) * r), r = 1/sqrt(sqrt(d)); with ``extra_reader`` q * r is also an output."""
    r = numpy_helper.from_array(np.array(1 / np.sqrt(np.sqrt(d)), np.float32), "r")
    nodes = [helper.make_node("Mul", ["q", "r"], ["qs"]),
             helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
             helper.make_node("Mul", ["kt", "r"], ["ks"]),
             helper.make_node("MatMul", ["qs", "ks"], ["y"])]
    t = lambda n, sh: helper.make_tensor_value_info(n, TensorProto.FLOAT, sh)   # noqa: E731
    outs = [t("y", [b, h, s, s])] + ([t("qs", [b, h, s, d])] if extra_reader else [])
    g = helper.make_graph(nodes, "sdpa", [t("q", [b, h, s, d]), t("k", [b, h, s, d])], outs, [r])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _stage_ops(model, **tuning):
    return [st.op for st in gpu_schedule(Pipeline.from_onnx(model).optimize().graph, tuning=PtxTuning(**tuning)).stages]


def test_scaled_operands_are_multiplied_in_the_loads():
    model = scaled_scores()
    assert _stage_ops(model) == ["MatMul"]
    assert _stage_ops(model, scaled_operands=False).count("Mul") == 2
    # a value something else reads (here a graph output) stays stored
    assert "Mul" in _stage_ops(scaled_scores(extra_reader=True))
    # x86's schedule is unchanged
    assert [st.op for st in schedule(Pipeline.from_onnx(model).optimize().graph).stages].count("Mul") == 2


@pytest.mark.parametrize("tf32", [False, True])
def test_the_product_still_takes_the_matrix_kernel(tf32):
    r = build_ptx(gpu_schedule(Pipeline.from_onnx(scaled_scores()).optimize().graph), "sm_90", fma=True,
                  allow_tf32=tf32)
    assert [k.kind for k in r.kernels] == ["matmul_tf32" if tf32 else "gemm_fp32"]


@needs_gpu
def test_gpu_scaled_operands_give_the_same_bits(tmp_path):
    model = scaled_scores()
    rng = np.random.default_rng(0)
    q, k = (rng.standard_normal((1, 3, 40, 32)).astype(np.float32) for _ in range(2))
    y = run_ptx_bundle(model, [q, k], tmp_path / "new")
    y0 = run_ptx_bundle(model, [q, k], tmp_path / "old", scaled_operands=False)
    r = np.float32(1 / np.sqrt(np.sqrt(32)))
    want = (q * r).astype(np.float64) @ np.swapaxes(k * r, -1, -2).astype(np.float64)
    assert np.abs(y - want).max() / np.abs(want).max() < 1e-6
    assert np.array_equal(y.view(np.uint32), y0.view(np.uint32))
