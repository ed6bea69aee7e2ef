"""The command line's grammar (issue 27): every subcommand documented, every flag spelled and defaulted the same
way in every command, and every usage error answered with a `cuvil: error:` line and the next step (`next:`),
never a traceback. Uses the bundled demo CNN (symbolic batch N) to stay fast."""
import argparse
import os
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import cuvil
from cuvil.cli import build_parser
from cuvil.cli import main as cli_main
from cuvil.cli.flags import opt_level, resolve_target
from cuvil.targets.ptx.archs import GPU_ARCHS, check_arch
from cuvil.targets.ptx.libdevice import find_libdevice

DEMO = os.path.join(os.path.dirname(cuvil.__file__), "data", "demo_cnn.onnx")
SRC = os.path.dirname(os.path.dirname(cuvil.__file__))
BENCH_FAST = ["--runs", "3", "--warmup", "0", "--cold-runs", "0"]


def subcommands(parser, path=()):
    """(path, help line, parser) for every subcommand and sub-subcommand, found in the parser itself."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            for name, sub in action.choices.items():
                yield path + (name,), helps.get(name), sub
                yield from subcommands(sub, path + (name,))


def options(parser) -> set:
    return {s for a in parser._actions for s in a.option_strings}


def positionals(parser) -> list:
    return [a.dest for a in parser._actions if not a.option_strings and not isinstance(a, argparse._SubParsersAction)]


def errors_of(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def assert_next_step(err: str, *expected: str) -> None:
    """A CLI error: one `cuvil: error:` line, then (details and) the `next:` line naming the next step."""
    assert err.startswith("cuvil: error: "), err
    nxt = [line for line in err.splitlines() if line.startswith("  next: ")]
    assert len(nxt) == 1, err
    for text in expected:
        assert text in err, (text, err)


@pytest.fixture(scope="module")
def demo_lib(tmp_path_factory):
    """The demo CNN compiled with N fixed to 2, and .npy files of every kind `cuvil run` must refuse."""
    d = tmp_path_factory.mktemp("cli")
    lib = str(d / "libdemo.so")
    assert cli_main(["compile", DEMO, "-o", lib, "--fix", "N=2", "-q"]) == 0
    np.save(d / "good.npy", np.zeros((2, 3, 16, 16), np.float32))
    np.save(d / "f64.npy", np.zeros((2, 3, 16, 16)))
    np.save(d / "small.npy", np.zeros((2, 3, 8, 8), np.float32))
    np.zeros((2, 3, 16, 16), np.float32).tofile(d / "raw.bin")
    return lib, d


@pytest.fixture(scope="module")
def ocr_like(tmp_path_factory):
    """A one-Conv model whose input is x: [N, 3, 48, W], as the text recognisers `bench --shape x=1x3x48x320`
    was documented for."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 48, "W"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    w = numpy_helper.from_array(np.ones((4, 3, 3, 3), np.float32), "w")
    g = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1])], "ocr", [x], [y], [w])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    path = str(tmp_path_factory.mktemp("ocr") / "ocr.onnx")
    onnx.save(m, path)
    return path


# -- every subcommand documented --------------------------------------------------------------------------

def test_every_subcommand_has_a_help_line_and_a_description(capsys):
    found = list(subcommands(build_parser()))
    names = {" ".join(path) for path, _, _ in found}
    assert {"inspect", "demo", "zoo", "rules", "rules check", "rules list", "compile", "run", "verify", "ops",
            "bench"} <= names
    for path, help_line, sub in found:
        assert help_line and len(help_line) > 15, path
        assert sub.description and len(sub.description) > 40, path
        with pytest.raises(SystemExit) as e:
            cli_main([*path, "--help"])
        assert e.value.code == 0
        out = capsys.readouterr().out
        assert " ".join(sub.description.split()[:4]) in " ".join(out.split()), path


def test_a_command_without_its_action_shows_its_actions(capsys):
    # rules, precision and lora do their work in actions (flags.add_actions): alone, each prints its help, which
    # names the actions, and exits 2, as `cuvil` alone does
    for command, actions in (("rules", ["check", "list"]), ("precision", ["report"]), ("lora", ["check"])):
        assert cli_main([command]) == 2
        out = capsys.readouterr().out
        assert f"usage: cuvil {command} [-h] ACTION" in out and all(a in out for a in actions), out


