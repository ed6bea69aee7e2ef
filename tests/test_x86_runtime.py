"""The x86 artifact runtime (runtime.c), its generators (model.c, header) and its loaders (ctypes, C).

The kernels here are hand-written C standing in for the code generator: they follow the bufs/step
contract of cuvil_runtime.h and record how they were called into an output, so that the tests can check
the chunking as well as the results.
"""
from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import subprocess
import threading

import numpy as np
import pytest

from cuvil.errors import CuvilError, ShapeError
from cuvil.targets.x86 import loader
from cuvil.targets.x86.header import ERROR_CODES, generate_header
from cuvil.targets.x86.link import (WRITE_BLOCK, check_dependencies, exported_symbols, isa_object, link_shared,
                                    unexpected_dependencies, write_library)
from cuvil.targets.x86.loader import CTensor
from cuvil.targets.x86.model_c import c_string_literal, generate_model_c
from cuvil.targets.x86.model_info import IODesc, ModelInfo, StepDesc

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")

N = 10_000
GRAIN = 64
ODD_NAME = 'b "q"?\\é*/'  # quotes, trigraph-ish '?', backslash, non-ASCII, comment end

# bufs: [0] arena, [1] weights, [2] a, [3] b, [4] scale, [5] sum, [6] twice, [7] stats
KERNELS_C = r"""
#include <stdint.h>
#include <stdlib.h>
enum { ARENA, W, A, B, SCALE, SUM, TWICE, STATS };
/* stats: [0] k_add chunks, [1] contract violations, [2] k_one calls, [3] k_never calls */
static void violation(void **bufs) { __atomic_fetch_add(&((int64_t *)bufs[STATS])[1], 1, __ATOMIC_RELAXED); }
static void check_chunk(void **bufs, int64_t b, int64_t e, int64_t extent, int64_t grain) {
  if (b < 0 || e > extent || b >= e || b % grain != 0 || (e - b < grain && e - b != extent)) violation(bufs);
}
void k_init(void **bufs, int64_t b, int64_t e) {
  int64_t *st = bufs[STATS];
  if (b != 0 || e != 1) { st[1] = 1000; return; }
  for (int i = 0; i < 4; ++i) st[i] = 0;
  if (bufs[ARENA] == 0 || ((uintptr_t)bufs[ARENA] & 63) != 0 || ((uintptr_t)bufs[W] & 63) != 0) st[1] += 100;
}
void k_add(void **bufs, int64_t b, int64_t e) {
  const float *a = bufs[A], *bb = bufs[B], *w = bufs[W];
  float *t = bufs[ARENA];
  check_chunk(bufs, b, e, 10000, 64);
  __atomic_fetch_add(&((int64_t *)bufs[STATS])[0], 1, __ATOMIC_RELAXED);
  for (int64_t i = b; i < e; ++i) t[i] = a[i] + bb[i] + w[i];
}
void k_copy(void **bufs, int64_t b, int64_t e) {
  const float *t = bufs[ARENA], s = *(const float *)bufs[SCALE];
  float *sum = bufs[SUM], *tw = bufs[TWICE];
  check_chunk(bufs, b, e, 10000, 64);
  for (int64_t i = b; i < e; ++i) { sum[i] = t[i]; tw[i] = s * t[i]; }
}
void k_one(void **bufs, int64_t b, int64_t e) {
  if (b != 0 || e != 1) violation(bufs);
  ((int64_t *)bufs[STATS])[2] += 1;
}
void k_never(void **bufs, int64_t b, int64_t e) { ((int64_t *)bufs[STATS])[3] += 1; }
void k_empty(void **bufs, int64_t b, int64_t e) { (void)bufs; (void)b; (void)e; }
"""

WEIGHTS_S = """\
  .section .rodata
  .balign 64
  .globl {sym}
  .hidden {sym}
  .type {sym}, @object
{sym}:
  .incbin "{path}"
  .size {sym}, . - {sym}
  .section .note.GNU-stack,"",@progbits
"""


def model_info(prefix: str) -> ModelInfo:
    f32 = 1
    return ModelInfo(
        inputs=[IODesc("a", f32, (100, 100)), IODesc(ODD_NAME, f32, (100, 100)), IODesc("scale", f32, ())],
        outputs=[IODesc("sum", f32, (100, 100)), IODesc("twice", f32, (100, 100)), IODesc("stats", 7, (4,))],
        arena_bytes=4 * N,
        steps=[StepDesc("k_init", 1, 1), StepDesc("k_add", N, GRAIN), StepDesc("k_never", 0, 1),
               StepDesc("k_one", 1, 1), StepDesc("k_copy", N, GRAIN)],
        weights_symbol="model_weights",
        prefix=prefix,
    )


