/* AMX bf16 peak of one core: TDPBF16PS throughput on full 16x16x32 tiles (16384 multiply-adds each), a 2 x 2
 * block of independent float32 accumulators (tmm0-3) fed by two A and two B tiles (tmm4-7) that never change,
 * so nothing but the tile unit is timed. Reports instructions and GFLOP/s per second of the thread's CPU time
 * (CLOCK_THREAD_CPUTIME_ID: a shared VM's steal does not count) and of wall time, three repeats. (No cycle
 * count: on the shared VM a dependent-add clock estimate read 3.0 GHz in one run and 4.4-5.0 in the next.)
 *
 *   cc -O2 -mamx-tile -mamx-bf16 bench/amx_peak.c -o /tmp/amx_peak && /tmp/amx_peak
 *
 * Linux hands out the tile state only on request (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)), as
 * cuvil.targets.x86.amx does at session creation. Figures: bench/PRECISION.md (session 16). */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

typedef struct { uint8_t palette, start; uint8_t reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } tilecfg;

static double now(clockid_t c) { struct timespec t; clock_gettime(c, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }

int main(void) {
  if (syscall(SYS_arch_prctl, 0x1023, 18)) { puts("Linux refused the AMX tile state (or no AMX)"); return 1; }
  tilecfg cfg; memset(&cfg, 0, sizeof cfg); cfg.palette = 1;
  for (int i = 0; i < 8; i++) { cfg.colsb[i] = 64; cfg.rows[i] = 16; }
  _tile_loadconfig(&cfg);
  static uint16_t buf[16 * 32] __attribute__((aligned(64)));
  for (int i = 0; i < 16 * 32; i++) buf[i] = 0x3f80;      /* bfloat16 1.0 */
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  _tile_loadd(4, buf, 64); _tile_loadd(5, buf, 64); _tile_loadd(6, buf, 64); _tile_loadd(7, buf, 64);
  const long n = 10000000;
  for (int rep = 0; rep < 3; rep++) {
    double w0 = now(CLOCK_MONOTONIC), c0 = now(CLOCK_THREAD_CPUTIME_ID);
    for (long i = 0; i < n; i++) {
      _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
    }
    double w = now(CLOCK_MONOTONIC) - w0, c = now(CLOCK_THREAD_CPUTIME_ID) - c0;
    double ins = 4.0 * n, flop = ins * 16 * 16 * 32 * 2;
    printf("tdpbf16ps: %.2f ns each (CPU time); %.0f GFLOP/s per CPU second, %.0f per wall second\n",
           c / ins * 1e9, flop / c / 1e9, flop / w / 1e9);
  }
  _tile_release();
  return 0;
}