def test_every_command_is_quiet_with_q_and_every_model_command_takes_the_shape_flags():
    for path, _, sub in subcommands(build_parser()):
        if any(isinstance(a, argparse._SubParsersAction) for a in sub._actions):
            continue   # `rules` itself only chooses check or list
        assert {"-q", "--quiet"} <= options(sub), path
        if "model" in positionals(sub):
            assert {"--input-shape", "--fix", "--shape-profile"} <= options(sub), path
        if "--opt-level" in options(sub):
            assert "-O" in options(sub), path


# -- one spelling, one meaning ----------------------------------------------------------------------------

def test_compile_takes_the_model_positionally_or_by_input_and_o_or_output(tmp_path, capsys):
    a, b = str(tmp_path / "a" / "liba.so"), str(tmp_path / "b" / "libb.so")
    assert cli_main(["compile", DEMO, "-o", a, "--fix", "N=2", "-q"]) == 0
    assert cli_main(["compile", "--input", DEMO, "--output", b, "--fix", "N=2", "-q"]) == 0
    out = capsys.readouterr().out
    assert f"wrote {a}" in out and f"wrote {b}" in out
    assert open(a, "rb").read() == open(b, "rb").read()


@pytest.mark.parametrize("text,level", [("O0", 0), ("o1", 1), ("2", 2), ("O3", 3), ("3", 3)])
def test_opt_level_takes_O3_and_3(text, level):
    assert opt_level(text) == level


def test_dash_O3_and_opt_level_3_compile_alike(tmp_path, capsys):
    for k, flags in enumerate((["-O3"], ["--opt-level", "3"], ["--opt-level", "O3"], ["-O", "3"])):
        assert cli_main(["compile", DEMO, "-o", str(tmp_path / f"{k}" / "libd.so"), "--fix", "N=2", "-q", *flags]) == 0
    libs = [open(tmp_path / f"{k}" / "libd.so", "rb").read() for k in range(4)]
    assert all(lib == libs[0] for lib in libs)
    capsys.readouterr()


def test_threads_means_all_cores_by_default_in_run_bench_and_verify():
    p = build_parser()
    run = p.parse_args(["run", "lib.so"])
    verify = p.parse_args(["verify", DEMO])
    assert run.threads == verify.threads == 0
    bench = p.parse_args(["bench", DEMO])
    assert bench.threads is None   # None: the config's threads, else 0 (below, the report shows all cores)
    helps = {name: next(a.help for a in p._subparsers._group_actions[0].choices[name]._actions
                        if a.dest == "threads") for name in ("run", "verify", "bench")}
    assert all("default 0 = all cores" in h for h in helps.values()), helps


def test_bench_defaults_to_all_cores_and_accepts_O3_and_3(capsys):
    assert cli_main(["bench", DEMO, *BENCH_FAST, "-O", "3", "-q"]) == 0
    out = capsys.readouterr().out
    assert f"settings   {len(os.sched_getaffinity(0))} thread(s)" in out
    assert cli_main(["bench", DEMO, *BENCH_FAST, "--opt-level", "O3", "-q"]) == 0
    capsys.readouterr()


def test_bench_shape_alias_works_for_an_onnx(ocr_like, capsys):
    assert cli_main(["bench", ocr_like, "--shape", "x=1x3x48x320", *BENCH_FAST, "-q"]) == 0
    assert "inputs     x: float32[1, 3, 48, 320]" in capsys.readouterr().out
    # NAME=DIM is --fix, INPUT=DIMS is --input-shape: the same library and shape either way
    assert cli_main(["bench", ocr_like, "--shape", "N=1", "--shape", "W=320", *BENCH_FAST, "-q"]) == 0
    assert "inputs     x: float32[1, 3, 48, 320]" in capsys.readouterr().out
    assert cli_main(["bench", ocr_like, "--fix", "N=1", "--fix", "W=320", *BENCH_FAST, "-q"]) == 0
    assert "inputs     x: float32[1, 3, 48, 320]" in capsys.readouterr().out
    assert cli_main(["bench", ocr_like, "--fix", "N=1", "--shape-profile", "W=32:320:640", *BENCH_FAST, "-q"]) == 0
    assert "inputs     x: float32[1, 3, 48, 320]" in capsys.readouterr().out


