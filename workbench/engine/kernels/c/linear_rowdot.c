/* A linear layer at one input row, y[n] = dot(W[n, :], x) (+ bias[n]), in a given summation order:
 * the first P products summed one by one into lane 0, then whole groups of L in L lanes (product k
 * into lane (k - P) % L, each lane in order of k), the lanes folded by halves ((a0 + a2) + (a1 + a3)
 * for four), the products left over added one by one, then the bias; products and sums rounded
 * separately, or fused (fma). P < 0 means "up to the next 16-byte boundary of the weight row": 4 -
 * (address mod 16) / 4 products (4 where the row is aligned), as MKL peels them, row by row.
 *
 * Why: at one row MKL's sgemm computes each output as such a dot product, and on some CPUs (AMD
 * EPYC) does so at a fraction of the memory bandwidth. With the order MKL uses on this CPU (found
 * and checked bit for bit by kernels/gemm.py) this kernel gives F.linear's bits while streaming the
 * weight at close to the copy rate. Each thread takes one contiguous run of rows and cuts it into
 * ROWS streams, one row of each in flight at a time (independent chains hide the add latency).
 * Streams far apart, not ROWS neighbouring rows: a neighbouring block is ROWS short runs of 2-6 KB,
 * which the hardware prefetcher never gets ahead of (27.5 GB/s at 8 neighbours on an EPYC), where
 * four long runs read at 36 GB/s, the copy rate (benchmarks/linear_sweep.py --rows 1).
 *
 * Built with -std=c11 -ffp-contract=off (native.py): a product and its sum are never fused unless
 * the order says fma. */
#include <stdint.h>
#include <string.h>
#include <math.h>
#include <omp.h>
#include <immintrin.h>

#define ROWS 4 /* rows (streams) in flight at once */

/* products before the row's next 16-byte boundary, as MKL peels them: 4 on an aligned row */
static inline int64_t row_peel(const float *w) { return 4 - (int64_t)(((uintptr_t)w % 16) / 4); }

