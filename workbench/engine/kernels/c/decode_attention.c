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
 * the hardware prefetcher misses them: K/V rows PF positions ahead are prefetched by hand.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifndef PF
#define PF 8 /* positions ahead; 8 beat 4 at 72-1000 cached tokens */
#endif

/* Ask for one slot's K or V row (n floats) to be brought into cache. */
static inline void prefetch_row(const float *row, int64_t n) {
    const char *p = (const char *)row;
    for (int64_t off = 0; off < n * (int64_t)sizeof(float); off += 64) __builtin_prefetch(p + off, 0, 3);
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
#pragma omp parallel num_threads(num_threads > 0 ? num_threads : 1)
    {
        /* one task per request: each KV row (all heads, contiguous) is read once */
        float *scores = (float *)malloc(sizeof(float) * (size_t)(H * (max_len > 0 ? max_len : 1)));
        float *acc = (float *)malloc(sizeof(float) * (size_t)(H * D));
        if (!scores || !acc) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t b = 0; b < B; b++) {
            if (!scores || !acc) continue;
            const int64_t first = (window > 0 && lens[b] > window) ? lens[b] - window : 0;
            const int64_t L = lens[b] - first;
            const int64_t *slots = idx + b * idx_stride + first;
            const float *qb = q + b * H * D;
            const int64_t row = KVH * D; /* floats per slot */
            for (int64_t l = 0; l < L; l++) {
                if (l + PF < L) prefetch_row(k + slots[l + PF] * row, row);
                const float *kp = k + slots[l] * row;
                for (int64_t j = 0; j < H; j++) {
                    const float *qj = qb + j * D, *kj = kp + (j / G) * D;
                    float s = 0.f;
#pragma omp simd reduction(+ : s)
                    for (int64_t d = 0; d < D; d++) s += qj[d] * kj[d];
                    s *= scale;
                    if (softcap > 0.f) s = tanhf(s / softcap) * softcap;
                    scores[j * L + l] = s;
                }
            }
            for (int64_t j = 0; j < H; j++) {
                float *sj = scores + j * L;
                float m = sinks ? sinks[j] : -INFINITY;
                for (int64_t l = 0; l < L; l++) m = sj[l] > m ? sj[l] : m;
                float sum = sinks ? expf(sinks[j] - m) : 0.f;
                for (int64_t l = 0; l < L; l++) {
                    sj[l] = expf(sj[l] - m);
                    sum += sj[l];
                }
                const float inv = 1.f / sum;
                for (int64_t l = 0; l < L; l++) sj[l] *= inv;
            }
            memset(acc, 0, sizeof(float) * (size_t)(H * D));
            for (int64_t l = 0; l < L; l++) {
                if (l + PF < L) prefetch_row(v + slots[l + PF] * row, row);
                const float *vp = v + slots[l] * row;
                for (int64_t j = 0; j < H; j++) {
                    const float p = scores[j * L + l], *vj = vp + (j / G) * D;
                    float *aj = acc + j * D;
#pragma omp simd
                    for (int64_t d = 0; d < D; d++) aj[d] += p * vj[d];
                }
            }
            memcpy(out + b * H * D, acc, sizeof(float) * (size_t)(H * D));
        }
        free(scores);
        free(acc);
    }
    return failed ? -1 : 0;
}