def test_bench_errors_spell_the_flag_the_user_gave(demo_lib, capsys):
    lib, _ = demo_lib
    for flag in ("--shape", "--input-shape"):
        assert cli_main(["bench", lib, flag, "image=2x3x8x8", *BENCH_FAST]) == 2
        assert_next_step(errors_of(capsys), f"{flag} image=2x3x8x8 does not fit the library's input image",
                         "next: --input-shape image=2x3x16x16")
    for flag in ("--shape", "--fix"):
        assert cli_main(["bench", DEMO, flag, "M=3", *BENCH_FAST]) == 2
        assert f"{flag} M=3: the model has no symbol 'M'" in errors_of(capsys)
    assert cli_main(["bench", lib, "--shape-profile", "N=1:2:4", *BENCH_FAST]) == 2
    assert_next_step(errors_of(capsys), "a compiled library's profile was set when it was compiled",
                     "next: give one size to time: --fix N=SIZE, or bench the .onnx with --shape-profile")


def test_inspect_and_verify_take_the_shape_flags(demo_lib, capsys):
    assert cli_main(["inspect", DEMO, "--fix", "N=2"]) == 0
    assert "fixed  N = 2" in capsys.readouterr().out
    assert cli_main(["inspect", DEMO, "--input-shape", "image=4x3x16x16"]) == 0
    assert "fixed  N = 4" in capsys.readouterr().out
    assert cli_main(["inspect", DEMO, "--shape-profile", "N=1:8:64"]) == 0
    assert "symbol N in [1, 64], opt 8" in capsys.readouterr().out
    lib, _ = demo_lib
    assert cli_main(["verify", DEMO, "--fix", "N=2", "--artifact", lib, "--examples", "2", "--threads", "1"]) == 0
    assert "verify passed" in capsys.readouterr().out


def test_quiet_wins_over_progress_and_progress_shows_without_a_terminal(tmp_path, capsys):
    lib = str(tmp_path / "libd.so")
    assert cli_main(["compile", DEMO, "-o", lib, "--fix", "N=2", "--progress"]) == 0
    assert capsys.readouterr().err.strip()   # what the progress shows is the progress module's business
    assert cli_main(["compile", DEMO, "-o", lib, "--fix", "N=2", "--progress", "-q"]) == 0
    assert capsys.readouterr().err == ""
    assert cli_main(["compile", DEMO, "-o", lib, "--fix", "N=2"]) == 0   # stderr is no terminal here
    assert capsys.readouterr().err == ""
    assert cli_main(["bench", lib, *BENCH_FAST, "--progress"]) == 0
    assert capsys.readouterr().err.strip()
    assert cli_main(["bench", DEMO, *BENCH_FAST, "--progress", "-q"]) == 0
    assert capsys.readouterr().err == ""


def test_target_aliases():
    assert resolve_target("x86_64") == resolve_target("x86_64-linux-gnu") == "x86_64-linux-gnu"
    assert resolve_target("cuda") == resolve_target("nvptx64-nvidia-cuda") == "nvptx64-nvidia-cuda"
    assert check_arch("sm_90") == "sm_90" and "sm_80" in GPU_ARCHS and "sm_90a" in GPU_ARCHS


# -- errors: one line, then the next step ----------------------------------------------------------------

