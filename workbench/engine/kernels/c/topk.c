/* Per row, the k largest values and their ids, in exactly the order torch.topk(k, largest=True,
 * sorted=True) gives on CPU where k * 64 <= V: ATen copies each row into (value, id) pairs and runs
 * std::partial_sort with the comparator "x is NaN and y is not, or x > y"; libstdc++'s partial_sort
 * is a heap select (make_heap over the first k, then each later pair that beats the heap's top
 * replaces it) followed by sort_heap. This file replays those steps on a k-sized heap, without the
 * row-sized copy: a pair that leaves the heap is never looked at again, so only the heap is kept.
 * Ties therefore come out in torch's order, which is neither ascending nor descending id.
 *
 * Why: the traced sampler records the top-k of every row's distribution each step; torch.topk
 * spends most of its time copying the row into pairs (a third of tracing's cost at batch 32).
 * kernels/sampling.py checks this kernel against torch.topk on tie-heavy probe rows. */
#include <stdint.h>
#include <math.h>
#include <omp.h>

typedef struct { float v; int64_t i; } pair_t;

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

static void topk_row(const float *x, int64_t V, int64_t k, float *vals, int64_t *ids, pair_t *h) {
    for (int64_t j = 0; j < k; j++) h[j] = (pair_t){x[j], j};
    if (k >= 2) /* __make_heap */
        for (int64_t parent = (k - 2) / 2;; parent--) {
            adjust_heap(h, parent, k, h[parent]);
            if (parent == 0) break;
        }
    /* __heap_select: each later pair that beats the top replaces it (__pop_heap(first, middle, i)).
     * The top only rises, so a block of 32 where nothing beats the top as it stood (or is NaN) is
     * skipped whole; otherwise its pairs are taken one by one, as libstdc++ does. */
    int64_t j = k;
    for (; j + 32 <= V; j += 32) {
        const float top = h[0].v;
        int any = 0;
        for (int l = 0; l < 32; l++) any |= (x[j + l] > top) | (x[j + l] != x[j + l]);
        if (!any) continue;
        for (int l = 0; l < 32; l++) {
            const pair_t p = {x[j + l], j + l};
            if (beats(p, h[0])) adjust_heap(h, 0, k, p);
        }
    }
    for (; j < V; j++) {
        const pair_t p = {x[j], j};
        if (beats(p, h[0])) adjust_heap(h, 0, k, p);
    }
    for (int64_t last = k; last > 1;) { /* __sort_heap */
        --last;
        const pair_t value = h[last];
        h[last] = h[0];
        adjust_heap(h, 0, last, value);
    }
    for (int64_t j = 0; j < k; j++) { vals[j] = h[j].v; ids[j] = h[j].i; }
}

/* One row's top-k as wb_topk gives it (layer_ops.c's fused log-softmax record calls it). */
void wb_topk_row(const float *x, int64_t V, int64_t k, float *vals, int64_t *ids) {
    pair_t heap[256];
    topk_row(x, V, k, vals, ids, heap);
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