#define DEFINE_ROWDOT(L, V, FMA_EXPR)                                                              \
typedef float V __attribute__((vector_size(4 * L)));                                               \
static inline V load_##V(const float *p) { V v; memcpy(&v, p, sizeof v); return v; }              \
static void rowdot_one_##L(const float *w, const float *x, const float *bias, float *y, int64_t K,  \
                           int64_t p, int fma) {                                                   \
    float a[L] = {0}, s = 0.0f;                                                                    \
    if (p > K) p = K;                                                                              \
    const int64_t body = p + (K - p) / L * L;                                                      \
    for (int64_t k = 0; k < p; k++) s = fma ? fmaf(w[k], x[k], s) : s + w[k] * x[k];               \
    a[0] = s;                                                                                      \
    for (int64_t k = p; k < body; k += L)                                                          \
        for (int l = 0; l < L; l++) a[l] = fma ? fmaf(w[k + l], x[k + l], a[l]) : a[l] + w[k + l] * x[k + l]; \
    for (int width = L / 2; width >= 1; width /= 2)                                                \
        for (int l = 0; l < width; l++) a[l] = a[l] + a[l + width];                                \
    s = a[0];                                                                                      \
    for (int64_t k = body; k < K; k++) s = fma ? fmaf(w[k], x[k], s) : s + w[k] * x[k];            \
    *y = bias ? s + *bias : s;                                                                     \
}                                                                                                  \
static void rowdot_##L(const float *W, const float *x, const float *bias, float *y, int64_t n0,     \
                       int64_t n1, int64_t K, int64_t P, int fma) {                                \
    const int64_t S = (n1 - n0 + ROWS - 1) / ROWS; /* rows per stream */                           \
    for (int64_t b = 0; b < S; b++) {                                                              \
        int64_t m[ROWS];                                                                           \
        int R = 0;                                                                                 \
        for (int r = 0; r < ROWS; r++)                                                             \
            if (n0 + r * S + b < n1) m[R++] = n0 + r * S + b;                                      \
        const float *w[ROWS];                                                                      \
        int64_t p = P;                                                                             \
        V acc[ROWS];                                                                               \
        if (P < 0) { /* the rows of a step share their peel, or the step goes one row at a time */ \
            p = row_peel(W + m[0] * K);                                                            \
            for (int r = 1; r < R; r++)                                                            \
                if (row_peel(W + m[r] * K) != p) {                                                 \
                    for (int q = 0; q < R; q++) rowdot_one_##L(W + m[q] * K, x, bias ? bias + m[q] : NULL, y + m[q], K, row_peel(W + m[q] * K), fma); \
                    goto next;                                                                     \
                }                                                                                  \
        }                                                                                          \
        if (p > K) p = K;                                                                          \
        const int64_t body = p + (K - p) / L * L;                                                  \
        for (int r = 0; r < ROWS; r++) {                                                           \
            w[r] = W + m[r < R ? r : 0] * K;                                                       \
            float s = 0.0f;                                                                        \
            for (int64_t k = 0; k < p; k++) s = fma ? fmaf(w[r][k], x[k], s) : s + w[r][k] * x[k]; \
            acc[r] = (V){0}; acc[r][0] = s;                                                        \
        }                                                                                          \
        if (fma) {                                                                                 \
            for (int64_t k = p; k < body; k += L) {                                                \
                const V xv = load_##V(x + k);                                                      \
                for (int r = 0; r < ROWS; r++) { V wv = load_##V(w[r] + k); acc[r] = FMA_EXPR; }   \
            }                                                                                      \
        } else {                                                                                   \
            for (int64_t k = p; k < body; k += L) {                                                \
                const V xv = load_##V(x + k);                                                      \
                for (int r = 0; r < ROWS; r++) { V wv = load_##V(w[r] + k); acc[r] = acc[r] + wv * xv; } \
            }                                                                                      \
        }                                                                                          \
        for (int r = 0; r < R; r++) {                                                              \
            float a[L];                                                                            \
            memcpy(a, &acc[r], sizeof a);                                                          \
            for (int width = L / 2; width >= 1; width /= 2)                                        \
                for (int l = 0; l < width; l++) a[l] = a[l] + a[l + width];                        \
            float s = a[0];                                                                        \
            for (int64_t k = body; k < K; k++) s = fma ? fmaf(w[r][k], x[k], s) : s + w[r][k] * x[k]; \
            y[m[r]] = bias ? s + bias[m[r]] : s;                                                   \
        }                                                                                          \
    next:;                                                                                         \
    }                                                                                              \
}

#if defined(__FMA__)
#define FMA4 (V4)_mm_fmadd_ps((__m128)wv, (__m128)xv, (__m128)acc[r])
#define FMA8 (V8)_mm256_fmadd_ps((__m256)wv, (__m256)xv, (__m256)acc[r])
#else
#define FMA4 ({ V4 o; for (int l = 0; l < 4; l++) o[l] = fmaf(wv[l], xv[l], acc[r][l]); o; })
#define FMA8 ({ V8 o; for (int l = 0; l < 8; l++) o[l] = fmaf(wv[l], xv[l], acc[r][l]); o; })
#endif
#if defined(__AVX512F__)
#define FMA16 (V16)_mm512_fmadd_ps((__m512)wv, (__m512)xv, (__m512)acc[r])
#else
#define FMA16 ({ V16 o; for (int l = 0; l < 16; l++) o[l] = fmaf(wv[l], xv[l], acc[r][l]); o; })
#endif
DEFINE_ROWDOT(4, V4, FMA4)
DEFINE_ROWDOT(8, V8, FMA8)
DEFINE_ROWDOT(16, V16, FMA16)

/* Several linear layers at the same input row in one call (the direct forward's q/k/v and gate/up
 * projections): layer i's outputs y[i][n] for its N[i] rows of W[i]. One parallel region for all
 * of them: each thread takes its contiguous run of row blocks of every layer in turn, so a small
 * layer (192 rows) does not pay a region of its own.
 * Returns 0, or -1 when the lanes are not 4, 8 or 16 or P is below -1. */
int wb_linear_rowdot_group(int64_t count, const float *const *W, const float *const *bias, float *const *y,
                           const int64_t *N, const float *x, int64_t K, int64_t P, int64_t L, int fma,
                           int num_threads) {
    if (P < -1 || (L != 4 && L != 8 && L != 16)) return -1;
#pragma omp parallel num_threads(num_threads > 0 ? num_threads : 1)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        for (int64_t i = 0; i < count; i++) {
            const int64_t blocks = (N[i] + ROWS - 1) / ROWS;
            const int64_t n0 = blocks * t / nt * ROWS, e = blocks * (t + 1) / nt * ROWS, n1 = e < N[i] ? e : N[i];
            if (n0 >= n1) continue;
            if (L == 4) rowdot_4(W[i], x, bias[i], y[i], n0, n1, K, P, fma);
            else if (L == 8) rowdot_8(W[i], x, bias[i], y[i], n0, n1, K, P, fma);
            else rowdot_16(W[i], x, bias[i], y[i], n0, n1, K, P, fma);
        }
    }
    return 0;
}

