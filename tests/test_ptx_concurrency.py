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
    assert PtxOptions().tuning is DEFAULT_TUNING or PtxOptions().tuning == DEFAULT_TUNING
    t = PtxOptions(concurrency=4).tuning
    assert (t.target_blocks, t.mma_min_blocks, t.gemv_min_blocks) == (
        DEFAULT_TUNING.target_blocks // 4, DEFAULT_TUNING.mma_min_blocks // 4, DEFAULT_TUNING.gemv_min_blocks // 4)
    assert PtxOptions(concurrency=4, gemv=False).tuning.gemv is False      # the other settings kept
    assert concurrent_tuning(DEFAULT_TUNING, MAX_CONCURRENCY).target_blocks >= 1
    assert concurrent_tuning(DEFAULT_TUNING, 1) is DEFAULT_TUNING


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
