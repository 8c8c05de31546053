/* The small per-layer ops of a Llama-style decoder, each in torch's own arithmetic, so that the
 * result is bit-identical to transformers' ops (the checks in kernels/layer_ops.py confirm it on the
 * CPU that runs them):
 *
 * - wb_rms_norm: [residual + delta then] LlamaRMSNorm: w * (h * rsqrt(mean(h^2) + eps)). The mean is
 *   torch's float sum (ATen/native/cpu/SumKernel.cpp: vectorized_inner_sum -> row_sum ->
 *   multi_row_sum, with `lanes` floats per vector: 16 on AVX512, 8 on AVX2) divided by n.
 * - wb_rope: transformers' apply_rotary_pos_emb, q*cos + rotate_half(q)*sin, for q and k.
 * - wb_silu_mul: LlamaMLP's act_fn(gate) * up with act_fn SiLU, as torch's vectorized SiLU kernel
 *   computes it: x / (1 + exp(-x)), its exp being SLEEF's expf_u10 (Sleef_expf16_u10 / expf8_u10,
 *   the same steps at either width), then the product rounded.
 * - wb_entropy and wb_log_softmax: the sampler's -(p * lp).sum(-1), and its log-softmax with each
 *   row's argmax and the traced record of the row's distribution, softmax(x) (kernels/sampling.py).
 *
 * Built with -ffp-contract=off: every product is rounded before it is added, as torch's separate
 * mul and add kernels round it.
 */
#include <math.h>
#include <stdint.h>
#include <stddef.h>
#include <string.h>
#include <stdlib.h>
#include <omp.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define WB_AVX2 1
#else
#define WB_AVX2 0
#endif

#define ILP 4
#define LEVELS 4

static int64_t ceil_log2(int64_t x) {
    if (x <= 2) return 1;
    uint64_t v = (uint64_t)(x - 1);
    int64_t bits = 0;
    while (v) { bits++; v >>= 1; }
    return bits;
}

/* torch's sum of v[i] = x[i]*y[i] (each product rounded, as a separate mul kernel rounds it) over
 * one row of n floats, as one reduction task sums it (SumKernel's cascade: vectorized_inner_sum ->
 * row_sum -> multi_row_sum), with L floats per vector; each accumulator a vector, so the compiler
 * keeps it in a register. It runs in pieces, so that a row can be summed as it is computed:
 * sum_open, sum_feed over consecutive pieces, sum_close. Every piece but the last is sum_piece
 * floats, a whole number of level blocks (level_step rows of ILP vectors), so the cascade adds and
 * flushes exactly as in one call. A piece is passed as pointers to its floats and its offset `off`
 * in the row: element j of the row is x[j - off], y[j - off]. */
typedef struct {
    float acc[LEVELS][ILP][16]; /* the cascade's accumulators, vectors of L floats */
    int64_t n, i;               /* the row's length; the rows of ILP vectors summed so far */
} sum_state;

static int64_t sum_level_step(int64_t size) {
    const int64_t level_power = ceil_log2(size) / LEVELS > 4 ? ceil_log2(size) / LEVELS : 4;
    return (int64_t)1 << level_power;
}

#define DEFINE_SUM_PRODUCTS(L)                                                                        \
typedef float vsum##L __attribute__((vector_size(4 * L)));                                           \
/* The rows of ILP vectors from st->i up to the piece's end (all of them where end is the row's). */ \
static void sum_feed_##L(sum_state *st, const float *x, const float *y, int64_t off, int64_t end) {   \
    const int64_t size = st->n / L / ILP;    /* multi_row_sum's "rows" of ILP vectors each */         \
    const int64_t stop = end >= st->n ? size : end / (ILP * L);                                       \
    const int64_t level_step = sum_level_step(size), level_mask = level_step - 1;                     \
    const int64_t level_power = __builtin_ctzll((uint64_t)level_step);                                \
    vsum##L acc[LEVELS][ILP];                                                                         \
    memcpy(acc, st->acc, sizeof acc);                                                                 \
    int64_t i = st->i;                                                                                \
    vsum##L xv, yv;                                                                                   \
    for (; i + level_step <= stop;) {                                                                 \
        for (int64_t j = 0; j < level_step; ++j, ++i)                                                 \
            for (int k = 0; k < ILP; k++) {                                                           \
                memcpy(&xv, x + (i * ILP + k) * L - off, sizeof xv);                                  \
                memcpy(&yv, y + (i * ILP + k) * L - off, sizeof yv);                                  \
                acc[0][k] += xv * yv;                                                                 \
            }                                                                                         \
        for (int j = 1; j < LEVELS; ++j) {                                                            \
            for (int k = 0; k < ILP; k++) { acc[j][k] += acc[j - 1][k]; acc[j - 1][k] = (vsum##L){0}; } \
            if ((i & (level_mask << (j * level_power))) != 0) break;                                  \
        }                                                                                             \
    }                                                                                                 \
    if (stop == size)                                                                                 \
        for (; i < size; ++i)                                                                         \
            for (int k = 0; k < ILP; k++) {                                                           \
                memcpy(&xv, x + (i * ILP + k) * L - off, sizeof xv);                                  \
                memcpy(&yv, y + (i * ILP + k) * L - off, sizeof yv);                                  \
                acc[0][k] += xv * yv;                                                                 \
            }                                                                                         \
    memcpy(st->acc, acc, sizeof acc);                                                                 \
    st->i = i;                                                                                        \
}                                                                                                     \
/* The end of the cascade, after the last piece was fed (x, y: that piece). */                        \
static float sum_close_##L(const sum_state *st, const float *x, const float *y, int64_t off) {        \
    const int64_t n = st->n, vec_size = n / L, size = vec_size / ILP;                                 \
    vsum##L acc[LEVELS][ILP];                                                                         \
    memcpy(acc, st->acc, sizeof acc);                                                                 \
    vsum##L xv, yv;                                                                                   \
    for (int j = 1; j < LEVELS; ++j)                                                                  \
        for (int k = 0; k < ILP; k++) acc[0][k] += acc[j][k];                                         \
    /* row_sum: the vectors left over after the ILP rows, then the ILP partial sums in turn */       \
    for (int64_t v = size * ILP; v < vec_size; v++) {                                                 \
        memcpy(&xv, x + v * L - off, sizeof xv);                                                      \
        memcpy(&yv, y + v * L - off, sizeof yv);                                                      \
        acc[0][0] += xv * yv;                                                                         \
    }                                                                                                 \
    for (int k = 1; k < ILP; k++) acc[0][0] += acc[0][k];                                             \
    /* vectorized_inner_sum: the scalar tail first, then the lanes in order */                        \
    float total = 0.0f;                                                                               \
    for (int64_t k = vec_size * L; k < n; k++) total += x[k - off] * y[k - off];                      \
    for (int l = 0; l < L; l++) total += acc[0][0][l];                                                \
    return total;                                                                                     \
}
DEFINE_SUM_PRODUCTS(1)
DEFINE_SUM_PRODUCTS(4)
DEFINE_SUM_PRODUCTS(8)
DEFINE_SUM_PRODUCTS(16)

