/* A fresh process's first runs of a compiled model, from C: dlopen, session create, then RUNS runs, each
 * with its wall time and the minor page faults it took (getrusage). What the first-run figures in
 * src/cuvil/targets/x86/link.py (write_library) and runtime.c (prefault) were measured with.
 *
 *     cc -O2 bench/first_run.c -o /tmp/first_run -ldl
 *     /tmp/first_run LIB.so THREADS [RUNS [PREFIX]]          # e.g. build/libresnet50.so 2 4
 *     dd if=LIB.so of=/tmp/small.so bs=4k && /tmp/first_run /tmp/small.so 1 3   # the library in 4 KiB pages
 *
 * Prints "dlopen MS create MS | RUN_MS(FAULTS) ...". Float32 inputs get a fixed pattern, others zeros; every
 * dim must be static (compile with --fix). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>

typedef struct { void *data; int32_t dtype; int32_t ndim; int64_t *shape; } tensor;

static double now_ms(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e3 + t.tv_nsec * 1e-6;
}

static size_t dtype_bytes(int32_t code) {       /* ONNX TensorProto codes */
  switch (code) {
    case 2: case 3: case 9: return 1;
    case 4: case 5: case 10: case 16: return 2;
    case 11: case 7: case 13: case 14: return 8;
    case 15: return 16;
    default: return 4;
  }
}

static long minflt(void) {
  struct rusage r;
  getrusage(RUSAGE_SELF, &r);
  return r.ru_minflt;
}

static void *sym(void *h, const char *prefix, const char *name) {
  char full[256];
  snprintf(full, sizeof full, "%s_%s", prefix, name);
  void *f = dlsym(h, full);
  if (!f) {
    fprintf(stderr, "%s: not exported\n", full);
    exit(1);
  }
  return f;
}

int main(int argc, char **argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: %s LIB.so THREADS [RUNS [PREFIX]]\n", argv[0]);
    return 2;
  }
  int threads = atoi(argv[2]), runs = argc > 3 ? atoi(argv[3]) : 4;
  const char *prefix = argc > 4 ? argv[4] : "cuvil";
  double t0 = now_ms();
  void *h = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    fprintf(stderr, "%s\n", dlerror());
    return 1;
  }
  void *(*create)(int) = (void *(*)(int))sym(h, prefix, "session_create");
  int (*run)(void *, tensor *, tensor *) = (int (*)(void *, tensor *, tensor *))sym(h, prefix, "run");
  int (*info_in)(int, int32_t *, int32_t *, int64_t *) = (int (*)(int, int32_t *, int32_t *, int64_t *))sym(h, prefix, "input_info");
  int (*info_out)(int, int32_t *, int32_t *, int64_t *) = (int (*)(int, int32_t *, int32_t *, int64_t *))sym(h, prefix, "output_info");
  const char *(*last_error)(void) = (const char *(*)(void))sym(h, prefix, "last_error");
  double t1 = now_ms();
  void *s = create(threads);
  double t2 = now_ms();
  if (!s) {
    fprintf(stderr, "session_create: %s\n", last_error());
    return 1;
  }
  int (*num_inputs)(void) = (int (*)(void))sym(h, prefix, "num_inputs");
  int (*num_outputs)(void) = (int (*)(void))sym(h, prefix, "num_outputs");
  int ni = num_inputs(), no = num_outputs();
  tensor *in = calloc((size_t)(ni > 0 ? ni : 1), sizeof(tensor)), *out = calloc((size_t)(no > 0 ? no : 1), sizeof(tensor));
  for (int i = 0; i < ni + no; ++i) {
    tensor *t = i < ni ? &in[i] : &out[i - ni];
    int (*info)(int, int32_t *, int32_t *, int64_t *) = i < ni ? info_in : info_out;
    int j = i < ni ? i : i - ni;
    info(j, &t->dtype, &t->ndim, NULL);
    t->shape = calloc((size_t)(t->ndim > 0 ? t->ndim : 1), sizeof(int64_t));
    info(j, NULL, NULL, t->shape);
    size_t n = 1;
    for (int k = 0; k < t->ndim; ++k) {
      if (t->shape[k] < 0) {
        fprintf(stderr, "%s %d has a symbolic dim: compile with --fix\n", i < ni ? "input" : "output", j);
        return 2;
      }
      n *= (size_t)t->shape[k];
    }
    size_t bytes = n * dtype_bytes(t->dtype);
    t->data = aligned_alloc(64, (bytes + 64) / 64 * 64);
    memset(t->data, 0, bytes);
    if (i < ni && t->dtype == 1)                        /* float32 inputs: a fixed pattern in [0, 1) */
      for (size_t e = 0; e < n; ++e) ((float *)t->data)[e] = (float)((e * 2654435761u) % 1000) / 1000.f;
  }
  printf("dlopen %.2f create %.2f |", t1 - t0, t2 - t1);
  for (int r = 0; r < runs; ++r) {
    long f0 = minflt();
    double a = now_ms();
    if (run(s, in, out) != 0) {
      fprintf(stderr, "run: %s\n", last_error());
      return 1;
    }
    printf(" %.1f(%ld)", now_ms() - a, minflt() - f0);
  }
  printf("\n");
  return 0;
}
