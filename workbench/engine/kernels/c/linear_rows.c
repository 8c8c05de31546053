/* A linear layer at a few input rows (a decode batch), Y[r, n] = X[r, :] . W[n, :] (+ bias[n]), in
 * the summation order of a blocked GEMM: per output, a chain of fused multiply-adds over k in blocks
 * of KC products (each block's chain starting from zero), the blocks' sums added in turn, the bias
 * added before the first block or after the last.
 *
 * Why: at 4-64 rows MKL's sgemm sums in exactly this order on the AMD EPYCs (KC 192, the bias
 * first; found by probing, benchmarks/mkl_order.py) but at a decode batch's few rows it is far from
 * its own rate at 256 rows. This kernel keeps the order, and so F.linear's bits (kernels/gemm.py
 * checks it per shape, row count and thread count; the race decides whether it runs), and
 * computes 16 rows per vector (8 at up to 8 rows, and at every row count without AVX512): X is transposed once per call into a [K][RP] panel
 * (RP = rows rounded up to the vector), each weight row is read once per 64 rows as broadcast scalars, and a tile of NT outputs
 * x up to 64 rows stays in registers for a block of KC products; the blocks' running sums wait in a
 * small vector buffer (in L1) and reach Y, whose rows are N floats apart, once per tile rather than
 * once per block (at 32 rows that took the model's sweep from 88 to 60 ms). While a tile runs, the next tile's
 * rows are prefetched a line of each per 16 products: a tile's NT rows are NT short runs of 2-6 KB,
 * which the hardware prefetcher does not get ahead of (the model's sweep at 8 rows 28.6 ms against
 * 36.6, at 32 rows 82.4 against 88.4, on the EPYC in one process).
 *
 * Built with -std=c11 -ffp-contract=off (native.py); the fma below is explicit. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <omp.h>
#include <immintrin.h>

typedef float V16 __attribute__((vector_size(64)));
typedef float V8 __attribute__((vector_size(32)));

#define DEFINE_VEC(V, L, FMA)                                                                       \
static inline V load_##V(const float *p) { V v; memcpy(&v, p, sizeof v); return v; }               \
static inline void store_##V(float *p, V v) { memcpy(p, &v, sizeof v); }                           \
static inline V splat_##V(float s) { return s - (V){0}; }                                          \
static inline V fma_##V(V a, V b, V c) { FMA }
#if defined(__AVX512F__)
DEFINE_VEC(V16, 16, return (V16)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);)
#endif
#if defined(__FMA__)
DEFINE_VEC(V8, 8, return (V8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);)
#else
DEFINE_VEC(V8, 8, V8 o; for (int l = 0; l < 8; l++) o[l] = fmaf(a[l], b[l], c[l]); return o;)
#endif

/* Outputs [n0, n1) of Y [R][N] for G groups of L rows (panel columns from L g0),
 * NT outputs at a time: NT x G accumulators stay in registers for a block of KC products, and each
 * weight row is read once for all G groups. tot: (bias +) block 0 + block 1 + ..., in that order. */
#define DEFINE_TILE(V, L, G, NT)                                                                          \
static void tile_##L##_##G(const float *panel, int64_t RP, int64_t g0, const float *W, const float *bias_first, \
                     int64_t K, int64_t KC, float *Y, int64_t R, int64_t N, int64_t n0, int64_t n1) { \
    float tot[NT][G][L] __attribute__((aligned(64))); /* the blocks' sums so far, per output */   \
    for (int64_t n = n0; n < n1; n += NT) {                                                        \
        const int64_t T = n1 - n < NT ? n1 - n : NT;                                               \
        const float *w[NT];                                                                        \
        for (int t = 0; t < NT; t++) w[t] = W + (n + (t < T ? t : 0)) * K;                         \
        for (int64_t k0 = 0; k0 < K; k0 += KC) {                                                   \
            const int64_t k1 = k0 + KC < K ? k0 + KC : K;                                          \
            V acc[NT][G];                                                                        \
            for (int t = 0; t < NT; t++) for (int g = 0; g < G; g++) acc[t][g] = splat_##V(0.0f);      \
            for (int64_t k = k0; k < k1; k++) {                                                    \
                if ((k & 15) < NT) /* the next tile's rows, a line of each per 16 products */     \
                    _mm_prefetch((const char *)(w[k & 15] + NT * K + k), _MM_HINT_T0);             \
                V xv[G];                                                                         \
                for (int g = 0; g < G; g++) xv[g] = load_##V(panel + k * RP + L * (g0 + g));        \
                for (int t = 0; t < NT; t++) {                                                     \
                    const V wv = splat_##V(w[t][k]);                                                 \
                    for (int g = 0; g < G; g++) acc[t][g] = fma_##V(xv[g], wv, acc[t][g]);           \
                }                                                                                  \
            }                                                                                      \
            for (int t = 0; t < NT; t++)                                                           \
                for (int g = 0; g < G; g++)                                                        \
                    store_##V(tot[t][g], k0 > 0 ? load_##V(tot[t][g]) + acc[t][g]                      \
                            : bias_first && t < T ? splat_##V(bias_first[n + t]) + acc[t][g] : acc[t][g]); \
        }                                                                                          \
        for (int t = 0; t < T; t++)                                                                \
            for (int g = 0; g < G; g++) {                                                          \
                const int64_t r0 = L * (g0 + g);                                                  \
                for (int l = 0; l < L && r0 + l < R; l++) Y[(r0 + l) * N + n + t] = tot[t][g][l]; \
            }                                                                                      \
    }                                                                                              \
}
DEFINE_TILE(V8, 8, 1, 12)
#if defined(__AVX512F__)
DEFINE_TILE(V16, 16, 1, 12)
DEFINE_TILE(V16, 16, 2, 12)
DEFINE_TILE(V16, 16, 3, 6)
DEFINE_TILE(V16, 16, 4, 5)
#define LANES 16
#else
/* Without AVX512 (an AVX2-only CPU, or -mno-avx512f) more than 8 rows run as 8-lane groups, the
 * tiles sized for 16 vector registers (NT x G accumulators, G rows of X and a weight): 16-lane
 * vectors there were emulated lane by lane, 10x slower (32 rows 560 against 69 ms for the
 * model's sweep), and never won the race */
