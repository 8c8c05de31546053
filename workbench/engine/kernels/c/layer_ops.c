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
 *
 * Built with -ffp-contract=off: every product is rounded before it is added, as torch's separate
 * mul and add kernels round it.
 */
#include <math.h>
#include <stdint.h>
#include <stddef.h>
#include <string.h>
#include <omp.h>

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
 * keeps it in a register. */
#define DEFINE_SUM_PRODUCTS(L)                                                                        \
typedef float vsum##L __attribute__((vector_size(4 * L)));                                           \
static float torch_sum_products_##L(const float *x, const float *y, int64_t n) {                     \
    const int64_t vec_size = n / L;          /* whole vectors */                                      \
    const int64_t size = vec_size / ILP;     /* multi_row_sum's "rows" of ILP vectors each */         \
    const int64_t level_power = ceil_log2(size) / LEVELS > 4 ? ceil_log2(size) / LEVELS : 4;         \
    const int64_t level_step = (int64_t)1 << level_power, level_mask = level_step - 1;               \
    vsum##L acc[LEVELS][ILP];                                                                         \
    memset(acc, 0, sizeof acc);                                                                       \
    int64_t i = 0;                                                                                    \
    vsum##L xv, yv;                                                                                   \
    for (; i + level_step <= size;) {                                                                 \
        for (int64_t j = 0; j < level_step; ++j, ++i)                                                 \
            for (int k = 0; k < ILP; k++) {                                                           \
                memcpy(&xv, x + (i * ILP + k) * L, sizeof xv);                                        \
                memcpy(&yv, y + (i * ILP + k) * L, sizeof yv);                                        \
                acc[0][k] += xv * yv;                                                                 \
            }                                                                                         \
        for (int j = 1; j < LEVELS; ++j) {                                                            \
            for (int k = 0; k < ILP; k++) { acc[j][k] += acc[j - 1][k]; acc[j - 1][k] = (vsum##L){0}; } \
            if ((i & (level_mask << (j * level_power))) != 0) break;                                  \
        }                                                                                             \
    }                                                                                                 \
    for (; i < size; ++i)                                                                             \
        for (int k = 0; k < ILP; k++) {                                                               \
            memcpy(&xv, x + (i * ILP + k) * L, sizeof xv);                                            \
            memcpy(&yv, y + (i * ILP + k) * L, sizeof yv);                                            \
            acc[0][k] += xv * yv;                                                                     \
        }                                                                                             \
    for (int j = 1; j < LEVELS; ++j)                                                                  \
        for (int k = 0; k < ILP; k++) acc[0][k] += acc[j][k];                                         \
    /* row_sum: the vectors left over after the ILP rows, then the ILP partial sums in turn */       \
    for (int64_t v = size * ILP; v < vec_size; v++) {                                                 \
        memcpy(&xv, x + v * L, sizeof xv);                                                            \
        memcpy(&yv, y + v * L, sizeof yv);                                                            \
        acc[0][0] += xv * yv;                                                                         \
    }                                                                                                 \
    for (int k = 1; k < ILP; k++) acc[0][0] += acc[0][k];                                             \
    /* vectorized_inner_sum: the scalar tail first, then the lanes in order */                        \
    float total = 0.0f;                                                                               \
    for (int64_t k = vec_size * L; k < n; k++) total += x[k] * y[k];                                  \
    for (int l = 0; l < L; l++) total += acc[0][0][l];                                                \
    return total;                                                                                     \
}
DEFINE_SUM_PRODUCTS(1)
DEFINE_SUM_PRODUCTS(4)
DEFINE_SUM_PRODUCTS(8)
DEFINE_SUM_PRODUCTS(16)

static int lanes_ok(int lanes) { return lanes == 1 || lanes == 4 || lanes == 8 || lanes == 16; }

static float torch_sum_products(const float *x, const float *y, int64_t n, int lanes) {
    if (lanes == 16) return torch_sum_products_16(x, y, n);
    if (lanes == 8) return torch_sum_products_8(x, y, n);
    if (lanes == 4) return torch_sum_products_4(x, y, n);
    return torch_sum_products_1(x, y, n);
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
    const int32_t bits = (q + 0x7f) << 23;
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

/* The row's maximum; 1 where it holds a NaN or the maximum is not finite (torch's path then). */
static int row_max(const float *restrict x, int64_t n, float *out) {
    float mx = -INFINITY; /* the maximum of floats without NaN does not depend on the order */
    int bad = 0;
#pragma omp simd reduction(max : mx) reduction(| : bad)
    for (int64_t j = 0; j < n; j++) {
        const float v = x[j];
        mx = v > mx ? v : mx;
        bad |= v != v;
    }
    *out = mx;
    return bad || !isfinite(mx);
}

/* One row of torch.log_softmax (ATen's serial_vec_log_softmax_lastdim_range at `lanes` floats a
 * vector): the maximum; the exps of x - max summed as vec::map_reduce_all does (one vector of
 * partial sums over the row, the tail's lanes added into the first ones, then vec_reduce_all's
 * halving tree); SLEEF's log of the sum; out = (x - max) - log.
 * The argmax (first index of the maximum) too. Returns 1 where torch's path must run. */
static int log_softmax_row(const float *restrict x, int64_t n, int lanes, float *restrict out, int64_t *argmax) {
    float mx;
    if (n < lanes || row_max(x, n, &mx)) return 1;
    /* the exps of whole vectors added lane by lane into acc as map_reduce_all adds them (the first
     * vector starts acc), kept in registers: a row of exps written out and read back was the slower
     * way; then the tail's lanes into the first ones of acc */
    const int64_t whole = n - n % lanes;
    float acc[16];
    if (lanes == 16) {
        for (int i = 0; i < 16; i++) acc[i] = sleef_expf_u10(x[i] - mx);
        for (int64_t d = 16; d < whole; d += 16) {
            float v[16];
            for (int i = 0; i < 16; i++) v[i] = sleef_expf_u10(x[d + i] - mx);
            for (int i = 0; i < 16; i++) acc[i] = acc[i] + v[i];
        }
    } else {
        for (int i = 0; i < 8; i++) acc[i] = sleef_expf_u10(x[i] - mx);
        for (int64_t d = 8; d < whole; d += 8) {
            float v[8];
            for (int i = 0; i < 8; i++) v[i] = sleef_expf_u10(x[d + i] - mx);
            for (int i = 0; i < 8; i++) acc[i] = acc[i] + v[i];
        }
    }
    for (int64_t i = 0; whole + i < n; i++) acc[i] = acc[i] + sleef_expf_u10(x[whole + i] - mx);
    for (int half = lanes / 2; half >= 1; half /= 2) {
        float next[16];
        for (int i = 0; i < lanes; i++) next[i] = acc[i] + acc[i ^ half];
        memcpy(acc, next, sizeof(float) * (size_t)lanes);
    }
    const float lse = sleef_logf_u10(acc[0], lanes == 16);
    for (int64_t j = 0; j < n; j++) out[j] = (x[j] - mx) - lse;
    int64_t first = 0;
    while (x[first] != mx) first++;
    *argmax = first;
    return 0;
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

void wb_topk_row(const float *x, int64_t V, int64_t k, float *vals, int64_t *ids); /* topk.c */
typedef void (*vexp_fn)(int n, const float *a, float *r);                        /* MKL's vsExp */

/* The traced sampler's first pass, per row of logits x [rows, n] (row stride `stride`), rows >= 2,
 * one task per row: lp = torch.log_softmax(x) into out [rows, n] and the argmax of x (argmax [rows]);
 * with k > 0 also the record of the row's own distribution: p = exp(lp) by the exp torch.exp runs
 * (MKL's vsExp at `vexp`), its top-k as wb_topk, its entropy -(p * lp).sum() as wb_entropy sums it
 * (at `elanes`), with p in a per-thread row of `scratch` [threads, n] that stays in cache (NULL
 * without a record).
 * Returns 0; 1 where a row holds a NaN or an infinite maximum (nothing is decided: run torch's
 * path for the batch); -1 for arguments out of range. */
int wb_log_softmax(const float *x, int64_t rows, int64_t n, int64_t stride, int lanes, float *out, int64_t *argmax,
                   int64_t k, void *vexp, int elanes, float *scratch, float *vals, int64_t *ids, float *entropy,
                   int threads) {
    if ((lanes != 16 && lanes != 8) || n < lanes || n > 2147483647 || rows < 1) return -1;
    if (k > 0 && (k > 256 || k * 64 > n || vexp == NULL || scratch == NULL || !lanes_ok(elanes))) return -1;
    int failed = 0;
#pragma omp parallel num_threads(threads > 0 ? threads : 1) if (rows > 1)
    {
        float *e = k > 0 ? scratch + (ptrdiff_t)omp_get_thread_num() * n : NULL;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            float *lp = out + r * n;
            if (log_softmax_row(x + r * stride, n, lanes, lp, argmax + r)) {
#pragma omp atomic write
                failed = 1;
                continue;
            }
            if (k > 0) {
                ((vexp_fn)vexp)((int)n, lp, e);
                wb_topk_row(e, n, k, vals + r * k, ids + r * k);
                float total = 0.0f; /* as wb_entropy adds a batch row's one sum */
                total += torch_sum_products(e, lp, n, elanes);
                entropy[r] = -total;
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