@pytest.mark.parametrize("argv,expected", [
    (["compile", DEMO, "--input", DEMO, "-o", "x.so"], ["the model is given twice", f"next: give it once: cuvil compile {DEMO} -o OUT"]),
    (["compile", "-o", "x.so"], ["no model to compile", "next: cuvil compile MODEL.onnx -o DIR/libNAME.so"]),
    (["compile", DEMO], ["no output named", "next: cuvil compile", "-o build/libdemo_cnn.so"]),
    (["compile", DEMO, "-o", "x.so", "-O", "4"], ["unknown optimisation level '4'", "next: -O3"]),
    (["compile", DEMO, "-o", "m.onnx"], ["--output must name DIR/libNAME.so", "next: -o libm.so"]),
    (["compile", DEMO, "-o", "m.so", "--target", "cuda"], ["DIR/NAME.cuvil", "next: -o m.cuvil"]),
    (["compile", DEMO, "-o", "m.so", "--arch", "sm_90"], ["--arch applies to --target nvptx64-nvidia-cuda only",
                                                         "next: drop --arch"]),
    (["compile", DEMO, "-o", "m.so", "--no-fma"], ["--no-fma applies to", "next: drop --no-fma"]),
    (["zoo", "resnet", "-o", "r.onnx"], ["unknown model 'resnet'", "next: cuvil zoo resnet50 -o r.onnx"]),
    (["zoo", "squeezenet"], ["no output file named", "next: cuvil zoo squeezenet -o squeezenet.onnx"]),
    (["bench", DEMO, "--threads", "-1"], ["--threads must be >= 0", "next: --threads 0 (all cores)"]),
    (["bench", DEMO, "--runs", "3", "--duration", "1s"], ["not both", "next: drop one"]),
    (["verify", DEMO, "--examples", "0"], ["at least one example", "next: --examples 50"]),
    # a bad --cpu, and malformed shape flags, are refused before the model is read (it does not exist here)
    (["compile", "nope.onnx", "-o", "x.so", "--cpu", "zen5"], ["unknown CPU 'zen5' (--cpu)", "znver5", "next: --cpu "]),
    (["compile", "nope.onnx", "-o", "x.so", "--fix", "N"], ["--fix takes NAME=INT", "next: --fix N=8"]),
    (["inspect", "nope.onnx", "--shape-profile", "N=1:x"], ["--shape-profile takes NAME=MIN:OPT:MAX",
                                                           "next: --shape-profile N=1:8:64"]),
    (["inspect", "nope.onnx", "--shape-profile", "N=8:1:4"], ["need 1 <= MIN <= OPT <= MAX",
                                                             "next: --shape-profile N=1:1:8"]),
    (["verify", "nope.onnx", "--input-shape", "x=1x2:3"], ["--input-shape takes INPUT=D0xD1x",
                                                          "next: --input-shape x=1x3x640x640 (one shape)"]),
    (["bench", "nope.onnx", "--input-shape", "x=1x2", "--input-shape", "x=1x2"], ["the input is given twice",
                                                                                 "next: give --input-shape x=... once"]),
    (["verify", DEMO, "--artifact", "nowhere/libm.so"], ["nowhere/libm.so: no such file",
                                                         f"next: compile it first: cuvil compile {DEMO} -o nowhere/libm.so"]),
])
def test_usage_errors_name_the_next_step(argv, expected, capsys):
    assert cli_main(argv) == 2
    assert_next_step(errors_of(capsys), *expected)


@pytest.mark.parametrize("target,nearest", [("aarch64-linux-gnu", "x86_64-linux-gnu"),
                                            ("cuda-sm90", "nvptx64-nvidia-cuda")])
def test_an_unknown_target_is_refused_before_the_model_is_read(target, nearest, tmp_path, capsys):
    missing = str(tmp_path / "missing.onnx")
    rc = cli_main(["compile", missing, "-o", str(tmp_path / "libm.so"), "--target", target])
    err = errors_of(capsys)
    assert rc == 2 and "missing.onnx" not in err
    assert_next_step(err, f"unknown target {target!r}", f"next: --target {nearest}")


@pytest.mark.parametrize("arch,hint", [("sm_1000", "--arch sm_100"), ("hopper", "--arch sm_90"),
                                       ("sm_60", "--arch sm_70"), ("sm90", "--arch sm_90")])
def test_an_unknown_gpu_arch_is_refused_before_the_model_is_read(arch, hint, tmp_path, capsys):
    rc = cli_main(["compile", str(tmp_path / "missing.onnx"), "-o", str(tmp_path / "m.cuvil"), "--target",
                   "nvptx64-nvidia-cuda", "--arch", arch])
    err = errors_of(capsys)
    assert rc == 2 and "missing.onnx" not in err
    assert_next_step(err, f"unknown GPU architecture {arch!r}", f"next: {hint}")


def test_run_errors_name_the_next_step(demo_lib, capsys):
    lib, d = demo_lib
    cases = [
        ([str(d / "nolib.so")], ["nolib.so: no such file", "next: compile one first: cuvil compile MODEL.onnx -o"]),
        (["--input", f"image={d / 'missing.npy'}"], ["no such file", "next: write it with numpy.save(",
                                                    "or --input-shape image=2x3x16x16"]),
        (["--input", f"image={d / 'raw.bin'}"], ["not a .npy file", "next: python3 -c \"import numpy; numpy.save(",
                                                "numpy.fromfile(", "numpy.float32).reshape(2, 3, 16, 16)"]),
        (["--input", f"x={d / 'good.npy'}"], ["has no input 'x'", "inputs: image float32[2x3x16x16]",
                                              f"next: --input image={d / 'good.npy'}"]),
        (["--input", f"image={d / 'f64.npy'}"], ["the array is float64, input 'image' is float32",
                                                 "next: convert it:", ".astype(numpy.float32)"]),
        (["--input", f"image={d / 'small.npy'}"], ["the array's shape is 2x3x8x8, input 'image' is 2x3x16x16",
                                                   "next: save an array of shape 2x3x16x16"]),
        (["--input", "image"], ["--input takes NAME=FILE.npy", "next: --input image=FILE.npy"]),
        ([], ["input 'image' is not given", "next: --input image=FILE.npy, or --input-shape image=2x3x16x16"]),
        (["--input-shape", "x=2x3x16x16"], ["has no input 'x'", "next: --input-shape image=2x3x16x16"]),
        (["--input-shape", "image=1x3x16x16:2x3x16x16:4x3x16x16"], ["one shape per input",
                                                                   "next: --input-shape image=2x3x16x16"]),
    ]
    for extra, expected in cases:
        argv = ["run", *(extra if extra[:1] == [str(d / "nolib.so")] else [lib, *extra])]
        assert cli_main(argv) == 2, argv
        assert_next_step(errors_of(capsys), *expected)
    assert cli_main(["run", lib, "--input", f"image={d / 'good.npy'}"]) == 0
    assert capsys.readouterr().out.startswith("probs: float32[2, 10] = ")


