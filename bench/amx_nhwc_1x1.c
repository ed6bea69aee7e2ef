/* How fast a plain channels-last (NHWC) 1x1 convolution runs on AMX tiles at batch 1 (a learning benchmark
 * for Cuvil's layout question, bench/results/xeon-session28/): activations [P][C] bf16 as the A tiles (16
 * positions x 32 channels, rows C*2 bytes apart), weights [C/2][M][2] (VNNI pairs) as the B tiles, 2 x 2 tiles a
 * unit (32 positions x 32 output channels), bias + ReLU rounded to bf16 into [P][M]. The chain of ResNet-50's
 * stage 1 bottleneck ends: 64 -> 256 (the expansion, writing a 1.6 MB map) then 256 -> 64 (its reader).
 * bench/amx_nhwc_1x1.py builds it (gcc -O2 -march=sapphirerapids -shared) and runs it beside Cuvil's own
 * (channel-planar) kernels for the same two layers, in one process. Written for this measurement, not a kernel
 * of Cuvil's: no partial panels (P a multiple of 32), no residual. */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <math.h>
#include <sys/syscall.h>

typedef struct { uint8_t palette, start; uint8_t r0[14]; uint16_t colsb[16]; uint8_t rows[16]; } tilecfg;

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }

static uint16_t bf(float f) { uint32_t u; memcpy(&u, &f, 4); u += 0x7fff + ((u >> 16) & 1); return (uint16_t)(u >> 16); }

static void conv1x1(const uint16_t *X, int P, int K, const uint16_t *Wv, const float *bias, int M, uint16_t *Y) {
  float ct[4][256] __attribute__((aligned(64)));
  for (int p = 0; p < P; p += 32)
    for (int m = 0; m < M; m += 32) {
      _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
      for (int k = 0; k < K; k += 32) {
        _tile_loadd(4, X + (size_t)p * K + k, K * 2);
        _tile_loadd(5, X + (size_t)(p + 16) * K + k, K * 2);
        _tile_loadd(6, Wv + (size_t)(k / 2) * M * 2 + m * 2, M * 4);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(2, 5, 6);
        _tile_loadd(7, Wv + (size_t)(k / 2) * M * 2 + (m + 16) * 2, M * 4);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(3, 5, 7);
      }
      _tile_stored(0, ct[0], 64); _tile_stored(1, ct[1], 64); _tile_stored(2, ct[2], 64); _tile_stored(3, ct[3], 64);
      for (int t = 0; t < 4; ++t) {
        int i = t >> 1, j = t & 1;
        __m512 b = _mm512_loadu_ps(bias + m + 16 * j), z = _mm512_setzero_ps();
        for (int r = 0; r < 16; ++r) {
          __m512 v = _mm512_max_ps(_mm512_add_ps(_mm512_load_ps(ct[t] + 16 * r), b), z);
          __m256bh h = _mm512_cvtneps_pbh(v);
          _mm256_storeu_si256((__m256i *)(Y + (size_t)(p + 16 * i + r) * M + m + 16 * j), (__m256i)h);
        }
      }
    }
}

static float f32(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }

/* Rounds of the chain: 64 -> 256 then 256 -> 64 over P positions (P a multiple of 32); per round the two
 * layers' seconds into t1[r], t2[r]; *err: the largest relative difference of 64 outputs a layer from a scalar
 * reference. Returns 0, or -1 where Linux refuses the tile state. */
int nhwc_chain(int P, int rounds, double *t1, double *t2, double *err) {
  if (syscall(158, 0x1023, 18)) return -1;
  tilecfg cfg = {0};
  cfg.palette = 1;
  for (int i = 0; i < 8; ++i) { cfg.colsb[i] = 64; cfg.rows[i] = 16; }
  _tile_loadconfig(&cfg);
  int C0 = 64, C1 = 256;
  uint16_t *X0 = aligned_alloc(64, (size_t)P * C0 * 2), *Y1 = aligned_alloc(64, (size_t)P * C1 * 2),
           *Y2 = aligned_alloc(64, (size_t)P * C0 * 2), *W1 = aligned_alloc(64, (size_t)C0 * C1 * 2),
           *W2 = aligned_alloc(64, (size_t)C1 * C0 * 2);
  float *b1 = aligned_alloc(64, C1 * 4), *b0 = aligned_alloc(64, C0 * 4);
  srand(1);
  for (size_t i = 0; i < (size_t)P * C0; ++i) X0[i] = bf((rand() / (float)RAND_MAX) * 2 - 1);
  for (size_t i = 0; i < (size_t)C0 * C1; ++i) { W1[i] = bf(((rand() / (float)RAND_MAX) * 2 - 1) * 0.1f); W2[i] = bf(((rand() / (float)RAND_MAX) * 2 - 1) * 0.06f); }
  for (int i = 0; i < C1; ++i) b1[i] = 0.01f * (i % 7);
  for (int i = 0; i < C0; ++i) b0[i] = 0.01f * (i % 5);
  for (int r = 0; r < rounds; ++r) {
    double a = now();
    conv1x1(X0, P, C0, W1, b1, C1, Y1);     /* 64 -> 256: writes the 1.6 MB map (at P = 3136) */
    double b = now();
    conv1x1(Y1, P, C1, W2, b0, C0, Y2);     /* 256 -> 64: reads it */
    double c = now();
    t1[r] = b - a; t2[r] = c - b;
  }
  double worst = 0;
  for (int q = 0; q < 64; ++q) {
    int p = (q * 977) % P, m1 = (q * 37) % C1, m2 = (q * 13) % C0;
    float s1 = b1[m1], s2 = b0[m2];
    for (int k = 0; k < C0; ++k) s1 += f32(X0[(size_t)p * C0 + k]) * f32(W1[(size_t)(k / 2) * C1 * 2 + m1 * 2 + (k & 1)]);
    for (int k = 0; k < C1; ++k) s2 += f32(Y1[(size_t)p * C1 + k]) * f32(W2[(size_t)(k / 2) * C0 * 2 + m2 * 2 + (k & 1)]);
    s1 = s1 > 0 ? s1 : 0; s2 = s2 > 0 ? s2 : 0;
    double e1 = fabs(f32(Y1[(size_t)p * C1 + m1]) - s1) / (1e-3 + fabs(s1)), e2 = fabs(f32(Y2[(size_t)p * C0 + m2]) - s2) / (1e-3 + fabs(s2));
    if (e1 > worst) worst = e1;
    if (e2 > worst) worst = e2;
  }
  *err = worst;
  _tile_release();
  free(X0); free(Y1); free(Y2); free(W1); free(W2); free(b1); free(b0);
  return 0;
}
