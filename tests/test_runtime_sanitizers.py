"""runtime.c built with AddressSanitizer and UBSan together with a real model's generated pieces (kernels.o,
model.c, weights.S, captured from the compiler's link step), driven by a C program through sessions at 1 and
2 threads, bad inputs and use after destroy; and built with ThreadSanitizer, driven by two threads racing
create, run and destroy on shared handles. Any sanitizer report ends the driver with a failure."""
from __future__ import annotations

import os
import shutil
import subprocess

import numpy as np
import pytest

from cuvil.fuzz import c_abi
from cuvil.pipeline import Pipeline
from cuvil.targets.x86 import compile as x86_compile
from cuvil.targets.x86.link import COMPILE_FLAGS, RUNTIME_C, RUNTIME_DIR
from cuvil.targets.x86.model_c import generate_isa_c

SANITIZE = ("-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer", "-g")
ENV = {"ASAN_OPTIONS": "halt_on_error=1:abort_on_error=1:detect_leaks=1:detect_stack_use_after_return=1",
       "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1"}

DRIVER_C = r"""
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "libcabi.h"

#define C_IN 3
#define C_OUT 4
#define HW 36
#define CHECK(cond) do { if (!(cond)) { fprintf(stderr, "driver line %d: %s (%s)\n", __LINE__, #cond, \
                                                       cuvil_last_error()); exit(3); } } while (0)

static float x[4 * C_IN * HW], z[4 * C_OUT * HW], y[4 * C_OUT * HW + 1];
static int64_t xs[4], zs[4], ys[4];
static cuvil_tensor in[2], out[1];

static void setup(int64_t n) {
  for (int i = 0; i < 4 * C_IN * HW; ++i) x[i] = sinf(0.37f * i);
  for (int i = 0; i < 4 * C_OUT * HW; ++i) z[i] = cosf(0.11f * i);
  int64_t sx[4] = {n, C_IN, 6, 6}, sz[4] = {n, C_OUT, 6, 6};
  memcpy(xs, sx, sizeof sx); memcpy(zs, sz, sizeof sz); memcpy(ys, sz, sizeof sz);
  in[0] = (cuvil_tensor){x, CUVIL_DTYPE_FLOAT, 4, xs};
  in[1] = (cuvil_tensor){z, CUVIL_DTYPE_FLOAT, 4, zs};
  out[0] = (cuvil_tensor){y, CUVIL_DTYPE_FLOAT, 4, ys};
  memset(y, 0x7f, sizeof y);
}

static int untouched(void) {
  for (size_t i = 0; i < sizeof y / sizeof y[0]; ++i) {
    uint32_t u; memcpy(&u, &y[i], 4);
    if (u != 0x7f7f7f7fu) return 0;
  }
  return 1;
}

/* a bad call must return rc and leave y alone */
static void refused(cuvil_session *s, int rc) {
  memset(y, 0x7f, sizeof y);
  CHECK(cuvil_run(s, in, out) == rc);
  CHECK(untouched());
}

static float reference[3][4 * C_OUT * HW];

typedef struct { cuvil_session *s; int runs; int ok; } job;

static void *concurrent(void *p) {
  job *j = p;
  float xl[2 * C_IN * HW], zl[2 * C_OUT * HW], yl[2 * C_OUT * HW];
  memcpy(xl, x, sizeof xl); memcpy(zl, z, sizeof zl);
  int64_t sx[4] = {2, C_IN, 6, 6}, sz[4] = {2, C_OUT, 6, 6}, sy[4] = {2, C_OUT, 6, 6};
  cuvil_tensor i2[2] = {{xl, CUVIL_DTYPE_FLOAT, 4, sx}, {zl, CUVIL_DTYPE_FLOAT, 4, sz}};
  cuvil_tensor o2[1] = {{yl, CUVIL_DTYPE_FLOAT, 4, sy}};
  j->ok = 1;
  for (int k = 0; k < j->runs; ++k) {
    if (cuvil_run(j->s, i2, o2) != 0 || memcmp(yl, reference[1], sizeof yl) != 0) j->ok = 0;
  }
  return NULL;
}

int main(void) {
  const int64_t batches[3] = {1, 2, 4};
  CHECK(cuvil_num_inputs() == 2 && cuvil_num_outputs() == 1);
  CHECK(strcmp(cuvil_input_name(1), "z") == 0 && cuvil_input_name(2) == NULL && cuvil_output_name(-1) == NULL);
  int32_t dt, nd; int64_t shape[4];
  CHECK(cuvil_input_info(0, &dt, &nd, NULL) == 0 && dt == CUVIL_DTYPE_FLOAT && nd == 4);
  CHECK(cuvil_input_info(0, NULL, NULL, shape) == 0 && shape[0] == -1 && shape[1] == C_IN);
  CHECK(cuvil_output_info(1, &dt, &nd, shape) == CUVIL_ERR_INDEX);
  const char *name; int64_t lo, opt, hi;
  CHECK(cuvil_symbol_info(0, &name, &lo, &opt, &hi) == 0 && lo == 1 && hi == 4 && cuvil_symbol_info(1, 0, 0, 0, 0) < 0);
  CHECK(cuvil_session_create(-1) == NULL && cuvil_session_create(5000) == NULL);

  for (int threads = 1; threads <= 2; ++threads) {
    cuvil_session *s = cuvil_session_create(threads);
    CHECK(s != NULL);
    int64_t *prof = calloc(256, sizeof(int64_t));
    int nsteps = cuvil_profile(s, NULL, 0);
    CHECK(nsteps > 0 && nsteps <= 256 && cuvil_profile(s, prof, nsteps) == nsteps);
    for (int b = 0; b < 3; ++b) {
      setup(batches[b]);
      int64_t os[4];
      CHECK(cuvil_output_shape(s, in, 0, os) == 0 && os[0] == batches[b] && os[1] == C_OUT);
      CHECK(cuvil_run(s, in, out) == 0 && cuvil_run(s, in, out) == 0);
      size_t n = (size_t)batches[b] * C_OUT * HW;
      if (threads == 1) {
        memcpy(reference[b], y, n * sizeof(float));
        printf("y %lld", (long long)batches[b]);
        for (size_t i = 0; i < n; ++i) printf(" %.9g", y[i]);
        printf("\n");
      } else {
        CHECK(memcmp(reference[b], y, n * sizeof(float)) == 0);       /* the same bits at 2 threads */
      }
    }
    CHECK(cuvil_profile(s, NULL, 0) == nsteps);
    free(prof);

    setup(2);
    in[0].dtype = CUVIL_DTYPE_DOUBLE; refused(s, CUVIL_ERR_DTYPE); setup(2);
    in[1].ndim = 3; refused(s, CUVIL_ERR_NDIM); setup(2);
    in[0].data = NULL; refused(s, CUVIL_ERR_NULL_DATA); setup(2);
    in[1].shape = NULL; refused(s, CUVIL_ERR_NULL_SHAPE); setup(2);
    xs[0] = zs[0] = ys[0] = 5; refused(s, CUVIL_ERR_PROFILE); setup(2);
    xs[0] = zs[0] = ys[0] = 0; refused(s, CUVIL_ERR_PROFILE); setup(2);
    xs[2] = (int64_t)1 << 62; refused(s, CUVIL_ERR_DIM); setup(2);
    zs[0] = 3; refused(s, CUVIL_ERR_DIM); setup(2);
    ys[3] = 7; refused(s, CUVIL_ERR_DIM); setup(2);
    in[0].data = (char *)x + 2; refused(s, CUVIL_ERR_ALIGN); setup(2);
    out[0].data = z; CHECK(cuvil_run(s, in, out) == CUVIL_ERR_OVERLAP); setup(2);
    CHECK(cuvil_run(s, NULL, out) == CUVIL_ERR_NULL_INPUTS && cuvil_run(s, in, NULL) == CUVIL_ERR_NULL_OUTPUTS);
    CHECK(cuvil_run(NULL, in, out) == CUVIL_ERR_NULL_SESSION);

    cuvil_session_destroy(s);
    refused(s, CUVIL_ERR_BAD_SESSION);                                  /* use after destroy */
    CHECK(cuvil_output_shape(s, in, 0, shape) == CUVIL_ERR_BAD_SESSION);
    CHECK(cuvil_profile(s, NULL, 0) == CUVIL_ERR_BAD_SESSION);
    cuvil_session_destroy(s);                                           /* double destroy: nothing */
    cuvil_session *again = cuvil_session_create(threads);             /* may reuse the slot */
    refused(s, CUVIL_ERR_BAD_SESSION);
    setup(2);
    CHECK(cuvil_run(again, in, out) == 0);
    cuvil_session_destroy(again);
    refused((cuvil_session *)x, CUVIL_ERR_BAD_SESSION);                 /* a pointer it never handed out */
    cuvil_session_destroy((cuvil_session *)x);
    cuvil_session_destroy(NULL);
  }

  setup(2);
  job jobs[2] = {{cuvil_session_create(1), 40, 0}, {cuvil_session_create(2), 40, 0}};
  pthread_t t[2];
  for (int k = 0; k < 2; ++k) CHECK(jobs[k].s && pthread_create(&t[k], NULL, concurrent, &jobs[k]) == 0);
  for (int k = 0; k < 2; ++k) pthread_join(t[k], NULL);
  for (int k = 0; k < 2; ++k) { CHECK(jobs[k].ok); cuvil_session_destroy(jobs[k].s); }
  printf("done\n");
  return 0;
}
"""


