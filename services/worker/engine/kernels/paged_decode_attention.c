/* Decode attention straight from the paged KV cache (CPU, float32).
 *
 * One query token per row attends to the row's whole context, read block by block through its
 * block table: no gathered copy of the context and no padding, so each step reads exactly the
 * rows' real K/V once. Rows are spread over OpenMP threads; a row does all its heads at once so
 * that each token's K/V (all KV heads, contiguous in the cache) is read in one sweep.
 *
 * Layouts (contiguous):
 *   q, out        [rows, heads, head_dim]
 *   key_cache,
 *   value_cache   [num_blocks, block_size, kv_heads, head_dim]  (one layer)
 *   block_tables  [rows, max_blocks] int64
 *   context_lens  [rows] int64, each >= 1 and <= max_blocks * block_size
 * Query head h reads KV head h / (heads / kv_heads) (grouped-query attention). With window > 0
 * (a sliding attention window) a row attends to its last `window` tokens only, its own
 * included; the blocks before them are never read.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "exp_approx.h"

typedef float v8 __attribute__((vector_size(32)));

static inline v8 load8(const float *p) {
    v8 v;
    memcpy(&v, p, sizeof v); /* unaligned load */
    return v;
}

/* a . b with four independent vector sums: one running sum would make every multiply-add
 * wait for the previous one, and a decode step is mostly these short (head_dim) dots. */
static inline float dot(const float *restrict a, const float *restrict b, int64_t n) {
    v8 s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        s0 += load8(a + i) * load8(b + i);
        s1 += load8(a + i + 8) * load8(b + i + 8);
        s2 += load8(a + i + 16) * load8(b + i + 16);
        s3 += load8(a + i + 24) * load8(b + i + 24);
    }
    for (; i + 8 <= n; i += 8) s0 += load8(a + i) * load8(b + i);
    const v8 total = (s0 + s1) + (s2 + s3);
    float sum = 0.f;
    for (int lane = 0; lane < 8; lane++) sum += total[lane];
    for (; i < n; i++) sum += a[i] * b[i];
    return sum;
}

static void softmax_in_place(float *restrict scores, int64_t n) {
    float max = -FLT_MAX, sum = 0.f;
    for (int64_t t = 0; t < n; t++) max = scores[t] > max ? scores[t] : max;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < n; t++) {
        scores[t] = exp_approx(scores[t] - max);
        sum += scores[t];
    }
    const float inverse = 1.f / sum;
#pragma omp simd
    for (int64_t t = 0; t < n; t++) scores[t] *= inverse;
}

/* scores[h * n + t - first] = q_h . k_t * scale for every head h and context token t in
 * [first, context), n = context - first. */
static void row_scores(const float *q, const float *key_cache, const int64_t *table,
                       int64_t first, int64_t context, int64_t heads, int64_t group,
                       int64_t head_dim, int64_t block_size, int64_t token_stride, float scale,
                       float *scores) {
    const int64_t n = context - first;
    for (int64_t start = first - first % block_size; start < context; start += block_size) {
        const int64_t lo = start < first ? first - start : 0;
        const int64_t hi = context - start < block_size ? context - start : block_size;
        const float *block = key_cache + table[start / block_size] * block_size * token_stride;
        for (int64_t i = lo; i < hi; i++)
            for (int64_t h = 0; h < heads; h++)
                scores[h * n + start + i - first] =
                    dot(q + h * head_dim, block + i * token_stride + (h / group) * head_dim,
                        head_dim) * scale;
    }
}

/* out_h = sum_t probs[h * n + t - first] * v_t for every head h (t, n as in row_scores). */
static void row_values(const float *probs, const float *value_cache, const int64_t *table,
                       int64_t first, int64_t context, int64_t heads, int64_t group,
                       int64_t head_dim, int64_t block_size, int64_t token_stride, float *out) {
    const int64_t n = context - first;
    for (int64_t i = 0; i < heads * head_dim; i++) out[i] = 0.f;
    for (int64_t start = first - first % block_size; start < context; start += block_size) {
        const int64_t lo = start < first ? first - start : 0;
        const int64_t hi = context - start < block_size ? context - start : block_size;
        const float *block = value_cache + table[start / block_size] * block_size * token_stride;
        for (int64_t i = lo; i < hi; i++)
            for (int64_t h = 0; h < heads; h++) {
                const float p = probs[h * n + start + i - first];
                const float *restrict v = block + i * token_stride + (h / group) * head_dim;
                float *restrict o = out + h * head_dim;
#pragma omp simd
                for (int64_t d = 0; d < head_dim; d++) o[d] += p * v[d];
            }
    }
}

/* Returns 0, or -1 when a row's scratch memory could not be allocated. */
int paged_decode_attention(const float *q, const float *key_cache, const float *value_cache,
                           const int64_t *block_tables, const int64_t *context_lens, float *out,
                           int64_t rows, int64_t heads, int64_t kv_heads, int64_t head_dim,
                           int64_t block_size, int64_t max_blocks, int64_t window, float scale,
                           int threads) {
    const int64_t group = heads / kv_heads, token_stride = kv_heads * head_dim;
    int failed = 0;
    /* No more threads than rows: a thread with nothing to do would still join the barrier,
     * which on a busy machine can cost a whole scheduling slice. Longest rows usually come
     * first: dynamic scheduling keeps the threads evenly busy. */
    const int team = rows < threads ? (int)rows : threads;
#pragma omp parallel for schedule(dynamic, 1) num_threads(team)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t context = context_lens[r];
        const int64_t first = window > 0 && context > window ? context - window : 0;
        const int64_t n = context - first;
        const int64_t *table = block_tables + r * max_blocks;
        float *scores = malloc(sizeof(float) * heads * n);
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
            continue;
        }
        row_scores(q + r * heads * head_dim, key_cache, table, first, context, heads, group,
                   head_dim, block_size, token_stride, scale, scores);
        for (int64_t h = 0; h < heads; h++) softmax_in_place(scores + h * n, n);
        row_values(scores, value_cache, table, first, context, heads, group, head_dim,
                   block_size, token_stride, out + r * heads * head_dim);
        free(scores);
    }
    return failed ? -1 : 0;
}
