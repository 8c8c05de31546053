/* What this machine allows, for benchmarks/limits.py (which times these).
 *
 * wb_read_streams: how fast it reads memory. Each thread sums its part of a buffer as S runs read
 * side by side, a 64-byte line of each in turn (one stream per thread is held back by how far the
 * hardware prefetcher runs ahead; several reach the memory's rate), optionally prefetching `ahead`
 * bytes in front of each. Returns the sum, so the reads are not optimized away.
 *
 * wb_fma_peak: its float32 fused multiply-add rate, on the widest vectors it has. */
#include <stdint.h>
#include <string.h>
#include <omp.h>
#include <immintrin.h>

typedef float V8 __attribute__((vector_size(32)));

#define DEFINE_READ(S)                                                                             \
static float read_##S(const float *a, int64_t len, int64_t ahead) {                                \
    V8 acc[S][2] = {{{0}}};                                                                        \
    for (int64_t i = 0; i < len; i += 16)                                                          \
        for (int j = 0; j < S; j++) {                                                              \
            const float *p = a + j * len + i;                                                      \
            if (ahead) _mm_prefetch((const char *)p + ahead, _MM_HINT_NTA);                        \
            V8 v0, v1;                                                                             \
            memcpy(&v0, p, sizeof v0);                                                             \
            memcpy(&v1, p + 8, sizeof v1);                                                         \
            acc[j][0] += v0;                                                                       \
            acc[j][1] += v1;                                                                       \
        }                                                                                          \
    float total = 0.0f;                                                                            \
    for (int j = 0; j < S; j++)                                                                    \
        for (int l = 0; l < 8; l++) total += acc[j][0][l] + acc[j][1][l];                          \
    return total;                                                                                  \
}
DEFINE_READ(1)
DEFINE_READ(4)
DEFINE_READ(8)

/* streams: 1, 4 or 8 a thread (else 1). */
float wb_read_streams(const float *a, int64_t n, int64_t streams, int64_t ahead, int threads) {
    float total = 0.0f;
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t s0 = n * t / nt, S = streams == 4 || streams == 8 ? streams : 1;
        const int64_t len = (n * (t + 1) / nt - s0) / S / 16 * 16;
        total += S == 8 ? read_8(a + s0, len, ahead) : S == 4 ? read_4(a + s0, len, ahead) : read_1(a + s0, len, ahead);
    }
    return total;
}

#if defined(__AVX512F__)
typedef float VW __attribute__((vector_size(64)));
#define FMAW(a, b, c) (VW)_mm512_fmadd_ps((__m512)(a), (__m512)(b), (__m512)(c))
#elif defined(__FMA__)
typedef float VW __attribute__((vector_size(32)));
#define FMAW(a, b, c) (VW)_mm256_fmadd_ps((__m256)(a), (__m256)(b), (__m256)(c))
#else
typedef float VW __attribute__((vector_size(32)));
#define FMAW(a, b, c) ((a) * (b) + (c))
#endif

/* Each thread runs 12 independent chains (enough to cover the latency on two pipes), `iters`
 * rounds. Returns the lanes of a vector (for the FLOP count: 2 x lanes x 12 x iters x threads). */
int wb_fma_peak(int64_t iters, int threads, float *sink) {
    float total = 0.0f;
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
        VW a[12], b = 0.999f - (VW){0}, c = 1e-4f - (VW){0};
        for (int j = 0; j < 12; j++) a[j] = (float)j * 1e-3f - (VW){0};
        for (int64_t i = 0; i < iters; i++)
            for (int j = 0; j < 12; j++) a[j] = FMAW(a[j], b, c);
        for (int j = 0; j < 12; j++)
            for (int l = 0; l < (int)(sizeof(VW) / 4); l++) total += a[j][l];
    }
    *sink = total;
    return (int)(sizeof(VW) / 4);
}
