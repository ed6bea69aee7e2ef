/* The float32 MatMul register tile alone (issue 20): the k-loop Cuvil generates for an 8 x 48 AVX-512 tile
 * (src/cuvil/targets/x86/matmul.py; per k: 3 panel vectors loaded, 8 broadcasts of A, 24 FMAs, the panel
 * prefetched PF rows ahead), written with intrinsics, so the kernel's ceiling can be told apart from what the
 * memory hierarchy costs it. Weights: P panels of K x 48 floats; A: M rows of K floats; as in Cuvil, every
 * row tile (8 rows) runs over one panel before the next panel. No epilogue, no output stores.
 *
 *   cc -O3 -march=native bench/gemm_ukernel.c -o /tmp/gemm_ukernel
 *   /tmp/gemm_ukernel K PF M P      # e.g. 768 32 384 64: BERT-base's 768 -> 3072 at S = 384
 *
 * Prints GFLOP/s in the thread's CPU time (best of 5); compare with bench/gemm_peak.py's peak and its
 * Cuvil / onnxruntime rows for the same shape. Needs AVX-512F.
 */
#include <immintrin.h>
#include <stdio.h>
#include "ukernel_8x48.h"
#include <stdlib.h>
#include <time.h>

static double cpu_now(void) {
  struct timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}

__attribute__((noinline)) static void tile(const float *w, const float *a, long lda, long k_len, float *out, long pf) {
  __m512 c[24];
  for (int i = 0; i < 24; i++) c[i] = _mm512_setzero_ps();
  for (long k = 0; k < k_len; k++) {
    if (pf)
      for (int line = 0; line < 3; line++) _mm_prefetch((const char *)(w + (k + pf) * 48 + 16 * line), _MM_HINT_T0);
    ukernel_8x48_step(w, a, lda, k, c);
  }
  for (int i = 0; i < 24; i++) _mm512_storeu_ps(out + 16 * i, c[i]);
}

int main(int argc, char **argv) {
  if (argc != 5) {
    fprintf(stderr, "usage: %s K PREFETCH_ROWS M PANELS (M a multiple of 8)\n", argv[0]);
    return 2;
  }
  long K = atol(argv[1]), pf = atol(argv[2]), M = atol(argv[3]), P = atol(argv[4]);
  if (K < 1 || pf < 0 || M < 8 || M % 8 || P < 1) {
    fprintf(stderr, "K >= 1, PREFETCH_ROWS >= 0, M a positive multiple of 8, PANELS >= 1\n");
    return 2;
  }
  long wn = (P * K + pf + 1) * 48;           /* prefetches past the last panel stay inside the buffer */
  float *w = aligned_alloc(64, ((wn * 4 + 63) / 64) * 64), *a = aligned_alloc(64, ((M * K * 4 + 63) / 64) * 64);
  static float out[384];
  if (!w || !a) return 1;
  for (long i = 0; i < wn; i++) w[i] = 1e-3f * (i % 7);
  for (long i = 0; i < M * K; i++) a[i] = 1e-3f * (i % 5);
  double flops = 2.0 * 8 * 48 * K * (M / 8) * P;
  long reps = (long)(4e9 / flops) + 1;
  double best = 1e30;
  for (int t = 0; t < 5; t++) {
    double t0 = cpu_now();
    for (long r = 0; r < reps; r++)
      for (long p = 0; p < P; p++)
        for (long m = 0; m < M; m += 8) tile(w + p * K * 48, a + m * K, K, K, out, pf);
    double dt = cpu_now() - t0;
    if (dt < best) best = dt;
  }
  printf("K=%ld prefetch=%ld M=%ld panels=%ld: %.1f GFLOP/s (checksum %g)\n", K, pf, M, P, flops * reps / best / 1e9, out[5]);
  return 0;
}
