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
    inode = os.stat(so).st_ino
    assert cuvil.artifact.Artifact(so, art.manifest).save(so) == so       # onto itself: left as it is
    assert os.stat(so).st_ino == inode
    np.save(tmp_path / "x.npy", x)
    code = (f"import numpy as np, cuvil; m = cuvil.load({so!r}); "
            f"np.save({str(tmp_path / 'y.npy')!r}, m.run(np.load({str(tmp_path / 'x.npy')!r}))[0])")
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")})
    np.testing.assert_array_equal(np.load(tmp_path / "y.npy"), art.run({"image": x})["probs"])


def test_manifest_says_what_was_built(optimized):
    m = optimized.compile(fixed={"N": 1}).manifest
    assert m["model_sha256"] and len(m["model_sha256"]) == 64
    assert m["specialized"] == {"N": 1}
    rec = m["rules_applied"]["fold_conv_bn"]
    assert {k: rec[k] for k in ("applied", "obligation", "verdict")} == {"applied": 2, "obligation": "real", "verdict": "proved"}
    # fold_conv_bn has an optional bias (b?): each case is proved on its own, and the coverage names both.
    cov = rec["coverage"]
    assert cov.startswith("b present: generic: ") and "; b absent: generic: " in cov
    assert "ms" not in cov and "float" in rec["dtypes"]
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


def _raw_lib(path):
    import ctypes
    lib = ctypes.CDLL(path)
    lib.cuvil_session_create.restype = ctypes.c_void_p
    lib.cuvil_session_create.argtypes = [ctypes.c_int]
    lib.cuvil_run.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    lib.cuvil_strerror.restype = ctypes.c_char_p
    lib.cuvil_last_error.restype = ctypes.c_char_p
    lib.cuvil_session_destroy.argtypes = [ctypes.c_void_p]
    return lib


def test_compiled_model_rejects_bad_tensors_without_touching_outputs(optimized):
    """Wrong dtype, rank, dims, NULL data or shape: a negative code, a message, outputs untouched."""
    import ctypes

    from cuvil.targets.x86.loader import CTensor
    lib = _raw_lib(optimized.compile(fixed={"N": 1}).path)
    s = lib.cuvil_session_create(1)
    x = np.ones((1, 3, 16, 16), np.float32)
    y = np.full((1, 10), 7.0, np.float32)
    xs, ys = (ctypes.c_int64 * 4)(1, 3, 16, 16), (ctypes.c_int64 * 2)(1, 10)

    def call(**bad):
        t_in = CTensor(x.ctypes.data, 1, 4, ctypes.cast(xs, ctypes.POINTER(ctypes.c_int64)))
        t_out = CTensor(y.ctypes.data, 1, 2, ctypes.cast(ys, ctypes.POINTER(ctypes.c_int64)))
        for k, v in bad.items():
            setattr(t_in, k, v)
        return lib.cuvil_run(s, ctypes.byref(t_in), ctypes.byref(t_out))

    wrong_dims = (ctypes.c_int64 * 4)(1, 3, 16, 15)
    for bad, detail in (({"dtype": 11}, "dtype"), ({"ndim": 3}, "ndim"), ({"data": None}, "NULL"),
                        ({"shape": ctypes.cast(wrong_dims, ctypes.POINTER(ctypes.c_int64))}, "dim 3 is 15"),
                        ({"shape": None}, "NULL")):
        rc = call(**bad)
        assert rc < 0, bad
        assert lib.cuvil_strerror(rc), rc
        assert detail in lib.cuvil_last_error().decode(), (bad, lib.cuvil_last_error())
        assert np.all(y == 7.0), f"outputs touched by a rejected call {bad}"
    assert call() == 0 and not np.all(y == 7.0)
    lib.cuvil_session_destroy(s)


def test_sessions_on_several_threads_stay_correct(optimized):
    import threading
    art = optimized.compile(fixed={"N": 1})
    rng = np.random.default_rng(5)
    xs = [rng.standard_normal((1, 3, 16, 16)).astype(np.float32) for _ in range(4)]
    want = [art.run({"image": x})["probs"] for x in xs]
    errors = []

    def worker(k):
        m = cuvil.load(art.path, num_threads=1)  # one session per thread
        for _ in range(25):
            got = m.run(xs[k])[0]
            if not np.array_equal(got, want[k]):
                errors.append(k)
    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


@pytest.mark.skipif(__import__("shutil").which("valgrind") is None or __import__("shutil").which("cc") is None,
                    reason="needs valgrind and cc")
def test_compiled_model_is_clean_under_valgrind(optimized, tmp_path):
    # valgrind decodes AVX2 but not AVX-512: the library targets an AVX2 CPU whatever the host
    art = optimized.compile(fixed={"N": 1}, cpu="haswell")
    art.save(tmp_path / "libmodel.so")
    exe = tmp_path / "run_model"
    subprocess.run(["cc", "-O1", "-g", os.path.join(ROOT, "examples", "c", "run_model.c"), f"-I{tmp_path}",
                    f"-L{tmp_path}", "-lmodel", f"-Wl,-rpath,{tmp_path}", "-o", str(exe)], check=True)
    np.random.default_rng(0).standard_normal((1, 3, 16, 16)).astype(np.float32).tofile(tmp_path / "x.bin")
    res = subprocess.run(["valgrind", "--error-exitcode=1", "--leak-check=full", "--errors-for-leak-kinds=definite",
                          str(exe), str(tmp_path / "x.bin")], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "argmax" in res.stdout


def test_artifact_model_takes_the_latest_thread_count(optimized):
    art = optimized.compile(fixed={"N": 1})
    assert art.model(num_threads=1).num_threads == 1
    m = art.model(num_threads=2)
    assert m is art.model(num_threads=2) and m.num_threads == 2
