"""examples/c/run_model.c builds with cc against a compiled model's header and library, prints what Python
gets from the same library, and checks each input file's format and size: a .npy's dtype, order and shape,
raw data's exact size; bad input is refused with a message naming the file and exit status 2."""
import os
import shutil
import subprocess

import numpy as np
import pytest

from cuvil import Pipeline

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "src", "cuvil", "data", "demo_cnn.onnx")
SOURCE = os.path.join(ROOT, "examples", "c", "run_model.c")

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")


def build(folder, art, name):
    art.save(folder / f"lib{name}.so")
    exe = folder / f"run_{name}"
    subprocess.run(["cc", "-O2", "-Wall", "-Werror", SOURCE, f"-DMODEL_HEADER=\"lib{name}.h\"", f"-I{folder}",
                    f"-L{folder}", f"-l{name}", f"-Wl,-rpath,{folder}", "-o", str(exe)], check=True)
    return exe


@pytest.fixture(scope="module")
def static(tmp_path_factory):
    """run_model against the demo CNN specialised to N = 1 (input image [1, 3, 16, 16] float32)."""
    folder = tmp_path_factory.mktemp("c_static")
    art = Pipeline.from_onnx(DEMO).optimize().compile(fixed={"N": 1})
    return folder, art, build(folder, art, "model")


@pytest.fixture(scope="module")
def dynamic(tmp_path_factory):
    """The demo CNN with its batch N symbolic, N in [1, 4] (input image [-1, 3, 16, 16])."""
    folder = tmp_path_factory.mktemp("c_dynamic")
    art = Pipeline.from_onnx(DEMO).optimize().compile(shape_profiles={"N": (1, 2, 4)})
    return folder, art, build(folder, art, "dyn")


def run(exe, *files):
    return subprocess.run([str(exe), *map(str, files)], capture_output=True, text=True)


def check_printed(res, art, x):
    assert res.returncode == 0, res.stderr
    line = res.stdout.strip().splitlines()[0]
    assert line.startswith(f"probs shape [{x.shape[0]},10] argmax ")
    want = art.run({"image": x})["probs"].reshape(-1)
    assert int(line.split("argmax ")[1].split()[0]) == int(np.argmax(want))
    printed = np.array([float(v) for v in line.split("values ")[1].split()])
    np.testing.assert_allclose(printed, want[:10], rtol=1e-5)


def image(n=1, seed=3):
    return np.random.default_rng(seed).standard_normal((n, 3, 16, 16)).astype(np.float32)


def test_npy_input(static):
    folder, art, exe = static
    x = image()
    np.save(folder / "x.npy", x)
    check_printed(run(exe, folder / "x.npy"), art, x)


def test_raw_float32_input(static):
    folder, art, exe = static
    x = image(seed=4)
    x.tofile(folder / "image.bin")
    check_printed(run(exe, folder / "image.bin"), art, x)


def test_usage(static):
    res = run(static[2])
    assert res.returncode == 2 and "usage" in res.stderr and "image.npy" in res.stderr


@pytest.mark.parametrize("array, message", [
    (image().astype(np.float64), "dtype '<f8', but input 'image' is float32 ('<f4'): save it with .astype('float32')"),
    (np.zeros((1, 3, 16, 15), np.float32), "shape [1, 3, 16, 15], but input 'image' is [1, 3, 16, 16]"),
    (np.zeros((3, 16, 16), np.float32), "shape [3, 16, 16], but input 'image' is [1, 3, 16, 16]"),
    (np.asfortranarray(image()), "Fortran order; input 'image' needs C order: save numpy.ascontiguousarray(x)"),
], ids=["float64", "wrong-dim", "wrong-rank", "fortran"])
def test_bad_npy_is_refused(static, array, message):
    folder, _, exe = static
    np.save(folder / "bad.npy", array)
    res = run(exe, folder / "bad.npy")
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.strip() == f"{folder / 'bad.npy'}: {message}"


def test_truncated_npy_is_refused(static):
    folder, _, exe = static
    np.save(folder / "x.npy", image())
    data = (folder / "x.npy").read_bytes()
    (folder / "cut.npy").write_bytes(data[:-4])
    res = run(exe, folder / "cut.npy")
    assert res.returncode == 2
    assert "3068 bytes of data, but input 'image' [1, 3, 16, 16] float32 needs exactly 3072 (truncated file?)" in res.stderr
    (folder / "header.npy").write_bytes(data[:20])
    res = run(exe, folder / "header.npy")
    assert res.returncode == 2 and "header cannot be read (write it with numpy.save)" in res.stderr


@pytest.mark.parametrize("nbytes, why", [(3068, "truncated file?"), (3076, "trailing bytes")])
def test_raw_of_the_wrong_size_is_refused(static, nbytes, why):
    folder, _, exe = static
    (folder / "raw.bin").write_bytes(bytes(nbytes))
    res = run(exe, folder / "raw.bin")
    assert res.returncode == 2
    assert f"{nbytes} bytes of data, but input 'image' [1, 3, 16, 16] float32 needs exactly 3072 ({why}" in res.stderr


def test_missing_file(static):
    res = run(static[2], static[0] / "absent.npy")
    assert res.returncode == 2 and "absent.npy: No such file" in res.stderr


def test_symbolic_batch_takes_the_npy_shape(dynamic):
    folder, art, exe = dynamic
    x = image(3)
    np.save(folder / "x3.npy", x)
    check_printed(run(exe, folder / "x3.npy"), art, x)


def test_symbolic_batch_refuses_raw_and_out_of_profile(dynamic):
    folder, _, exe = dynamic
    image(2).tofile(folder / "x2.bin")
    res = run(exe, folder / "x2.bin")
    assert res.returncode == 2
    assert "raw data carry no shape, and input 'image' [-1, 3, 16, 16] has symbolic dims (-1): give a .npy file" in res.stderr
    np.save(folder / "x5.npy", image(5))
    res = run(exe, folder / "x5.npy")
    assert res.returncode == 1 and "outside the profile N in [1, 4]" in res.stderr
