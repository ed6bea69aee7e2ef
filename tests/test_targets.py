"""The table of targets, the per-target option objects and the artifact cache's entries."""
import os

import pytest

import cuvil

from cuvil import CuvilError, Pipeline
from cuvil.artifact import cache_entry, cached_path, compiler_sources
from cuvil.cli import main as cli_main
from cuvil.targets import PTX_TARGET, TARGETS, X86_TARGET, get_target, make_options
from cuvil.targets.ptx.target import PtxOptions
from cuvil.targets.x86.target import X86Options
from cuvil.testing.conv_models import conv_relu_model

DEMO = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src", "cuvil", "data",
                    "demo_cnn.onnx")


def test_each_row_names_its_target():
    assert set(TARGETS) == {X86_TARGET, PTX_TARGET}
    for triple in TARGETS:
        t = get_target(triple)
        assert t.triple == triple and t.options_type.triple == triple
        assert callable(t.plan) and callable(t.emit) and callable(t.load)


def test_unknown_target_lists_the_table():
    with pytest.raises(CuvilError, match=r"unknown target 'aarch64-linux-gnu'; the targets are x86_64-linux-gnu "
                                         r"\(cuvil.targets.x86.target\), nvptx64-nvidia-cuda"):
        get_target("aarch64-linux-gnu")


def test_cli_refuses_an_unknown_target_before_reading_the_model(tmp_path, capsys):
    rc = cli_main(["compile", "--input", str(tmp_path / "missing.onnx"), "--target", "aarch64-linux-gnu",
                   "--output", str(tmp_path / "libm.so")])
    err = capsys.readouterr().err
    assert rc == 2 and "unknown target 'aarch64-linux-gnu'" in err and "missing.onnx" not in err


def test_options_check_themselves():
    assert X86Options().opt_level == 3 and PtxOptions().arch == "sm_90"
    with pytest.raises(CuvilError, match=r"X86Options: unknown option tile; the options of x86_64-linux-gnu are "
                                         r"opt_level, cpu, prefix"):
        X86Options(tile=4)
    with pytest.raises(CuvilError, match=r"X86Options.opt_level takes 0, 1, 2 or 3, got 4"):
        X86Options(opt_level=4)
    with pytest.raises(CuvilError, match=r"X86Options.prefix takes a C identifier"):
        X86Options(prefix="my-model")
    with pytest.raises(CuvilError, match=r"PtxOptions.fma takes True or False, got 'no'"):
        PtxOptions(fma="no")
    with pytest.raises(CuvilError, match=r"PtxOptions.kernel_rules takes None"):
        PtxOptions(kernel_rules=["fma_contract"])
    assert PtxOptions(arch="sm_80").replace(fma=False) == PtxOptions(arch="sm_80", fma=False)


def test_a_keyword_of_the_other_target_is_named():
    with pytest.raises(CuvilError, match=r"register_pass is an option of the nvptx64-nvidia-cuda target only, "
                                         r"not of x86_64-linux-gnu"):
        make_options(X86_TARGET, register_pass=True)
    with pytest.raises(CuvilError, match=r"winograd is an option of the x86_64-linux-gnu target only"):
        make_options(PTX_TARGET, winograd=False)
    assert make_options(PTX_TARGET, arch="sm_80") == PtxOptions(arch="sm_80")


def test_compile_takes_options_or_keywords_not_both():
    p = Pipeline.from_onnx(DEMO)
    with pytest.raises(CuvilError, match="are given both as options= and as keywords"):
        p.compile(options=X86Options(), winograd=False)
    with pytest.raises(CuvilError, match=r"options=PtxOptions\(...\) are not options of x86_64-linux-gnu"):
        p.compile(X86_TARGET, options=PtxOptions())
    with pytest.raises(CuvilError, match="unknown target"):
        p.compile("riscv64", options=X86Options())


def test_a_failed_build_leaves_no_cache_entry(tmp_path, monkeypatch):
    monkeypatch.setenv("CUVIL_CACHE_DIR", str(tmp_path))
    with pytest.raises(RuntimeError):
        with cache_entry("k1", "libx.so") as out:
            open(out, "w").close()
            raise RuntimeError("the build failed")
    assert cached_path("k1", "libx.so") is None
    assert os.listdir(tmp_path / "artifacts") == []
    with cache_entry("k2", "libx.so") as out:
        open(out, "w").close()
    assert cached_path("k2", "libx.so") == str(tmp_path / "artifacts" / "k2" / "libx.so")


def test_gpu_switches_reach_the_kernels():
    """PtxOptions.unpadded and fused_splitk (once module switches benchmarks flipped) reach the GPU schedule
    and code generator, and are part of the cache key."""
    demo = Pipeline.from_onnx(DEMO).optimize()
    padded, unpadded = demo.compile(PTX_TARGET, unpadded=False), demo.compile(PTX_TARGET)
    assert padded.path != unpadded.path and padded.manifest["kernels"] > unpadded.manifest["kernels"]
    conv = Pipeline.from_onnx(conv_relu_model((1, 256, 7, 7), (256, 256, 3, 3))).optimize()
    fused = conv.compile(options=PtxOptions(fused_splitk=True), cache=False)
    split = conv.compile(options=PtxOptions(), cache=False)
    assert fused.manifest["kernels"] == 1 and split.manifest["kernels"] == 2    # no separate sum kernel


def test_the_cache_key_covers_the_kernel_layer_and_the_passes_a_build_runs():
    """A cached library is keyed by the sources that built it: the backends, and also the kernel layer (lowering,
    scheduling, bounds) and the rewrite passes a build runs (float16, specialisation). Moving the kernel layer
    out of targets/ once left it out of the key, so an edited lowering returned stale libraries."""
    root = os.path.dirname(cuvil.__file__)
    covered = {os.path.relpath(p, root) for p in compiler_sources()}
    for sub in ("kernels", "targets", "rewrite_rules", "ir"):
        for dirpath, _, files in os.walk(os.path.join(root, sub)):
            for f in files:
                if f.endswith((".py", ".c", ".h")) and "__pycache__" not in dirpath:
                    assert os.path.relpath(os.path.join(dirpath, f), root) in covered
    assert os.path.join("kernels", "lower", "core.py") in covered
    assert os.path.join("targets", "x86", "runtime.c") in covered


def test_a_cached_library_is_not_returned_past_a_smaller_arena_limit(tmp_path, monkeypatch):
    """The arena limit is enforced while building: a library built under a larger limit (or the default) must
    not come back from the cache to a caller who set a smaller one."""
    monkeypatch.setenv("CUVIL_CACHE_DIR", str(tmp_path))
    p = Pipeline.from_onnx(DEMO).optimize()
    first = p.compile(opt_level=0, fixed={"N": 1})
    assert first.manifest["arena_bytes"] > 1
    with pytest.raises(CuvilError, match="limit"):
        p.compile(opt_level=0, fixed={"N": 1}, max_arena_bytes=1)
    assert p.compile(opt_level=0, fixed={"N": 1}).cached
