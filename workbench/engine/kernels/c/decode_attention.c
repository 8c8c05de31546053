/* Paged decode attention for CPU, float32: one query token per request, reading K/V straight from
 * the engine's KV pool through each request's slot indices (no gather copy).
 *
 * q    [B, H, D]           the decode rows' queries, contiguous
 * k, v [slots, KVH, D]     one layer of the KV pool, contiguous
 * idx  [B, idx_stride]     KV slot of each cached position (int64), first lens[b] are valid
 * out  [B, H, D]           written; may be a slice of a larger contiguous tensor
 * window  > 0: sliding window, row b attends only its last min(lens[b], window) positions (its query
 *          is at position lens[b]-1 and sees positions > lens[b]-1-window, transformers' overlay);
 *          0: all lens[b] positions. The windowed path is the full path over the window's slots.
 * softcap > 0: scores -> tanh(scores / softcap) * softcap (Gemma 2), after scaling, before the softmax.
 * sinks   NULL, or [H]: one extra logit per head in the softmax's denominator, no value (gpt-oss).
 * Returns 0; -2 (nothing written) when a length or a slot index is out of range; -1 out of memory.
 * Query head j attends with KV head j / (H / KVH) (transformers' repeat_kv).
 * num_threads: torch.get_num_threads() of the caller (the engine may step on any thread).
 * Softmax in float32 with the running max subtracted, like scaled_dot_product_attention.
 * A request's slots are not adjacent (each decode step allocates one slot per running request), so
 * the hardware prefetcher misses them: K/V rows KPF and VPF positions ahead are prefetched by hand.
 * One task per (request, KV head). With AVX2 and FMA and D a multiple of 8, the scores come four
 * positions at a time for up to three of the query heads that share the KV head (each 8-float
 * chunk of a K row loaded once for them, four dot products reduced into one vector), the softmax's
 * exps are a vector polynomial (exp8) and p.V accumulates up to three heads on each chunk of a V
 * row; elsewhere the same steps run in scalar code. At several rows the check asks only for sdpa's
 * own rounding error (decode_attention.py); at one row, for its bits, which neither path has.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define WB_VEC 1
#else
#define WB_VEC 0
#endif
#ifndef PF
#define PF 8 /* positions ahead; 8 beat 4 at 72-1000 cached tokens */
#endif
#ifndef KPF
#define KPF 32 /* positions ahead of a block of four scores */
#endif
#ifndef VPF
#define VPF 32 /* positions ahead in p.V */
#endif

/* Ask for one slot's K or V row (n floats) to be brought into cache. */
static inline void prefetch_row(const float *row, int64_t n) {
    const char *p = (const char *)row;
    for (int64_t off = 0; off < n * (int64_t)sizeof(float); off += 64) __builtin_prefetch(p + off, 0, 3);
}

#if WB_VEC
/* exp(x) of 8 lanes, within 1 ulp of the correctly rounded value on [-87, 0] (checked at every
 * float there): n = round(x / ln2), r = x - n ln2 in two parts, e^r by a degree-6 polynomial, 2^n
 * added to the exponent; 0 below -87.3 (where expf is ~1e-38, a term no softmax sum sees), NaN for
 * NaN. Inputs here are <= 0 (a score minus the row's maximum). */
