"""Progress on long work (cuvil.progress): silent unless asked for, on stderr only, each compile stage and the
LLVM IR kernel by kernel when on; the CLI shows it with --progress (or on a terminal) and never with -q."""
import io
import os
import re
import threading

from cuvil import Pipeline, progress
from cuvil.cli import main as cli_main

DEMO = os.path.join(os.path.dirname(__file__), "..", "src", "cuvil", "data", "demo_cnn.onnx")


def test_library_is_silent_by_default(capfd):
    p = Pipeline.from_onnx(DEMO).optimize()
    p.compile(cache=False, fixed={"N": 1})
    out, err = capfd.readouterr()
    assert out == "" and err == ""


def test_compile_reports_each_stage_and_each_kernel_on_stderr_only(capfd):
    with progress.enabled():
        p = Pipeline.from_onnx(DEMO).optimize()
    art = p.compile(cache=False, fixed={"N": 1}, progress=True)   # per call, outside the block
    out, err = capfd.readouterr()
    assert out == ""
    n = art.manifest["kernels"]
    for name in ("import: demo_cnn.onnx, 18 nodes", "optimize: 18 -> 14 nodes", f"schedule: {n} kernels",
                 f"memory safety: {n}/{n} kernels proved in bounds", "link: libcuvil.so"):
        assert name in err, name
    # the LLVM IR, then LLVM's optimisation and code generation, each kernel by kernel
    kernels = re.findall(r"llvm IR: (\d+)/\d+ kernels, (cuvil_kernel\d+): ", err)
    assert [int(k) for k, _ in kernels] == list(range(1, n + 1))
    assert {sym for _, sym in kernels} == {f"cuvil_kernel{i}" for i in range(n)}
    steps = [s["stage"] for s in art.manifest["steps"]]
    emitted = re.findall(r"llvm: (\d+)/(\d+) kernels, (cuvil_\w+): ", err)
    assert [int(k) for k, _, _ in emitted] == list(range(1, len(steps) + 1))
    assert {int(total) for _, total, _ in emitted} == {len(steps)}


def test_enabled_is_context_local_and_can_be_switched_off():
    sink = io.StringIO()
    heard = []
    with progress.enabled(stream=sink):
        with progress.stage("outer"):
            pass
        with progress.enabled(False):
            assert not progress.is_enabled()
            with progress.stage("hidden"):
                pass
        t = threading.Thread(target=lambda: heard.append(progress.is_enabled()))
        t.start()
        t.join()
    assert not progress.is_enabled()
    assert heard == [False]   # a thread that did not opt in stays quiet
    assert "outer" in sink.getvalue() and "hidden" not in sink.getvalue()


def test_bars_and_lines():
    bars, lines = io.StringIO(), io.StringIO()
    for sink, as_bars in ((bars, True), (lines, False)):
        with progress.enabled(stream=sink, bars=as_bars):
            for _ in progress.track(range(3), "steps", unit="items", item=lambda i: f"item{i}"):
                pass
            with progress.stage("figures", total=2, unit="examples") as s:
                s.advance()
                s.show(max_error="1e-07")
                s.advance()
    assert "steps: 100%" in bars.getvalue() and "3/3 items" in bars.getvalue()
    assert "max error 1e-07" in bars.getvalue()
    text = lines.getvalue()
    assert "steps: 1/3 items, item0" in text and "steps: 3/3 items, item2" in text
    assert re.search(r"figures: 2/2 examples in [\d.]+ s, max error 1e-07", text)


def test_cli_wants_progress_on_a_terminal_or_when_forced_never_when_quiet():
    class Tty(io.StringIO):
        def isatty(self):
            return True
    assert progress.wanted(stream=Tty()) and not progress.wanted(stream=io.StringIO())
    assert progress.wanted(forced=True, stream=io.StringIO())
    assert not progress.wanted(quiet=True, forced=True, stream=Tty())


def test_cli_verify_progress_and_quiet(capfd):
    assert cli_main(["verify", DEMO, "--examples", "3", "--progress"]) == 0
    out, err = capfd.readouterr()
    assert "verify: optimized vs original" in err and "3/3 examples" in err and "max error" in err
    assert "verify:" not in out and "largest error: " in out
    assert cli_main(["verify", DEMO, "--examples", "3", "-q", "--progress"]) == 0
    out, err = capfd.readouterr()
    assert err == "" and "largest error: " in out
    assert cli_main(["verify", DEMO, "--examples", "3"]) == 0   # stderr is not a terminal here
    assert capfd.readouterr().err == ""


def test_cli_compile_progress_and_quiet(tmp_path, capfd):
    so = str(tmp_path / "libdemo.so")
    assert cli_main(["compile", DEMO, "-o", so, "--fix", "N=1", "--progress"]) == 0
    out, err = capfd.readouterr()
    assert "import: demo_cnn.onnx" in err and "optimize:" in err
    assert "import:" not in out and "wrote " in out
    assert cli_main(["compile", DEMO, "-o", so, "--fix", "N=1", "-q"]) == 0
    out, err = capfd.readouterr()
    assert err == "" and "wrote " in out


def test_llvm_parts_copy_internal_helpers_and_refuse_external_ones():
    """The x86 LLVM stage emits one object per kernel: a helper function two kernels call is copied into both
    (internal), an external one could not be and is refused rather than defined twice."""
    import llvmlite.ir as ir
    import pytest
    from cuvil.errors import CuvilError
    from cuvil.targets.llvm.types import I64, PTR
    from cuvil.targets.x86.codegen import KernelModule, host_target
    tm, triple, _ = host_target(None, 2)
    km = KernelModule("t", tm, triple)
    helper = ir.Function(km.module, ir.FunctionType(I64, [I64]), name="helper")
    helper.linkage = "internal"
    b = ir.IRBuilder(helper.append_basic_block())
    b.ret(b.add(helper.args[0], I64(1)))
    for k in range(2):
        fn = km.function(f"k{k}", [PTR, I64, I64])
        b = ir.IRBuilder(fn.append_basic_block())
        b.call(helper, [fn.args[1]])
        b.ret_void()
    done = []
    assert len(km.compile_parts(2, [("k0", {"k0"}), ("k1", {"k1"})], done.append)) == 2 and done == ["k0", "k1"]
    helper.linkage = ""
    with pytest.raises(CuvilError, match="helper"):
        km.compile_parts(2, [("k0", {"k0"}), ("k1", {"k1"})])
