/* Cross-core read bandwidth: how fast one core reads a buffer another core has just written (the lines sit
 * modified in the writer's L2), against reading what it wrote itself. This is the cost the runtime's chunk
 * affinity avoids (runtime.c, claim_chunks): consecutive steps cut the same way run their parts of a tensor on
 * the core that wrote them.
 *
 *     cc -O3 -march=native -pthread bench/cross_core.c -o /tmp/cross_core && /tmp/cross_core 64 256 800 4096
 *
 * Prints, per buffer size in KiB, the best of 20 reads by core 0 of a buffer written by core 1 ("remote") and
 * by core 0 itself ("local"). On the 2-core Zen 5 VM of bench/RESULTS.md, 64 KiB to 4 MiB, local reads ran at
 * 126-134 GB/s and remote ones at 36-47 GB/s in one measurement, 83-122 GB/s half an hour later: where the
 * host places the two vCPUs (one L3 or two) changes, and so does the cost of sharing data between them. */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define ROUNDS 20

static size_t n;
static float *buf;
static atomic_int phase;

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static void pin(int cpu) {
  cpu_set_t s;
  CPU_ZERO(&s);
  CPU_SET(cpu, &s);
  pthread_setaffinity_np(pthread_self(), sizeof s, &s);
}

static void fill(int r) {
  for (size_t i = 0; i < n; ++i) buf[i] = (float)(r + i);
}

static float sum(void) {
  float a[16] = {0};
  for (size_t i = 0; i < n; i += 16)
    for (int j = 0; j < 16; ++j) a[j] += buf[i + j];
  float s = 0;
  for (int j = 0; j < 16; ++j) s += a[j];
  return s;
}

static void *writer(void *unused) {
  (void)unused;
  pin(1);
  for (int r = 0; r < ROUNDS; ++r) {
    while (atomic_load(&phase) != 2 * r + 1) {
    }
    fill(r);
    atomic_store(&phase, 2 * r + 2);
  }
  return NULL;
}

static void measure(size_t kib) {
  n = kib * 256;
  buf = aligned_alloc(64, n * sizeof(float));
  memset(buf, 0, n * sizeof(float));
  atomic_store(&phase, 0);
  pthread_t t;
  pthread_create(&t, NULL, writer, NULL);
  double remote = 1e9, local = 1e9;
  float check = 0;
  for (int r = 0; r < ROUNDS; ++r) {
    atomic_store(&phase, 2 * r + 1);
    while (atomic_load(&phase) != 2 * r + 2) {
    }
    double t0 = now();
    check += sum();
    double t1 = now();
    if (t1 - t0 < remote) remote = t1 - t0;
    fill(r);
    t0 = now();
    check += sum();
    t1 = now();
    if (t1 - t0 < local) local = t1 - t0;
  }
  pthread_join(t, NULL);
  double bytes = (double)n * sizeof(float);
  printf("%6zu KiB: remote %8.1f us (%5.1f GB/s)  local %8.1f us (%5.1f GB/s)  [%g]\n", kib, remote * 1e6,
         bytes / remote / 1e9, local * 1e6, bytes / local / 1e9, check);
  free(buf);
}

int main(int argc, char **argv) {
  pin(0);
  if (argc < 2) {
    fprintf(stderr, "usage: %s KIB [KIB ...]\n", argv[0]);
    return 2;
  }
  for (int i = 1; i < argc; ++i) measure((size_t)atoi(argv[i]));
  return 0;
}
