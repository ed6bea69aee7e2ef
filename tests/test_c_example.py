"""examples/c/run_model.c builds with cc against a compiled model's header and library, and prints what
Python gets from the same library."""
import os
import shutil
import subprocess

import numpy as np
import pytest

from cuvil import Pipeline

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "src", "cuvil", "data", "demo_cnn.onnx")


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
def test_c_example_runs_a_compiled_model(tmp_path):
    art = Pipeline.from_onnx(DEMO).optimize().compile(fixed={"N": 1})
    art.save(tmp_path / "libmodel.so")
    exe = tmp_path / "run_model"
    subprocess.run(["cc", "-O2", "-Wall", "-Werror", os.path.join(ROOT, "examples", "c", "run_model.c"), f"-I{tmp_path}",
                    f"-L{tmp_path}", "-lmodel", f"-Wl,-rpath,{tmp_path}", "-o", str(exe)], check=True)
    x = np.random.default_rng(3).standard_normal((1, 3, 16, 16)).astype(np.float32)
    x.tofile(tmp_path / "image.bin")
    res = subprocess.run([str(exe), str(tmp_path / "image.bin")], capture_output=True, text=True, check=True)
    line = res.stdout.strip().splitlines()[0]
    assert line.startswith("probs shape [1,10] argmax ")
    want = art.run({"image": x})["probs"].reshape(-1)
    assert int(line.split("argmax ")[1].split()[0]) == int(np.argmax(want))
    printed = np.array([float(v) for v in line.split("values ")[1].split()])
    np.testing.assert_allclose(printed, want[:10], rtol=1e-5)
    bad = subprocess.run([str(exe)], capture_output=True, text=True)
    assert bad.returncode == 2 and "usage" in bad.stderr