static int lanes_ok(int lanes) { return lanes == 1 || lanes == 4 || lanes == 8 || lanes == 16; }

/* floats a piece: a multiple of every level block (level_step * ILP * L) where n < 2^31. The record
 * (wb_log_softmax) finishes a row in pieces this long (lp, p and their sum while the piece is in
 * cache). */
#define SUM_PIECE 16384

static void sum_open(sum_state *st, int64_t n) {
    memset(st, 0, sizeof *st);
    st->n = n;
}

static void sum_feed(sum_state *st, const float *x, const float *y, int64_t off, int64_t end, int lanes) {
    if (lanes == 16) sum_feed_16(st, x, y, off, end);
    else if (lanes == 8) sum_feed_8(st, x, y, off, end);
    else if (lanes == 4) sum_feed_4(st, x, y, off, end);
    else sum_feed_1(st, x, y, off, end);
}

static float sum_close(const sum_state *st, const float *x, const float *y, int64_t off, int lanes) {
    if (lanes == 16) return sum_close_16(st, x, y, off);
    if (lanes == 8) return sum_close_8(st, x, y, off);
    if (lanes == 4) return sum_close_4(st, x, y, off);
    return sum_close_1(st, x, y, off);
}

/* The pieces a row of n floats is fed in: SUM_PIECE floats, or the level block where that is longer
 * (no row under 2^31 floats has one). */
static int64_t sum_piece(int64_t n, int lanes) {
    const int64_t block = sum_level_step(n / lanes / ILP) * ILP * lanes;
    return block > SUM_PIECE ? block : SUM_PIECE;
}

static float torch_sum_products(const float *x, const float *y, int64_t n, int lanes) {
    sum_state st;
    sum_open(&st, n);
    sum_feed(&st, x, y, 0, n, lanes);
    return sum_close(&st, x, y, 0, lanes);
}

/* rows x n: h = x (+ delta, stored in sum_out when given), out = w * (h * (1 / sqrt(sum(h^2) / n + eps))). */
int wb_rms_norm(const float *x, const float *delta, float *sum_out, const float *w, float *out, int64_t rows,
                int64_t n, float eps, int lanes) {
    if (!lanes_ok(lanes)) return -1;
    for (int64_t r = 0; r < rows; r++) {
        const float *h = x + r * n;
        if (delta != NULL) {
            float *s = sum_out + r * n;
            const float *d = delta + r * n;
            for (int64_t i = 0; i < n; i++) s[i] = h[i] + d[i];
            h = s;
        }
        const float mean = torch_sum_products(h, h, n, lanes) / (float)n;
        const float inv = 1.0f / sqrtf(mean + eps);
        float *o = out + r * n;
        for (int64_t i = 0; i < n; i++) o[i] = w[i] * (h[i] * inv);
    }
    return 0;
}

/* q [rows, hq * d], k [rows, hk * d] (row strides q_stride, k_stride), cos/sin [rows, d]:
 * qo/ko [rows, h * d] contiguous = x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x2, x1). */
int wb_rope(const float *q, const float *k, int64_t q_stride, int64_t k_stride, const float *cos_, const float *sin_,
            float *qo, float *ko, int64_t rows, int64_t hq, int64_t hk, int64_t d) {
    if (d % 2) return -1;
    const int64_t half = d / 2;
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos_ + r * d, *s = sin_ + r * d;
        for (int pass = 0; pass < 2; pass++) {
            const int64_t heads = pass ? hk : hq;
            const float *src = pass ? k + r * k_stride : q + r * q_stride;
            float *dst = pass ? ko + r * hk * d : qo + r * hq * d;
            for (int64_t h = 0; h < heads; h++) {
                const float *x = src + h * d;
                float *y = dst + h * d;
                for (int64_t i = 0; i < half; i++) y[i] = x[i] * c[i] + (-x[i + half]) * s[i];
                for (int64_t i = half; i < d; i++) y[i] = x[i] * c[i] + x[i - half] * s[i];
            }
        }
    }
    return 0;
}

/* SLEEF's xexpf (expf_u10) as its AVX2 and AVX512 builds compute it, lane by lane: q = rint(d/ln2),
 * s = d - q*ln2 in two fused steps (ln2 split in a high and a low part), a degree-6 polynomial in
 * fused multiply-adds, scaled by 2^q in two halves, then the out-of-range cases. Written per float
 * so the compiler vectorizes the loops below (rint, fma and the selects all have vector forms);
 * the selects vectorize only where compares may be assumed not to trap, which changes no value. */
