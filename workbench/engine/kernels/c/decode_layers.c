/* Every decoder layer of a Llama-shaped model at one decode row, in one call: the direct forward's
 * own sequence of checked kernels (run/exact_forward.py), called with the arguments the Python
 * path passes them, in the same order, into buffers laid out as torch lays out its own (each its
 * own 64-byte aligned allocation: MKL's bits inside the flash replay depend on where its operands
 * lie). What it saves is the Python around ~15 calls a layer (~5 ms a step on SmolLM2), not
 * arithmetic: every number is what the kernels give when called one by one, which the check in
 * kernels/decode_layers.py compares bit for bit.
 *
 * Per layer, as LlamaDecoderLayer.forward with the engine's attention:
 *   res += pending (the last layer's MLP output), x = input_layernorm(res)     wb_rms_norm
 *   q, k, v = q/k/v_proj(x)                                                   wb_linear_rowdot_group
 *   q, k = rope(q, k)                                                         wb_rope
 *   pool[slot] = k, v                                                         (index_copy_: a copy)
 *   attn = flash attention of q over the run of slots                         wb_flash_row
 *   res += o_proj(attn), x = post_attention_layernorm(res)                    rowdot, wb_rms_norm
 *   pending = down_proj(silu(gate_proj(x)) * up_proj(x))                      rowdot, wb_silu_mul, rowdot
 * The first layer's residual is the embedding (no add); the last layer's pending is left for the
 * final norm, which the caller runs on the kept rows as the Python path does. */
#include <stdint.h>
#include <string.h>

int wb_rms_norm(const float *x, const float *delta, float *sum_out, const float *w, float *out, int64_t rows,
                int64_t n, float eps, int lanes);
int wb_rope(const float *q, const float *k, int64_t q_stride, int64_t k_stride, const float *cos_, const float *sin_,
            float *qo, float *ko, int64_t rows, int64_t hq, int64_t hk, int64_t d);
int wb_silu_mul(const float *gate, const float *up, float *out, int64_t n, int num_threads);
int wb_linear_rowdot_group(int64_t count, const float *const *W, const float *const *bias, float *const *y,
                           const int64_t *N, const float *x, int64_t K, int64_t P, int64_t L, int fma,
                           int num_threads);
int wb_flash_row(const float *q, int64_t q_head_stride, const float *k, const float *v, int64_t kv_stride,
                 int64_t keys, int64_t heads, int64_t kv_heads, int64_t d, float scale, int lanes, float *out,
                 int num_threads);

/* One linear group's order, as kernels/gemm.py checked it: peel, lanes, fma. */
typedef struct {
    int64_t peel, lanes, fma;
} wb_order;

typedef struct {
    const float *ln1, *ln2;                      /* the two RMSNorm weights */
    float eps1, eps2;
    int64_t lanes1, lanes2;                      /* each norm's checked sum width */
    const float *wq, *wk, *wv, *bq, *bk, *bv;    /* biases NULL where the layer has none */
    const float *wo, *bo, *wg, *bg, *wu, *bu, *wd, *bd;
    wb_order qkv, o, gate_up, down;
    float *k_pool, *v_pool;                      /* [slots, kv_heads, head_dim] */
    float scale;
} wb_layer;

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, inter;
    int64_t flash_lanes;
    int threads;
    /* scratch, each its own aligned allocation: x [hidden], q [heads * d], k, v [kv_heads * d],
     * qr [heads * d], kr [kv_heads * d], attn [heads * d], o [hidden], gate, up, act [inter] */
    float *x, *q, *k, *v, *qr, *kr, *attn, *o, *gate, *up, *act;
} wb_shape;

/* res [hidden]: the embedding in, the residual stream out; pending [hidden]: the last layer's MLP
 * output out. cos/sin [head_dim] at the row's position; slot: the new token's KV slot; run, keys:
 * the row's consecutive slots (the new one included). Returns 0, or the first kernel's nonzero
 * code (nothing after it ran). */
