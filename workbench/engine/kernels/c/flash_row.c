/* One decode row's attention, exactly as torch's CPU flash-attention kernel computes it (ATen's
 * FlashAttentionKernel.cpp, float32, one query row), which is what scaled_dot_product_attention runs
 * for transformers' decode step on CPU. Per query head h (KV head h / (heads / kv_heads)), for each
 * block of up to 512 keys:
 *
 *   qk = K_block q            MKL's sgemm ('T', 'N', m = keys, n = 1, k = head_dim), called here
 *                             with the arguments torch passes after its normalization, so MKL's own
 *                             summation order gives the same bits;
 *   qk *= scale; m = max(qk)  each product rounded;
 *   p = exp_u20(qk - m)       ATen's Vectorized<float>::exp_u20 (a degree-5 polynomial after range
 *                             reduction, fused multiply-adds) on whole vectors of `lanes` floats,
 *                             the C library's expf on the scalar tail;
 *   s = sum(p)                the vectors added lane by lane, the lanes folded by halves
 *                             (vec_reduce_all's shuffles), then the tail one by one;
 *   rescale by expf(m_old - m) the running sum and output, as the kernel does between blocks;
 *   dst (+)= V_block^T p      MKL's sgemm ('N', 'N', m = head_dim, n = 1, k = keys);
 *
 * then out = dst * (1 / s). `lanes` is the vector width torch's kernel was built for on this CPU (16
 * on AVX512, 8 on AVX2); kernels/decode_attention.py finds it by comparing with sdpa itself.
 *
 * Why: at one row the engine otherwise slices the pool and calls sdpa per layer, whose dispatch and
 * block bookkeeping cost several times the arithmetic on a few hundred keys.
 *
 * Built with -ffp-contract=off: only the explicit fmaf calls fuse, as only the intrinsics do there. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#define KV_SPLIT 512
#define MAX_HEAD_DIM 512

typedef void (*sgemm_fn)(const char *, const char *, const int *, const int *, const int *, const float *,
                         const float *, const int *, const float *, const int *, const float *, float *,
                         const int *);
static sgemm_fn sgemm_ptr;

/* MKL's Fortran sgemm_ from the copy torch links (native.py passes its address). */
void wb_set_sgemm(void *fn) { sgemm_ptr = (sgemm_fn)fn; }

static inline float from_bits(uint32_t b) {
    float f;
    memcpy(&f, &b, sizeof f);
    return f;
}

/* Vectorized<float>::exp_u20, one lane. */
static inline float exp_u20(float x) {
    const float ln_min = from_bits(0xc2aeac50u), ln_max = from_bits(0x42b17218u);
    const int below = x < ln_min;
    float src = x < ln_max ? x : ln_max; /* min_ps: the second operand where either is NaN */
    src = src > ln_min ? src : ln_min;   /* max_ps */
    const float fx = floorf(fmaf(src, from_bits(0x3fb8aa3bu), 0.5f));
    const float r = fmaf(-fx, from_bits(0x3f317218u), src);
    float p = fmaf(r, 0.00828929059f, 0.0418978221f);
    p = fmaf(r, p, 0.166676521f);
    p = fmaf(r, p, 0.499991506f);
    p = fmaf(r, p, 0.999999701f);
    p = fmaf(r, p, 1.0f);
    const int32_t n = (int32_t)(fx - 1.0f); /* an integer already: the conversion is exact */
    const float two_n = below ? 0.0f : from_bits((uint32_t)(n + 127) << 23);
    return p * two_n * 2.0f;
}

