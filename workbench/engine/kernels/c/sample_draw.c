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