static inline __m256 exp8(const __m256 x0) {
    const __m256 nan_mask = _mm256_cmp_ps(x0, x0, _CMP_UNORD_Q);
    const __m256 tiny = _mm256_cmp_ps(x0, _mm256_set1_ps(-87.3f), _CMP_LT_OQ);
    __m256 x = _mm256_max_ps(x0, _mm256_set1_ps(-87.3f));
    x = _mm256_min_ps(x, _mm256_set1_ps(88.3f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r);
    p = _mm256_add_ps(p, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    const __m256 y = _mm256_andnot_ps(tiny, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));  /* 0 below -87.3 */
    return _mm256_blendv_ps(y, x0, nan_mask);  /* NaN in, NaN out (max/min above would drop it) */
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The four sums of a[0..3] (each 8 lanes) in one 4-lane vector. */
static inline __m128 sum4x8(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
}

/* Scores of GH (1-3, a literal) query heads at qh (D floats apart) against four K rows at a time:
 * each chunk of a K row is loaded once for all GH heads (12 accumulators at most). */
static inline __attribute__((always_inline)) void qk_heads(const float *qh, const float *k, const int64_t *slots,
                                                           int64_t L, int64_t row, int64_t koff, int64_t D,
                                                           float scale, float *sc, const int GH) {
    const __m128 vscale = _mm_set1_ps(scale);
    int64_t l0 = 0;
    for (; l0 + 4 <= L; l0 += 4) {
        const float *k0 = k + slots[l0] * row + koff, *k1 = k + slots[l0 + 1] * row + koff;
        const float *k2 = k + slots[l0 + 2] * row + koff, *k3 = k + slots[l0 + 3] * row + koff;
        for (int p = 0; p < 4; p++)
            if (l0 + KPF + p < L) prefetch_row(k + slots[l0 + KPF + p] * row + koff, D);
        __m256 acc[3][4];
        for (int h = 0; h < GH; h++)
            for (int p = 0; p < 4; p++) acc[h][p] = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += 8) {
            const __m256 x0 = _mm256_loadu_ps(k0 + d), x1 = _mm256_loadu_ps(k1 + d);
            const __m256 x2 = _mm256_loadu_ps(k2 + d), x3 = _mm256_loadu_ps(k3 + d);
            for (int h = 0; h < GH; h++) {
                const __m256 qv = _mm256_loadu_ps(qh + h * D + d);
                acc[h][0] = _mm256_fmadd_ps(qv, x0, acc[h][0]);
                acc[h][1] = _mm256_fmadd_ps(qv, x1, acc[h][1]);
                acc[h][2] = _mm256_fmadd_ps(qv, x2, acc[h][2]);
                acc[h][3] = _mm256_fmadd_ps(qv, x3, acc[h][3]);
            }
        }
        for (int h = 0; h < GH; h++)
            _mm_storeu_ps(sc + h * L + l0, _mm_mul_ps(sum4x8(acc[h][0], acc[h][1], acc[h][2], acc[h][3]), vscale));
    }
    for (; l0 < L; l0++) {
        const float *kl = k + slots[l0] * row + koff;
        for (int h = 0; h < GH; h++) {
            __m256 acc = _mm256_setzero_ps();
            for (int64_t d = 0; d < D; d += 8)
                acc = _mm256_fmadd_ps(_mm256_loadu_ps(qh + h * D + d), _mm256_loadu_ps(kl + d), acc);
            sc[h * L + l0] = hsum8(acc) * scale;
        }
    }
}
#endif

/* Scores of query heads j0..j0+G-1 against one KV head's rows (kv head offset `koff` floats into a
 * slot's row of `row` floats) at the L positions `slots`: sc[(j - j0) * L + l]. */
static void scores_of(const float *qb, const float *k, const int64_t *slots, int64_t L, int64_t row,
                      int64_t koff, int64_t j0, int64_t G, int64_t D, float scale, float softcap, float *sc) {
#if WB_VEC
    if (D % 8 == 0) {
        for (int64_t jj = 0; jj < G; jj += 3) {  /* three heads a pass over the rows */
            const float *qh = qb + (j0 + jj) * D;
            float *s = sc + jj * L;
            if (G - jj >= 3) qk_heads(qh, k, slots, L, row, koff, D, scale, s, 3);
            else if (G - jj == 2) qk_heads(qh, k, slots, L, row, koff, D, scale, s, 2);
            else qk_heads(qh, k, slots, L, row, koff, D, scale, s, 1);
        }
    } else
#endif
    for (int64_t l = 0; l < L; l++) {
        if (l + PF < L) prefetch_row(k + slots[l + PF] * row + koff, D);
        const float *kl = k + slots[l] * row + koff;
        for (int64_t jj = 0; jj < G; jj++) {
            const float *qj = qb + (j0 + jj) * D;
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int64_t d = 0; d < D; d++) s += qj[d] * kl[d];
            sc[jj * L + l] = s * scale;
        }
    }
    if (softcap > 0.f)
        for (int64_t i = 0; i < G * L; i++) sc[i] = tanhf(sc[i] / softcap) * softcap;
}

/* Softmax of one head's L scores in place, with an optional sink logit in the denominator. */
static void softmax_of(float *sj, int64_t L, const float *sink) {
    float m = sink ? *sink : -INFINITY;
    for (int64_t l = 0; l < L; l++) m = sj[l] > m ? sj[l] : m;
    float sum = sink ? expf(*sink - m) : 0.f;
    int64_t l = 0;
#if WB_VEC
    const __m256 vm = _mm256_set1_ps(m);
    __m256 vsum = _mm256_setzero_ps();
    for (; l + 8 <= L; l += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sj + l), vm));
        _mm256_storeu_ps(sj + l, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    sum += hsum8(vsum);
#endif
    for (; l < L; l++) {
        sj[l] = expf(sj[l] - m);
        sum += sj[l];
    }
    const float inv = 1.f / sum;
    for (l = 0; l < L; l++) sj[l] *= inv;
}

#if WB_VEC
/* out_h (NC 8-lane chunks) = sum_l p_h[l] v_l for GH heads (literals: GH <= 3, NC <= 4, so the
 * 12 accumulators stay in registers), each chunk of a V row loaded once for all GH heads. */