#pragma GCC push_options
#pragma GCC optimize("no-trapping-math")
static inline float pow2i(int32_t q) {
    const int32_t bits = (int32_t)((uint32_t)(q + 0x7f) << 23);
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline float sleef_expf_u10(float d) {
    const int32_t q = (int32_t)rintf(d * 1.442695040888963407359924681001892137426645954152985934135449406931f);
    float s = fmaf((float)q, -0.693145751953125f, d);
    s = fmaf((float)q, -1.428606765330187045e-06f, s);
    float u = 0.000198527617612853646278381f;
    u = fmaf(u, s, 0.00139304355252534151077271f);
    u = fmaf(u, s, 0.00833336077630519866943359f);
    u = fmaf(u, s, 0.0416664853692054748535156f);
    u = fmaf(u, s, 0.166666671633720397949219f);
    u = fmaf(u, s, 0.5f);
    u = 1.0f + fmaf(s * s, u, s);
    u = u * pow2i(q >> 1) * pow2i(q - (q >> 1));
    u = d < -104.0f ? 0.0f : u;
    u = d > 100.0f ? INFINITY : u;
    return d != d ? d : u;
}

/* out[i] = silu(gate[i]) * up[i] for n floats; the rows split between threads where there are
 * enough of them to pay for it. Returns 0. */
int wb_silu_mul(const float *gate, const float *up, float *out, int64_t n, int num_threads) {
#pragma omp parallel for num_threads(num_threads > 0 ? num_threads : 1) schedule(static) if (n >= 16384)
    for (int64_t i = 0; i < n; i++) {
        const float g = gate[i];
        out[i] = g / (1.0f + sleef_expf_u10(-g)) * up[i];
    }
    return 0;
}
static inline int32_t bits_of(float f) {
    int32_t b;
    memcpy(&b, &f, sizeof b);
    return b;
}

static inline float of_bits(int32_t b) {
    float f;
    memcpy(&f, &b, sizeof f);
    return f;
}

/* SLEEF's xlogf_u1 (Sleef_logf16_u10 / logf8_u10, torch's Vectorized<float>::log) for a positive,
 * normal, finite d, one lane: the exponent and mantissa by getexp/getmant (`avx512`) or by
 * ilogb2k/ldexp3k (the AVX2 build), then its double-float steps with fused multiply-adds. */
static float sleef_logf_u10(float d, int avx512) {
    const int32_t q = ((bits_of(d * (1.0f / 0.75f)) >> 23) & 0xff) - 0x7f;
    float m;
    if (avx512) { /* _mm512_getmant_ps(d, _MM_MANT_NORM_p75_1p5, _MM_MANT_SIGN_nan) */
        const int32_t frac = bits_of(d) & 0x7fffff;
        m = of_bits(frac | ((frac & 0x400000) ? 0x7e << 23 : 0x7f << 23));
    } else {
        m = of_bits(bits_of(d) + (int32_t)((uint32_t)(-q) << 23));
    }
    const float e = (float)q;
    const float nx = -1.0f + m, nv = nx - (-1.0f), ny = (-1.0f - (nx - nv)) + (m - nv); /* dfadd2(-1, m) */
    const float dx = 1.0f + m, dv = dx - 1.0f, dy = (1.0f - (dx - dv)) + (m - dv);      /* dfadd2(1, m) */
    const float t = 1.0f / dx, s = nx * t;                                                /* dfdiv */
    const float u = fmaf(t, nx, -s), v = fmaf(-dy, t, fmaf(-dx, t, 1.0f));
    const float xx = s, xy = fmaf(s, v, fmaf(ny, t, u));
    const float x2 = xx * xx;
    float p = 0.3027294874e+0f;
    p = fmaf(p, x2, 0.3996108174e+0f);
    p = fmaf(p, x2, 0.6666694880e+0f);
    const float hi = 0.69314718246459960938f, lo = -1.904654323148236017e-09f;
    const float sx = hi * e, sy = fmaf(lo, e, fmaf(hi, e, -sx)); /* dfmul((hi, lo), e) */
    const float yx = xx * 2.0f, yy = xy * 2.0f;                  /* dfadd(s, dfscale(x, 2)) */
    const float r0 = sx + yx, r1 = (((sx - r0) + yx) + sy) + yy;
    const float w = (x2 * xx) * p;                               /* dfadd(s, x2 * x * t) */
    const float q0 = r0 + w, q1 = ((r0 - q0) + w) + r1;
    return q0 + q1;
}

/* The sampler's log-softmax pass (wb_log_softmax below) works on spans of a row: the maximum and
 * its first index, the exps of x - max summed, lp = (x - max) - log(sum), and the record of
 * p = exp(lp). With AVX2 and FMA, 8 floats a vector (torch's 16-lane vectors as two halves);
 * elsewhere the same steps a float at a time. */
#if WB_AVX2
/* sleef_expf_u10's middle on 8 lanes: s = d - q*ln2 in two fused steps, then 1 + s + s^2 * p(s)
 * (the degree-6 polynomial in fused multiply-adds), before the scaling by 2^q. */
static inline __m256 exp8_reduced(__m256 qf, __m256 d) {
    __m256 s = _mm256_fmadd_ps(qf, _mm256_set1_ps(-0.693145751953125f), d);
    s = _mm256_fmadd_ps(qf, _mm256_set1_ps(-1.428606765330187045e-06f), s);
    __m256 u = _mm256_set1_ps(0.000198527617612853646278381f);
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.00139304355252534151077271f));
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.00833336077630519866943359f));
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.0416664853692054748535156f));
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.166666671633720397949219f));
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.5f));
    return _mm256_add_ps(_mm256_set1_ps(1.0f), _mm256_fmadd_ps(_mm256_mul_ps(s, s), u, s));
}

/* sleef_expf_u10 on 8 lanes for d that are not NaN and at most 100 (here x - max, at most 0): the
 * same rounded operations in the same order, so the same bits. */