def weights_for(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(N).astype(np.float32)


def build(root, name: str, prefix: str, seed: int, kernels_o: str, manifest: bool = True) -> str:
    root = str(root)
    os.makedirs(root, exist_ok=True)
    wbin = os.path.join(root, f"{name}.weights.bin")
    weights_for(seed).tofile(wbin)
    wS = os.path.join(root, f"{name}.weights.S")
    with open(wS, "w") as f:
        f.write(WEIGHTS_S.format(sym="model_weights", path=wbin))
    info = model_info(prefix)
    so = os.path.join(root, f"lib{name}.so")
    link_shared(so, [kernels_o], generate_model_c(info), wS, prefix)
    with open(os.path.join(root, f"lib{name}.h"), "w") as f:
        f.write(generate_header(info))
    if manifest:
        with open(os.path.join(root, f"lib{name}.manifest.json"), "w") as f:
            json.dump({"prefix": prefix}, f)
    return so


def compile_kernels(root, source: str) -> str:
    """The hand-written kernels ``source`` compiled to ROOT/kernels.o."""
    kc = root / "kernels.c"
    kc.write_text(source)
    ko = str(root / "kernels.o")
    subprocess.run(["cc", "-O2", "-fPIC", "-c", str(kc), "-o", ko], check=True)
    return ko


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("x86rt")
    ko = compile_kernels(root, KERNELS_C)
    return {
        "root": root,
        "kernels_o": ko,
        "main": build(root / "m1", "net", "cuvil", 1, ko),
        "renamed": build(root / "m2", "netA", "netA", 2, ko),
        "twin": build(root / "m3", "net", "cuvil", 3, ko, manifest=False),  # same name and prefix, other weights
    }


def inputs(seed=0):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((100, 100)).astype(np.float32)
    b = rng.standard_normal((100, 100)).astype(np.float32)
    return a, b, np.array(3.0, dtype=np.float32)


def expected(a, b, s, wseed):
    t = a + b + weights_for(wseed).reshape(100, 100)
    return t, s * t


# -- results ---------------------------------------------------------------------------------------


def test_model_io_and_results(built):
    with loader.load(built["main"]) as m:
        assert m.prefix == "cuvil"
        assert [d.name for d in m.inputs] == ["a", ODD_NAME, "scale"]
        assert [d.name for d in m.outputs] == ["sum", "twice", "stats"]
        assert m.inputs[0].dtype == np.float32 and m.inputs[0].shape == (100, 100) and m.inputs[2].shape == ()
        assert m.outputs[2].dtype == np.int64 and m.outputs[2].shape == (4,)
        a, b, s = inputs()
        want_sum, want_twice = expected(a, b, s, 1)
        for got in (m.run(a, b, s), m.run(a, **{ODD_NAME: b, "scale": s}), m.run(scale=s, a=a, **{ODD_NAME: b})):
            np.testing.assert_array_equal(got[0], want_sum)
            np.testing.assert_array_equal(got[1], want_twice)
            assert got[2][1] == 0 and got[2][2] == 1 and got[2][3] == 0  # no violation, k_one once, k_never never
        # non-contiguous input: copied (layout only), not cast
        a2 = np.asfortranarray(a)
        np.testing.assert_array_equal(m.run(a2, b, s)[0], want_sum)


@pytest.mark.parametrize("threads", [1, 2, 3, 4])
def test_threads_same_results(built, threads):
    a, b, s = inputs(7)
    with loader.load(built["main"], num_threads=1) as m:
        ref = m.run(a, b, s)
        assert ref[2][0] == 1  # one thread: one chunk
        for _ in range(20):
            got = m.run(a, b, s, num_threads=threads)
            np.testing.assert_array_equal(got[0], ref[0])
            np.testing.assert_array_equal(got[1], ref[1])
            assert got[2][0] == threads and got[2][1] == 0 and got[2][2] == 1 and got[2][3] == 0


def test_all_cores_and_python_threads(built):
    a, b, s = inputs(3)
    m = loader.load(built["main"])  # num_threads=0: all cores
    ref = m.run(a, b, s)
    errors = []

    def worker():
        try:
            for _ in range(30):
                np.testing.assert_array_equal(m.run(a, b, s)[0], ref[0])
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    ts = [threading.Thread(target=worker) for _ in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors
    assert ref[2][0] == min(len(os.sched_getaffinity(0)), N // GRAIN)
    m.close()
    m.close()                                                  # harmless
    with pytest.raises(CuvilError, match="the model was closed.*\n  next: load it again"):
        m.run(a, b, s)
    del m


# -- validation ------------------------------------------------------------------------------------


def test_python_errors_name_the_input_and_the_fix(built):
    m = loader.load(built["main"])
    a, b, s = inputs()
    with pytest.raises(ShapeError, match=r"dtype does not match.*input 0 'a': dtype is 11 \(double\), expected 1 "
                                         r"\(float\) \(code -6\)\n  next: convert it"):
        m.run(a.astype(np.float64), b, s)
    with pytest.raises(ShapeError, match=re.escape(f"input 1 '{ODD_NAME}': dim 1 is 101, expected 100")):
        m.run(a, np.zeros((100, 101), np.float32), s)
    with pytest.raises(ShapeError, match=r"input 2 'scale': ndim is 1, expected 0"):
        m.run(a, b, np.ones(1, np.float32))
    with pytest.raises(ShapeError, match="dtype is 0"):
        m.run(a.astype(">f4"), b, s)  # non-native byte order: not converted
    with pytest.raises(ShapeError, match="missing input"):
        m.run(a, b)
    with pytest.raises(ShapeError, match="unknown input"):
        m.run(a, b, s, nope=a)
    with pytest.raises(ShapeError, match="given twice"):
        m.run(a, b, s, a=a)
    with pytest.raises(ShapeError, match="positional"):
        m.run(a, b, s, s)
    with pytest.raises(CuvilError, match="num_threads"):
        m.run(a, b, s, num_threads=-1)
    m.close()


def _raw(so, prefix="cuvil"):
    lib = ctypes.CDLL(so)
    tp = ctypes.POINTER(CTensor)

    def fn(name, res, *args):
        f = getattr(lib, f"{prefix}_{name}")
        f.restype, f.argtypes = res, list(args)
        return f

    i32p, i64p = ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_int64)
    return dict(
        create=fn("session_create", ctypes.c_void_p, ctypes.c_int),
        destroy=fn("session_destroy", None, ctypes.c_void_p),
        run=fn("run", ctypes.c_int, ctypes.c_void_p, tp, tp),
        strerror=fn("strerror", ctypes.c_char_p, ctypes.c_int),
        last_error=fn("last_error", ctypes.c_char_p),
        input_name=fn("input_name", ctypes.c_char_p, ctypes.c_int),
        output_name=fn("output_name", ctypes.c_char_p, ctypes.c_int),
        input_info=fn("input_info", ctypes.c_int, ctypes.c_int, i32p, i32p, i64p),
        output_info=fn("output_info", ctypes.c_int, ctypes.c_int, i32p, i32p, i64p),
        output_shape=fn("output_shape", ctypes.c_int, ctypes.c_void_p, tp, ctypes.c_int, i64p),
    )


class _Call:
    """Well-formed raw tensors for the main model, to be broken one field at a time."""

    def __init__(self):
        self.arrays = list(inputs())
        self.outs = [np.full((100, 100), 7, np.float32), np.full((100, 100), 7, np.float32),
                     np.full(4, 7, np.int64)]
        self.keep = []
        self.ins = (CTensor * 3)(*[self.tensor(x) for x in self.arrays])
        self.out = (CTensor * 3)(*[self.tensor(y) for y in self.outs])

    def tensor(self, x):
        shape = (ctypes.c_int64 * max(1, x.ndim))(*x.shape)
        self.keep.append(shape)
        code = {np.dtype(np.float32): 1, np.dtype(np.int64): 7}[x.dtype]
        return CTensor(x.ctypes.data, code, x.ndim, shape)

    def untouched(self):
        return all((y == 7).all() for y in self.outs)


def test_raw_validation_codes(built):
    f = _raw(built["main"])
    codes = {name: code for name, code, _ in ERROR_CODES}
    s = f["create"](1)
    assert s
    try:
        c = _Call()
        assert f["run"](None, c.ins, c.out) == codes["CUVIL_ERR_NULL_SESSION"]
        assert f["run"](s, None, c.out) == codes["CUVIL_ERR_NULL_INPUTS"]
        assert f["run"](s, c.ins, None) == codes["CUVIL_ERR_NULL_OUTPUTS"]

        def broken(where, k, field, value, code, detail):
            c = _Call()
            t = (c.ins if where == "in" else c.out)[k]
            setattr(t, field, value(c) if callable(value) else value)
            rc = f["run"](s, c.ins, c.out)
            assert rc == codes[code], (where, k, field, rc, f["last_error"]())
            assert detail in f["last_error"]().decode(), f["last_error"]()
            assert f["strerror"](rc).decode() == dict((v, m) for _, v, m in ERROR_CODES)[rc]
            assert c.untouched() == (rc != 0)

        broken("in", 0, "data", None, "CUVIL_ERR_NULL_DATA", "input 0 'a': data is NULL")
        broken("in", 0, "dtype", 11, "CUVIL_ERR_DTYPE", "input 0 'a': dtype is 11 (double), expected 1 (float)")
        broken("in", 0, "ndim", 3, "CUVIL_ERR_NDIM", "input 0 'a': ndim is 3, expected 2")
        broken("in", 0, "shape", None, "CUVIL_ERR_NULL_SHAPE", "input 0 'a': shape is NULL")
        broken("in", 2, "shape", None, "CUVIL_OK", "")  # a scalar needs no shape pointer
        broken("out", 1, "dtype", 6, "CUVIL_ERR_DTYPE", "output 1 'twice': dtype is 6 (int32), expected 1")
        broken("out", 2, "ndim", 0, "CUVIL_ERR_NDIM", "output 2 'stats': ndim is 0, expected 1")
        broken("out", 0, "data", None, "CUVIL_ERR_NULL_DATA", "output 0 'sum': data is NULL")
        broken("in", 0, "data", lambda c: c.arrays[0].ctypes.data + 1, "CUVIL_ERR_ALIGN", "not aligned to 4 bytes")
        broken("out", 1, "data", lambda c: c.outs[0].ctypes.data + 400, "CUVIL_ERR_OVERLAP",
               "output 1 'twice' overlaps output 0 'sum'")

        c = _Call()
        c.ins[0].shape[1] = 101
        assert f["run"](s, c.ins, c.out) == codes["CUVIL_ERR_DIM"]
        assert f["last_error"]().decode() == "input 0 'a': dim 1 is 101, expected 100"
        c = _Call()
        c.out[2].shape[0] = -4
        assert f["run"](s, c.ins, c.out) == codes["CUVIL_ERR_DIM"] and c.untouched()
        c = _Call()
        c.out[0].data = c.arrays[0].ctypes.data
        assert f["run"](s, c.ins, c.out) == codes["CUVIL_ERR_OVERLAP"] and c.untouched()
        assert b"overlaps input 0 'a'" in f["last_error"]()

        c = _Call()
        assert f["run"](s, c.ins, c.out) == 0 and not c.untouched()
    finally:
        f["destroy"](s)
        f["destroy"](None)  # harmless


def test_raw_info_functions(built):
    f = _raw(built["main"])
    assert f["input_name"](1).decode() == ODD_NAME
    assert f["input_name"](3) is None and f["input_name"](-1) is None and f["output_name"](3) is None
    dt, nd = ctypes.c_int32(), ctypes.c_int32()
    assert f["input_info"](0, ctypes.byref(dt), ctypes.byref(nd), None) == 0 and (dt.value, nd.value) == (1, 2)
    shape = (ctypes.c_int64 * 2)()
    assert f["input_info"](0, None, None, shape) == 0 and list(shape) == [100, 100]
    assert f["input_info"](0, None, None, None) == 0
    assert f["input_info"](3, ctypes.byref(dt), None, None) == -11
    assert f["output_info"](-1, None, None, None) == -11 and b"out of range" in f["last_error"]()
    s = f["create"](2)
    try:
        out = (ctypes.c_int64 * 1)()
        assert f["output_shape"](s, None, 2, out) == 0 and out[0] == 4
        assert f["output_shape"](s, None, 3, out) == -11
        assert f["output_shape"](None, None, 0, out) == -1
        assert f["output_shape"](s, None, 0, None) == -12
        c = _Call()
        c.ins[1].dtype = 2
        assert f["output_shape"](s, c.ins, 0, out) == -6  # given inputs are checked
    finally:
        f["destroy"](s)
    assert not f["create"](-1) and b"num_threads is -1" in f["last_error"]()


def test_strerror_matches_header_table(built):
    f = _raw(built["main"])
    for name, code, msg in ERROR_CODES:
        assert f["strerror"](code).decode() == msg, name
    assert f["strerror"](-999) == b"unknown error code" and f["strerror"](5) == b"unknown error code"
    src = open(os.path.join(os.path.dirname(loader.__file__), "runtime.c")).read()
    for name, code, msg in ERROR_CODES:
        assert f"{name} = {code}," in src and f'"{msg}"' in src


# -- symbols, prefixes, dependencies ------------------------------------------------------------------


def _dynamic_symbols(so):
    out = subprocess.run(["nm", "-D", "--defined-only", so], capture_output=True, text=True, check=True).stdout
    return sorted(line.split()[-1] for line in out.splitlines() if line.strip())


def test_exports_only_the_prefixed_abi(built):
    assert _dynamic_symbols(built["main"]) == sorted(exported_symbols("cuvil"))
    assert _dynamic_symbols(built["renamed"]) == sorted(exported_symbols("netA"))


def test_manifest_prefix_and_two_models_in_one_process(built):
    a, b, s = inputs(5)
    m1 = loader.load(built["main"])
    m2 = loader.load(built["renamed"])  # prefix "netA" from libnetA.manifest.json
    m3 = loader.load(built["twin"])  # no manifest: "cuvil"; same file name and prefix as m1
    assert m2.prefix == "netA" and m3.prefix == "cuvil"
    for m, seed in ((m1, 1), (m2, 2), (m3, 3), (m1, 1)):
        got = m.run(a, b, s, num_threads=2)
        np.testing.assert_array_equal(got[0], expected(a, b, s, seed)[0])
    with pytest.raises(CuvilError, match="no symbol netA_num_inputs"):
        loader.load(built["main"], prefix="netA")
    for m in (m1, m2, m3):
        m.close()


def test_ldd_only_system_libraries(built):
    for key in ("main", "renamed"):
        libs = check_dependencies(built[key])
        assert any(lib.startswith("libc.so") for lib in libs)
        assert unexpected_dependencies(libs) == [], libs
    assert unexpected_dependencies(["libstdc++.so.6", "libgcc_s.so.1", "libfoo.so (not found)"]) == [
        "libstdc++.so.6", "libgcc_s.so.1", "libfoo.so (not found)"]


# -- generators ------------------------------------------------------------------------------------


def test_c_string_literal_escapes():
    assert c_string_literal('a"b\\c?') == '"a\\"b\\\\c\\?"'
    assert c_string_literal("é1\n") == '"\\303\\2511\\012"'
    with pytest.raises(CuvilError):
        c_string_literal("a\0b")


def test_model_info_validation():
    f32 = 1
    with pytest.raises(CuvilError, match="C identifier"):
        ModelInfo([], [], 0, [], prefix="my-net")
    with pytest.raises(CuvilError, match="C identifier"):
        StepDesc("k.0", 1, 1)
    with pytest.raises(CuvilError, match="clash"):
        ModelInfo([], [], 0, [StepDesc("cuvil_run", 1, 1)])
    with pytest.raises(CuvilError, match="tensor 'x': element type code 8 cannot cross the C ABI"):
        IODesc("x", 8, (1,))  # STRING
    with pytest.raises(CuvilError, match=r"tensor 'x' has shape \[-1\]: a dim is not a size >= 0") as e:
        IODesc("x", f32, (-1,))
    assert "IODesc" not in str(e.value) and e.value.hint
    with pytest.raises(CuvilError, match=">= 1"):
        StepDesc("k", 10, 0)
    with pytest.raises(CuvilError, match="reserved"):
        generate_model_c(ModelInfo([], [], 0, [StepDesc("cuvil__steps", 1, 1)]))


def test_empty_model_and_link_errors(built, tmp_path):
    info = ModelInfo(inputs=[], outputs=[IODesc("y", 1, (None, 2))], arena_bytes=0,
                     steps=[StepDesc("k_empty", 1, 1)], prefix="empty")
    so = str(tmp_path / "libempty.so")
    link_shared(so, [built["kernels_o"]], generate_model_c(info), None, "empty")
    with loader.load(so, prefix="empty") as m:
        assert m.inputs == [] and m.outputs[0].shape == (None, 2)
        with pytest.raises(ShapeError, match="symbolic dims"):
            m.run()
    with pytest.raises(CuvilError, match="undefined reference to `k_missing'|k_missing"):
        link_shared(str(tmp_path / "libbad.so"), [built["kernels_o"]],
                    generate_model_c(ModelInfo([], [], 0, [StepDesc("k_missing", 1, 1)], prefix="bad")), None, "bad")
    with pytest.raises(CuvilError, match="error"):
        link_shared(str(tmp_path / "libbad.so"), [], "this is not C", None, "bad")
    assert not os.path.exists(tmp_path / "libbad.so")
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


C_PROGRAM = r"""
#include <stdio.h>
#include <stdlib.h>
#include "libnetA.h"
#include "libnet.h"   /* a second model's header in the same translation unit */

int main(void) {
  static float a[10000], b[10000], sum[10000], twice[10000];
  float scale = 0.5f;
  int64_t stats[4];
  int64_t s2[2] = {100, 100}, s1[1] = {4};
  for (int i = 0; i < 10000; ++i) { a[i] = (float)i; b[i] = 1.0f; }
  if (netA_num_inputs() != 3 || netA_num_outputs() != 3) return 2;
  int32_t nd = -1;
  if (netA_input_info(0, NULL, &nd, NULL) != CUVIL_OK || nd != 2) return 3;
  netA_session *s = netA_session_create(2);
  if (!s) { fprintf(stderr, "%s\n", netA_last_error()); return 4; }
  cuvil_tensor in[3] = {{a, CUVIL_DTYPE_FLOAT, 2, s2}, {b, CUVIL_DTYPE_FLOAT, 2, s2}, {&scale, CUVIL_DTYPE_FLOAT, 0, NULL}};
  cuvil_tensor out[3] = {{sum, CUVIL_DTYPE_FLOAT, 2, s2}, {twice, CUVIL_DTYPE_FLOAT, 2, s2}, {stats, CUVIL_DTYPE_INT64, 1, s1}};
  int rc = netA_run(s, in, out);
  if (rc) { fprintf(stderr, "%s: %s\n", netA_strerror(rc), netA_last_error()); return 5; }
  double total = 0;
  for (int i = 0; i < 10000; ++i) total += sum[i];
  printf("total %.3f twice0 %.6f chunks %lld\n", total, twice[0], (long long)stats[0]);
  in[0].dtype = CUVIL_DTYPE_DOUBLE;
  rc = netA_run(s, in, out);
  printf("error %d %s | %s\n", rc, netA_strerror(rc), netA_last_error());
  netA_session_destroy(s);
  printf("second model %s has %d inputs\n", cuvil_input_name(0), cuvil_num_inputs());
  return 0;
}
"""


def test_c_program_against_generated_header(built, tmp_path):
    src = tmp_path / "main.c"
    src.write_text(C_PROGRAM)
    exe = str(tmp_path / "main")
    d2, d1 = os.path.dirname(built["renamed"]), os.path.dirname(built["main"])
    subprocess.run(["cc", "-std=c99", "-Wall", "-Werror", "-pedantic", str(src), f"-I{d2}", f"-I{d1}",
                    f"-L{d2}", f"-L{d1}", "-lnetA", "-lnet", f"-Wl,-rpath,{d2}:{d1}", "-o", exe],
                   check=True, capture_output=True, text=True)
    out = subprocess.run([exe], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    w = weights_for(2)
    want_total = float((np.arange(N, dtype=np.float32) + np.float32(1) + w).astype(np.float64).sum())
    lines = out.stdout.splitlines()
    total, twice0, chunks = lines[0].split()[1::2]
    assert float(total) == pytest.approx(want_total, rel=1e-9, abs=1e-3)
    assert float(twice0) == pytest.approx(0.5 * (1 + float(w[0])), rel=1e-6)
    assert chunks == "2"
    assert lines[1].startswith("error -6 tensor dtype does not match the model | input 0 'a': dtype is 11")
    assert lines[2] == "second model a has 3 inputs"


def test_header_compiles_as_cxx(built, tmp_path):
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    src = tmp_path / "h.cc"
    src.write_text('#include "libnetA.h"\n#include "libnet.h"\nint main() { return netA_num_inputs() == 0 ? 1 : 0; }\n')
    subprocess.run([cxx, "-fsyntax-only", "-Wall", "-Werror", f"-I{os.path.dirname(built['renamed'])}",
                    f"-I{os.path.dirname(built['main'])}", str(src)], check=True)


def test_many_small_steps_oversubscribed_bit_exact():
    """60 small GEMM steps (4 chunks per thread, shares stolen back and forth) at 1-7 threads on however many
    cores the host has: every run is bit for bit the 1-thread result. A claim loaded in one step and
    succeeding in a later one, or a chunk run twice or never, would show here."""
    from onnx import TensorProto, helper, numpy_helper
    from cuvil import Pipeline
    rng = np.random.default_rng(21)
    nodes, inits, x = [], [], "x"
    for i in range(60):
        inits.append(numpy_helper.from_array((rng.standard_normal((32, 32, 1, 1)) / 6).astype(np.float32), f"w{i}"))
        nodes.append(helper.make_node("Conv", [x, f"w{i}"], [f"c{i}"], kernel_shape=[1, 1]))
        nodes.append(helper.make_node("Relu", [f"c{i}"], [f"y{i}"]))
        x = f"y{i}"
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 32, 28, 28])],
                          [helper.make_tensor_value_info(x, TensorProto.FLOAT, None)], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    art = Pipeline.from_onnx(m).compile()
    assert len(art.manifest["steps"]) == 60
    xs = rng.standard_normal((1, 32, 28, 28)).astype(np.float32)
    with art.model() as mod:
        ref = mod.run(xs, num_threads=1)[0]
        for threads in (2, 3, 7):
            for _ in range(15):
                np.testing.assert_array_equal(mod.run(xs, num_threads=threads)[0], ref)