/* One layer: the group of one. */
int wb_linear_rowdot(const float *W, const float *x, const float *bias, float *y, int64_t N, int64_t K,
                     int64_t P, int64_t L, int fma, int num_threads) {
    return wb_linear_rowdot_group(1, &W, &bias, &y, &N, x, K, P, L, fma, num_threads);
}

/* Several input rows through the one-row order: a block of ROWS neighbouring weight rows against TT
 * input rows at once (ROWS x TT independent chains hide the add latency, which one output at a time,
 * 144 dependent adds for 576 inputs, does not), each output the sum `rowdot_one` computes. */
#if defined(__FMA__)
#define FMAV4(a, b, c) (V4)_mm_fmadd_ps((__m128)(a), (__m128)(b), (__m128)(c))
#define FMAV8(a, b, c) (V8)_mm256_fmadd_ps((__m256)(a), (__m256)(b), (__m256)(c))
#else
#define FMAV4(a, b, c) ({ V4 o_; for (int l_ = 0; l_ < 4; l_++) o_[l_] = fmaf((a)[l_], (b)[l_], (c)[l_]); o_; })
#define FMAV8(a, b, c) ({ V8 o_; for (int l_ = 0; l_ < 8; l_++) o_[l_] = fmaf((a)[l_], (b)[l_], (c)[l_]); o_; })
#endif
#if defined(__AVX512F__)
#define FMAV16(a, b, c) (V16)_mm512_fmadd_ps((__m512)(a), (__m512)(b), (__m512)(c))
#else
#define FMAV16(a, b, c) ({ V16 o_; for (int l_ = 0; l_ < 16; l_++) o_[l_] = fmaf((a)[l_], (b)[l_], (c)[l_]); o_; })
#endif