static inline __m256 exp8_all(__m256 d) {
    const __m256i q = _mm256_cvtps_epi32(
        _mm256_mul_ps(d, _mm256_set1_ps(1.442695040888963407359924681001892137426645954152985934135449406931f)));
    __m256 u = exp8_reduced(_mm256_cvtepi32_ps(q), d);
    const __m256i half = _mm256_srai_epi32(q, 1), bias = _mm256_set1_epi32(0x7f);
    const __m256 a = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, bias), 23));
    const __m256 b = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(q, half), bias), 23));
    u = _mm256_mul_ps(_mm256_mul_ps(u, a), b);
    return _mm256_andnot_ps(_mm256_cmp_ps(d, _mm256_set1_ps(-104.0f), _CMP_LT_OQ), u);
}

/* exp8_all where every lane has -86.5 <= d <= 0, in fewer operations with the same bits: q =
 * rint(d / ln2) by adding and subtracting 1.5 * 2^23 (round to nearest even, as the conversion),
 * and the scaling by 2^q as an add to u's exponent field. q >= -125 there and u > 0.7, so u * 2^q
 * is a normal float, which both of exp8_all's multiplications by powers of two give exactly; and
 * d >= -104 needs no mask. */
static inline __m256 exp8_normal(__m256 d) {
    const __m256 magic = _mm256_set1_ps(12582912.0f);
    const __m256 t = _mm256_add_ps(
        _mm256_mul_ps(d, _mm256_set1_ps(1.442695040888963407359924681001892137426645954152985934135449406931f)),
        magic);
    const __m256 u = exp8_reduced(_mm256_sub_ps(t, magic), d);
    /* t's low mantissa bits hold q (two's complement): shifted into the exponent field */
    return _mm256_castsi256_ps(
        _mm256_add_epi32(_mm256_castps_si256(u), _mm256_slli_epi32(_mm256_castps_si256(t), 23)));
}

/* exp(x - mx) of 8 floats as sleef_expf_u10 gives it: exp8_normal where it applies (every lane, or
 * `narrow`: the whole span's x - mx is known to be at least -86.5), else exp8_all. */
static inline __m256 exp8(__m256 x, __m256 mx, int narrow) {
    const __m256 d = _mm256_sub_ps(x, mx);
    if (!narrow && _mm256_movemask_ps(_mm256_cmp_ps(d, _mm256_set1_ps(-86.5f), _CMP_NGE_UQ)) != 0)
        return exp8_all(d);
    return exp8_normal(d);
}

/* exp8 of the 32 floats at x into e[4], one test for the four: their steps interleave. */
static inline void exp32(const float *x, __m256 mx, __m256 *e, int narrow) {
    __m256 d[4];
    for (int i = 0; i < 4; i++) d[i] = _mm256_sub_ps(_mm256_loadu_ps(x + 8 * i), mx);
    if (!narrow) {
        const __m256 low = _mm256_set1_ps(-86.5f);
        __m256 out = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) out = _mm256_or_ps(out, _mm256_cmp_ps(d[i], low, _CMP_NGE_UQ));
        if (_mm256_movemask_ps(out) != 0) {
            for (int i = 0; i < 4; i++) e[i] = exp8_all(d[i]);
            return;
        }
    }
    for (int i = 0; i < 4; i++) e[i] = exp8_normal(d[i]);
}

/* The maximum and the minimum of x[0..n) (n >= 1) in *out and *low; 1 where the span holds a NaN
 * (the two are then not decided). */
static int span_max(const float *x, int64_t n, float *out, float *low) {
    const __m256 inf = _mm256_set1_ps(INFINITY), minus_inf = _mm256_set1_ps(-INFINITY);
    __m256 m0 = minus_inf, m1 = minus_inf, l0 = inf, l1 = inf, nan = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 32 <= n; j += 32) {
        const __m256 a = _mm256_loadu_ps(x + j), b = _mm256_loadu_ps(x + j + 8);
        const __m256 c = _mm256_loadu_ps(x + j + 16), d = _mm256_loadu_ps(x + j + 24);
        m0 = _mm256_max_ps(m0, _mm256_max_ps(a, b));
        m1 = _mm256_max_ps(m1, _mm256_max_ps(c, d));
        l0 = _mm256_min_ps(l0, _mm256_min_ps(a, b));
        l1 = _mm256_min_ps(l1, _mm256_min_ps(c, d));
        const __m256 unordered = _mm256_or_ps(_mm256_cmp_ps(a, b, _CMP_UNORD_Q), _mm256_cmp_ps(c, d, _CMP_UNORD_Q));
        nan = _mm256_or_ps(nan, unordered);
    }
    for (; j + 8 <= n; j += 8) {
        const __m256 a = _mm256_loadu_ps(x + j);
        m0 = _mm256_max_ps(m0, a);
        l0 = _mm256_min_ps(l0, a);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
    }
    float hi[8], lo[8];
    _mm256_storeu_ps(hi, _mm256_max_ps(m0, m1));
    _mm256_storeu_ps(lo, _mm256_min_ps(l0, l1));
    float mx = hi[0], mn = lo[0]; /* the maximum of floats without NaN does not depend on the order */
    for (int i = 1; i < 8; i++) {
        mx = hi[i] > mx ? hi[i] : mx;
        mn = lo[i] < mn ? lo[i] : mn;
    }
    int bad = _mm256_movemask_ps(nan) != 0;
    for (; j < n; j++) {
        mx = x[j] > mx ? x[j] : mx;
        mn = x[j] < mn ? x[j] : mn;
        bad |= x[j] != x[j];
    }
    *out = mx;
    *low = mn;
    return bad;
}

/* A bitmask of the 8 floats at x equal to t. */
static inline uint32_t equal8(const float *x, __m256 t) {
    return (uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x), t, _CMP_EQ_OQ));
}

/* The first index of v in x[0..n), n where there is none. */
static int64_t span_find(const float *x, int64_t n, float v) {
    const __m256 t = _mm256_set1_ps(v);
    int64_t j = 0;
    for (; j + 32 <= n; j += 32) {
        const uint32_t m = equal8(x + j, t) | equal8(x + j + 8, t) << 8 | equal8(x + j + 16, t) << 16 |
                           equal8(x + j + 24, t) << 24;
        if (m) return j + __builtin_ctz(m);
    }
    for (; j < n; j++)
        if (x[j] == v) return j;
    return n;
}