static void head_row(const float *q, const float *k, const float *v, int64_t kv_stride, int64_t keys, int64_t d,
                     float scale, int lanes, float *out, float *qk, float *dst) {
    const char trans = 'T', none = 'N';
    const float one = 1.0f, zero = 0.0f;
    float qk_max = -INFINITY, qk_sum = 0.0f;
    for (int64_t n = 0; n < keys; n += KV_SPLIT) {
        const int block = (int)(keys - n < KV_SPLIT ? keys - n : KV_SPLIT);
        /* cpublas::gemm's normalization for n = 1: ldc = m, ldb = k; lda = k where m = 1 (transposed A) */
        const int m1 = block, n1 = 1, k1 = (int)d, lda1 = block == 1 ? (int)d : (int)kv_stride, ldb1 = (int)d,
                  ldc1 = block;
        sgemm_ptr(&trans, &none, &m1, &n1, &k1, &one, k + n * kv_stride, &lda1, q, &ldb1, &zero, qk, &ldc1);
        float block_max = -INFINITY;
        for (int i = 0; i < block; i++) {
            qk[i] = qk[i] * scale;
            block_max = qk[i] > block_max ? qk[i] : block_max;
        }
        const float new_max = qk_max > block_max ? qk_max : block_max;
        if (new_max == -INFINITY) {
            memset(qk, 0, sizeof(float) * block);
        } else {
            const int whole = block - block % lanes;
            float acc[16] = {0};
            for (int i = 0; i < whole; i += lanes)
                for (int l = 0; l < lanes; l++) {
                    const float e = exp_u20(qk[i + l] - new_max);
                    acc[l] += e;
                    qk[i + l] = e;
                }
            for (int width = lanes / 2; width >= 1; width /= 2)
                for (int l = 0; l < width; l++) acc[l] = acc[l] + acc[l + width];
            float s = acc[0];
            for (int i = whole; i < block; i++) {
                const float e = (float)exp((double)(qk[i] - new_max));
                s += e;
                qk[i] = e;
            }
            const float rescale = expf(qk_max - new_max);
            qk_sum = fmaf(rescale, qk_sum, s); /* the compiler contracts ATen's `sum + exp_tmp * sum_old` */
            qk_max = new_max;
            if (n > 0)
                for (int64_t j = 0; j < d; j++) dst[j] = dst[j] * rescale;
        }
        const float beta = n == 0 ? 0.0f : 1.0f;
        const int m2 = (int)d, n2 = 1, k2 = block, lda2 = block == 1 ? (int)d : (int)kv_stride, ldb2 = block,
                  ldc2 = (int)d;
        sgemm_ptr(&none, &none, &m2, &n2, &k2, &one, v + n * kv_stride, &lda2, qk, &ldb2, &beta, dst, &ldc2);
    }
    if (qk_sum == 0.0f) qk_sum = 1.0f;
    const float reciprocal = 1.0f / qk_sum;
    for (int64_t j = 0; j < d; j++) out[j] = dst[j] * reciprocal;
}

/* q: head h's row at q + h * q_head_stride; k/v: `keys` rows of the pool, row stride kv_stride floats,
 * KV head g at column g * d; out [heads, d]. The heads are split between threads as at::parallel_for
 * splits them (contiguous runs of ceil(heads / threads)), and each thread's scratch sits where the
 * kernel's own does inside one 64-byte aligned buffer (qk, max, sum, dst: MKL's kernels take
 * different paths by address, so its bits depend on where B and C lie). Returns 0, -1 for a layout
 * or width it does not take, -2 without sgemm, -3 without memory. */
int wb_flash_row(const float *q, int64_t q_head_stride, const float *k, const float *v, int64_t kv_stride,
                 int64_t keys, int64_t heads, int64_t kv_heads, int64_t d, float scale, int lanes, float *out,
                 int num_threads) {
    if (sgemm_ptr == NULL) return -2;
    if ((lanes != 8 && lanes != 16) || d < 1 || d > MAX_HEAD_DIM || keys < 1 || kv_heads < 1 || heads % kv_heads)
        return -1;
    const int threads = num_threads > 0 ? num_threads : 1;
    const int64_t split = keys < KV_SPLIT ? keys : KV_SPLIT;
    const int64_t per_thread = split + 1 + 1 + d; /* qk [1, split], max [1], sum [1], dst [1, d] */
    float *buf = aligned_alloc(64, (size_t)((threads * per_thread * 4 + 63) / 64 * 64));
    if (buf == NULL) return -3;
    const int64_t group = heads / kv_heads, chunk = (heads + threads - 1) / threads;
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num();
        float *qk = buf + t * per_thread, *dst = qk + split + 2;
        for (int64_t h = t * chunk; h < (t + 1) * chunk && h < heads; h++) {
            const int64_t g = h / group;
            head_row(q + h * q_head_stride, k + g * d, v + g * d, kv_stride, keys, d, scale, lanes, out + h * d, qk,
                     dst);
        }
    }
    free(buf);
    return 0;
}
