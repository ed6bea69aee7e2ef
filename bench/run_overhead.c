/* The fixed cost of one cuvil_run on a tiny model: the ABI's validation, session lookup and step dispatch,
 * which a small model's run time is made of. Runs a library whose inputs are all static float32 (compile
 * with --fix) ROUNDS x RUNS times at THREADS threads (default 1) and prints the median and best round's
 * nanoseconds per run, wall clock and the process's CPU time (on a shared, loaded machine the CPU time is the
 * figure that does not count other processes' turns).
 *
 *     cc -O2 bench/run_overhead.c -o /tmp/run_overhead -ldl
 *     /tmp/run_overhead LIB.so [RUNS [ROUNDS [PREFIX [THREADS]]]]
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

typedef struct { void *data; int32_t dtype; int32_t ndim; int64_t *shape; } tensor;

static double now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e9 + t.tv_nsec;
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

static double cpu_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return t.tv_sec * 1e9 + t.tv_nsec;
}

static int cmp(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

static tensor make(int (*info)(int, int32_t *, int32_t *, int64_t *), int i) {
  tensor t;
  info(i, &t.dtype, &t.ndim, NULL);
  t.shape = calloc((size_t)t.ndim + 1, sizeof(int64_t));
  info(i, NULL, NULL, t.shape);
  size_t n = 1;
  for (int k = 0; k < t.ndim; ++k) n *= (size_t)t.shape[k];
  t.data = calloc(n + 16, 8);
  return t;
}

int main(int argc, char **argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: %s LIB.so [RUNS [ROUNDS [PREFIX [THREADS]]]]\n", argv[0]);
    return 2;
  }
  int runs = argc > 2 ? atoi(argv[2]) : 100000, rounds = argc > 3 ? atoi(argv[3]) : 21;
  const char *prefix = argc > 4 ? argv[4] : "cuvil";
  int threads = argc > 5 ? atoi(argv[5]) : 1;
  void *h = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    fprintf(stderr, "%s\n", dlerror());
    return 1;
  }
  int (*num_inputs)(void) = sym(h, prefix, "num_inputs"), (*num_outputs)(void) = sym(h, prefix, "num_outputs");
  int (*input_info)(int, int32_t *, int32_t *, int64_t *) = sym(h, prefix, "input_info");
  int (*output_info)(int, int32_t *, int32_t *, int64_t *) = sym(h, prefix, "output_info");
  void *(*create)(int) = sym(h, prefix, "session_create");
  int (*run)(void *, const tensor *, tensor *) = sym(h, prefix, "run");
  void (*destroy)(void *) = sym(h, prefix, "session_destroy");
  int ni = num_inputs(), no = num_outputs();
  tensor *ins = calloc((size_t)ni + 1, sizeof(tensor)), *outs = calloc((size_t)no + 1, sizeof(tensor));
  for (int i = 0; i < ni; ++i) ins[i] = make(input_info, i);
  for (int j = 0; j < no; ++j) outs[j] = make(output_info, j);
  void *s = create(threads);
  if (!s || run(s, ins, outs) != 0) {
    fprintf(stderr, "create/run failed\n");
    return 1;
  }
  double *per = malloc(sizeof(double) * (size_t)rounds), *cpu = malloc(sizeof(double) * (size_t)rounds);
  for (int r = 0; r < rounds; ++r) {
    double t0 = now_ns(), c0 = cpu_ns();
    for (int k = 0; k < runs; ++k) run(s, ins, outs);
    per[r] = (now_ns() - t0) / runs;
    cpu[r] = (cpu_ns() - c0) / runs;
  }
  qsort(per, (size_t)rounds, sizeof(double), cmp);
  qsort(cpu, (size_t)rounds, sizeof(double), cmp);
  printf("ns/run: median %.1f  best %.1f  cpu median %.1f  (%d rounds x %d runs, %d thread%s)\n", per[rounds / 2],
         per[0], cpu[rounds / 2], rounds, runs, threads, threads == 1 ? "" : "s");
  destroy(s);
  return 0;
}