/* acc[0..lanes) += exp(x - mx) of each vector of `lanes` floats in [v0, v1), lane by lane in order
 * (vec::map_reduce_all's adds); `narrow` as exp8 takes it. */
static void exp_add(const float *x, float mx, int64_t v0, int64_t v1, int lanes, float *acc, int narrow) {
    const __m256 m = _mm256_set1_ps(mx);
    const int64_t w = lanes / 8; /* 8-float halves a vector */
    __m256 a = _mm256_loadu_ps(acc), b = w == 2 ? _mm256_loadu_ps(acc + 8) : a;
    int64_t j = v0 * lanes;
    /* four exps in flight (each a long chain of dependent steps), added in order */
    for (; j + 32 <= v1 * lanes; j += 32) {
        __m256 e[4];
        exp32(x + j, m, e, narrow);
        if (w == 1) {
            a = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a, e[0]), e[1]), e[2]), e[3]);
        } else {
            a = _mm256_add_ps(_mm256_add_ps(a, e[0]), e[2]);
            b = _mm256_add_ps(_mm256_add_ps(b, e[1]), e[3]);
        }
    }
    for (; j < v1 * lanes; j += 8) {
        const __m256 e = exp8(_mm256_loadu_ps(x + j), m, narrow);
        if (w == 1 || (j / 8) % 2 == 0) a = _mm256_add_ps(a, e);
        else b = _mm256_add_ps(b, e);
    }
    _mm256_storeu_ps(acc, a);
    if (w == 2) _mm256_storeu_ps(acc + 8, b);
}

/* e[j] = exp(x[j] - mx) over the vectors of `lanes` floats in [v0, v1); `narrow` as exp8 takes it. */
static void exp_store(const float *x, float mx, int64_t v0, int64_t v1, int lanes, float *e, int narrow) {
    const __m256 m = _mm256_set1_ps(mx);
    int64_t j = v0 * lanes;
    for (; j + 32 <= v1 * lanes; j += 32) {
        __m256 q[4];
        exp32(x + j, m, q, narrow);
        for (int i = 0; i < 4; i++) _mm256_storeu_ps(e + j + 8 * i, q[i]);
    }
    for (; j < v1 * lanes; j += 8) _mm256_storeu_ps(e + j, exp8(_mm256_loadu_ps(x + j), m, narrow));
}

/* acc[0..lanes) += the stored exps e of each vector in [v0, v1), as exp_add adds them. */
static void stored_add(const float *e, int64_t v0, int64_t v1, int lanes, float *acc) {
    if (lanes == 8) {
        __m256 a = _mm256_loadu_ps(acc);
        for (int64_t v = v0; v < v1; v++) a = _mm256_add_ps(a, _mm256_loadu_ps(e + v * 8));
        _mm256_storeu_ps(acc, a);
    } else {
        __m256 a = _mm256_loadu_ps(acc), b = _mm256_loadu_ps(acc + 8);
        for (int64_t v = v0; v < v1; v++) {
            a = _mm256_add_ps(a, _mm256_loadu_ps(e + v * 16));
            b = _mm256_add_ps(b, _mm256_loadu_ps(e + v * 16 + 8));
        }
        _mm256_storeu_ps(acc, a);
        _mm256_storeu_ps(acc + 8, b);
    }
}
#else
static int span_max(const float *restrict x, int64_t n, float *out, float *low) {
    float mx = -INFINITY, mn = INFINITY; /* the maximum of floats without NaN does not depend on the order */
    int bad = 0;
#pragma omp simd reduction(max : mx) reduction(min : mn) reduction(| : bad)
    for (int64_t j = 0; j < n; j++) {
        const float v = x[j];
        mx = v > mx ? v : mx;
        mn = v < mn ? v : mn;
        bad |= v != v;
    }
    *out = mx;
    *low = mn;
    return bad;
}

static int64_t span_find(const float *x, int64_t n, float v) {
    for (int64_t j = 0; j < n; j++)
        if (x[j] == v) return j;
    return n;
}

static void exp_add(const float *restrict x, float mx, int64_t v0, int64_t v1, int lanes, float *restrict acc,
                    int narrow) {
    (void)narrow;
    for (int64_t v = v0; v < v1; v++)
        for (int i = 0; i < lanes; i++) acc[i] = acc[i] + sleef_expf_u10(x[v * lanes + i] - mx);
}

static void exp_store(const float *restrict x, float mx, int64_t v0, int64_t v1, int lanes, float *restrict e,
                      int narrow) {
    (void)narrow;
    for (int64_t j = v0 * lanes; j < v1 * lanes; j++) e[j] = sleef_expf_u10(x[j] - mx);
}

static void stored_add(const float *restrict e, int64_t v0, int64_t v1, int lanes, float *restrict acc) {
    for (int64_t v = v0; v < v1; v++)
        for (int i = 0; i < lanes; i++) acc[i] = acc[i] + e[v * lanes + i];
}
#endif

/* out[j] = (x[j] - mx) - lse for j in [0, n): ATen's order (see issue 11752: the max first). */
static void lp_write(const float *restrict x, float mx, float lse, float *restrict out, int64_t n) {
    for (int64_t j = 0; j < n; j++) out[j] = (x[j] - mx) - lse;
}

/* The row's maximum and its first index (torch.argmax), and whether every x - max is at least
 * -86.5 (`narrow`, for exp8); 1 where torch's path must run: a NaN or an infinite maximum. A
 * maximum of zero may have another sign than ATen's (which takes it from the order of the zeros it
 * met) only where two or more zeros hold it: then log(sum) >= log(2), and (x - max) - log is the same
 * float for either sign. */
static int max_arg(const float *x, int64_t n, float *mx, int64_t *arg, int *narrow) {
    float low;
    if (span_max(x, n, mx, &low) || !isfinite(*mx)) return 1;
    *arg = span_find(x, n, *mx);
    *narrow = low - *mx >= -86.5f; /* rounding is monotone: no x - max below the minimum's */
    return 0;
}

