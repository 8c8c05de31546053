/* The sampler's inverse-CDF draw for CPU, float32 probabilities, with exactly the arithmetic of
 * its torch formula (sampler.py, Sampler.draw):
 *
 *     cdf = probs.to(float64).cumsum(-1)
 *     id  = (cdf <= u * cdf[-1]).sum(-1).clamp(max=V - 1)
 *
 * torch's CPU cumsum adds each row's elements one after another into a double (acc_type of
 * double), so the same sequential double additions give the same cdf, bit for bit; the count of
 * cdf values <= the threshold is the index of the first one above it (cdf never decreases: every
 * probability is >= 0). Nothing is vectorized across the additions (no -ffast-math: the compiler
 * may not reorder them). The formula writes three [R, V] tensors (the float64 copy, the cdf, the
 * comparison); this reads each row once for its total and up to the draw for the search.
 *
 * probs [R, stride] rows of V probabilities; u [R] float64 uniforms; out [R] int64 token ids.
 * A row whose total is not finite (NaN in its probabilities) gets -1: the caller computes that row
 * with the torch formula, whose NaN semantics this does not reproduce. A NaN u (a greedy row,
 * which the caller replaces by its argmax) gives 0, as the formula's all-false comparison does.
 * num_threads: rows in parallel, torch.get_num_threads() of the caller.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <immintrin.h>

void wb_sample_draw(const float *probs, int64_t rows, int64_t vocab, int64_t stride, const double *u,
                    int64_t *out, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *p = probs + r * stride;
        double total = 0.0;
        for (int64_t i = 0; i < vocab; i++)
            total += (double)p[i];
        if (!isfinite(total)) {
            out[r] = -1;
            continue;
        }
        const double thr = u[r] * total;
        if (isnan(thr)) {
            out[r] = 0;
            continue;
        }
        double acc = 0.0;
        int64_t id = vocab;
        for (int64_t i = 0; i < vocab; i++) {
            acc += (double)p[i];
            if (acc > thr) {
                id = i;
                break;
            }
        }
        out[r] = id < vocab ? id : vocab - 1;
    }
}

/* The rank of each row's picked token, less one: how many of the row's log-probabilities are
 * strictly above `picked[r]` (logprobs.py, _ranks: 1 + count(lp > picked)). A comparison and a
 * count are exact, NaN compares false as in torch, and this reads each row once instead of
 * copying the rows and writing a [R, V] mask.
 * lp [R, stride] rows of V float32; picked [R] float32; out [R] int64. */
void wb_count_above(const float *lp, int64_t rows, int64_t vocab, int64_t stride, const float *picked,
                    int64_t *out, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *p = lp + r * stride;
        const float x = picked[r];
        int64_t count = 0;
        for (int64_t i = 0; i < vocab; i++)
            count += p[i] > x;
        out[r] = count;
    }
}

/* Per row, the index torch.argmax gives: the first NaN if the row holds one (argmax counts NaN as
 * the maximum), else the first index holding the row's maximum (+0 and -0 equal, as in its compare).
 * Two reads of the row: the maximum and whether a NaN occurs, a vector at a time (compares and
 * selects only, no arithmetic), then the first index equal to it. torch.argmax over a row is a
 * scalar loop with a data-dependent branch (45 us for 49152 logits); this takes a few. */
#if defined(__AVX2__) /* 8 lanes: as fast as AVX512's 16 here (8 against 9 us a 49152-float row) */
static inline float am_max(const float *p, int64_t n, int64_t *done, int *nan) {
    __m256 m = _mm256_set1_ps(-INFINITY), isnan = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(p + i);
        m = _mm256_blendv_ps(m, v, _mm256_cmp_ps(v, m, _CMP_GT_OQ));
        isnan = _mm256_or_ps(isnan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, m);
    float best = -INFINITY;
    for (int l = 0; l < 8; l++) best = lanes[l] > best ? lanes[l] : best;
    *done = i, *nan = _mm256_movemask_ps(isnan) != 0;
    return best;
}
static inline int64_t am_first(const float *p, int64_t n, float best, int nan) {
    const __m256 b = _mm256_set1_ps(best);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(p + i);
        const int hit = _mm256_movemask_ps(nan ? _mm256_cmp_ps(v, v, _CMP_UNORD_Q) : _mm256_cmp_ps(v, b, _CMP_EQ_OQ));
        if (hit) return i + __builtin_ctz(hit);
    }
    return i;
}
#else
static inline float am_max(const float *p, int64_t n, int64_t *done, int *nan) {
    (void)p, (void)n;
    *done = 0, *nan = 0;
    return -INFINITY;
}
static inline int64_t am_first(const float *p, int64_t n, float best, int nan) {
    (void)p, (void)n, (void)best, (void)nan;
    return 0;
}
#endif

void wb_argmax(const float *x, int64_t rows, int64_t vocab, int64_t stride, int64_t *out, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const float *p = x + r * stride;
        int64_t i;
        int any_nan;
        float best = am_max(p, vocab, &i, &any_nan);
        for (; i < vocab; i++) { best = p[i] > best ? p[i] : best; any_nan |= p[i] != p[i]; }
        int64_t at = am_first(p, vocab, best, any_nan); /* the vector holding it, or where the vectors end */
        if (any_nan) { while (p[at] == p[at]) at++; }
        else { while (p[at] != best) at++; }
        out[r] = at;
    }
}
