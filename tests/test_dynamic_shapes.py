"""Symbolic dims end to end on x86: one library per shape profile serves every shape inside it (checked against
onnxruntime), rejects shapes outside it (Python ShapeError and the C ABI's CUVIL_ERR_PROFILE), reports its
symbols through the C ABI, and graphs whose shape conditions fail inside a profile are refused at compile time."""
import ctypes
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import cuvil
from cuvil import Pipeline
from cuvil.cli import main as cli_main
from cuvil.errors import ShapeError
from cuvil.targets.x86.loader import CTensor
from cuvil.testing.artifacts import close_and_remove, compile_and_load
from cuvil.testing.models import SYMBOLIC_CNN_PROFILE, TRANSFORMER_PROFILE, symbolic_batch_cnn, transformer_block
from cuvil.testing.oracles import max_rel_error, ort_session

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CUVIL_ERR_DIM, CUVIL_ERR_INDEX, CUVIL_ERR_PROFILE = -8, -11, -19


# -- models and helpers -------------------------------------------------------------------------------------

def add_model():
    """y = a + b with a[N, 4], b[N, 4]: two inputs bind the same symbol."""
    a = helper.make_tensor_value_info("a", TensorProto.FLOAT, ["N", 4])
    b = helper.make_tensor_value_info("b", TensorProto.FLOAT, ["N", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])
    g = helper.make_graph([helper.make_node("Add", ["a", "b"], ["y"])], "add2", [a, b], [y])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def reshape_model(target, width=12):
    """x[N, width] -> Reshape 'r1' to the constant shape ``target``."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", width])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    s = numpy_helper.from_array(np.array(target, np.int64), "s")
    g = helper.make_graph([helper.make_node("Reshape", ["x", "s"], ["y"], name="r1")], "reshape", [x], [y], [s])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def sha256(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def raw_lib(path):
    """The library through plain ctypes, with the C ABI's signatures (own CDLL object: the loader's are untouched)."""
    lib = ctypes.CDLL(path)
    i32p, i64p, tp = ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(CTensor)
    for name, res, args in (
            ("session_create", ctypes.c_void_p, [ctypes.c_int]),
            ("session_destroy", None, [ctypes.c_void_p]),
            ("run", ctypes.c_int, [ctypes.c_void_p, tp, tp]),
            ("output_shape", ctypes.c_int, [ctypes.c_void_p, tp, ctypes.c_int, i64p]),
            ("input_info", ctypes.c_int, [ctypes.c_int, i32p, i32p, i64p]),
            ("output_info", ctypes.c_int, [ctypes.c_int, i32p, i32p, i64p]),
            ("num_symbols", ctypes.c_int, []),
            ("symbol_info", ctypes.c_int, [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p), i64p, i64p, i64p]),
            ("strerror", ctypes.c_char_p, [ctypes.c_int]),
            ("last_error", ctypes.c_char_p, [])):
        fn = getattr(lib, f"cuvil_{name}")
        fn.restype, fn.argtypes = res, args
    return lib


def c_tensors(*arrays):
    """A cuvil_tensor array for numpy arrays (the shape buffers are kept alive on the returned array)."""
    ts = (CTensor * len(arrays))()
    keep = []
    for t, a in zip(ts, arrays):
        shape = (ctypes.c_int64 * max(1, a.ndim))(*a.shape)
        keep.append(shape)
        t.data, t.dtype, t.ndim = a.ctypes.data, 1, a.ndim
        t.shape = ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64))
    ts._keep = (keep, arrays)
    return ts


# -- the CNN with a symbolic batch ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cnn():
    model = symbolic_batch_cnn()
    art, m = compile_and_load(model, SYMBOLIC_CNN_PROFILE)
    yield model, art, m, ort_session(model)
    close_and_remove(art, m)


def test_cnn_symbol_imported_and_described(cnn):
    model, art, m, _ = cnn
    sym = Pipeline.from_onnx(model).graph.symbols["N"]
    assert (sym.name, sym.min, sym.max) == ("N", 1, 4096)          # the default range before a profile
    man = art.manifest
    assert man["symbols"] == {"N": {"min": 1, "opt": 4, "max": 16}}
    assert [d["shape"] for d in man["inputs"]] == [["N", 3, 16, 16]]
    assert [d["shape"] for d in man["outputs"]] == [["N", 10]]
    assert man["arena_bytes"] > 0 and man["steps"]
    assert m.inputs[0].shape == (None, 3, 16, 16) and m.outputs[0].shape == (None, 10)
    with open(art.path[:-3] + ".manifest.json") as f:
        assert json.load(f)["symbols"] == man["symbols"]


def test_cnn_runs_every_batch_of_the_profile_without_recompiling(cnn):
    _, art, m, sess = cnn
    before = (sha256(art.path), os.stat(art.path).st_mtime_ns)
    files_before = sorted(os.listdir(os.path.dirname(art.path)))
    for n in (1, 4, 16, 2, 3, 5, 7, 9, 15, 4, 1):          # min, opt, max, in between, and back
        x = np.random.default_rng(n).standard_normal((n, 3, 16, 16)).astype(np.float32)
        (y,) = m.run(x)
        (r,) = sess.run(None, {"x": x})
        assert y.shape == (n, 10)
        assert max_rel_error(y, r) <= 1e-4, (n, max_rel_error(y, r))
    assert m.path == os.path.abspath(art.path)
    assert (sha256(art.path), os.stat(art.path).st_mtime_ns) == before
    assert sorted(os.listdir(os.path.dirname(art.path))) == files_before
    assert art.manifest["symbols"] == {"N": {"min": 1, "opt": 4, "max": 16}}


def test_cnn_batch_rows_are_independent(cnn):
    """Row k of a batch-9 run equals the batch-1 run of row k (the symbolic loops do not mix rows)."""
    _, _, m, _ = cnn
    x = np.random.default_rng(42).standard_normal((9, 3, 16, 16)).astype(np.float32)
    (y,) = m.run(x)
    for k in (0, 4, 8):
        np.testing.assert_allclose(y[k:k + 1], m.run(x[k:k + 1])[0], rtol=1e-5, atol=1e-7)


def test_cnn_out_of_profile_raises_shape_error(cnn):
    _, _, m, _ = cnn
    for n in (0, 17, 64):
        with pytest.raises(ShapeError) as ei:
            m.run(np.zeros((n, 3, 16, 16), np.float32))
        msg = str(ei.value)
        assert "outside the profile N in [1, 16]" in msg and "(code -19)" in msg, msg
        assert f"N = {n}" in msg, msg
    (y,) = m.run(np.zeros((16, 3, 16, 16), np.float32))      # still usable after rejected calls
    assert y.shape == (16, 10)


def test_cnn_compiles_are_cached_per_profile():
    p = Pipeline.from_onnx(symbolic_batch_cnn())
    a = p.compile(shape_profiles=SYMBOLIC_CNN_PROFILE)
    b = p.compile(shape_profiles=SYMBOLIC_CNN_PROFILE)
    assert b.cached and b.path == a.path
    c = p.compile(shape_profiles={"N": (1, 2, 16)})
    assert c.path != a.path and c.manifest["symbols"]["N"] == {"min": 1, "opt": 2, "max": 16}


# -- the transformer block with symbolic batch and sequence ----------------------------------------------------

@pytest.fixture(scope="module")
def transformer():
    model = transformer_block(d_model=32, heads=4, d_ff=64, batch="B", seq="S", seed=0)
    art, m = compile_and_load(model, TRANSFORMER_PROFILE)
    yield model, art, m, ort_session(model)
    close_and_remove(art, m)


def test_transformer_symbols(transformer):
    model, art, m, _ = transformer
    assert set(Pipeline.from_onnx(model).graph.symbols) == {"B", "S"}
    assert art.manifest["symbols"] == {"B": {"min": 1, "opt": 2, "max": 8}, "S": {"min": 1, "opt": 16, "max": 64}}
    assert m.inputs[0].shape == (None, None, 32) and m.outputs[0].shape == (None, None, 32)


@pytest.mark.parametrize("b,s", [(1, 1), (2, 16), (8, 64), (3, 7), (5, 33), (8, 1), (1, 64), (2, 17), (7, 16)])
def test_transformer_matches_onnxruntime(transformer, b, s):
    _, _, m, sess = transformer
    x = np.random.default_rng(100 * b + s).standard_normal((b, s, 32)).astype(np.float32)
    (y,) = m.run(x)
    (r,) = sess.run(None, {"x": x})
    assert y.shape == (b, s, 32)
    assert max_rel_error(y, r) <= 1e-4, ((b, s), max_rel_error(y, r))


def test_transformer_out_of_profile(transformer):
    _, _, m, _ = transformer
    for shape, sym, rng in (((9, 4, 32), "B", "[1, 8]"), ((2, 65, 32), "S", "[1, 64]"), ((2, 0, 32), "S", "[1, 64]")):
        with pytest.raises(ShapeError, match=re.escape(f"outside the profile {sym} in {rng}")) as ei:
            m.run(np.zeros(shape, np.float32))
        assert "(code -19)" in str(ei.value)


# -- the C ABI ----------------------------------------------------------------------------------------------

def test_c_abi_reports_symbols_and_symbolic_dims(cnn):
    _, art, _, _ = cnn
    lib = raw_lib(art.path)
    dtype, ndim, shape = ctypes.c_int32(), ctypes.c_int32(), (ctypes.c_int64 * 4)()
    assert lib.cuvil_input_info(0, ctypes.byref(dtype), ctypes.byref(ndim), shape) == 0
    assert (dtype.value, ndim.value, list(shape)) == (1, 4, [-1, 3, 16, 16])
    assert lib.cuvil_output_info(0, ctypes.byref(dtype), ctypes.byref(ndim), shape) == 0
    assert (ndim.value, list(shape[:2])) == (2, [-1, 10])
    assert lib.cuvil_num_symbols() == 1
    name, lo, opt, hi = ctypes.c_char_p(), ctypes.c_int64(), ctypes.c_int64(), ctypes.c_int64()
    assert lib.cuvil_symbol_info(0, ctypes.byref(name), ctypes.byref(lo), ctypes.byref(opt), ctypes.byref(hi)) == 0
    assert (name.value, lo.value, opt.value, hi.value) == (b"N", 1, 4, 16)
    assert lib.cuvil_symbol_info(1, None, None, None, None) == CUVIL_ERR_INDEX
    assert lib.cuvil_symbol_info(-1, None, None, None, None) == CUVIL_ERR_INDEX


def test_c_abi_transformer_symbols_and_output_shape(transformer):
    _, art, _, _ = transformer
    lib = raw_lib(art.path)
    assert lib.cuvil_num_symbols() == 2
    got = {}
    for i in range(2):
        name, lo, opt, hi = ctypes.c_char_p(), ctypes.c_int64(), ctypes.c_int64(), ctypes.c_int64()
        assert lib.cuvil_symbol_info(i, ctypes.byref(name), ctypes.byref(lo), ctypes.byref(opt), ctypes.byref(hi)) == 0
        got[name.value.decode()] = (lo.value, opt.value, hi.value)
    assert got == {"B": (1, 2, 8), "S": (1, 16, 64)}
    shape = (ctypes.c_int64 * 3)()
    assert lib.cuvil_input_info(0, None, None, shape) == 0 and list(shape) == [-1, -1, 32]
    s = lib.cuvil_session_create(1)
    try:
        for b, sq in ((3, 7), (8, 64), (1, 1)):
            x = np.zeros((b, sq, 32), np.float32)
            assert lib.cuvil_output_shape(s, c_tensors(x), 0, shape) == 0
            assert list(shape) == [b, sq, 32]
        assert lib.cuvil_output_shape(s, c_tensors(np.zeros((3, 65, 32), np.float32)), 0, shape) == CUVIL_ERR_PROFILE
        assert "S" in lib.cuvil_last_error().decode()
    finally:
        lib.cuvil_session_destroy(s)


def test_c_abi_run_out_of_profile_and_inside(cnn):
    _, art, _, sess = cnn
    lib = raw_lib(art.path)
    s = lib.cuvil_session_create(1)
    try:
        shape = (ctypes.c_int64 * 2)()
        x5 = np.random.default_rng(5).standard_normal((5, 3, 16, 16)).astype(np.float32)
        assert lib.cuvil_output_shape(s, c_tensors(x5), 0, shape) == 0 and list(shape) == [5, 10]
        assert lib.cuvil_output_shape(s, c_tensors(x5), 1, shape) == CUVIL_ERR_INDEX

        for n in (17, 0):
            x = np.ones((n, 3, 16, 16), np.float32)
            y = np.full((n, 10), 7.0, np.float32)
            rc = lib.cuvil_run(s, c_tensors(x), c_tensors(y))
            assert rc == CUVIL_ERR_PROFILE, rc
            err = lib.cuvil_last_error().decode()
            assert f"N = {n}" in err and "[1, 16]" in err, err
            assert b"profile" in lib.cuvil_strerror(rc)
            assert np.all(y == 7.0), "a rejected run wrote its output"
            assert lib.cuvil_output_shape(s, c_tensors(x), 0, shape) == CUVIL_ERR_PROFILE

        y = np.full((4, 10), 7.0, np.float32)                  # output shape disagrees with the input's N = 5
        rc = lib.cuvil_run(s, c_tensors(x5), c_tensors(y))
        assert rc < 0 and "expected 5" in lib.cuvil_last_error().decode(), (rc, lib.cuvil_last_error())
        assert np.all(y == 7.0)

        y = np.empty((5, 10), np.float32)
        assert lib.cuvil_run(s, c_tensors(x5), c_tensors(y)) == 0
        assert max_rel_error(y, sess.run(None, {"x": x5})[0]) <= 1e-4
    finally:
        lib.cuvil_session_destroy(s)


@pytest.fixture(scope="module")
def add2():
    art, m = compile_and_load(add_model(), {"N": (1, 2, 8)})
    yield art, m
    close_and_remove(art, m)


def test_inputs_sharing_a_symbol_must_agree(add2):
    art, m = add2
    rng = np.random.default_rng(0)
    for n in (1, 2, 3, 8):
        a, b = rng.standard_normal((2, n, 4)).astype(np.float32)
        (y,) = m.run(a, b)
        np.testing.assert_array_equal(y, a + b)
    with pytest.raises(ShapeError) as ei:
        m.run(np.ones((3, 4), np.float32), np.ones((2, 4), np.float32))
    msg = str(ei.value)
    assert "N = 2" in msg and "N = 3" in msg and "'b'" in msg, msg
    with pytest.raises(ShapeError, match=re.escape("outside the profile N in [1, 8]")):
        m.run(np.ones((3, 4), np.float32), np.ones((9, 4), np.float32))

    lib = raw_lib(art.path)
    s = lib.cuvil_session_create(1)
    try:
        a, b, y = np.ones((3, 4), np.float32), np.ones((2, 4), np.float32), np.full((3, 4), 7.0, np.float32)
        rc = lib.cuvil_run(s, c_tensors(a, b), c_tensors(y))
        assert rc == CUVIL_ERR_DIM, rc
        assert "N" in lib.cuvil_last_error().decode()
        assert np.all(y == 7.0)
        assert lib.cuvil_output_shape(s, c_tensors(a, b), 0, (ctypes.c_int64 * 2)()) == CUVIL_ERR_DIM
    finally:
        lib.cuvil_session_destroy(s)


# -- shape conditions inside a profile ----------------------------------------------------------------------

def test_reshape_condition_failing_inside_profile_is_refused():
    """x[N, 12] -> Reshape [-1, 8] needs 12*N % 8 == 0, i.e. N even: a profile with an odd N is refused."""
    p = Pipeline.from_onnx(reshape_model([-1, 8]))
    counterexample = re.compile(r"N = [1357] makes Reshape 'r1' need")
    bad = p.check_shapes({"N": (1, 2, 8)})
    assert bad and counterexample.search("\n".join(map(str, bad))), bad
    with pytest.raises(ShapeError, match=counterexample):
        p.with_profiles({"N": (1, 2, 8)})
    with pytest.raises(ShapeError, match=counterexample) as ei:
        p.compile(shape_profiles={"N": (1, 2, 8)}, cache=False)
    assert "12*N" in str(ei.value) and "[-1, 8]" in str(ei.value), str(ei.value)
    with pytest.raises(ShapeError, match=r"N = 3 makes Reshape 'r1'"):
        p.compile(shape_profiles={"N": (3, 3, 3)}, cache=False)
    with pytest.raises(ShapeError, match="r1"):                 # no profile: the default range [1, 4096]
        p.compile(cache=False)
    assert p.check_shapes({"N": (2, 2, 2)}) == [] and p.check_shapes({"N": (6, 6)}) == []
    assert p.with_profiles({"N": (2, 2, 2)}).graph.symbols["N"].max == 2


@pytest.mark.parametrize("target,profile", [
    ([0, 3, 4], (1, 2, 8)),     # splits the fixed dim only: N maps through
    ([-1], (1, 2, 8)),          # merges N with 12: holds everywhere
    ([-1, 4], (1, 2, 8)),       # 12*N % 4 == 0 everywhere
    ([-1, 8], (2, 2, 2)),       # the refused reshape above, on a profile where its condition holds
    ([-1, 8], (4, 4, 4)),
])
def test_reshape_compiles_where_its_condition_holds(target, profile):
    model = reshape_model(target)
    p = Pipeline.from_onnx(model)
    assert p.check_shapes({"N": profile}) == []
    try:
        art = p.compile(shape_profiles={"N": profile}, cache=False)
    except Exception as e:  # noqa: BLE001 - report the crash as a failed expectation, with what was compiled
        pytest.fail(f"BUG: compiling Reshape {target} on [N, 12] with profile N={profile} (its shape condition holds "
                    f"there) crashed: {type(e).__name__}: {e}")
    m = cuvil.load(art.path)
    sess = ort_session(model)
    try:
        for n in sorted({profile[0], profile[1], profile[-1]}):
            x = np.arange(n * 12, dtype=np.float32).reshape(n, 12)
            np.testing.assert_array_equal(m.run(x)[0], sess.run(None, {"x": x})[0])
    finally:
        close_and_remove(art, m)


def test_reshape_merging_two_symbols_compiles():
    """x[B, S, 32] -> MatMul -> Reshape [-1, 8] (flattening the tokens): valid for every B and S, so one library
    serves the profile."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "S", 32])
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((32, 8)).astype(np.float32), "w")
    s = numpy_helper.from_array(np.array([-1, 8], np.int64), "s")
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["h"]),
                           helper.make_node("Reshape", ["h", "s"], ["y"], name="r1")], "tokens", [x],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [w, s])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    try:
        art, m = compile_and_load(model, {"B": (1, 2, 8), "S": (1, 4, 16)})
    except Exception as e:  # noqa: BLE001
        pytest.fail(f"BUG: compiling MatMul -> Reshape [B, S, 8] -> [-1, 8] with B=(1,2,8), S=(1,4,16) crashed: "
                    f"{type(e).__name__}: {e}")
    sess = ort_session(model)
    try:
        for b, sq in ((1, 1), (2, 4), (3, 5), (8, 16)):
            xv = np.random.default_rng(b * sq).standard_normal((b, sq, 32)).astype(np.float32)
            assert max_rel_error(m.run(xv)[0], sess.run(None, {"x": xv})[0]) <= 1e-4
    finally:
        close_and_remove(art, m)