/* The sum of the row's exps from acc, the exps of its whole vectors summed lane by lane: the tail's
 * exps added into the first lanes (map_reduce_all; reduce_all over stored exps adds them the same
 * way), then vec_reduce_all's halving tree. torch.log_softmax takes SLEEF's log of it, torch.softmax
 * multiplies each exp by its reciprocal. */
static float exp_sum(float *acc, const float *x, float mx, int64_t n, int lanes) {
    const int64_t whole = n - n % lanes;
    for (int64_t i = 0; whole + i < n; i++) acc[i] = acc[i] + sleef_expf_u10(x[whole + i] - mx);
    for (int half = lanes / 2; half >= 1; half /= 2) {
        float next[16];
        for (int i = 0; i < lanes; i++) next[i] = acc[i] + acc[i ^ half];
        memcpy(acc, next, sizeof(float) * (size_t)lanes);
    }
    return acc[0];
}

static float lse_of(float sum, int lanes) { return sleef_logf_u10(sum, lanes == 16); }

/* e[j] = exp(x[j] - mx) for the whole row (the vectors, then the tail), and acc its lanes' sums as
 * exp_add leaves them: the exps softmax stores before it sums them. */
static void exp_row(const float *x, float mx, int64_t n, int lanes, float *e, float *acc, int narrow) {
    const int64_t nv = n / lanes;
    exp_store(x, mx, 0, nv, lanes, e, narrow);
    for (int64_t j = nv * lanes; j < n; j++) e[j] = sleef_expf_u10(x[j] - mx);
    memcpy(acc, e, sizeof(float) * (size_t)lanes);
    stored_add(e, 1, nv, lanes, acc);
}

#pragma GCC pop_options

/* Per row of p and lp ([rows, n], row stride `stride`): -(sum of p[i] * lp[i]), the entropy the
 * traced sampler records, as torch computes -(p * lp).sum(-1): a row longer than torch's grain
 * (32768) with several threads is cut into min(threads, ceil(n / 32768)) chunks of ceil(n / chunks)
 * floats, each summed as above and the partial sums added in turn to 0 (TensorIterator's two-pass
 * reduction of a single output); a row within the grain, or several rows (one task per row), is
 * one sum. Returns 0, or -1 for lanes out of range. */
int wb_entropy(const float *p, const float *lp, int64_t rows, int64_t n, int64_t stride, int lanes, int threads,
               float *out) {
    if (!lanes_ok(lanes)) return -1;
    const int64_t grain = 32768;
#pragma omp parallel for num_threads(threads > 0 ? threads : 1) schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const float *x = p + r * stride, *y = lp + r * stride;
        int64_t chunks = rows == 1 && threads > 1 ? (n + grain - 1) / grain : 1;
        if (chunks > threads) chunks = threads;
        const int64_t size = (n + chunks - 1) / chunks;
        float total = 0.0f;
        for (int64_t c = 0; c < chunks; c++) {
            const int64_t begin = c * size, end = begin + size < n ? begin + size : n;
            if (begin < end) total += torch_sum_products(x + begin, y + begin, end - begin, lanes);
        }
        out[r] = -total;
    }
    return 0;
}

typedef struct { float v; int64_t i; } wb_pair; /* topk.c's pair_t */
void wb_topk_open(wb_pair *h, const float *x, int64_t k, int64_t base);           /* topk.c */
void wb_topk_feed(wb_pair *h, int64_t k, const float *x, int64_t m, int64_t base, wb_pair *log, int64_t cap,
                  int64_t *logged);
void wb_topk_replay(wb_pair *h, int64_t k, const wb_pair *log, int64_t count);
void wb_topk_close(wb_pair *h, int64_t k, float *vals, int64_t *ids);
typedef struct {
    int64_t k;  /* the record's top-k; 0: no record */
    int elanes; /* the entropy's sum width (wb_entropy's lanes) */
} record_t;

typedef struct {        /* the record of one span of a row */
    wb_pair heap[256];  /* its top-k heap (topk.c) */
    wb_pair *log;       /* NULL, or where the pairs that entered the heap go (wb_topk_feed) */
    int64_t cap, logged;
    float sum;          /* its sum of p * lp, in torch's order from the span's start */
} span_rec;

/* lp[j] = (x[j] - mx) - lse over the span [b, e) of a row; with a record, piece by piece while the
 * piece is in cache: p[j] (the exps of x - max, stored by the exp pass) times `inv`, the reciprocal
 * of their sum (torch.softmax's last step), its pairs offered to the span's heap (opened on its
 * first k), and, where `sum`, p * lp summed by the cascade from b (pieces of sum_piece floats).
 * p is indexed as the row. lp NULL (a record only): each piece of lp lives in a buffer of the
 * thread's own while it is summed, and the row's lp is not stored. */
static void span_out(const float *x, float *lp, float mx, float lse, float inv, int64_t b, int64_t e,
                     const record_t *rec, float *p, int sum, span_rec *sr) {
    if (rec->k == 0) {
        lp_write(x + b, mx, lse, lp + b, e - b);
        return;
    }
    const int64_t k = rec->k, piece = sum_piece(e - b, rec->elanes);
    float local[SUM_PIECE]; /* wb_log_softmax sees to piece <= SUM_PIECE where lp is NULL */
    sum_state st;
    sum_open(&st, e - b);
    int64_t c = b;
    float *l = local; /* this piece's lp: in lp where it is stored */
    for (;;) {
        const int64_t m = e - c < piece ? e - c : piece;
        float *q = p + c;
        l = lp != NULL ? lp + c : local;
        lp_write(x + c, mx, lse, l, m);
        for (int64_t j = 0; j < m; j++) q[j] = q[j] * inv;
        if (c == b) { /* m >= k: a span holds k * 64 floats or more, a piece SUM_PIECE or all of them */
            wb_topk_open(sr->heap, q, k, b);
            if (sr->log != NULL) {
                for (int64_t j = 0; j < k; j++) sr->log[j] = (wb_pair){q[j], b + j};
                sr->logged = k;
            }
            wb_topk_feed(sr->heap, k, q + k, m - k, b + k, sr->log, sr->cap, &sr->logged);
        } else {
            wb_topk_feed(sr->heap, k, q, m, c, sr->log, sr->cap, &sr->logged);
        }
        if (sum) sum_feed(&st, q, l, c - b, c + m - b, rec->elanes);
        if (c + m >= e) break;
        c += m;
    }
    sr->sum = sum ? sum_close(&st, p + c, l, c - b, rec->elanes) : 0.0f;
}