static inline __attribute__((always_inline)) void pv_heads(const float *v, const int64_t *slots, int64_t L,
                                                           int64_t row, int64_t voff, const float *p, int64_t D,
                                                           float *o, const int GH, const int NC) {
    __m256 acc[3][4];
    for (int h = 0; h < GH; h++)
        for (int c = 0; c < NC; c++) acc[h][c] = _mm256_setzero_ps();
    for (int64_t l = 0; l < L; l++) {
        if (l + VPF < L) prefetch_row(v + slots[l + VPF] * row + voff, NC * 8);
        const float *vl = v + slots[l] * row + voff;
        __m256 x[4];
        for (int c = 0; c < NC; c++) x[c] = _mm256_loadu_ps(vl + 8 * c);
        for (int h = 0; h < GH; h++) {
            const __m256 ph = _mm256_set1_ps(p[h * L + l]);
            for (int c = 0; c < NC; c++) acc[h][c] = _mm256_fmadd_ps(ph, x[c], acc[h][c]);
        }
    }
    for (int h = 0; h < GH; h++)
        for (int c = 0; c < NC; c++) _mm256_storeu_ps(o + h * D + 8 * c, acc[h][c]);
}

#define WB_PV(GH) do { \
        switch (nc) { \
        case 4: pv_heads(v, slots, L, row, koff + d0, p, D, o, GH, 4); break; \
        case 3: pv_heads(v, slots, L, row, koff + d0, p, D, o, GH, 3); break; \
        case 2: pv_heads(v, slots, L, row, koff + d0, p, D, o, GH, 2); break; \
        default: pv_heads(v, slots, L, row, koff + d0, p, D, o, GH, 1); break; \
        } \
    } while (0)
#endif

/* out_j = sum_l p_j[l] v_l for query heads j0..j0+G-1 against one KV head's rows. */
static void values_of(const float *v, const int64_t *slots, int64_t L, int64_t row, int64_t koff, int64_t G,
                      int64_t D, const float *sc, float *outj0) {
#if WB_VEC
    if (D % 8 == 0) {
        for (int64_t jj = 0; jj < G; jj += 3) {
            for (int64_t d0 = 0; d0 < D; d0 += 32) {  /* 32 floats of the rows a pass */
                const int nc = D - d0 >= 32 ? 4 : (int)((D - d0) / 8);
                const float *p = sc + jj * L;
                float *o = outj0 + jj * D + d0;
                if (G - jj >= 3) WB_PV(3);
                else if (G - jj == 2) WB_PV(2);
                else WB_PV(1);
            }
        }
        return;
    }
#endif
    memset(outj0, 0, sizeof(float) * (size_t)(G * D));
    for (int64_t l = 0; l < L; l++) {
        if (l + PF < L) prefetch_row(v + slots[l + PF] * row + koff, D);
        const float *vl = v + slots[l] * row + koff;
        for (int64_t jj = 0; jj < G; jj++) {
            const float p = sc[jj * L + l];
            float *aj = outj0 + jj * D;
#pragma omp simd
            for (int64_t d = 0; d < D; d++) aj[d] += p * vl[d];
        }
    }
}

int wb_decode_attention(const float *q, const float *k, const float *v, const int64_t *idx,
                        int64_t idx_stride, const int64_t *lens, float *out, int64_t B, int64_t H,
                        int64_t KVH, int64_t D, float scale, int num_threads, int64_t num_slots,
                        int64_t window, float softcap, const float *sinks) {
    const int64_t G = H / KVH;
    int64_t max_len = 0;
    for (int64_t b = 0; b < B; b++) {
        if (lens[b] < 1 || lens[b] > idx_stride) return -2; /* a row longer than its slot list */
        for (int64_t l = 0; l < lens[b]; l++)
            if (idx[b * idx_stride + l] < 0 || idx[b * idx_stride + l] >= num_slots) return -2;
        max_len = lens[b] > max_len ? lens[b] : max_len;
    }
    int failed = 0;
    const int64_t row = KVH * D; /* floats per slot */
#pragma omp parallel num_threads(num_threads > 0 ? num_threads : 1)
    {
        float *scores = (float *)malloc(sizeof(float) * (size_t)(G * (max_len > 0 ? max_len : 1)));
        if (!scores) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < B * KVH; task++) {
            if (!scores) continue;
            const int64_t b = task / KVH, g = task % KVH;
            const int64_t first = (window > 0 && lens[b] > window) ? lens[b] - window : 0;
            const int64_t L = lens[b] - first;
            const int64_t *slots = idx + b * idx_stride + first;
            scores_of(q + b * H * D, k, slots, L, row, g * D, g * G, G, D, scale, softcap, scores);
            for (int64_t jj = 0; jj < G; jj++) softmax_of(scores + jj * L, L, sinks ? sinks + g * G + jj : NULL);
            values_of(v, slots, L, row, g * D, G, D, scores, out + (b * H + g * G) * D);
        }
        free(scores);
    }
    return failed ? -1 : 0;
}