def test_fixed_value_where_the_condition_holds_compiles():
    """fixed={"N": 2} pins N to a value where 12*N % 8 == 0; the default range [1, 4096] should not matter."""
    model = reshape_model([-1, 8])
    p = Pipeline.from_onnx(model)
    try:
        art = p.compile(fixed={"N": 2}, cache=False)
    except ShapeError as e:
        pytest.fail(f"BUG: compile(fixed={{'N': 2}}) checks the shape conditions over N's default range before "
                    f"specialising, and refuses a graph whose condition holds at N = 2: {e}")
    m = cuvil.load(art.path)
    try:
        x = np.arange(24, dtype=np.float32).reshape(2, 12)
        assert m.inputs[0].shape == (2, 12)
        np.testing.assert_array_equal(m.run(x)[0], x.reshape(3, 8))
    finally:
        close_and_remove(art, m)


# -- fixed symbols and the CLI ---------------------------------------------------------------------------------

def test_fixed_batch_gives_a_static_library():
    model = symbolic_batch_cnn()
    art = Pipeline.from_onnx(model).compile(fixed={"N": 2}, cache=False)
    m = cuvil.load(art.path)
    try:
        assert m.inputs[0].shape == (2, 3, 16, 16) and m.outputs[0].shape == (2, 10)
        assert art.manifest["specialized"] == {"N": 2} and not art.manifest.get("symbols")
        assert art.manifest["inputs"][0]["shape"] == [2, 3, 16, 16]
        assert raw_lib(art.path).cuvil_num_symbols() == 0
        x = np.random.default_rng(2).standard_normal((2, 3, 16, 16)).astype(np.float32)
        assert max_rel_error(m.run(x)[0], ort_session(model).run(None, {"x": x})[0]) <= 1e-4
        with pytest.raises(ShapeError, match="dim 0 is 3, expected 2"):
            m.run(np.zeros((3, 3, 16, 16), np.float32))
    finally:
        close_and_remove(art, m)