/* One row, one thread: wb_log_softmax's per-row pass; p: n floats for the record's exps. Returns 1
 * where torch's path must run. */
static int ls_row(const float *x, int64_t n, int lanes, float *lp, int64_t *argmax, const record_t *rec, float *p,
                  float *vals, int64_t *ids, float *entropy, float *stats) {
    float mx;
    int narrow;
    if (max_arg(x, n, &mx, argmax, &narrow)) return 1;
    float acc[16];
    if (rec->k > 0) {
        exp_row(x, mx, n, lanes, p, acc, narrow);
    } else {
        exp_store(x, mx, 0, 1, lanes, acc, narrow); /* map_reduce_all starts from the first vector's exps */
        exp_add(x, mx, 1, n / lanes, lanes, acc, narrow);
    }
    const float total_exp = exp_sum(acc, x, mx, n, lanes), lse = lse_of(total_exp, lanes);
    stats[0] = mx;
    stats[1] = lse;
    span_rec sr = {.log = NULL, .cap = 0, .logged = 0};
    span_out(x, lp, mx, lse, 1.0f / total_exp, 0, n, rec, p, 1, &sr);
    if (rec->k > 0) {
        wb_topk_close(sr.heap, rec->k, vals, ids);
        float total = 0.0f; /* as wb_entropy adds a batch row's one sum */
        total += sr.sum;
        *entropy = -total;
    }
    return 0;
}

#define PART_LOG 1024 /* pairs a later part of a row logs (wb_topk_feed); past them, it is fed again */

typedef struct {
    float mx, low;
    int64_t arg;
    int bad;
    span_rec rec;
} part_t;

/* One row cut into `parts` spans of ceil(n / parts) floats, one a thread: torch.log_softmax runs a
 * row on one thread, but its maximum does not depend on the order, the exps of later spans can be
 * computed beside the first span's and added after them in the same order (stored in lp, or in p
 * with a record, and lp is written last), and lp, p and the top-k (merged by wb_topk_replay) are a
 * span's own. The entropy: where torch's sum cuts the row into `parts` chunks at this many threads
 * (wb_entropy), the spans are those chunks, each summed from its start and the partial sums added
 * in turn; a row torch sums whole (`parts` > chunks = 1) is summed from p after the spans.
 * Returns 1 where torch's path must run. */
static int ls_one_row(const float *x, int64_t n, int lanes, float *lp, int64_t *argmax, const record_t *rec,
                      float *p, float *vals, int64_t *ids, float *entropy, float *stats, int64_t parts,
                      int64_t chunks) {
    const int64_t size = (n + parts - 1) / parts, nv = n / lanes, k = rec->k;
    part_t *part = malloc((size_t)parts * sizeof *part);
    wb_pair *logs = k > 0 ? malloc((size_t)parts * PART_LOG * sizeof *logs) : NULL;
    if (part == NULL || (k > 0 && logs == NULL)) {
        free(part);
        free(logs);
        return 1;
    }
    float mx = 0.0f, lse = 0.0f, inv = 0.0f, acc[16];
    int failed = 0, narrow = 0;
#pragma omp parallel num_threads((int)parts)
    {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < parts; t++) {
            const int64_t b = t * size, e = b + size < n ? b + size : n;
            part[t].bad = span_max(x + b, e - b, &part[t].mx, &part[t].low);
            part[t].arg = part[t].bad ? 0 : b + span_find(x + b, e - b, part[t].mx);
        }
#pragma omp single
        {
            float low = part[0].low;
            mx = part[0].mx;
            for (int64_t t = 0; t < parts; t++) {
                failed |= part[t].bad;
                mx = part[t].mx > mx ? part[t].mx : mx;
                low = part[t].low < low ? part[t].low : low;
            }
            failed |= !isfinite(mx); /* as max_arg */
            narrow = low - mx >= -86.5f;
            for (int64_t t = 0; !failed && t < parts; t++)
                if (part[t].mx == mx) {
                    *argmax = part[t].arg;
                    break;
                }
        }
        if (!failed) {
            float *stored = k > 0 ? p : lp; /* where the later spans' exps wait to be added */
#pragma omp for schedule(static)
            for (int64_t t = 0; t < parts; t++) { /* the vectors that start in the span */
                const int64_t v1 = t == parts - 1 ? nv : ((t + 1) * size + lanes - 1) / lanes;
                const int64_t w1 = v1 < nv ? v1 : nv;
                if (t == 0 && k > 0) {
                    exp_store(x, mx, 0, w1, lanes, p, narrow);
                    memcpy(acc, p, sizeof(float) * (size_t)lanes);
                    stored_add(p, 1, w1, lanes, acc);
                } else if (t == 0) {
                    exp_store(x, mx, 0, 1, lanes, acc, narrow);
                    exp_add(x, mx, 1, w1, lanes, acc, narrow);
                } else {
                    const int64_t v0 = (t * size + lanes - 1) / lanes;
                    exp_store(x, mx, v0 < nv ? v0 : nv, w1, lanes, stored, narrow);
                }
                if (t == parts - 1 && k > 0) /* the tail past the whole vectors: p's only */
                    for (int64_t j = nv * lanes; j < n; j++) p[j] = sleef_expf_u10(x[j] - mx);
            }
#pragma omp single
            {
                const int64_t v0 = (size + lanes - 1) / lanes;
                stored_add(stored, v0 < nv ? v0 : nv, nv, lanes, acc);
                const float total_exp = exp_sum(acc, x, mx, n, lanes);
                lse = lse_of(total_exp, lanes);
                inv = 1.0f / total_exp;
                stats[0] = mx;
                stats[1] = lse;
            }
#pragma omp for schedule(static)
            for (int64_t t = 0; t < parts; t++) {
                const int64_t b = t * size, e = b + size < n ? b + size : n;
                part[t].rec.log = t > 0 && logs != NULL ? logs + t * PART_LOG : NULL;
                part[t].rec.cap = PART_LOG;
                part[t].rec.logged = 0;
                span_out(x, lp, mx, lse, inv, b, e, rec, p, chunks == parts, &part[t].rec);
            }
#pragma omp single
            if (k > 0) {
                float total = 0.0f;
                if (chunks == parts)
                    for (int64_t t = 0; t < parts; t++) total += part[t].rec.sum;
                else
                    total += torch_sum_products(p, lp, n, rec->elanes);
                *entropy = -total;
                wb_pair *h = part[0].rec.heap;
                for (int64_t t = 1; t < parts; t++) {
                    const int64_t b = t * size, e = b + size < n ? b + size : n;
                    if (part[t].rec.logged <= PART_LOG) wb_topk_replay(h, k, part[t].rec.log, part[t].rec.logged);
                    else wb_topk_feed(h, k, p + b, e - b, b, NULL, 0, NULL);
                }
                wb_topk_close(h, k, vals, ids);
            }
        }
    }
    free(part);
    free(logs);
    return failed;
}

