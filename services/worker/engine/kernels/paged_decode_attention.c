/* Decode attention straight from the paged KV cache (CPU, float32).
 *
 * One query token per row attends to the row's whole context, read block by block through its
 * block table: no gathered copy of the context and no padding, so each step reads exactly the
 * rows' real K/V once. Rows are spread over OpenMP threads; a row does all its heads at once so
 * that each token's K/V (all KV heads, contiguous in the cache) is read in one sweep.
 *
 * The scores of a tile of LANES tokens are LANES dot products whose partial sums stay in
 * vectors and are reduced together by a shuffle tree (one reduction per tile, not a chain of
 * scalar adds per dot product); the softmax's maximum is taken in vectors; a block's values
 * are summed into registers, each loaded vector of V serving up to VALUE_HEADS heads of its
 * group, before they touch the output row (one load and store of it per block). From the
 * scalar version: 23.8 -> 17.1 ms a step with the KV in cache, 44.6 -> ~37 ms from memory
 * (32 rows of 310 tokens, 30 layers, SmolLM2-135M's heads; 2 cores of an Intel Xeon with
 * AVX-512). From memory it ran at about half the machine's streaming read bandwidth, reading
 * and arithmetic taking turns, until each row's next block was asked for in slices spread
 * over the current block's loop (prefetch_slice); huge pages and reading each block in
 * address order changed nothing.
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
 *
 * Built with -DKV_BFLOAT16 (a library of its own, kernel_build.build's defines), the caches hold
 * bfloat16 (a bfloat16 model's): each K/V element is widened to the float32 it stands for as it
 * is loaded (16 bits of zeros after it), and everything after that is this same float32 code,
 * so its result is bit for bit the float32 build's on the caches widened beforehand. That
 * reads half the bytes: a decode step's attention streams its context, and is bound by it.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "exp_approx.h"
#include "kv_element.h"
#include "prefetch_slice.h"

#if defined(__AVX512F__)
#define LANES 16
#else
#define LANES 8
#endif
/* The value tile: VALUE_HEADS heads by VALUE_VECTORS vectors of the head dimension summed in
 * registers, with the vectors of V being loaded (AVX2 has 16 registers, AVX-512 32). */
#define VALUE_VECTORS 4
#if LANES == 16
#define VALUE_HEADS 4
#else
#define VALUE_HEADS 2
#endif

typedef float vec __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t lane_index __attribute__((vector_size(LANES * sizeof(int32_t))));

#include "bfloat16_vector.h"
#include "vector_ops.h"

#include "vector_io.h"

/* LANES cache elements, each widened to its float32. */
#if defined(KV_BFLOAT16)
static inline vec load_kv(const kv_t *p) { return bfloat16_vector(p); }
#else
static inline vec load_kv(const kv_t *p) { return load(p); }
#endif

/* One level of lane_sums' tree: lane l of the result adds two lanes of a or b that hold parts
 * of the same sum (lo picks the first, the one `unit` lanes after it is the second). */
static inline vec fold(vec a, vec b, lane_index lo, int unit) {
    return __builtin_shuffle(a, b, lo) + __builtin_shuffle(a, b, lo + unit);
}

/* Lane j of the result = the sum of the lanes of v[j]. The masks pick, for each pair of
 * unit-wide lane groups, the first group of a then the first group of b (indices >= LANES
 * are b's), so that after log2(LANES) levels lane j holds v[j]'s total. */
static inline vec lane_sums(vec v[LANES]) {
#if LANES == 16
    const lane_index level1 = {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30};
    const lane_index level2 = {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29};
    const lane_index level3 = {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27};
    const lane_index level4 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    for (int i = 0; i < 8; i++) v[i] = fold(v[2 * i], v[2 * i + 1], level1, 1);
    for (int i = 0; i < 4; i++) v[i] = fold(v[2 * i], v[2 * i + 1], level2, 2);
    for (int i = 0; i < 2; i++) v[i] = fold(v[2 * i], v[2 * i + 1], level3, 4);
    return fold(v[0], v[1], level4, 8);
#else
    const lane_index level1 = {0, 8, 2, 10, 4, 12, 6, 14};
    const lane_index level2 = {0, 1, 8, 9, 4, 5, 12, 13};
    const lane_index level3 = {0, 1, 2, 3, 8, 9, 10, 11};
    for (int i = 0; i < 4; i++) v[i] = fold(v[2 * i], v[2 * i + 1], level1, 1);
    for (int i = 0; i < 2; i++) v[i] = fold(v[2 * i], v[2 * i + 1], level2, 2);
    return fold(v[0], v[1], level3, 4);
#endif
}