TSAN = ("-fsanitize=thread", "-fno-omit-frame-pointer", "-g")
TSAN_ENV = {"TSAN_OPTIONS": "halt_on_error=1"}

TSAN_DRIVER_C = r"""
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "libcabi.h"

/* Two threads hammer four shared handle cells with create, run, destroy and stale destroys, so destroy races
 * run on another thread, two destroys race, and create reuses a slot another thread is destroying. */
#define C_IN 3
#define C_OUT 4
#define HW 36
#define CELLS 4
#define ITERS 400
static _Atomic(cuvil_session *) cells[CELLS];
static float x[C_IN * HW], z[C_OUT * HW], ref[C_OUT * HW];
static atomic_int bad;

static unsigned next(unsigned *r) { *r = *r * 1103515245u + 12345u; return *r >> 16; }

static int run(cuvil_session *s, float *y) {
  int64_t sx[4] = {1, C_IN, 6, 6}, sz[4] = {1, C_OUT, 6, 6}, sy[4] = {1, C_OUT, 6, 6};
  cuvil_tensor in[2] = {{x, CUVIL_DTYPE_FLOAT, 4, sx}, {z, CUVIL_DTYPE_FLOAT, 4, sz}};
  cuvil_tensor out[1] = {{y, CUVIL_DTYPE_FLOAT, 4, sy}};
  return cuvil_run(s, in, out);
}

static void *hammer(void *p) {
  unsigned r = (unsigned)(uintptr_t)p;
  float y[C_OUT * HW];
  for (int k = 0; k < ITERS; ++k) {
    int c = next(&r) % CELLS, op = next(&r) % 8;
    if (op < 2) {                                     /* create, replacing (and destroying) the cell's session */
      cuvil_session *s = cuvil_session_create(1 + (int)(next(&r) % 2));
      if (s == NULL) { atomic_store(&bad, 1); continue; }
      cuvil_session *old = atomic_exchange(&cells[c], s);
      if (old) cuvil_session_destroy(old);
    } else if (op < 3) {                              /* destroy without clearing the cell: stale handle left */
      cuvil_session *s = atomic_load(&cells[c]);
      if (s) cuvil_session_destroy(s);
    } else {
      cuvil_session *s = atomic_load(&cells[c]);
      if (!s) continue;
      int rc = run(s, y);
      if (rc == 0 && memcmp(y, ref, sizeof y) != 0) atomic_store(&bad, 2);
      if (rc != 0 && rc != CUVIL_ERR_BUSY && rc != CUVIL_ERR_BAD_SESSION) atomic_store(&bad, 3);
    }
  }
  return NULL;
}

int main(void) {
  for (int i = 0; i < C_IN * HW; ++i) x[i] = sinf(0.37f * i);
  for (int i = 0; i < C_OUT * HW; ++i) z[i] = cosf(0.11f * i);
  cuvil_session *s = cuvil_session_create(1);
  if (!s || run(s, ref) != 0) { fprintf(stderr, "reference run failed: %s\n", cuvil_last_error()); return 3; }
  cuvil_session_destroy(s);
  pthread_t t[2];
  for (int k = 0; k < 2; ++k) pthread_create(&t[k], NULL, hammer, (void *)(uintptr_t)(k * 7919 + 1));
  for (int k = 0; k < 2; ++k) pthread_join(t[k], NULL);
  for (int c = 0; c < CELLS; ++c) if (cells[c]) cuvil_session_destroy(cells[c]);
  if (atomic_load(&bad)) { fprintf(stderr, "driver: bad outcome %d\n", atomic_load(&bad)); return 4; }
  printf("done\n");
  return 0;
}
"""


