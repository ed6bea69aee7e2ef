"""Pipeline.compile / Artifact / cuvil.load / cuvil compile and run: the user-facing x86 flow."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import cuvil
from cuvil import CuvilError, Pipeline, ShapeError
from cuvil.cli import main as cli_main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "src", "cuvil", "data", "demo_cnn.onnx")


@pytest.fixture(scope="module")
def optimized():
    return Pipeline.from_onnx(DEMO).optimize()


def test_compile_save_load_in_another_process(optimized, tmp_path):
    art = optimized.compile(fixed={"N": 3})
    x = np.random.default_rng(0).standard_normal((3, 3, 16, 16)).astype(np.float32)
    want = optimized.specialize({"N": 3}).run_reference({"image": x})["probs"]
    np.testing.assert_allclose(art.run({"image": x})["probs"], want, rtol=1e-5, atol=1e-7)
    so = art.save(tmp_path / "out" / "libdemo.so")
    assert os.path.exists(tmp_path / "out" / "libdemo.h") and os.path.exists(tmp_path / "out" / "libdemo.manifest.json")
    np.save(tmp_path / "x.npy", x)
    code = (f"import numpy as np, cuvil; m = cuvil.load({so!r}); "
            f"np.save({str(tmp_path / 'y.npy')!r}, m.run(np.load({str(tmp_path / 'x.npy')!r}))[0])")
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")})
    np.testing.assert_array_equal(np.load(tmp_path / "y.npy"), art.run({"image": x})["probs"])


def test_manifest_says_what_was_built(optimized):
    m = optimized.compile(fixed={"N": 1}).manifest
    assert m["model_sha256"] and len(m["model_sha256"]) == 64
    assert m["specialized"] == {"N": 1}
    assert m["rules_applied"]["fold_conv_bn"] == {"applied": 2, "obligation": "real", "verdict": "proved"}
    assert m["target"]["triple"].startswith("x86_64") and m["target"]["cpu"]
    assert m["arena_bytes"] > 0 and m["weights_bytes"] > 0
    assert {os.path.basename(d).split(".so")[0] for d in m["dependencies"]} <= {
        "linux-vdso", "libc", "libm", "libpthread", "ld-linux-x86-64", "libdl", "librt"}


def test_compiles_are_cached(optimized):
    a = optimized.compile(fixed={"N": 1})
    b = optimized.compile(fixed={"N": 1})
    assert b.cached and b.path == a.path
    c = optimized.compile(fixed={"N": 1}, opt_level=1)
    assert c.path != a.path


def test_bad_inputs_raise_clear_errors(optimized):
    m = cuvil.load(optimized.compile(fixed={"N": 1}).path)
    with pytest.raises(ShapeError, match=r"dim 0 is 2, expected 1"):
        m.run(np.zeros((2, 3, 16, 16), np.float32))
    with pytest.raises(ShapeError):
        m.run(np.zeros((1, 3, 16, 16), np.float64))
    with pytest.raises((ShapeError, CuvilError)):
        m.run(np.zeros((1, 3, 16), np.float32))
    with pytest.raises(CuvilError, match="no such file"):
        cuvil.load("/nonexistent/libx.so")
    with pytest.raises(ShapeError, match="outside its range"):
        optimized.compile(fixed={"N": 0})
    with pytest.raises(CuvilError, match="unknown target"):
        optimized.compile(target="riscv64")


def test_cli_compile_and_run(tmp_path, capsys):
    so = tmp_path / "libcli.so"
    assert cli_main(["compile", "--input", DEMO, "--target", "x86_64-linux-gnu", "--opt-level", "O2",
                     "--output", str(so), "--prefix", "cli", "--fix", "N=2"]) == 0
    manifest = json.loads((tmp_path / "libcli.manifest.json").read_text())
    assert manifest["prefix"] == "cli" and manifest["opt_level"] == 2
    header = (tmp_path / "libcli.h").read_text()
    assert "cli_run(cuvil_session *s" in header and "cuvil_run(" not in header
    x = np.random.default_rng(1).standard_normal((2, 3, 16, 16)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    assert cli_main(["run", str(so), "--input", f"image={tmp_path / 'x.npy'}", "--output-dir", str(tmp_path / "o")]) == 0
    y = np.load(tmp_path / "o" / "probs.npy")
    np.testing.assert_allclose(y, cuvil.load(str(so)).run(x)[0])
    assert cli_main(["compile", "--input", DEMO, "--output", str(tmp_path / "bad.txt")]) == 2
    assert "libNAME.so" in capsys.readouterr().err