/* The vector part of q . k (head_dim rounded down to whole vectors), lanes not yet summed. */
static inline vec partial_dot(const float *q, const kv_t *k, int64_t vectors) {
    vec s0 = {0}, s1 = {0};
    int64_t c = 0;
    for (; c + 2 <= vectors; c += 2) {
        s0 += load(q + c * LANES) * load_kv(k + c * LANES);
        s1 += load(q + (c + 1) * LANES) * load_kv(k + (c + 1) * LANES);
    }
    if (c < vectors) s0 += load(q + c * LANES) * load_kv(k + c * LANES);
    return s0 + s1;
}

static void softmax_in_place(float *restrict scores, int64_t n) {
    /* The maximum in vectors: a scalar running max is one dependent compare a score. */
    float max = -FLT_MAX, sum = 0.f;
    int64_t t = 0;
    if (n >= LANES) {
        vec top = load(scores);
        for (t = LANES; t + LANES <= n; t += LANES) top = greater_of(load(scores + t), top);
        for (int lane = 0; lane < LANES; lane++) max = top[lane] > max ? top[lane] : max;
    }
    for (; t < n; t++) max = scores[t] > max ? scores[t] : max;
#pragma omp simd reduction(+ : sum)
    for (int64_t u = 0; u < n; u++) {
        scores[u] = exp_approx(scores[u] - max);
        sum += scores[u];
    }
    const float inverse = 1.f / sum;
#pragma omp simd
    for (int64_t u = 0; u < n; u++) scores[u] *= inverse;
}

/* A row's next block (all its KV heads: a work item of a lone row's split reads one, and the
 * items after it the others) is asked for in slices (prefetch_slice), one per step of the
 * current block's loop: on 2 cores of an AMD EPYC Zen 5, 32 rows of 310 tokens x 30 layers
 * with the blocks scattered took 17.1 ms instead of 27.0 (26.7 vs 16.9 GB/s; AVX2 build 22.8
 * vs 36.5 ms), one row of 600 tokens 1.36 vs 1.84 ms; asking for a whole block at once at the
 * start of the one before gained 6%. The lines go to L2, not L1: a row's current block of keys,
 * its next one and the block of values asked for beside them are 36 KiB, more than a 32 KiB L1
 * holds, and the hardware brings lines from L2 to L1 as the loop reaches them. On 2 cores of an
 * AMD EPYC Zen 4, 64 rows of 250-350 tokens x 30 layers, the blocks scattered: 38-45 instead of
 * 55-70 ms (22 vs 15 GB/s), 32 rows of 60-160 tokens 8.2-8.8 vs 11-12.3 ms, one row of 500-600
 * 2.5 vs 3.6 ms; asking for the keys two blocks ahead, or for the values one block ahead, or
 * into L1 in the values' pass, gained nothing more there. */
#define INTO PREFETCH_INTO_L2

/* One work item: query heads [head0, head0 + heads) of one row. */
typedef struct {
    const int64_t *table;
    int64_t first, context; /* the tokens attended: [first, context) */
    int64_t head0, heads, group, head_dim, block_size, token_stride;
} Row;

/* The row's block after the one holding token `start` in `cache` (keys or values), or NULL
 * when that block is the row's last. */
static inline const kv_t *next_block(const Row *row, const kv_t *cache, int64_t start) {
    const int64_t next = start / row->block_size + 1;
    if (next * row->block_size >= row->context) return NULL;
    return cache + row->table[next] * row->block_size * row->token_stride;
}

/* The LANES lane-partial dot products of q with `count` keys `stride` elements apart (zero
 * vectors past count). */
static inline __attribute__((always_inline)) void tile_dots(const float *q, const kv_t *k,
                                                            int64_t stride, int64_t count,
                                                            int64_t vectors, vec partial[LANES]) {
    if (count == LANES) /* a whole tile (all but a row's first and last): no test per key */
        for (int j = 0; j < LANES; j++) partial[j] = partial_dot(q, k + j * stride, vectors);
    else
        for (int j = 0; j < LANES; j++)
            partial[j] = j < count ? partial_dot(q, k + j * stride, vectors) : (vec){0};
}

/* scores[h * n + t - first] = q_h . k_t * scale for every head h and context token t in
 * [first, context), n = context - first; tokens in tiles of up to LANES within a block.
 * `vectors` (head_dim / LANES) is a constant where row_scores calls it, so that the dot
 * products unroll. Each block's values are asked for too, in slices beside the next block's
 * keys: the values' pass that follows then reads them from the cache, and the memory has two
 * streams to serve at once instead of one (32 rows of 301 tokens x 30 layers, 2 cores of an
 * AMD EPYC Zen 5: 14.8 vs 16.0 ms; a lone stream of blocks read back to back ran at 31 GB/s
 * where two interleaved ran at 42). */