#define DEFINE_ROWDOT_ROWS(L, V, TT)                                                               \
static void rowdot_rows_##L##_##TT(const float *W, const float *X, const float *bias, float *Y,    \
                                   int64_t N, int64_t K, int64_t n0, int64_t n1, int64_t P, int fma) { \
    for (int64_t n = n0; n < n1; n += ROWS) {                                                      \
        const float *w[ROWS];                                                                      \
        int64_t p = P < 0 ? row_peel(W + n * K) : P;                                               \
        int whole = n + ROWS <= n1;                                                                \
        for (int r = 0; r < ROWS && whole; r++) {                                                  \
            w[r] = W + (n + r) * K;                                                                \
            if (P < 0 && row_peel(w[r]) != p) whole = 0;                                           \
        }                                                                                          \
        if (!whole) { /* a short last block, or rows with different peels: one output at a time */  \
            for (int64_t m = n; m < n1 && m < n + ROWS; m++)                                       \
                for (int t = 0; t < TT; t++)                                                       \
                    rowdot_one_##L(W + m * K, X + t * K, bias ? bias + m : NULL, Y + t * N + m, K,  \
                                   P < 0 ? row_peel(W + m * K) : P, fma);                          \
            continue;                                                                              \
        }                                                                                          \
        if (p > K) p = K;                                                                          \
        const int64_t body = p + (K - p) / L * L;                                                  \
        V acc[ROWS][TT];                                                                           \
        for (int r = 0; r < ROWS; r++)                                                             \
            for (int t = 0; t < TT; t++) {                                                         \
                const float *x = X + t * K;                                                        \
                float s = 0.0f;                                                                    \
                for (int64_t k = 0; k < p; k++) s = fma ? fmaf(w[r][k], x[k], s) : s + w[r][k] * x[k]; \
                acc[r][t] = (V){0}; acc[r][t][0] = s;                                              \
            }                                                                                      \
        if (fma) {                                                                                 \
            for (int64_t k = p; k < body; k += L) {                                                \
                V xv[TT];                                                                          \
                for (int t = 0; t < TT; t++) xv[t] = load_##V(X + t * K + k);                      \
                for (int r = 0; r < ROWS; r++) {                                                   \
                    const V wv = load_##V(w[r] + k);                                               \
                    for (int t = 0; t < TT; t++) acc[r][t] = FMAV##L(wv, xv[t], acc[r][t]);        \
                }                                                                                  \
            }                                                                                      \
        } else {                                                                                   \
            for (int64_t k = p; k < body; k += L) {                                                \
                V xv[TT];                                                                          \
                for (int t = 0; t < TT; t++) xv[t] = load_##V(X + t * K + k);                      \
                for (int r = 0; r < ROWS; r++) {                                                   \
                    const V wv = load_##V(w[r] + k);                                               \
                    for (int t = 0; t < TT; t++) acc[r][t] = acc[r][t] + wv * xv[t];               \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
        for (int r = 0; r < ROWS; r++)                                                             \
            for (int t = 0; t < TT; t++) {                                                         \
                const float *x = X + t * K;                                                        \
                float a[L];                                                                        \
                memcpy(a, &acc[r][t], sizeof a);                                                   \
                for (int width = L / 2; width >= 1; width /= 2)                                    \
                    for (int l = 0; l < width; l++) a[l] = a[l] + a[l + width];                    \
                float s = a[0];                                                                    \
                for (int64_t k = body; k < K; k++) s = fma ? fmaf(w[r][k], x[k], s) : s + w[r][k] * x[k]; \
                Y[t * N + n + r] = bias ? s + bias[n + r] : s;                                     \
            }                                                                                      \
    }                                                                                              \
}
#define DEFINE_ROWDOT_ROWS_ALL(L, V) DEFINE_ROWDOT_ROWS(L, V, 1) DEFINE_ROWDOT_ROWS(L, V, 2)        \
    DEFINE_ROWDOT_ROWS(L, V, 3) DEFINE_ROWDOT_ROWS(L, V, 4)
DEFINE_ROWDOT_ROWS_ALL(4, V4)
DEFINE_ROWDOT_ROWS_ALL(8, V8)
DEFINE_ROWDOT_ROWS_ALL(16, V16)

#define ROWDOT_ROWS_CALL(L, TT) rowdot_rows_##L##_##TT(W, X + t0 * K, bias, Y + t0 * N, N, K, n0, n1, P, fma)
#define ROWDOT_ROWS_BY_T(L)                                                                        \
    (tt == 1 ? ROWDOT_ROWS_CALL(L, 1) : tt == 2 ? ROWDOT_ROWS_CALL(L, 2) : tt == 3 ? ROWDOT_ROWS_CALL(L, 3) \
     : ROWDOT_ROWS_CALL(L, 4))

/* `T` input rows through the one-row order: Y[t, n] = dot(W[n, :], X[t, :]) (+ bias[n]), each output
 * as `rowdot_one` computes it (the order of wb_linear_rowdot), up to four input rows per pass over
 * the weight (each thread a contiguous run of blocks of ROWS weight rows). For the rows MKL computes
 * this way at some row counts (past its blocked kernel's last block: kernels/gemm.py, split orders).
 * Returns 0, or -1 when the lanes are not 4, 8 or 16, P is below -1 or T below 1. */
int wb_linear_rowdot_rows(const float *W, const float *X, const float *bias, float *Y, int64_t T, int64_t N,
                          int64_t K, int64_t P, int64_t L, int fma, int num_threads) {
    if (P < -1 || (L != 4 && L != 8 && L != 16) || T < 1) return -1;
#pragma omp parallel num_threads(num_threads > 0 ? num_threads : 1)
    {
        const int th = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t blocks = (N + ROWS - 1) / ROWS;
        const int64_t n0 = blocks * th / nt * ROWS, e = blocks * (th + 1) / nt * ROWS, n1 = e < N ? e : N;
        for (int64_t t0 = 0; t0 < T && n0 < n1; t0 += 4) {
            const int64_t tt = T - t0 < 4 ? T - t0 : 4;
            if (L == 4) ROWDOT_ROWS_BY_T(4);
            else if (L == 8) ROWDOT_ROWS_BY_T(8);
            else ROWDOT_ROWS_BY_T(16);
        }
    }
    return 0;
}