DEFINE_TILE(V8, 8, 2, 6)
DEFINE_TILE(V8, 8, 3, 4)
#define LANES 8
#endif

/* Returns 0; -1 when the parameters do not fit (rows < 1, KC < 1) or memory runs out. */
int wb_linear_rows(const float *X, const float *W, const float *bias, float *Y, int64_t R, int64_t N,
                   int64_t K, int64_t KC, int bias_first, int num_threads) {
    if (R < 1 || KC < 1 || N < 1 || K < 1) return -1;
    const int64_t lanes = R <= 8 ? 8 : LANES; /* up to 8 rows: 8-lane vectors, no padding rows to compute */
    const int64_t RP = (R + lanes - 1) / lanes * lanes, groups = RP / lanes;
    float *panel = aligned_alloc(64, (size_t)(K * RP) * sizeof(float));
    if (!panel) return -1;
    for (int64_t k = 0; k < K; k++)
        for (int64_t r = 0; r < RP; r++) panel[k * RP + r] = r < R ? X[r * K + k] : 0.0f;
    const float *b0 = bias_first ? bias : NULL;
    /* each thread's outputs: whole multiples of the NT of every tile this call runs (a larger unit
     * split 576 outputs 360/216 between two threads) */
    const int64_t step = lanes == 16 && groups >= 3 ? 60 : 12;
    const int64_t chunks = (N + step - 1) / step;
#pragma omp parallel num_threads(num_threads > 0 ? num_threads : 1)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t n0 = chunks * t / nt * step, e = chunks * (t + 1) / nt * step, n1 = e < N ? e : N;
#if defined(__AVX512F__)
        if (lanes == 8 && n0 < n1) tile_8_1(panel, RP, 0, W, b0, K, KC, Y, R, N, n0, n1);
        for (int64_t g = 0; lanes == 16 && g < groups && n0 < n1; g += 4) {
            const int64_t left = groups - g;
            if (left >= 4) tile_16_4(panel, RP, g, W, b0, K, KC, Y, R, N, n0, n1);
            else if (left == 3) tile_16_3(panel, RP, g, W, b0, K, KC, Y, R, N, n0, n1);
            else if (left == 2) tile_16_2(panel, RP, g, W, b0, K, KC, Y, R, N, n0, n1);
            else tile_16_1(panel, RP, g, W, b0, K, KC, Y, R, N, n0, n1);
        }
#else
        /* two groups (16 rows) a pass, 6 outputs x 2 groups = 12 accumulators: four groups a pass
         * fit only 2 outputs (8 accumulators) in 16 registers, and each tile then read the whole
         * transposed X for every 2 outputs (the model's 32-row sweep 80 against 65 ms in one
         * process, the AVX2-only EPYC); a pass reads each weight row again, from the L3 */
        for (int64_t g = 0; g < groups && n0 < n1; g += 2) {
            const int64_t left = groups - g;
            if (left == 3) { tile_8_3(panel, RP, g, W, b0, K, KC, Y, R, N, n0, n1); break; }
            if (left >= 2) tile_8_2(panel, RP, g, W, b0, K, KC, Y, R, N, n0, n1);
            else tile_8_1(panel, RP, g, W, b0, K, KC, Y, R, N, n0, n1);
        }
#endif
    }
    if (bias && !bias_first)
        for (int64_t r = 0; r < R; r++)
            for (int64_t n = 0; n < N; n++) Y[r * N + n] = Y[r * N + n] + bias[n];
    free(panel);
    return 0;
}

int wb_linear_rowdot_rows(const float *W, const float *X, const float *bias, float *Y, int64_t T, int64_t N,
                          int64_t K, int64_t P, int64_t L, int fma, int num_threads); /* linear_rowdot.c */

/* `R` rows as MKL computes them at some row counts (an AVX512 EPYC at 2-3, 5-7 and 9-11 rows): the
 * first `head` (perhaps none) through the blocked kernel in (KC, bias_first), the rows after them
 * through the one-row kernel's order (P, L, fma). head >= R: every row blocked (wb_linear_rows).
 * Returns 0, or -1 when the parameters do not fit. */
int wb_linear_rows_split(const float *X, const float *W, const float *bias, float *Y, int64_t R, int64_t N,
                         int64_t K, int64_t KC, int bias_first, int64_t head, int64_t P, int64_t L, int fma,
                         int num_threads) {
    if (head >= R) return wb_linear_rows(X, W, bias, Y, R, N, K, KC, bias_first, num_threads);
    if (head < 0) return -1;
    const int rc = head ? wb_linear_rows(X, W, bias, Y, head, N, K, KC, bias_first, num_threads) : 0;
    return rc ? rc : wb_linear_rowdot_rows(W, X + head * K, bias, Y + head * N, R - head, N, K, P, L, fma, num_threads);
}