int wb_decode_layers(const wb_layer *layers, int64_t count, const wb_shape *s, float *res, float *pending,
                     const float *cos_, const float *sin_, int64_t slot, int64_t run, int64_t keys) {
    const int64_t H = s->hidden, d = s->head_dim, kvd = s->kv_heads * d;
    int rc;
    for (int64_t i = 0; i < count; i++) {
        const wb_layer *l = layers + i;
        rc = wb_rms_norm(res, i ? pending : NULL, i ? res : NULL, l->ln1, s->x, 1, H, l->eps1, (int)l->lanes1);
        if (rc) return rc;
        {
            const float *w[3] = {l->wq, l->wk, l->wv}, *b[3] = {l->bq, l->bk, l->bv};
            float *y[3] = {s->q, s->k, s->v};
            const int64_t n[3] = {s->heads * d, kvd, kvd};
            rc = wb_linear_rowdot_group(3, w, b, y, n, s->x, H, l->qkv.peel, l->qkv.lanes, (int)l->qkv.fma, s->threads);
            if (rc) return rc;
        }
        rc = wb_rope(s->q, s->k, s->heads * d, kvd, cos_, sin_, s->qr, s->kr, 1, s->heads, s->kv_heads, d);
        if (rc) return rc;
        memcpy(l->k_pool + slot * kvd, s->kr, (size_t)kvd * sizeof(float));
        memcpy(l->v_pool + slot * kvd, s->v, (size_t)kvd * sizeof(float));
        rc = wb_flash_row(s->qr, d, l->k_pool + run * kvd, l->v_pool + run * kvd, kvd, keys, s->heads, s->kv_heads,
                          d, l->scale, (int)s->flash_lanes, s->attn, s->threads);
        if (rc) return rc;
        {
            const float *w[1] = {l->wo}, *b[1] = {l->bo};
            float *y[1] = {s->o};
            const int64_t n[1] = {H};
            rc = wb_linear_rowdot_group(1, w, b, y, n, s->attn, s->heads * d, l->o.peel, l->o.lanes, (int)l->o.fma,
                                        s->threads);
            if (rc) return rc;
        }
        rc = wb_rms_norm(res, s->o, res, l->ln2, s->x, 1, H, l->eps2, (int)l->lanes2);
        if (rc) return rc;
        {
            const float *w[2] = {l->wg, l->wu}, *b[2] = {l->bg, l->bu};
            float *y[2] = {s->gate, s->up};
            const int64_t n[2] = {s->inter, s->inter};
            rc = wb_linear_rowdot_group(2, w, b, y, n, s->x, H, l->gate_up.peel, l->gate_up.lanes,
                                        (int)l->gate_up.fma, s->threads);
            if (rc) return rc;
        }
        rc = wb_silu_mul(s->gate, s->up, s->act, s->inter, s->threads);
        if (rc) return rc;
        {
            const float *w[1] = {l->wd}, *b[1] = {l->bd};
            float *y[1] = {pending};
            const int64_t n[1] = {H};
            rc = wb_linear_rowdot_group(1, w, b, y, n, s->act, s->inter, l->down.peel, l->down.lanes,
                                        (int)l->down.fma, s->threads);
            if (rc) return rc;
        }
    }
    return 0;
}

/* ---- several decode rows ------------------------------------------------------------------------
 * The same layers at R decode rows (a decode-only batch), in one call: the direct forward's
 * sequence at several rows, each kernel called with what the Python path passes it. Per layer:
 *   res += pending, x = input_layernorm(res)                    wb_rms_norm (R rows)
 *   q, k, v = q/k/v_proj(x)                                     wb_linear_rows(_split), each its own order
 *   q, k = rope(q, k)                                           wb_rope (R rows)
 *   pool[loc[r]] = k[r], v[r]                                   (the KV write: a copy)
 *   attn = each row's query over its slots kv_idx[r][:lens[r]]  wb_decode_attention
 *   res += o_proj(attn), x = post_attention_layernorm(res)      wb_linear_rows, wb_rms_norm
 *   pending = down_proj(silu(gate_proj(x)) * up_proj(x))        wb_linear_rows, wb_silu_mul
 */
int wb_linear_rows_split(const float *X, const float *W, const float *bias, float *Y, int64_t R, int64_t N,
                         int64_t K, int64_t KC, int bias_first, int64_t head, int64_t P, int64_t L, int fma,
                         int num_threads);
int wb_kv_write(char *k_pool, char *v_pool, int64_t slots, const int64_t *loc, int64_t n, const char *k,
                const char *v, int64_t row);
int wb_decode_attention(const float *q, const float *k, const float *v, const int64_t *idx,
                        int64_t idx_stride, const int64_t *lens, float *out, int64_t B, int64_t H,
                        int64_t KVH, int64_t D, float scale, int num_threads, int64_t num_slots,
                        int64_t window, float softcap, const float *sinks);

