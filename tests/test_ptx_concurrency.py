"""``PtxOptions.concurrency`` / ``cuvil compile --concurrency C`` (no GPU needed): a bundle meant to run C inferences
at once sizes its kernels' grids for a C-th of the GPU (:func:`cuvil.targets.ptx.tuning.concurrent_tuning`), so a
convolution the default build splits over K to fill the GPU alone keeps one slice; the manifest says what it
was built for; bad values are refused with the valid range. Throughput on a GPU: bench/gpu/concurrency.py."""
import json
import os

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from cuvil import Pipeline
from cuvil.cli import main as cli_main
from cuvil.errors import CuvilError
from cuvil.targets.ptx.target import PtxOptions
from cuvil.targets.ptx.tuning import DEFAULT_TUNING, MAX_CONCURRENCY, concurrent_tuning
from cuvil.testing.requires import needs_gpu

TARGET = "nvptx64-nvidia-cuda"


def conv_model(c=256, m=512, hw=28):
    """One 3x3 convolution + Relu at batch 1: 8 x 13 blocks of 64 x 64 at most, so the default build (264
    blocks) splits its K = 2,304 terms, and a build for 8 calls in flight (33 blocks) need not."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array((rng.standard_normal((m, c, 3, 3)) * 0.02).astype(np.float32), "W")
    g = helper.make_graph([helper.make_node("Conv", ["x", "W"], ["c"], pads=[1, 1, 1, 1]),
                           helper.make_node("Relu", ["c"], ["y"])], "conv",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c, hw, hw])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, m, hw, hw])], [w])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_the_grid_targets_are_divided():
    assert PtxOptions().tuning == DEFAULT_TUNING and DEFAULT_TUNING.concurrency == 1
    t = PtxOptions(concurrency=4).tuning
    assert t.concurrency == 4
    assert (t.target_blocks, t.gemv_min_blocks, t.split_target_threads) == (
        DEFAULT_TUNING.target_blocks // 4, DEFAULT_TUNING.gemv_min_blocks // 4, DEFAULT_TUNING.split_target_threads // 4)
    # a product's tile choice is kept: its K slices are planned for a quarter of the SMs instead (codegen)
    assert t.mma_min_blocks == DEFAULT_TUNING.mma_min_blocks
    assert PtxOptions(concurrency=4, gemv=False).tuning.gemv is False      # the other settings kept
    assert concurrent_tuning(DEFAULT_TUNING, MAX_CONCURRENCY).target_blocks >= 1
    assert concurrent_tuning(DEFAULT_TUNING, 1) is DEFAULT_TUNING


def test_the_cache_tells_them_apart():
    from cuvil.targets.ptx.target import TARGET as PTX
    g = Pipeline.from_onnx(conv_model(c=32, m=64, hw=8)).optimize().graph
    keys = [PTX.plan(g, PtxOptions(concurrency=c), {}).key_parts for c in (1, 1, 4, 8)]
    assert keys[0] == keys[1] and len({tuple(k) for k in keys}) == 3


@pytest.mark.parametrize("bad", [0, -2, MAX_CONCURRENCY + 1, True, "4", 2.0])
def test_bad_values_are_refused(bad):
    with pytest.raises(CuvilError, match=rf"PtxOptions.concurrency takes an int from 1 to {MAX_CONCURRENCY}"):
        PtxOptions(concurrency=bad)


def test_a_concurrent_bundle_splits_less_and_says_so(tmp_path):
    p = Pipeline.from_onnx(conv_model()).optimize()
    alone = p.compile(TARGET, cache=False, enable_fp16=True).manifest
    shared = p.compile(TARGET, cache=False, enable_fp16=True, concurrency=8).manifest
    assert alone["concurrency"] == 1 and shared["concurrency"] == 8
    assert alone["grid_targets"]["target_blocks"] == DEFAULT_TUNING.target_blocks
    assert shared["grid_targets"]["target_blocks"] == DEFAULT_TUNING.target_blocks // 8
    assert shared["grid_targets"]["product_sms"] == max(1, alone["grid_targets"]["product_sms"] // 8)
    tc_alone, tc_shared = alone["tensor_core_kernels"], shared["tensor_core_kernels"]
    assert tc_alone.get("conv_splitk_mma_fp16", 0) == 1 and tc_alone.get("conv_mma_fp16", 0) == 0, tc_alone
    assert tc_shared.get("conv_mma_fp16", 0) == 1 and tc_shared.get("conv_splitk_mma_fp16", 0) == 0, tc_shared
    assert shared["kernels"] < alone["kernels"]          # no sum kernel for the slices


def test_cli(tmp_path, capsys):
    path = str(tmp_path / "conv.onnx")
    with open(path, "wb") as f:
        f.write(conv_model(c=32, m=64, hw=8).SerializeToString())
    out = str(tmp_path / "conv.cuvil")
    assert cli_main(["compile", path, "--target", TARGET, "--concurrency", "4", "-o", out, "-q"]) == 0
    with open(os.path.join(out, "manifest.json")) as f:
        assert json.load(f)["concurrency"] == 4
    assert cli_main(["compile", path, "--concurrency", "4", "-o", str(tmp_path / "libc.so"), "-q"]) in (1, 2)
    assert "--concurrency applies to --target nvptx64-nvidia-cuda only" in capsys.readouterr().err
    assert cli_main(["compile", path, "--target", TARGET, "--concurrency", "0", "-o", out, "-q"]) in (1, 2)
    assert f"an int from 1 to {MAX_CONCURRENCY}" in capsys.readouterr().err


def test_a_profile_bundle_is_built_for_it_at_every_bucket():
    from cuvil.testing.models import symbolic_batch_cnn
    b = Pipeline.from_onnx(symbolic_batch_cnn()).optimize().compile(
        TARGET, cache=False, shape_profiles={"N": (1, 2, 4)}, concurrency=2)
    assert b.manifest["concurrency"] == 2
    points = [os.path.join(b.path, d, "manifest.json") for d in sorted(os.listdir(b.path))
              if os.path.isfile(os.path.join(b.path, d, "manifest.json"))]
    assert points, os.listdir(b.path)
    for pt in points:
        with open(pt) as f:
            assert json.load(f)["grid_targets"]["target_blocks"] == DEFAULT_TUNING.target_blocks // 2


def test_a_product_plans_its_k_slices_for_fewer_sms():
    """A BERT-sized product at batch 1 (128 x 3072 @ 3072 x 768, float16): the default build splits K over blocks
    to fill the GPU and adds the slices with a sum kernel; built for 8 calls (its K slices planned for 132 / 8
    SMs) it runs as one kernel of fewer blocks."""
    from cuvil.testing.matmul_models import linear_gelu
    model, _ = linear_gelu(b=1, m=128, k=3072, n=768)
    p = Pipeline.from_onnx(model).optimize()
    grids = {}
    for c in (1, 8):
        b = p.compile(TARGET, cache=False, enable_fp16=True, concurrency=c)
        with open(os.path.join(b.path, "plan.json")) as f:
            grids[c] = [k["grid"][0] for k in json.load(f)["kernels"]]
        grids[c, "kinds"] = b.manifest["tensor_core_kernels"]
    assert grids[1, "kinds"] == {"matmul_splitk_fp16": 1, "matmul_sum": 1}, grids
    assert grids[8, "kinds"] == {"matmul_fp16": 1}, grids
    assert len(grids[8]) == len(grids[1]) - 1 and max(grids[8]) < max(grids[1])


@needs_gpu
@pytest.mark.parametrize("concurrency", [1, 8])
def test_gpu_concurrent_bundles_compute_the_model(tmp_path, concurrency):
    """Built for 8 calls in flight (fewer split-K slices) the convolution and the product still match the
    references, and 4 threads on 4 sessions give the one-session bits."""
    import threading
    import cuvil
    import onnxruntime as ort
    from cuvil.testing.matmul_models import linear_gelu
    rng = np.random.default_rng(1)
    conv = conv_model()
    conv.ir_version = min(conv.ir_version, 10)      # an onnx newer than the onnxruntime beside it writes IR 14
    x = rng.standard_normal((1, 256, 28, 28)).astype(np.float32)
    want = ort.InferenceSession(conv.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    prod, ref = linear_gelu(b=1, m=128, k=3072, n=768)
    a = rng.standard_normal((1, 128, 3072)).astype(np.float32)
    for model, feeds, expect in ((conv, [x], want), (prod, [a], ref(a))):
        b = Pipeline.from_onnx(model).optimize().compile(TARGET, cache=False, enable_fp16=True, concurrency=concurrency)
        path = b.save(str(tmp_path / f"m{concurrency}.cuvil"))
        with cuvil.load(path, sessions=4) as m:
            (y,) = m.run(*feeds)
            err = np.abs(y - expect).max() / np.abs(expect).max()
            assert err < 3e-2, err
            got = [None] * 4

            def work(i):
                for _ in range(5):
                    got[i] = m.run(*feeds)[0]
            ts = [threading.Thread(target=work, args=(i,)) for i in range(4)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            assert all(np.array_equal(g_, y) for g_ in got)