static inline __attribute__((always_inline)) void row_scores_of(const Row *row, const float *q,
                                                                const kv_t *key_cache,
                                                                const kv_t *value_cache,
                                                                float scale, float *scores,
                                                                int64_t vectors) {
    const int64_t n = row->context - row->first, dim = row->head_dim, tail = vectors * LANES;
    const int64_t bs = row->block_size, block_floats = bs * row->token_stride;
    const int64_t block_bytes = block_floats * (int64_t)sizeof(kv_t);
    float sums[LANES];
    for (int64_t start = row->first - row->first % bs; start < row->context; start += bs) {
        const int64_t lo = start < row->first ? row->first - start : 0;
        const int64_t hi = row->context - start < bs ? row->context - start : bs;
        const kv_t *block = key_cache + row->table[start / bs] * block_floats;
        const kv_t *values = value_cache + row->table[start / bs] * block_floats;
        const kv_t *next = next_block(row, key_cache, start);
        const int64_t parts = (hi - lo + LANES - 1) / LANES * row->heads;
        int64_t part = 0;
        for (int64_t i = lo; i < hi; i += LANES) {
            const int64_t count = hi - i < LANES ? hi - i : LANES;
            const kv_t *keys = block + i * row->token_stride;
            for (int64_t h = 0; h < row->heads; h++) {
                if (next != NULL) prefetch_slice(next, block_bytes, part, parts, INTO);
                prefetch_slice(values, block_bytes, part++, parts, INTO);
                const float *qh = q + h * dim;
                const kv_t *kh = keys + ((row->head0 + h) / row->group) * dim;
                vec partial[LANES];
                tile_dots(qh, kh, row->token_stride, count, vectors, partial);
                const vec dots = lane_sums(partial) * scale;
                float *out = scores + h * n + start + i - row->first;
                if (count == LANES && tail == dim) {
                    store(out, dots);
                    continue;
                }
                store(sums, dots);
                for (int64_t j = 0; j < count; j++) {
                    float sum = 0.f;
                    for (int64_t d = tail; d < dim; d++)
                        sum += qh[d] * kv_value(kh[j * row->token_stride + d]);
                    out[j] = sums[j] + sum * scale;
                }
            }
        }
    }
}

static void row_scores(const Row *row, const float *q, const kv_t *key_cache,
                       const kv_t *value_cache, float scale, float *scores) {
    /* The head sizes of the models served (64, 128) unrolled; others through the loop. */
    switch (row->head_dim / LANES) {
    case 4: row_scores_of(row, q, key_cache, value_cache, scale, scores, 4); break;
    case 8: row_scores_of(row, q, key_cache, value_cache, scale, scores, 8); break;
    case 16: row_scores_of(row, q, key_cache, value_cache, scale, scores, 16); break;
    default: row_scores_of(row, q, key_cache, value_cache, scale, scores, row->head_dim / LANES);
    }
}

/* out_h += sum over tokens i in [lo, hi) of p[h][i] * v_i, for the `tile` heads h of one
 * group and the VALUE_VECTORS vectors of columns at `values` and `out` (rows `dim` apart):
 * each loaded vector of V serves every head of the tile, the sums stay in registers over
 * the block. `tile` is a constant where row_values calls it, so no lane of the tile idles. */
static inline __attribute__((always_inline)) void value_tile(const float *const p[VALUE_HEADS],
                                                             const kv_t *values, int64_t stride,
                                                             int64_t lo, int64_t hi, float *out,
                                                             int64_t dim, int tile) {
    vec sum[VALUE_HEADS][VALUE_VECTORS];
    for (int h = 0; h < tile; h++)
        for (int c = 0; c < VALUE_VECTORS; c++) sum[h][c] = load(out + h * dim + c * LANES);
    for (int64_t i = lo; i < hi; i++) {
        vec v[VALUE_VECTORS];
        for (int c = 0; c < VALUE_VECTORS; c++) v[c] = load_kv(values + i * stride + c * LANES);
        for (int h = 0; h < tile; h++) {
            const float weight = p[h][i];
            for (int c = 0; c < VALUE_VECTORS; c++) sum[h][c] += weight * v[c];
        }
    }
    for (int h = 0; h < tile; h++)
        for (int c = 0; c < VALUE_VECTORS; c++) store(out + h * dim + c * LANES, sum[h][c]);
}