/* One projection's blocked order at this row count, as kernels/gemm.py checked it: KC, bias first. */
typedef struct {
    int64_t kc, bias_first;
    int64_t head, peel, lanes, fma; /* rows past `head`: the one-row order (wb_linear_rows_split) */
} wb_blocked;

typedef struct {
    const float *ln1, *ln2;
    float eps1, eps2;
    int64_t lanes1, lanes2;
    const float *wq, *wk, *wv, *bq, *bk, *bv;
    const float *wo, *bo, *wg, *bg, *wu, *bu, *wd, *bd;
    wb_blocked q, k, v, o, g, u, d;
    float *k_pool, *v_pool;
    float scale;
} wb_layer_rows;

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, inter, slots;
    int threads;
    /* scratch for R rows: x [R, hidden], q [R, heads * d], k, v [R, kv_heads * d], qr, kr, attn, o, gate, up, act */
    float *x, *q, *k, *v, *qr, *kr, *attn, *o, *gate, *up, *act;
} wb_shape_rows;

static int rows_linear(const float *x, const float *w, const float *b, float *y, int64_t R, int64_t N, int64_t K,
                       wb_blocked order, int threads) {
    return wb_linear_rows_split(x, w, b, y, R, N, K, order.kc, (int)order.bias_first, order.head, order.peel,
                                order.lanes, (int)order.fma, threads);
}

/* res [R, hidden]: the embeddings in, the residual stream out; pending [R, hidden]: the last layer's
 * MLP output out. cos/sin [R, head_dim]; loc [R]: each row's new KV slot; kv_idx [R, idx_stride]
 * and lens [R]: each row's slots and how many it attends. Returns 0, -2 for a slot outside the
 * pool (nothing of that layer written), or the first kernel's nonzero code. */
int wb_decode_layers_rows(const wb_layer_rows *layers, int64_t count, const wb_shape_rows *s, int64_t R, float *res,
                          float *pending, const float *cos_, const float *sin_, const int64_t *loc,
                          const int64_t *kv_idx, int64_t idx_stride, const int64_t *lens) {
    const int64_t H = s->hidden, d = s->head_dim, qd = s->heads * d, kvd = s->kv_heads * d, I = s->inter;
    int rc;
    for (int64_t i = 0; i < count; i++) {
        const wb_layer_rows *l = layers + i;
        if ((rc = wb_rms_norm(res, i ? pending : NULL, i ? res : NULL, l->ln1, s->x, R, H, l->eps1, (int)l->lanes1)))
            return rc;
        if ((rc = rows_linear(s->x, l->wq, l->bq, s->q, R, qd, H, l->q, s->threads))) return rc;
        if ((rc = rows_linear(s->x, l->wk, l->bk, s->k, R, kvd, H, l->k, s->threads))) return rc;
        if ((rc = rows_linear(s->x, l->wv, l->bv, s->v, R, kvd, H, l->v, s->threads))) return rc;
        if ((rc = wb_rope(s->q, s->k, qd, kvd, cos_, sin_, s->qr, s->kr, R, s->heads, s->kv_heads, d))) return rc;
        if (wb_kv_write((char *)l->k_pool, (char *)l->v_pool, s->slots, loc, R, (const char *)s->kr,
                        (const char *)s->v, kvd * (int64_t)sizeof(float)))
            return -2; /* a slot outside the pool: found at the first layer, before any pool is written */
        if ((rc = wb_decode_attention(s->qr, l->k_pool, l->v_pool, kv_idx, idx_stride, lens, s->attn, R, s->heads,
                                      s->kv_heads, d, l->scale, s->threads, s->slots, 0, 0.0f, NULL)))
            return rc;
        if ((rc = rows_linear(s->attn, l->wo, l->bo, s->o, R, H, qd, l->o, s->threads))) return rc;
        if ((rc = wb_rms_norm(res, s->o, res, l->ln2, s->x, R, H, l->eps2, (int)l->lanes2))) return rc;
        if ((rc = rows_linear(s->x, l->wg, l->bg, s->gate, R, I, H, l->g, s->threads))) return rc;
        if ((rc = rows_linear(s->x, l->wu, l->bu, s->up, R, I, H, l->u, s->threads))) return rc;
        if ((rc = wb_silu_mul(s->gate, s->up, s->act, R * I, s->threads))) return rc;
        if ((rc = rows_linear(s->act, l->wd, l->bd, pending, R, H, I, l->d, s->threads))) return rc;
    }
    return 0;
}