def _sanitizers_work(tmp, sanitize=SANITIZE, env=ENV) -> str:
    """'' if cc builds and runs a program with these sanitizers here, else why not."""
    src = os.path.join(tmp, "probe.c")
    with open(src, "w") as f:
        f.write("int main(void) { return 0; }\n")
    exe = os.path.join(tmp, "probe")
    p = subprocess.run(["cc", *sanitize, src, "-o", exe], capture_output=True, text=True)
    if p.returncode != 0:
        return f"cc cannot build with {sanitize[0]}: {p.stderr.strip().splitlines()[-1:]}"
    p = subprocess.run([exe], capture_output=True, text=True, env={**os.environ, **env})
    if p.returncode != 0:
        return f"a {sanitize[0]} program does not run here: {p.stderr.strip()[:200]}"
    return ""


def _build_pieces(tmp, monkeypatch) -> dict:
    """Compiles the fuzz fixture, keeping copies of what the compiler hands to its link step."""
    pieces = {}
    real = x86_compile.link_shared

    def capture(out_so, objects, model_c_src, weights_S, prefix, *args, **kw):
        objs = []
        for k, o in enumerate(objects):
            objs.append(os.path.join(tmp, f"kernels{k}.o"))
            shutil.copy(o, objs[-1])
        ws = None
        if weights_S is not None:
            text = weights_S
            for line in weights_S.splitlines():
                if ".incbin" in line:
                    path = line.split('"')[1]
                    keep = os.path.join(tmp, os.path.basename(path))
                    shutil.copy(path, keep)
                    text = text.replace(path, keep)
            ws = os.path.join(tmp, "weights.S")
            with open(ws, "w") as f:
                f.write(text)
        with open(os.path.join(tmp, "model.c"), "w") as f:
            f.write(model_c_src)
        with open(os.path.join(tmp, "isa.c"), "w") as f:        # linked from a cached object (link.isa_object)
            f.write(generate_isa_c(prefix, kw.get("isa_checks", ())))
        pieces.update(objects=objs, weights=ws, model_c=os.path.join(tmp, "model.c"), isa_c=os.path.join(tmp, "isa.c"),
                      prefix=prefix)
        return real(out_so, objects, model_c_src, weights_S, prefix, *args, **kw)

    monkeypatch.setattr(x86_compile, "link_shared", capture)
    art = Pipeline.from_onnx(c_abi.fixture_model()).compile(shape_profiles=c_abi.PROFILE, cache=False)
    pieces["so"] = art.save(os.path.join(tmp, "libcabi.so"))
    return pieces


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
def test_runtime_under_asan_and_ubsan(tmp_path, monkeypatch):
    tmp = str(tmp_path)
    why = _sanitizers_work(tmp)
    if why:
        print(f"skipped: {why}")
        pytest.skip(why)
    p = _build_pieces(tmp, monkeypatch)
    assert p["prefix"] == "cuvil" and p["objects"]
    driver = os.path.join(tmp, "driver.c")
    with open(driver, "w") as f:
        f.write(DRIVER_C)
    exe = os.path.join(tmp, "driver")
    flags = [f for f in COMPILE_FLAGS if f != "-O2"] + ["-O1"]
    cmd = ["cc", *flags, *SANITIZE, "-DCUVIL_PREFIX=cuvil", f"-I{RUNTIME_DIR}", f"-I{tmp}", driver, RUNTIME_C,
           p["model_c"], p["isa_c"], *([p["weights"]] if p["weights"] else []), *p["objects"], "-o", exe, "-lm", "-lpthread"]
    b = subprocess.run(cmd, capture_output=True, text=True)
    assert b.returncode == 0, b.stderr
    r = subprocess.run([exe], capture_output=True, text=True, env={**os.environ, **ENV}, timeout=120)
    assert r.returncode == 0 and "done" in r.stdout, r.stderr[-3000:]
    assert "runtime error" not in r.stderr and "Sanitizer" not in r.stderr, r.stderr[-3000:]
    rows = [line.split() for line in r.stdout.splitlines() if line.startswith("y ")]
    assert [int(row[1]) for row in rows] == [1, 2, 4]
    for row in rows:
        n = int(row[1])
        x = np.sin(np.float32(0.37) * np.arange(4 * 3 * 36, dtype=np.float32))[:n * 3 * 36].reshape(n, 3, 6, 6)
        z = np.cos(np.float32(0.11) * np.arange(4 * 4 * 36, dtype=np.float32))[:n * 4 * 36].reshape(n, 4, 6, 6)
        got = np.array(row[2:], np.float64).reshape(n, 4, 6, 6)
        np.testing.assert_allclose(got, c_abi.reference(x, z), rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
def test_session_registry_under_tsan(tmp_path, monkeypatch):
    """Two threads race create (reusing slots), run, destroy and destroys of stale handles on four shared
    handle cells, with 1- and 2-thread sessions (the pool's start, steps and shutdown): no data race, every
    call either succeeds with the reference bits or returns CUVIL_ERR_BUSY / CUVIL_ERR_BAD_SESSION. The
    registry before the DYING state raced here every time (destroy read the slot's session after handing the
    slot to a concurrent create)."""
    tmp = str(tmp_path)
    why = _sanitizers_work(tmp, TSAN, TSAN_ENV)
    if why:
        print(f"skipped: {why}")
        pytest.skip(why)
    p = _build_pieces(tmp, monkeypatch)
    driver = os.path.join(tmp, "tsan_driver.c")
    with open(driver, "w") as f:
        f.write(TSAN_DRIVER_C)
    exe = os.path.join(tmp, "tsan_driver")
    flags = [f for f in COMPILE_FLAGS if f != "-O2"] + ["-O1"]
    cmd = ["cc", *flags, *TSAN, "-DCUVIL_PREFIX=cuvil", f"-I{RUNTIME_DIR}", f"-I{tmp}", driver, RUNTIME_C,
           p["model_c"], p["isa_c"], *([p["weights"]] if p["weights"] else []), *p["objects"], "-o", exe, "-lm", "-lpthread"]
    b = subprocess.run(cmd, capture_output=True, text=True)
    assert b.returncode == 0, b.stderr
    for _ in range(3):
        r = subprocess.run([exe], capture_output=True, text=True, env={**os.environ, **TSAN_ENV}, timeout=120)
        assert r.returncode == 0 and "done" in r.stdout, r.stderr[-3000:]
        assert "ThreadSanitizer" not in r.stderr, r.stderr[-3000:]