/* out_h = sum_t probs[h * n + t - first] * v_t for every head h (t, n as in row_scores). */
static void row_values(const Row *row, const float *probs, const kv_t *value_cache,
                       float *out) {
    const int64_t n = row->context - row->first, dim = row->head_dim;
    const int64_t bs = row->block_size, stride = row->token_stride, group = row->group;
    const int64_t whole = dim - dim % (VALUE_VECTORS * LANES);
    for (int64_t i = 0; i < row->heads * dim; i++) out[i] = 0.f;
    for (int64_t start = row->first - row->first % bs; start < row->context; start += bs) {
        const int64_t lo = start < row->first ? row->first - start : 0;
        const int64_t hi = row->context - start < bs ? row->context - start : bs;
        const kv_t *block = value_cache + row->table[start / bs] * bs * stride;
        const kv_t *next = next_block(row, value_cache, start);
        const int64_t parts = row->heads / group * ((group + VALUE_HEADS - 1) / VALUE_HEADS);
        int64_t part = 0;
        /* A row's heads come in whole groups (work items split rows at KV heads); up to
         * VALUE_HEADS heads of a group share each loaded vector of V. */
        int64_t tile;
        for (int64_t h0 = 0; h0 < row->heads; h0 += tile) {
            const int64_t group_end = (h0 / group + 1) * group;
            tile = group_end - h0 < VALUE_HEADS ? group_end - h0 : VALUE_HEADS;
            const kv_t *values = block + ((row->head0 + h0) / group) * dim;
            if (next != NULL)
                prefetch_slice(next, bs * stride * sizeof(kv_t), part++, parts, INTO);
            const float *p[VALUE_HEADS];
            for (int h = 0; h < VALUE_HEADS; h++)
                p[h] = probs + (h0 + (h < tile ? h : 0)) * n + start - row->first;
            float *tile_out = out + h0 * dim;
            for (int64_t d = 0; d < whole; d += VALUE_VECTORS * LANES) {
                switch (tile) {
                case 1: value_tile(p, values + d, stride, lo, hi, tile_out + d, dim, 1); break;
#if VALUE_HEADS == 4
                case 2: value_tile(p, values + d, stride, lo, hi, tile_out + d, dim, 2); break;
                case 3: value_tile(p, values + d, stride, lo, hi, tile_out + d, dim, 3); break;
#endif
                default:
                    value_tile(p, values + d, stride, lo, hi, tile_out + d, dim, VALUE_HEADS);
                }
            }
            for (int64_t h = 0; h < tile; h++)
                for (int64_t e = whole; e < dim; e++) {
                    float sum = tile_out[h * dim + e];
                    for (int64_t i = lo; i < hi; i++)
                        sum += p[h][i] * kv_value(values[i * stride + e]);
                    tile_out[h * dim + e] = sum;
                }
        }
    }
}

/* Returns 0, or -1 when a row's scratch memory could not be allocated. */
int paged_decode_attention(const float *q, const kv_t *key_cache, const kv_t *value_cache,
                           const int64_t *block_tables, const int64_t *context_lens, float *out,
                           int64_t rows, int64_t heads, int64_t kv_heads, int64_t head_dim,
                           int64_t block_size, int64_t max_blocks, int64_t window, float scale,
                           int threads) {
    int failed = 0;
    /* Fewer rows than threads (a lone request's decode): each row is split by KV head too, or
     * all threads but one would wait. */
    const int64_t parts = rows < threads ? kv_heads : 1, items = rows * parts;
    const int64_t part_heads = heads / parts;
    /* No more threads than items: a thread with nothing to do would still join the barrier,
     * which on a busy machine can cost a whole scheduling slice. Longest rows usually come
     * first: dynamic scheduling keeps the threads evenly busy. */
    const int team = items < threads ? (int)items : threads;
#pragma omp parallel for schedule(dynamic, 1) num_threads(team)
    for (int64_t item = 0; item < items; item++) {
        const int64_t r = item / parts, context = context_lens[r];
        const Row row = {
            .table = block_tables + r * max_blocks,
            .first = window > 0 && context > window ? context - window : 0,
            .context = context,
            .head0 = item % parts * part_heads,
            .heads = part_heads,
            .group = heads / kv_heads,
            .head_dim = head_dim,
            .block_size = block_size,
            .token_stride = kv_heads * head_dim,
        };
        const int64_t n = row.context - row.first;
        const int64_t offset = (r * heads + row.head0) * head_dim;
        float *scores = malloc(sizeof(float) * part_heads * n);
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
            continue;
        }
        row_scores(&row, q + offset, key_cache, value_cache, scale, scores);
        for (int64_t h = 0; h < part_heads; h++) softmax_in_place(scores + h * n, n);
        row_values(&row, scores, value_cache, out + offset);
        free(scores);
    }
    return failed ? -1 : 0;
}
