/* The machine's own latency floor: how steady a perfectly regular program runs here. Each "inference" is a
 * fixed amount of register-only FMA work (no memory traffic, no page faults, no allocation) that takes
 * WORK_MS, optionally plus a read of a STREAM_MB buffer (like a model's weights), cut into 16 chunks per
 * thread that THREADS threads (pinned one per CPU) claim from one counter, joined with a spin barrier, and
 * timed the way bench/run_all.py times a model: RUNS runs, each after a PAUSE_MS sleep.
 *
 *     cc -O2 -march=native -pthread bench/jitter_floor.c -o /tmp/jitter_floor
 *     /tmp/jitter_floor WORK_MS STREAM_MB THREADS RUNS PAUSE_MS      # e.g. 30 128 1 200 150
 *
 * Prints p50 / p90 / p99 / max and p99/p50. Nothing in it can be slow except the machine: a p99/p50 above
 * 1.0 here is time the vCPUs did not run (or ran slower), which no engine on this VM can avoid. bench/run_all.py
 * runs it beside each model (same work time, weights size, threads, runs and pauses) and reports both. */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define MAX_THREADS 64

static double now_ms(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e3 + t.tv_nsec * 1e-6;
}

/* 8 independent FMA chains of 16 floats: the compiler keeps them in registers. */
static float fma_work(long iters, float seed) {
  typedef float v16 __attribute__((vector_size(64)));
  v16 a[8], m, c;
  for (int k = 0; k < 16; ++k) { m[k] = 0.999999f; c[k] = 1e-7f; }
  for (int j = 0; j < 8; ++j)
    for (int k = 0; k < 16; ++k) a[j][k] = seed + (float)(j * 16 + k);
  for (long i = 0; i < iters; ++i)
    for (int j = 0; j < 8; ++j) a[j] = a[j] * m + c;
  float s = 0;
  for (int j = 0; j < 8; ++j)
    for (int k = 0; k < 16; ++k) s += a[j][k];
  return s;
}

static float stream_read(const float *b, size_t n) {
  typedef float v16 __attribute__((vector_size(64)));
  v16 acc = {0};
  for (size_t i = 0; i + 16 <= n; i += 16) acc += *(const v16 *)(b + i);
  float s = 0;
  for (int k = 0; k < 16; ++k) s += acc[k];
  return s;
}

#define CHUNKS_PER_THREAD 16

static int nthreads, nchunks;
static long iters_total;
static float *buf;
static size_t buf_floats;
static _Atomic int gen, arrived, stop, next_chunk;
static volatile float sink;

/* Claim chunks until none is left (a thread the host has stopped delays a run by at most the chunk it
 * holds: the best any scheduler can do). */
static void part(int t) {
  float s = 0;
  int c;
  while ((c = atomic_fetch_add(&next_chunk, 1)) < nchunks) {
    size_t lo = buf_floats * (size_t)c / (size_t)nchunks, hi = buf_floats * (size_t)(c + 1) / (size_t)nchunks;
    lo &= ~(size_t)15;
    hi &= ~(size_t)15;
    s += fma_work(iters_total / nchunks, (float)t);
    if (buf) s += stream_read(buf + lo, hi - lo);
  }
  sink = s;
}

static void pin(int cpu) {
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(cpu, &one);
  pthread_setaffinity_np(pthread_self(), sizeof one, &one);
}

static void *worker(void *p) {
  int t = (int)(long)p, seen = 0;
  pin(t);
  for (;;) {
    int g;
    while ((g = atomic_load(&gen)) == seen) {
      if (atomic_load(&stop)) return NULL;
      usleep(50);                                   /* sleeps through the pause like an idle pool */
    }
    seen = g;
    part(t);
    atomic_fetch_add(&arrived, 1);
  }
}

/* numpy.percentile's default (linear between the two nearest ranks), as bench.py reports */
static double pct(const double *sorted, int n, double q) {
  double x = q / 100 * (n - 1);
  int lo = (int)x;
  if (lo >= n - 1) return sorted[n - 1];
  return sorted[lo] + (x - lo) * (sorted[lo + 1] - sorted[lo]);
}

static int cmp(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

int main(int argc, char **argv) {
  if (argc != 6) {
    fprintf(stderr, "usage: %s WORK_MS STREAM_MB THREADS RUNS PAUSE_MS\n", argv[0]);
    return 2;
  }
  double work_ms = atof(argv[1]), stream_mb = atof(argv[2]);
  nthreads = atoi(argv[3]);
  int runs = atoi(argv[4]);
  double pause_ms = atof(argv[5]);
  if (nthreads < 1 || nthreads > MAX_THREADS || runs < 1) return 2;
  buf_floats = (size_t)(stream_mb * 1048576 / sizeof(float));
  if (buf_floats) {
    buf = aligned_alloc(64, (buf_floats * sizeof(float) + 63) / 64 * 64);
    for (size_t i = 0; i < buf_floats; ++i) buf[i] = (float)(i & 1023);
  }
  pin(0);
  /* calibrate the FMA loop on one thread: iterations per ms, best of 5 */
  double best = 1e30;
  for (int k = 0; k < 5; ++k) {
    double t0 = now_ms();
    sink = fma_work(1000000, 1.0f);
    double d = now_ms() - t0;
    if (d < best) best = d;
  }
  double stream_ms = 0;
  if (buf) {
    double t0 = now_ms();
    sink = stream_read(buf, buf_floats);
    stream_ms = (now_ms() - t0) / nthreads;
  }
  double fma_ms = work_ms - stream_ms > work_ms * 0.2 ? work_ms - stream_ms : work_ms * 0.2;
  nchunks = CHUNKS_PER_THREAD * nthreads;
  iters_total = (long)(fma_ms * nthreads * 1000000 / best);
  pthread_t th[MAX_THREADS];
  for (int t = 1; t < nthreads; ++t) pthread_create(&th[t], NULL, worker, (void *)(long)t);
  double *ms = malloc(sizeof(double) * (size_t)runs);
  for (int r = -3; r < runs; ++r) {                  /* 3 warm-up runs */
    usleep((useconds_t)(pause_ms * 1000));
    double t0 = now_ms();
    atomic_store(&arrived, 0);
    atomic_store(&next_chunk, 0);
    atomic_fetch_add(&gen, 1);
    part(0);
    while (atomic_load(&arrived) < nthreads - 1) __builtin_ia32_pause();
    if (r >= 0) ms[r] = now_ms() - t0;
  }
  atomic_store(&stop, 1);
  for (int t = 1; t < nthreads; ++t) pthread_join(th[t], NULL);
  qsort(ms, (size_t)runs, sizeof(double), cmp);
  double p50 = pct(ms, runs, 50), p90 = pct(ms, runs, 90), p99 = pct(ms, runs, 99);
  printf("{\"p50_ms\": %.3f, \"p90_ms\": %.3f, \"p99_ms\": %.3f, \"max_ms\": %.3f, \"p99_over_p50\": %.3f, "
         "\"threads\": %d, \"runs\": %d, \"stream_mb\": %.1f}\n", p50, p90, p99, ms[runs - 1], p99 / p50, nthreads,
         runs, stream_mb);
  return 0;
}