def test_run_names_a_symbolic_dim_and_offers_a_shape_the_library_serves(tmp_path, capsys):
    lib = str(tmp_path / "libdyn.so")
    assert cli_main(["compile", DEMO, "-o", lib, "--shape-profile", "N=1:3:8", "-q"]) == 0
    capsys.readouterr()
    assert cli_main(["run", lib]) == 2
    assert_next_step(errors_of(capsys), "inputs: image float32[Nx3x16x16]", "next: --input image=FILE.npy, or "
                     "--input-shape image=3x3x16x16")
    np.save(tmp_path / "small.npy", np.zeros((2, 3, 8, 8), np.float32))
    assert cli_main(["run", lib, "--input", f"image={tmp_path / 'small.npy'}"]) == 2
    assert_next_step(errors_of(capsys), "input 'image' is Nx3x16x16", "next: save an array of shape 3x3x16x16")
    assert cli_main(["run", lib, "--input-shape", "image=9x3x16x16"]) == 2   # the model checks the profile
    assert_next_step(errors_of(capsys), "outside the profile N in [1, 8]", "next: ")
    assert cli_main(["run", lib, "--input-shape", "image=5x3x16x16"]) == 0
    assert capsys.readouterr().out.startswith("probs: float32[5, 10] = ")


def test_run_takes_a_gpu_bundle_through_cuvil_load(tmp_path, capsys):
    if find_libdevice() is None:
        pytest.skip("libdevice.10.bc not found: no GPU bundle can be compiled here")
    bundle = str(tmp_path / "demo.cuvil")
    assert cli_main(["compile", DEMO, "-o", bundle, "--target", "cuda", "--fix", "N=2", "-q"]) == 0
    capsys.readouterr()
    rc = cli_main(["run", bundle, "--input-shape", "image=2x3x16x16"])
    if rc == 0:   # a machine with a GPU: the same interface and output as the x86 library
        assert capsys.readouterr().out.startswith("probs: float32[2, 10] = ")
    else:
        assert rc == 2
        assert_next_step(errors_of(capsys), f"{bundle}: no CUDA driver/GPU", "next: run the bundle where an NVIDIA GPU",
                         "cuvil compile MODEL -o build/libNAME.so")