# -- session memory: one mapping, zeroed and pre-faulted at session_create ------------------------------------

PREFAULT_KERNELS_C = r"""
#include <stdint.h>
enum { ARENA, W, OUT, SCRATCH };
#define ARENA_BYTES (8 << 20)
#define SCRATCH_BYTES (1 << 20)
/* out (int64[4]): [0] non-zero bytes seen, [1] misaligned regions, [2] scratch regions seen, [3] unused.
 * Every page of the arena and of the calling thread's scratch is read (must be zero on the first run) and
 * written; the chunks of k_touch cover the arena, and each chunk also walks its thread's scratch. */
void k_touch(void **bufs, int64_t b, int64_t e) {
  int64_t *out = bufs[OUT];
  volatile unsigned char *a = bufs[ARENA], *s = bufs[SCRATCH];
  if (((uintptr_t)a & 4095) || ((uintptr_t)s & 4095)) __atomic_fetch_add(&out[1], 1, __ATOMIC_RELAXED);
  for (int64_t p = b; p < e; ++p) {
    if (a[p * 4096] | a[p * 4096 + 4095]) __atomic_fetch_add(&out[0], 1, __ATOMIC_RELAXED);
    a[p * 4096] = 1;
  }
  for (int64_t off = 0; off < SCRATCH_BYTES; off += 4096) s[off] = 1;
  __atomic_fetch_add(&out[2], 1, __ATOMIC_RELAXED);
}
"""


