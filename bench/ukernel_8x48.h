/* The 8 x 48 float32 register tile of cuvil.targets.x86.matmul (24 zmm accumulators, 3 panel vectors a k step,
   8 broadcasts of A), shared by the C probes bench/gemm_ukernel.c and bench/next_panel_probe.c: one k step of
   the tile over a K x 48 weight panel w (rows 48 floats apart) and 8 rows of A (lda floats apart). */
#ifndef CUVIL_BENCH_UKERNEL_8X48_H
#define CUVIL_BENCH_UKERNEL_8X48_H
#include <immintrin.h>

static inline void ukernel_8x48_step(const float *w, const float *a, long lda, long k, __m512 c[24]) {
  __m512 b0 = _mm512_loadu_ps(w + k * 48), b1 = _mm512_loadu_ps(w + k * 48 + 16), b2 = _mm512_loadu_ps(w + k * 48 + 32);
  for (int r = 0; r < 8; r++) {
    __m512 s = _mm512_set1_ps(a[r * lda + k]);
    c[3 * r] = _mm512_fmadd_ps(s, b0, c[3 * r]);
    c[3 * r + 1] = _mm512_fmadd_ps(s, b1, c[3 * r + 1]);
    c[3 * r + 2] = _mm512_fmadd_ps(s, b2, c[3 * r + 2]);
  }
}
#endif
