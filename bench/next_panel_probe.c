/* BERT's dense layers with their weights streaming from memory (bench/RESULTS.md, session 19): the 8 x 48 float32
 * k-loop of src/cuvil/targets/x86/matmul.py (3 panel vectors, 8 broadcasts, 24 FMAs per k; the panel's own rows
 * prefetched 32 steps ahead into L1) over P distinct K x 48 weight panels, M / 8 row tiles per panel, with the
 * NEXT panel prefetched into L2 while the row tiles run (MODE):
 *   0  none
 *   1  line t % 3 of every row by row tile t (what matmul.py does; HINT 1 = prefetcht1, 2 = t2, 3 = nta)
 *   4  the next panel in memory order, one line per k step (row tiles 0-2 cover it)
 *   5  the same, two lines per k step
 *   6  the same, one line every 4 k steps
 *   7  memory order spread evenly over all M / 8 row tiles
 * DIST: panels ahead (1 = the next). HUGE=1 in the environment: the weights on transparent huge pages.
 * P = 2,300 panels of K = 768 is BERT-base's 340 MB; P = 4 keeps them in L2 (the loop's own ceiling).
 *
 *   cc -O3 -march=native bench/next_panel_probe.c -o /tmp/next_panel_probe
 *   /tmp/next_panel_probe K M P MODE [DIST [HINT]]      # e.g. 768 32 2300 1
 *
 * Prints the best of 5 passes in thread CPU time: ms, GFLOP/s, and GB/s of weights. Needs AVX-512F.
 */
#include <immintrin.h>
#include <stdio.h>
#include "ukernel_8x48.h"
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/mman.h>
static double now(void){struct timespec t;clock_gettime(CLOCK_THREAD_CPUTIME_ID,&t);return t.tv_sec+1e-9*t.tv_nsec;}
/* one 8x48 tile over a K x 48 panel; next-panel prefetch: mode 0 none, 1 lines (t%3 line of each row, T1),
   2 lines two panels ahead, 3 all 3 lines of next panel from tile t< 1 ... */
static long MODE, DIST=1, SPREAD=1; static int HINT=1;
__attribute__((noinline)) static void tile(const float *w, const float *a, long lda, long K, float *out, long t, long nextoff) {
  __m512 c[24];
  for (int i = 0; i < 24; i++) c[i] = _mm512_setzero_ps();
  long line = (t % 3) * 16;
  for (long k = 0; k < K; k++) {
    _mm_prefetch((const char *)(w + (k + 32) * 48), _MM_HINT_T0);
    _mm_prefetch((const char *)(w + (k + 32) * 48 + 16), _MM_HINT_T0);
    _mm_prefetch((const char *)(w + (k + 32) * 48 + 32), _MM_HINT_T0);
    if (MODE == 1) { if (HINT==1) _mm_prefetch((const char *)(w + nextoff + k * 48 + line), _MM_HINT_T1);
                     else if (HINT==2) _mm_prefetch((const char *)(w + nextoff + k * 48 + line), _MM_HINT_T2);
                     else _mm_prefetch((const char *)(w + nextoff + k * 48 + line), _MM_HINT_NTA); }
    if (MODE == 4) { long q = t * K + k; if (q < 3 * K) _mm_prefetch((const char *)(w + nextoff + q * 16), _MM_HINT_T1); }
    if (MODE == 5) { long q = (t * K + k) * 2; if (q < 3 * K) { _mm_prefetch((const char *)(w + nextoff + q * 16), _MM_HINT_T1); _mm_prefetch((const char *)(w + nextoff + q * 16 + 16), _MM_HINT_T1);} }
    if (MODE == 6) { if ((k & 3) == 0) { long q = (t * K + k); if (q < 3 * K) _mm_prefetch((const char *)(w + nextoff + q * 16), _MM_HINT_T1);} }
    if (MODE == 7) { long g = t * K + k; if (g % SPREAD == 0) { long q = g / SPREAD; if (q < 3 * K) _mm_prefetch((const char *)(w + nextoff + q * 16), _MM_HINT_T1);} }
    ukernel_8x48_step(w, a, lda, k, c);
  }
  for (int i = 0; i < 24; i++) _mm512_storeu_ps(out + 16 * i, c[i]);
}
int main(int argc, char **argv) {
  long K = atol(argv[1]), M = atol(argv[2]), P = atol(argv[3]); MODE = atol(argv[4]); DIST = argc > 5 ? atol(argv[5]) : 1; HINT = argc > 6 ? atoi(argv[6]) : 1;
  long wn = (P + 4) * K * 48;
  float *w = aligned_alloc(2 << 20, ((wn * 4 + (2 << 20) - 1) >> 21) << 21), *a = aligned_alloc(64, M * K * 4), *out = aligned_alloc(64, 8 * 48 * 4 * 4);
  if (getenv("HUGE")) madvise(w, wn * 4, MADV_HUGEPAGE);
  for (long i = 0; i < wn; i++) w[i] = (i % 7) * 0.01f;
  for (long i = 0; i < M * K; i++) a[i] = (i % 5) * 0.1f;
  long T = M / 8; SPREAD = T / 3 > 1 ? T / 3 : 1; double best = 1e9, sum = 0;
  for (int rep = 0; rep < 5; rep++) {
    double t0 = now();
    for (long p = 0; p < P; p++)
      for (long t = 0; t < T; t++) tile(w + p * K * 48, a + t * 8 * K, K, K, out, t, DIST * K * 48);
    double dt = now() - t0; if (dt < best) best = dt; sum += out[3];
  }
  double flops = 2.0 * M * K * 48 * P;
  printf("K=%ld M=%ld P=%ld mode=%ld dist=%ld hint=%d: %.2f ms, %.1f GFLOP/s, %.2f GB/s weights (%g)\n", K, M, P, MODE, DIST, HINT, best*1e3, flops/best/1e9, P*K*48*4/best/1e9, sum);
}
