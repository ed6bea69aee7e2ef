"""cuvil.testing.warm_cli (the docs walk's `cuvil`): a command run by a fork of the warm server prints the same
streams and exits with the same status as a fresh `python -m cuvil`, and where a fork could differ (a start-up
variable such as PYTHONHASHSEED, a server that is gone) it is a fresh process."""
import os
import subprocess
import sys

import pytest

from cuvil.testing.warm_cli import WarmCli
from cuvil.version import __version__

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "src", "cuvil", "data", "demo_cnn.onnx")


@pytest.fixture(scope="module")
def shell(tmp_path_factory):
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"))
    warm = WarmCli(env)
    bin_dir = str(tmp_path_factory.mktemp("bin"))
    warm.write_client(bin_dir, sys.executable)

    def run(script, stdout=subprocess.PIPE, **extra):
        return subprocess.run(["bash", "-e", "-o", "pipefail", "-c", script], stdout=stdout, stderr=subprocess.PIPE,
                              text=True, cwd=str(tmp_path_factory.getbasetemp()),
                              env=dict(env, PATH=bin_dir + os.pathsep + env["PATH"], **extra))
    run.warm = warm
    yield run
    warm.close()


def _fresh(args, stdout=subprocess.PIPE, **extra):
    return subprocess.run([sys.executable, "-m", "cuvil", *args], stdout=stdout, stderr=subprocess.PIPE, text=True,
                          env=dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"), **extra))


def test_streams_and_status_are_those_of_a_fresh_process(shell):
    for args in (["inspect", DEMO], ["compile", "missing.onnx", "-o", "x.so"], ["frobnicate"]):
        warm, fresh = shell("cuvil " + " ".join(args)), _fresh(args)
        assert (warm.returncode, warm.stdout, warm.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr), args
    assert shell("cuvil frobnicate").returncode == 2


def test_the_commands_directory_input_and_environment_are_its_own(shell, tmp_path):
    (tmp_path / "sub").mkdir()
    out = shell(f"cd {tmp_path}/sub && CUVIL_CACHE_DIR={tmp_path}/c cuvil doctor | grep -F 'CUVIL_CACHE_DIR'")
    assert out.returncode == 0 and f"{tmp_path}/c" in out.stdout, out.stdout + out.stderr
    # a reader that has gone: the command ends quietly with SIGPIPE's status, as a fresh one does. The pipe's
    # read end is closed before the command starts, so its first write fails; `cuvil ops | head -1` raced
    # (its ~13 kB fit in the pipe's buffer before head closed it, and then the status was 0)
    for out in (_with_reader_gone(lambda w: shell("cuvil ops", stdout=w)),
                _with_reader_gone(lambda w: _fresh(["ops"], stdout=w))):
        assert out.returncode in (141, -13) and out.stderr == "", (out.returncode, out.stderr)
    out = shell("cuvil ops | head -1")          # a reader that stops early: whichever side wins, no noise
    assert out.returncode in (0, 141) and out.stdout.startswith("op ") and out.stderr == ""


def _with_reader_gone(run):
    r, w = os.pipe()
    os.close(r)
    try:
        return run(w)
    finally:
        os.close(w)


def test_a_start_up_variable_or_a_missing_server_gives_a_fresh_process(shell, tmp_path_factory):
    before = shell.warm.served().count("served: cuvil --version\n")
    assert shell("cuvil --version").returncode == 0
    assert shell.warm.served().count("served: cuvil --version\n") == before + 1
    log = shell.warm.served()
    out = shell("cuvil inspect " + DEMO, PYTHONHASHSEED="7")       # read by the interpreter at start-up
    assert out.returncode == 0 and "demo_cnn" in out.stdout + out.stderr
    assert shell.warm.served() == log


def test_without_its_server_the_client_runs_the_command_afresh(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"))
    warm = WarmCli(env)
    warm.write_client(str(tmp_path), sys.executable)
    warm.close()
    out = subprocess.run([os.path.join(str(tmp_path), "cuvil"), "--version"], capture_output=True, text=True, env=env)
    assert (out.returncode, out.stdout) == (0, f"cuvil {__version__}\n")