@pytest.fixture(scope="module")
def prefault_lib(tmp_path_factory):
    root = tmp_path_factory.mktemp("prefault")
    ko = compile_kernels(root, PREFAULT_KERNELS_C)
    info = ModelInfo(inputs=[], outputs=[IODesc("out", 7, (4,))], arena_bytes=8 << 20, scratch_bytes=1 << 20,
                     steps=[StepDesc("k_touch", (8 << 20) // 4096, 1)], prefix="pf")
    so = str(root / "libpf.so")
    link_shared(so, [ko], generate_model_c(info), None, "pf")
    return so


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_session_memory_is_zero_and_prefaulted(prefault_lib, threads):
    """session_create maps the arena and every thread's scratch page-aligned and zero, and faults them in
    (MADV_POPULATE_WRITE, shared by the threads): the first run touches 2,048 arena pages and 256 scratch
    pages per thread, and takes far fewer page faults than that (a run that faulted them would take one per
    page: this fails without the pre-faulting)."""
    import resource
    lib = ctypes.CDLL(prefault_lib)
    lib.pf_session_create.restype = ctypes.c_void_p
    lib.pf_session_create.argtypes = [ctypes.c_int]
    lib.pf_run.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(CTensor)]
    lib.pf_session_destroy.argtypes = [ctypes.c_void_p]
    s = lib.pf_session_create(threads)
    assert s
    try:
        out = np.zeros(4, np.int64)
        shape = (ctypes.c_int64 * 1)(4)
        t = CTensor(out.ctypes.data, 7, 1, shape)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        assert lib.pf_run(s, None, ctypes.byref(t)) == 0
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        assert out[0] == 0 and out[1] == 0, out          # zero, page-aligned
        assert out[2] >= 1
        assert faults < 256, faults                     # 2,048 + 256 per thread pages if they faulted here
    finally:
        lib.pf_session_destroy(s)


def test_write_library_copies_whole_and_replaces_atomically(tmp_path):
    """write_library (every library the compiler writes or saves goes through it, in 2 MiB writes) copies
    every byte of a file spanning several blocks, leaves it executable, replaces the target by rename (a
    mapping of the old file keeps the old bytes) and leaves no temporary file behind, also on failure."""
    import mmap
    src, dst = tmp_path / "a.so", tmp_path / "b.so"
    data = np.random.default_rng(0).integers(0, 256, 2 * WRITE_BLOCK + 12345, dtype=np.uint8).tobytes()
    src.write_bytes(data)
    dst.write_bytes(b"old library")
    with open(dst, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as old:
        write_library(str(src), str(dst))
        assert old[:] == b"old library"
    assert dst.read_bytes() == data
    assert os.stat(dst).st_mode & 0o777 == 0o755
    with pytest.raises(FileNotFoundError):
        write_library(str(tmp_path / "missing.so"), str(dst))
    assert dst.read_bytes() == data
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.so", "b.so"]


def test_first_run_program_runs_a_library(built, tmp_path):
    """bench/first_run.c (the first-run and page-fault figures of write_library and prefault) loads a library
    with several inputs and outputs of mixed dtypes, runs it, and prints each run with its fault count; a
    library it cannot open fails with a message. No timing is asserted."""
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "first_run.c")
    exe = str(tmp_path / "first_run")
    subprocess.run(["cc", "-O2", src, "-o", exe, "-ldl"], check=True)
    for threads in (1, 2):
        out = subprocess.run([exe, built["main"], str(threads), "3"], check=True, capture_output=True,
                             text=True).stdout
        assert re.fullmatch(r"dlopen [\d.]+ create [\d.]+ \|( [\d.]+\(\d+\)){3}\n", out), out
    out = subprocess.run([exe, built["renamed"], "1", "2", "netA"], check=True, capture_output=True, text=True).stdout
    assert out.count("(") == 2
    bad = subprocess.run([exe, str(tmp_path / "missing.so"), "1"], capture_output=True, text=True)
    assert bad.returncode == 1 and "missing.so" in bad.stderr


# -- session handles -------------------------------------------------------------------------------


def test_stale_and_foreign_session_handles_get_an_error_code(built):
    f = _raw(built["main"])
    codes = {name: code for name, code, _ in ERROR_CODES}
    bad = codes["CUVIL_ERR_BAD_SESSION"]
    c = _Call()
    s = f["create"](1)
    assert f["run"](s, c.ins, c.out) == 0
    f["destroy"](s)
    c = _Call()
    assert f["run"](s, c.ins, c.out) == bad and c.untouched()          # use after destroy
    assert b"not a live session" in f["last_error"]()
    assert f["strerror"](bad).decode() == dict((v, m) for _, v, m in ERROR_CODES)[bad]
    out = (ctypes.c_int64 * 1)()
    assert f["output_shape"](s, None, 2, out) == bad
    f["destroy"](s)                                                     # double destroy: a no-op
    assert b"nothing was freed" in f["last_error"]()
    s2 = f["create"](2)                                                 # may take the same slot
    try:
        assert f["run"](s, c.ins, c.out) == bad and c.untouched()       # the old handle stays dead
        assert f["run"](s2, c.ins, c.out) == 0
    finally:
        f["destroy"](s2)
    junk = np.zeros(64, np.uint8)
    for foreign in (junk.ctypes.data, 1, 0xFFFFFFFF, (1 << 63) | 5):   # never handed out by this library
        c = _Call()
        assert f["run"](foreign, c.ins, c.out) == bad and c.untouched(), hex(foreign)
        f["destroy"](foreign)
    assert (junk == 0).all()


def test_a_session_of_another_library_is_foreign(built):
    fa, fb = _raw(built["main"]), _raw(built["twin"])
    s = fa["create"](1)
    try:
        c = _Call()
        assert fb["run"](s, c.ins, c.out) == -20 and c.untouched()
        fb["destroy"](s)                                                 # B frees nothing of A's
        assert fa["run"](s, c.ins, c.out) == 0
    finally:
        fa["destroy"](s)


@pytest.mark.skipif(shutil.which("cc") is None or shutil.which("nm") is None, reason="needs a C compiler and nm")
def test_isa_check_is_compiled_once_per_feature_list(tmp_path, monkeypatch):
    """The ISA check (model_c.generate_isa_c) is an object cached by its source: a second library with the same
    features links the same file, without compiling it again; other features, or another prefix, get their own."""
    monkeypatch.setenv("CUVIL_CACHE_DIR", str(tmp_path))
    a = isa_object("p", ("avx2", "fma"))
    stamp = os.stat(a).st_mtime_ns
    assert isa_object("p", ("avx2", "fma")) == a and os.stat(a).st_mtime_ns == stamp
    others = {isa_object("p", ("avx2",)), isa_object("q", ("avx2", "fma")), isa_object("p", ())}
    assert a not in others and len(others) == 3
    for obj, prefix in ((a, "p"), (isa_object("q", ("avx2", "fma")), "q")):
        syms = subprocess.run(["nm", obj], capture_output=True, text=True, check=True).stdout
        assert re.search(rf"\bT {prefix}__missing_isa$", syms, re.M), syms
    with pytest.raises(CuvilError, match="prefix must be a C identifier"):
        isa_object("not an identifier", ())