/* The traced sampler's first pass, per row of logits x [rows, n] (row stride `stride`): lp =
 * torch.log_softmax(x) into out [rows, n] (ATen's serial_vec_log_softmax_lastdim_range at `lanes`
 * floats a vector: the maximum; the exps of x - max summed as vec::map_reduce_all does, one vector
 * of partial sums over the row, the tail's lanes added into the first ones, then vec_reduce_all's
 * halving tree; SLEEF's log of the sum; (x - max) - log) and the argmax of x (argmax [rows]); with
 * k > 0 also the record of the row's own distribution: p = torch.softmax(x) (ATen's
 * _vec_softmax_lastdim: the same exps, stored, and the same sum, each exp times 1 / sum), its top-k
 * as wb_topk (vals, ids [rows, k]), its entropy -(p * lp).sum() as wb_entropy sums it at `elanes`
 * (entropy [rows]), p in the thread's row of `scratch` [threads, n], a piece at a time while it is
 * in cache after the exp pass.
 * Several rows: one task per row. One row with several threads: cut into spans as ls_one_row says
 * (torch's chunks of its sum, or two spans where it sums the row whole), p in scratch's first row.
 * stats [rows, 2]: each row's maximum and log of its sum, so that lp at any index is (x - max) - log
 * (torch's own two steps, the same bits). out may be NULL with a record, except for one row that
 * torch sums whole at several threads: lp is then only computed, a piece at a time, for the sum.
 * Returns 0; 1 where a row holds a NaN or an infinite maximum (nothing is decided: run torch's path
 * for the batch); -1 for arguments out of range. */
int wb_log_softmax(const float *x, int64_t rows, int64_t n, int64_t stride, int lanes, float *out, int64_t *argmax,
                   int64_t k, int elanes, float *scratch, float *vals, int64_t *ids, float *entropy, float *stats,
                   int threads) {
    if ((lanes != 16 && lanes != 8) || n < lanes || n > 2147483647 || rows < 1 || stats == NULL) return -1;
    if (k < 0 || (k > 0 && (k > 256 || k * 64 > n || scratch == NULL || !lanes_ok(elanes))))
        return -1;
    const record_t rec = {k, elanes};
    threads = threads > 0 ? threads : 1;
    int64_t chunks = (n + 32767) / 32768; /* wb_entropy's chunks of one row */
    if (chunks > threads) chunks = threads;
    /* unstored: the record's sum must not need the whole row's lp after its spans (one row summed whole) */
    if (out == NULL && (k == 0 || (rows == 1 && threads > 1 && chunks < 2) || sum_piece(n, elanes) > SUM_PIECE))
        return -1;
    if (rows == 1 && threads > 1) {
        const int64_t parts = chunks > 1 ? chunks : 2;
        return ls_one_row(x, n, lanes, out, argmax, &rec, scratch, vals, ids, entropy, stats, parts, chunks);
    }
    int failed = 0;
#pragma omp parallel num_threads(threads) if (rows > 1)
    {
        float *p = k > 0 ? scratch + (ptrdiff_t)omp_get_thread_num() * n : NULL;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            const int record = k > 0; /* vals, ids and entropy: NULL without a record */
            if (ls_row(x + r * stride, n, lanes, out != NULL ? out + r * n : NULL, argmax + r, &rec, p,
                       record ? vals + r * k : NULL, record ? ids + r * k : NULL, record ? entropy + r : NULL,
                       stats + 2 * r)) {
#pragma omp atomic write
                failed = 1;
            }
        }
    }
    return failed;
}

/* A step's KV write: `n` contiguous rows of K and of V (`row` bytes each) copied into rows `loc` of
 * pools `slots` rows long; what `pool.index_copy_(0, loc, src)` does, without its dispatch (20-50 us
 * a call, two calls a layer). Also the KV write of decode_layers.c's rows call. Returns -1, having
 * copied nothing, where a slot is outside the pool. */
int wb_kv_write(char *k_pool, char *v_pool, int64_t slots, const int64_t *loc, int64_t n, const char *k,
                const char *v, int64_t row) {
    for (int64_t i = 0; i < n; i++)
        if (loc[i] < 0 || loc[i] >= slots) return -1;
    for (int64_t i = 0; i < n; i++) {
        memcpy(k_pool + loc[i] * row, k + i * row, (size_t)row);
        memcpy(v_pool + loc[i] * row, v + i * row, (size_t)row);
    }
    return 0;
}