def test_a_closed_pipe_ends_quietly():
    """`cuvil ops | head`: the reader is gone before cuvil writes; no traceback, the exit status of SIGPIPE."""
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.Popen([sys.executable, "-m", "cuvil", "ops"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env=env)
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait() == 141 and err == "", err


def test_review_model_file_errors_name_the_next_step(tmp_path, capsys):
    """A directory, an empty file or a bundle-less directory: each one `cuvil: error:` line with a next step
    (a directory was reported as "no such file", an empty file sent the user to onnx's checker, a directory
    given to `cuvil run` had no next step, and `cuvil run MODEL.onnx` ended in dlopen's "invalid ELF header")."""
    (tmp_path / "adir").mkdir()
    (tmp_path / "empty.onnx").write_bytes(b"")
    cases = [
        (["inspect", str(tmp_path / "adir")], ["adir: a directory, not a model file", "next: give the .onnx file inside it"]),
        (["inspect", str(tmp_path / "empty.onnx")], ["empty.onnx: an empty file, not an ONNX model", "next: write the model again"]),
        (["run", str(tmp_path / "adir")], ["not a complete GPU bundle", "next: write the bundle again: cuvil compile MODEL.onnx "
                                           "--target nvptx64-nvidia-cuda"]),
        (["run", DEMO], ["a model, not a compiled one", f"next: cuvil compile {DEMO} -o build/libdemo_cnn.so"]),
        (["run", str(tmp_path / "m.cuvil")], ["m.cuvil: no such file", "-o " + str(tmp_path / "m.cuvil") +
                                              " --target nvptx64-nvidia-cuda"]),
        (["compile", DEMO, "-o", str(tmp_path / "m.cuvil")], ["--output must name DIR/libNAME.so",
                                                              "add --target nvptx64-nvidia-cuda for a GPU bundle"]),
    ]
    for argv, expected in cases:
        assert cli_main(argv) == 2, argv
        err = errors_of(capsys)
        assert "Traceback" not in err
        assert_next_step(err, *expected)


def test_review_rule_file_errors_name_the_next_step(tmp_path, capsys):
    """A rule syntax error keeps file:line:col and gains a next step; a missing rule file no longer claims a
    position 0:0."""
    bad = tmp_path / "bad.rule"
    bad.write_text("rule r benefit 1\n  Relu(Relu(x) =>\n")
    assert cli_main(["rules", "check", str(bad)]) == 2
    assert_next_step(errors_of(capsys), "bad.rule:2:16: unexpected '=>'", "next: fix the rule there (docs/rules.md")
    assert cli_main(["rules", "check", str(tmp_path / "missing.rule")]) == 2
    err = errors_of(capsys)
    assert ":0:0" not in err
    assert_next_step(err, "missing.rule: no such rule file or directory", "next: give .rule files or folders of them")


def test_review_verify_refuses_a_library_of_another_model_at_once(demo_lib, tmp_path, capsys):
    """`cuvil verify OTHER.onnx --artifact LIB` ran the reference for minutes, silently, before failing; the
    libraries' inputs are compared first."""
    lib, _ = demo_lib
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])
    other = str(tmp_path / "other.onnx")
    onnx.save(helper.make_model(helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y]),
                                opset_imports=[helper.make_opsetid("", 17)]), other)
    assert cli_main(["verify", other, "--artifact", lib, "--examples", "1", "-q"]) == 2
    assert_next_step(errors_of(capsys), "its inputs do not match the model's", "library: image (rank 4)",
                     "model: x (rank 2)", f"next: compile it from this model (cuvil compile {other} -o {lib})")


def test_review_a_library_without_its_manifest_names_a_step_the_cli_can_take(tmp_path, capsys):
    """`cuvil run` on a library whose symbols have another prefix advised `prefix=`, which no CLI flag takes."""
    lib = tmp_path / "libp.so"
    assert cli_main(["compile", DEMO, "-o", str(lib), "--fix", "N=1", "--prefix", "foo", "-q"]) == 0
    capsys.readouterr()
    (tmp_path / "libp.manifest.json").unlink()
    assert cli_main(["run", str(lib), "--input-shape", "image=1x3x16x16"]) == 2
    assert_next_step(errors_of(capsys), "no symbol cuvil_num_inputs", "keep that file there",
                     "cuvil compile MODEL.onnx -o libNAME.so")


def test_review_fix_with_a_non_integer_value_suggests_an_integer(tmp_path, capsys):
    """`--fix N=abc` (NAME=OTHER: make two symbols one) advised naming a symbol; the value is the mistake."""
    assert cli_main(["compile", DEMO, "-o", str(tmp_path / "libx.so"), "--fix", "N=abc"]) == 2
    assert_next_step(errors_of(capsys), "--fix N=abc: the model has no symbol 'abc'",
                     "next: --fix N=8 (an integer), or --fix N=OTHER")


@pytest.mark.parametrize("argv,expected", [
    (["bench"], "cuvil bench: the following arguments are required: MODEL"),
    (["run", "lib.so", "--threads", "abc"], "cuvil run: argument --threads: invalid int value: 'abc'"),
    (["nosuch"], "cuvil: argument COMMAND: invalid choice: 'nosuch'"),
])
def test_usage_errors_read_like_every_other_error(argv, expected, capsys):
    # argparse's own refusals: the usage line, then the `cuvil: error:` line and this command's help as next step
    with pytest.raises(SystemExit) as e:
        cli_main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: "), err
    line = next(ln for ln in err.splitlines() if ln.startswith("cuvil: error: "))
    assert expected in line, err
    assert err.rstrip().endswith("--help lists its arguments"), err