def test_cli_compile_with_shape_profile(tmp_path):
    import onnx
    model = symbolic_batch_cnn()
    onnx.save(model, tmp_path / "m.onnx")
    so = tmp_path / "out" / "libm.so"
    res = subprocess.run([sys.executable, "-m", "cuvil", "compile", "--input", str(tmp_path / "m.onnx"),
                          "--output", str(so), "--shape-profile", "N=1:4:16"],
                         check=False, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")})
    assert res.returncode == 0, res.stderr[-3000:]
    assert "symbol N in [1, 16] (opt 4)" in res.stdout, res.stdout
    manifest = json.loads((tmp_path / "out" / "libm.manifest.json").read_text())
    assert manifest["symbols"] == {"N": {"min": 1, "opt": 4, "max": 16}}
    assert (tmp_path / "out" / "libm.h").exists()
    x = np.random.default_rng(3).standard_normal((3, 3, 16, 16)).astype(np.float32)
    with cuvil.load(str(so)) as m:
        assert m.inputs[0].shape == (None, 3, 16, 16)
        (y,) = m.run(x)
    assert y.shape == (3, 10)
    assert max_rel_error(y, ort_session(model).run(None, {"x": x})[0]) <= 1e-4
    np.save(tmp_path / "x.npy", x)                              # and `cuvil run` at N = 3
    assert cli_main(["run", str(so), "--input", f"x={tmp_path / 'x.npy'}", "--output-dir", str(tmp_path / "o")]) == 0
    np.testing.assert_array_equal(np.load(tmp_path / "o" / "y.npy"), y)


def test_cli_rejects_bad_profiles(tmp_path, capsys):
    import onnx
    onnx.save(reshape_model([-1, 8]), tmp_path / "r.onnx")
    so = str(tmp_path / "libr.so")
    assert cli_main(["compile", "--input", str(tmp_path / "r.onnx"), "--output", so, "--shape-profile", "N=1:2:8"]) != 0
    err = capsys.readouterr().err
    assert "Reshape 'r1'" in err and re.search(r"N = [1357]", err), err
    assert cli_main(["compile", "--input", str(tmp_path / "r.onnx"), "--output", so, "--shape-profile", "N=8:2:4"]) != 0
    assert "MIN <= OPT <= MAX" in capsys.readouterr().err
    assert not os.path.exists(so)


RELU_RULE = """\
rule relu_relu_batched benefit 5
  Relu(Relu(x)) when dim(x, 0) >= 2
  => Relu(x)
  prove exact
"""


def _relu_relu(batch="N"):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 4])
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Relu", ["r"], ["y"])]
    return helper.make_model(helper.make_graph(nodes, "rr", [x], [y]), opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("profile, fires", [((2, 4, 8), True), ((1, 4, 8), False)])
def test_guards_reason_about_symbolic_dims_over_their_range(tmp_path, profile, fires):
    """An order guard on a symbolic dim holds only when it holds for every value of the symbol's range."""
    rule = tmp_path / "batched.rule"
    rule.write_text(RELU_RULE)
    p = Pipeline.from_onnx(_relu_relu()).with_profiles({"N": profile})
    out = p.optimize(str(rule), builtin=False)
    assert out.report.applied.get("relu_relu_batched", 0) == (1 if fires else 0)
    assert [n.op for n in out.graph.nodes] == (["Relu"] if fires else ["Relu", "Relu"])


def _spatial_cnn():
    rng = np.random.default_rng(7)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, "H", "W"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    inits = [numpy_helper.from_array((rng.standard_normal(s) / 4).astype(np.float32), n)
             for n, s in (("w", (8, 3, 3, 3)), ("w2", (16, 8, 3, 3)), ("dw", (16, 1, 3, 3)))]
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("MaxPool", ["r"], ["p"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
             helper.make_node("Conv", ["p", "w2"], ["c2"], pads=[1, 1, 1, 1], strides=[2, 2]),
             helper.make_node("Conv", ["c2", "dw"], ["c3"], pads=[1, 1, 1, 1], group=16),
             helper.make_node("AveragePool", ["c3"], ["a"], kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("GlobalAveragePool", ["a"], ["y"])]
    return helper.make_model(helper.make_graph(nodes, "spatial", [x], [y], inits),
                             opset_imports=[helper.make_opsetid("", 17)])


def test_symbolic_spatial_dims():
    """H and W symbolic too: shapes like ((H + 1)/2 + 1)/2 stay symbolic (padding, strided windows, pools),
    the manifest reports the derived dims' ranges, and every shape of the profile matches onnxruntime."""
    model = _spatial_cnn()
    p = Pipeline.from_onnx(model)
    art = p.compile(shape_profiles={"N": (1, 1, 4), "H": (8, 32, 64), "W": (8, 32, 64)}, cache=False)
    try:
        assert art.manifest["derived_dims"]["((H + 1)/2 + 1)/2"] == [2, 16]
        m = cuvil.load(art.path)
        sess = ort_session(model)
        rng = np.random.default_rng(1)
        for shape in [(1, 3, 32, 32), (2, 3, 17, 23), (4, 3, 64, 8), (1, 3, 8, 8), (3, 3, 41, 64)]:
            x = rng.standard_normal(shape).astype(np.float32)
            got, want = m.run(x)[0], sess.run(None, {"x": x})[0]
            assert got.shape == want.shape
            assert max_rel_error(got, want) <= 1e-4
        with pytest.raises(ShapeError, match="outside the profile H in \\[8, 64\\]"):
            m.run(np.zeros((1, 3, 7, 8), np.float32))
    finally:
        shutil.rmtree(os.path.dirname(art.path), ignore_errors=True)


def test_cli_demo_runs_fixed_and_dynamic(capsys):
    """`cuvil demo` (the README's first command): the fixed-batch library and the one-library-per-profile
    run both agree with onnx.reference."""
    assert cli_main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "demo passed" in out
    assert re.search(r"dynamic +one library for N=1:2:8 .*batches 1, 5, 8 vs onnx.reference", out)


def test_concat_along_symbolic_axes_compiles_and_runs():
    """Concat of two inputs whose concatenated dims are both symbols (found by the fuzz suite: lowering compared a
    symbolic dim with 0 and raised TypeError). One library serves every split of the rows."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", 4])
    z = helper.make_tensor_value_info("z", TensorProto.FLOAT, None)
    g = helper.make_graph([helper.make_node("Concat", ["x", "y"], ["c"], axis=0), helper.make_node("Relu", ["c"], ["z"])],
                          "concat_sym", [x, y], [z])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    art = Pipeline.from_onnx(m).optimize().with_profiles({"N": (1, 2, 8), "M": (1, 3, 8)}).compile()
    rng = np.random.default_rng(0)
    for n, k in [(1, 3), (2, 1), (5, 2), (8, 8)]:
        a = rng.standard_normal((n, 4)).astype(np.float32)
        b = rng.standard_normal((k, 4)).astype(np.float32)
        np.testing.assert_array_equal(art.run({"x": a, "y": b})["z"], np.maximum(np.concatenate([a, b]), 0))
