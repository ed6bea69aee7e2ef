/* The memory figures behind x86/copy.py's streamed copies (bench/RESULTS.md, session 18): one core's (or T
 * cores') read bandwidth over a large buffer, and L copies of N KiB each between distinct buffers (GPT-2's
 * present copies: 24 x 3,072 KiB at past 1,023) as memcpy does them, as 64 KiB memmove blocks (x86/copy.py's
 * cached units) and with non-temporal AVX-512 stores (its streamed units). Wall time, best to read over the
 * 4-5 repeats printed.
 *
 *   cc -O2 -mavx512f -o /tmp/stream_copy bench/stream_copy.c -lpthread
 *   /tmp/stream_copy read 512 1      # MiB, threads
 *   /tmp/stream_copy copy 3072 24    # KiB per copy, copies
 */
#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }

typedef struct { const float *p; size_t n; float sum; } part_t;

static void *read_part(void *arg) {
    part_t *a = arg;
    __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    for (size_t i = 0; i < a->n; i += 64) {
        s0 = _mm512_add_ps(s0, _mm512_load_ps(a->p + i));
        s1 = _mm512_add_ps(s1, _mm512_load_ps(a->p + i + 16));
        s2 = _mm512_add_ps(s2, _mm512_load_ps(a->p + i + 32));
        s3 = _mm512_add_ps(s3, _mm512_load_ps(a->p + i + 48));
    }
    a->sum = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)));
    return NULL;
}

static void nt_copy(float *d, const float *s, size_t n) {
    for (size_t i = 0; i < n; i += 16) _mm512_stream_ps(d + i, _mm512_loadu_ps(s + i));
    _mm_sfence();
}

static void block_copy(float *d, const float *s, size_t n) {
    for (size_t i = 0; i < n; i += 16384) memmove(d + i, s + i, (n - i < 16384 ? n - i : 16384) * 4);
}

int main(int argc, char **argv) {
    if (argc != 4 || (strcmp(argv[1], "read") && strcmp(argv[1], "copy"))) {
        fprintf(stderr, "usage: %s read MIB THREADS | copy KIB COPIES\n", argv[0]);
        return 2;
    }
    if (!strcmp(argv[1], "read")) {
        size_t n = (size_t)atol(argv[2]) << 18;   /* floats in MIB MiB */
        int threads = atoi(argv[3]);
        if (threads < 1 || threads > 64 || n % (64 * (size_t)threads)) { fprintf(stderr, "bad sizes\n"); return 2; }
        float *buf = aligned_alloc(64, n * 4);
        memset(buf, 0, n * 4);
        for (int rep = 0; rep < 5; rep++) {
            pthread_t th[64]; part_t parts[64];
            double t0 = now();
            for (int k = 0; k < threads; k++) {
                parts[k] = (part_t){buf + n / threads * k, n / threads, 0};
                pthread_create(&th[k], NULL, read_part, &parts[k]);
            }
            for (int k = 0; k < threads; k++) pthread_join(th[k], NULL);
            double t = now() - t0;
            printf("read %zu MiB, %d thread(s): %.2f ms, %.1f GB/s\n", n >> 18, threads, t * 1e3, n * 4 / t / 1e9);
        }
        return 0;
    }
    size_t n = (size_t)atol(argv[2]) * 256;          /* floats in KIB KiB */
    int copies = atoi(argv[3]);
    if (copies < 1 || n % 16) { fprintf(stderr, "bad sizes\n"); return 2; }
    float **src = malloc(copies * sizeof *src), **dst = malloc(copies * sizeof *dst);
    for (int l = 0; l < copies; l++) {
        src[l] = aligned_alloc(64, n * 4); dst[l] = aligned_alloc(64, n * 4);
        memset(src[l], 1, n * 4); memset(dst[l], 0, n * 4);
    }
    const char *names[] = {"memcpy", "64 KiB memmove blocks", "non-temporal stores"};
    for (int mode = 0; mode < 3; mode++)
        for (int rep = 0; rep < 4; rep++) {
            double t0 = now();
            for (int l = 0; l < copies; l++) {
                if (mode == 0) memcpy(dst[l], src[l], n * 4);
                else if (mode == 1) block_copy(dst[l], src[l], n);
                else nt_copy(dst[l], src[l], n);
            }
            double t = now() - t0;
            printf("%s: %d x %zu KiB: %.2f ms, %.1f GB/s of payload\n", names[mode], copies, n / 256, t * 1e3,
                   (double)copies * n * 4 / t / 1e9);
        }
    return 0;
}
