/* Per row, the k largest values and their ids, in exactly the order torch.topk(k, largest=True,
 * sorted=True) gives on CPU where k * 64 <= V: ATen copies each row into (value, id) pairs and runs
 * std::partial_sort with the comparator "x is NaN and y is not, or x > y"; libstdc++'s partial_sort
 * is a heap select (make_heap over the first k, then each later pair that beats the heap's top
 * replaces it) followed by sort_heap. This file replays those steps on a k-sized heap, without the
 * row-sized copy: a pair that leaves the heap is never looked at again, so only the heap is kept.
 * Ties therefore come out in torch's order, which is neither ascending nor descending id.
 *
 * The heap select also runs in pieces (wb_topk_open, wb_topk_feed, wb_topk_close: layer_ops.c's
 * fused record feeds it a row as it computes it), and one row can be cut between threads: a later
 * part run as a row of its own logs the pairs that entered its own heap, and replaying that log on
 * the heap of the parts before it is the serial heap select (wb_topk_replay says why).
 *
 * Why: the traced sampler records the top-k of every row's distribution each step; torch.topk
 * spends most of its time copying the row into pairs (a third of tracing's cost at batch 32).
 * kernels/sampling.py checks this kernel against torch.topk on tie-heavy probe rows. */
#include <stddef.h>
#include <stdint.h>
#include <math.h>
#include <omp.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

typedef struct { float v; int64_t i; } pair_t; /* layer_ops.c's wb_pair: the same layout */

static inline int beats(pair_t x, pair_t y) { return (isnan(x.v) && !isnan(y.v)) || x.v > y.v; }

/* libstdc++'s __push_heap and __adjust_heap, with comp = beats */
static void push_heap(pair_t *h, int64_t hole, int64_t top, pair_t value) {
    int64_t parent = (hole - 1) / 2;
    while (hole > top && beats(h[parent], value)) {
        h[hole] = h[parent];
        hole = parent;
        parent = (hole - 1) / 2;
    }
    h[hole] = value;
}

static void adjust_heap(pair_t *h, int64_t hole, int64_t len, pair_t value) {
    const int64_t top = hole;
    int64_t child = hole;
    while (child < (len - 1) / 2) {
        child = 2 * (child + 1);
        if (beats(h[child], h[child - 1])) child--;
        h[hole] = h[child];
        hole = child;
    }
    if ((len & 1) == 0 && child == (len - 2) / 2) {
        child = 2 * (child + 1);
        h[hole] = h[child - 1];
        hole = child - 1;
    }
    push_heap(h, hole, top, value);
}

/* The heap of a row's first k values x[0..k), ids base.. (__make_heap). */
void wb_topk_open(pair_t *h, const float *x, int64_t k, int64_t base) {
    for (int64_t j = 0; j < k; j++) h[j] = (pair_t){x[j], base + j};
    if (k >= 2)
        for (int64_t parent = (k - 2) / 2;; parent--) {
            adjust_heap(h, parent, k, h[parent]);
            if (parent == 0) break;
        }
}

/* A bitmask of the 32 values x[0..32) that beat `top` as a value (greater, or NaN): the only ones
 * that can beat the heap's top from here, since the top only rises. */
static inline uint32_t above32(const float *x, float top) {
#if defined(__AVX2__)
    const __m256 t = _mm256_set1_ps(top);
    const uint32_t m0 = (uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x), t, _CMP_NLE_UQ));
    const uint32_t m1 = (uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + 8), t, _CMP_NLE_UQ));
    const uint32_t m2 = (uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + 16), t, _CMP_NLE_UQ));
    const uint32_t m3 = (uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + 24), t, _CMP_NLE_UQ));
    return m0 | m1 << 8 | m2 << 16 | m3 << 24;
#else
    uint32_t m = 0;
    for (int l = 0; l < 32; l++) m |= (uint32_t)(!(x[l] <= top)) << l;
    return m;
#endif
}

/* The pair enters the heap where it beats the top (__pop_heap(first, middle, i)); with a log, it is
 * appended there too (*logged counts past cap: the log is then incomplete). */
static inline void offer(pair_t *h, int64_t k, pair_t p, pair_t *log, int64_t cap, int64_t *logged) {
    if (!beats(p, h[0])) return;
    adjust_heap(h, 0, k, p);
    if (log != NULL) {
        if (*logged < cap) log[*logged] = p;
        ++*logged;
    }
}

/* __heap_select over the next m values x[0..m), ids base.., on the heap h of k pairs. A block of 32
 * where nothing beats the top as it stood is skipped whole; otherwise only the pairs that beat it
 * are offered, in order, as libstdc++ offers every pair (the others cannot beat a top that only
 * rose). `log` (or NULL): where the pairs that entered go, as `offer` logs them. */
void wb_topk_feed(pair_t *h, int64_t k, const float *x, int64_t m, int64_t base, pair_t *log, int64_t cap,
                  int64_t *logged) {
    int64_t j = 0;
    for (; j + 32 <= m; j += 32) {
        uint32_t mask = above32(x + j, h[0].v);
        while (mask) {
            const int l = __builtin_ctz(mask);
            mask &= mask - 1;
            offer(h, k, (pair_t){x[j + l], base + j + l}, log, cap, logged);
        }
    }
    for (; j < m; j++) offer(h, k, (pair_t){x[j], base + j}, log, cap, logged);
}

/* Offer the logged pairs of a later part of the row, in order, to the heap of the parts before it.
 * The same heap select as feeding that part's values: a pair that enters the whole row's heap beats
 * its top, which is at least the part's own heap's top (the k-th largest of a superset of what
 * that heap has seen), so it entered the part's heap too and is in its log. */
void wb_topk_replay(pair_t *h, int64_t k, const pair_t *log, int64_t count) {
    for (int64_t j = 0; j < count; j++) offer(h, k, log[j], NULL, 0, NULL);
}

/* __sort_heap, then the k pairs out, largest first. */
void wb_topk_close(pair_t *h, int64_t k, float *vals, int64_t *ids) {
    for (int64_t last = k; last > 1;) {
        --last;
        const pair_t value = h[last];
        h[last] = h[0];
        adjust_heap(h, 0, last, value);
    }
    for (int64_t j = 0; j < k; j++) { vals[j] = h[j].v; ids[j] = h[j].i; }
}

static void topk_row(const float *x, int64_t V, int64_t k, float *vals, int64_t *ids, pair_t *h) {
    wb_topk_open(h, x, k, 0);
    wb_topk_feed(h, k, x + k, V - k, k, NULL, 0, NULL);
    wb_topk_close(h, k, vals, ids);
}

/* x: [R, V] with row stride `stride`; vals [R, k], ids [R, k]. Returns 0, or -1 when k is out of
 * [1, 256] or k * 64 > V (torch takes its other path, nth_element, there). */
int wb_topk(const float *x, int64_t R, int64_t V, int64_t stride, int64_t k, float *vals, int64_t *ids,
            int num_threads) {
    if (k < 1 || k > 256 || k * 64 > V) return -1;
#pragma omp parallel for schedule(static) num_threads(num_threads > 0 ? num_threads : 1) if (R > 1)
    for (int64_t r = 0; r < R; r++) {
        pair_t heap[256];
        topk_row(x + r * stride, V, k, vals + r * k, ids + r * k, heap);
    }
    return 0;
}
