/* What a pause costs a model's first reads: an 8 MiB buffer (SqueezeNet's weights are 7.8 MB) read hot,
 * then read again after each of 15 pauses of 150 ms (bench/run_all.py's pause between timed runs).
 *
 *     cc -O2 -march=native bench/idle_refetch.c -o /tmp/idle_refetch && /tmp/idle_refetch 8
 *
 * Prints the best hot read and the mean read after a pause, for 4 KiB pages and for transparent huge pages
 * (MADV_HUGEPAGE), reading every float and one line per 4 KiB page. On the 2-core VM of bench/RESULTS.md
 * the hot read took 0.064-0.069 ms (the buffer in L3) and the read after a pause 0.21-0.26 ms: the buffer
 * comes back from DRAM (other tenants' work, or the host moving the idle vCPU, empties the L3 it was in),
 * which is why a small model's 2-thread runs after a pause take 0.3-0.8 ms longer than back-to-back ones
 * (`python3 bench/pause_effect.py squeezenet`). Huge pages cut the page-walk part (one line per page:
 * 0.050 -> 0.026 ms), not the refetch. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#define ROUNDS 15

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static float sum(const float *b, size_t n, size_t step) {
  float a[16] = {0};
  for (size_t i = 0; i < n; i += step)
    for (int j = 0; j < 16; ++j) a[j] += b[i + j];
  float s = 0;
  for (int j = 0; j < 16; ++j) s += a[j];
  return s;
}

static void measure(size_t mib, int huge, size_t step) {
  size_t n = mib << 18, align = (size_t)2 << 20;
  char *raw = mmap(NULL, n * sizeof(float) + align, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) {
    perror("mmap");
    exit(1);
  }
  float *b = (float *)(((size_t)raw + align - 1) & ~(align - 1));
  if (huge) madvise(b, n * sizeof(float), MADV_HUGEPAGE);
  for (size_t i = 0; i < n; ++i) b[i] = (float)i;
  float check = 0;
  double hot = 1e9, after = 0;
  for (int r = 0; r < ROUNDS; ++r) {
    double t0 = now();
    check += sum(b, n, step);
    double t = now() - t0;
    if (t < hot) hot = t;
  }
  for (int r = 0; r < ROUNDS; ++r) {
    usleep(150000);
    double t0 = now();
    check += sum(b, n, step);
    after += now() - t0;
  }
  printf("%zu MiB, %s pages, %s: hot %.3f ms, after a 150 ms pause %.3f ms  [%g]\n", mib, huge ? "huge" : "4 KiB",
         step == 16 ? "every float" : "a line per 4 KiB", hot * 1e3, after / ROUNDS * 1e3, check);
  munmap(raw, n * sizeof(float) + align);
}

int main(int argc, char **argv) {
  size_t mib = argc > 1 ? (size_t)atoi(argv[1]) : 8;
  for (int huge = 0; huge < 2; ++huge) {
    measure(mib, huge, 16);
    measure(mib, huge, 1024);
  }
  return 0;
}
