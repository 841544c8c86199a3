/* Causal attention of one prefill chunk straight from the paged KV cache (CPU, float32).
 *
 * The chunk's queries attend to every cached token before them (a prefix) and to the chunk's
 * own tokens, which the caller has already written into the cache: one pass over the context
 * through the block table, with no gathered copy, no mask tensor and no second call for the
 * prefix. Flash-attention style: the queries go in tiles, the keys in tiles, the softmax is
 * kept online (a running max and sum per query row), and key tiles after a query tile's last
 * position are never computed; nor, in the tile that holds it, the keys after the last
 * position of each block of TILE_ROWS rows (block_keys). Those keys had been half of what a
 * 128-token chunk computed: SmolLM2-135M's heads, 30 layers, 2 cores of an Intel Xeon (family 6
 * model 207), min of 7 alternated, a 128-token chunk 6.8 vs 7.2 ms, 64 tokens 3.6 vs 3.9, 16
 * tokens 1.2 vs 1.5, 1,056 tokens 194 vs 197 (outputs the same bit for bit).
 *
 * Grouped-query attention: the query heads that share a KV head are one tile's rows (position
 * major), so each key and value is read once for the whole group. A KV head's keys are packed
 * transposed and its values packed row-padded once per call, so that both products are
 * broadcast-and-multiply-add loops over whole vectors in the inner kernels.
 *
 * Layouts:
 *   q            [chunk, heads, head_dim], rows `q_row_stride` floats apart (a view of the
 *                layer's fused Q/K projection output)
 *   key_cache,
 *   value_cache  [num_blocks, block_size, kv_heads, head_dim] (one layer), contiguous
 *   block_table  [ceil(context / block_size)] int64
 *   out          [chunk, heads, head_dim], contiguous
 * Query i sits at position prefix_len + i and attends to positions [first, prefix_len + i],
 * first = 0, or with window > 0 (a sliding window) its last `window` positions only.
 *
 * Built with -DKV_BFLOAT16 (a library of its own, kernel_build.build's defines), the caches hold
 * bfloat16 (a bfloat16 model's): each K/V element is widened to the float32 it stands for as it
 * is packed, and everything after that is this same float32 code, so its result is bit for bit
 * the float32 build's on the caches widened beforehand.
 */
#include <float.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "exp_approx.h"
#include "in_register.h"
#include "kv_element.h"

#if defined(__AVX512F__)
#define LANES 16
/* Register tiles: rows x vectors of accumulators (24 of AVX-512's 32 registers). */
#define TILE_ROWS 6
#define SCORE_VECTORS 4
#define VALUE_VECTORS 4
#else
#define LANES 8
/* 12 of AVX2's 16 registers hold accumulators (its FMAs take 5 cycles, two at a time: ten
 * must be in flight), the rest the loads and broadcasts. */
#define TILE_ROWS 6
#define SCORE_VECTORS 2
#define VALUE_VECTORS 2
#endif

typedef float vec __attribute__((vector_size(LANES * sizeof(float))));

/* Keys per key tile: whole vectors of scores, a multiple of both score tiles' widths. */
#define KEY_TILE 64
/* Query positions per query tile (times the group's heads rows). */
#define QUERY_TILE 32

#include "vector_io.h"

/* x in every lane, written out: one broadcast. (GCC keeps `(vec){0} + x` as an add, since
 * 0 + -0 is +0, and builds a vector filled by a loop one lane at a time.) */
static inline vec splat(float x) {
    return (vec){x, x, x, x, x, x, x, x,
#if LANES == 16
                 x, x, x, x, x, x, x, x,
#endif
    };
}

static inline int64_t round_up(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

/* The vectors of a key tile's scores. */
#define TILE_VECTORS (KEY_TILE / LANES)

typedef int32_t lane_index __attribute__((vector_size(LANES * sizeof(int32_t))));
#if LANES == 16
static const lane_index LANE = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
#else
static const lane_index LANE = {0, 1, 2, 3, 4, 5, 6, 7};
#endif

#include "vector_ops.h"

/* The largest lane of v, by a tree of lane swaps (a maximum is the same in any order). */
static inline float across_lanes_max(vec v) {
    for (int apart = LANES / 2; apart >= 1; apart /= 2)
        v = greater_of(v, __builtin_shuffle(v, LANE ^ apart));
    return v[0];
}

/* The sum of v's lanes, by a tree of lane swaps. */
static inline float across_lanes_sum(vec v) {
    for (int apart = LANES / 2; apart >= 1; apart /= 2) v += __builtin_shuffle(v, LANE ^ apart);
    return v[0];
}

/* One KV head's context, packed: keys transposed tile by tile [keys / KEY_TILE][head_dim]
 * [KEY_TILE] (one tile's rows contiguous: rows a whole context apart would be a power-of-two
 * stride, all in a few cache sets) and values [keys][dim_pad], both zero-padded to whole key
 * tiles (keys) and whole vectors (dim_pad). Key 0 is position `first` of the sequence. */
typedef struct {
    float *keys_t;
    float *values;
} PackedHead;

/* Packs key tile `tile` of KV head `kv_head` (its keys [tile * KEY_TILE, + KEY_TILE), zeros
 * past the context). */
static void pack_tile(const PackedHead *packed, const kv_t *key_cache, const kv_t *value_cache,
                      const int64_t *table, int64_t first, int64_t context, int64_t kv_head,
                      int64_t tile, int64_t head_dim, int64_t dim_pad, int64_t block_size,
                      int64_t token_stride) {
    float *keys_t = packed->keys_t + tile * head_dim * KEY_TILE;
    for (int64_t j = 0; j < KEY_TILE; j++) {
        const int64_t t = tile * KEY_TILE + j, position = first + t;
        float *value = packed->values + t * dim_pad;
        if (position >= context) {
            for (int64_t d = 0; d < head_dim; d++) keys_t[d * KEY_TILE + j] = 0.f;
            memset(value, 0, sizeof(float) * dim_pad);
            continue;
        }
        const int64_t offset = (table[position / block_size] * block_size + position % block_size)
                                   * token_stride + kv_head * head_dim;
        const kv_t *key = key_cache + offset, *cached_value = value_cache + offset;
        for (int64_t d = 0; d < head_dim; d++) keys_t[d * KEY_TILE + j] = kv_value(key[d]);
        for (int64_t d = 0; d < head_dim; d++) value[d] = kv_value(cached_value[d]);
        memset(value + head_dim, 0, sizeof(float) * (dim_pad - head_dim));
    }
}

/* Which keys of a key tile the rows of a query tile attend: row r sits at position
 * position0 + r / group (relative to the tile's first key k0), rows past `rows` are padding;
 * window > 0: each row attends its last `window` positions only. */
typedef struct {
    int64_t rows, position0, group, k0, window;
} TileKeys;

/* The real scores of row r's key tile: [lo, hi), empty for padding rows. */
static inline void row_span(const TileKeys *keys, int64_t r, int64_t *lo, int64_t *hi) {
    *lo = *hi = 0;
    if (r >= keys->rows) return;
    const int64_t position = keys->position0 + r / keys->group, k0 = keys->k0;
    *hi = position - k0 + 1 < KEY_TILE ? position - k0 + 1 : KEY_TILE;
    if (keys->window > 0 && position - keys->window + 1 - k0 > 0)
        *lo = position - keys->window + 1 - k0;
}

/* How many of the key tile's first keys the rows [r0, r0 + TILE_ROWS) attend between them
 * (up to the last real row's hi): the keys after go uncomputed. Their scores would be masked
 * and their probabilities 0, so the numbers are the same either way. */
static inline int64_t block_keys(const TileKeys *keys, int64_t r0) {
    const int64_t last = (r0 + TILE_ROWS < keys->rows ? r0 + TILE_ROWS : keys->rows) - 1;
    if (last < r0) return 0;
    int64_t lo, hi;
    row_span(keys, last, &lo, &hi);
    return hi > 0 ? hi : 0;
}

/* scores[r][0:KEY_TILE] = queries[r] . keys[tile] for rows [0, rows) (rows a multiple of
 * TILE_ROWS): each query element broadcast against whole vectors of transposed keys. The
 * queries are interleaved by row tile ([rows / TILE_ROWS][head_dim][TILE_ROWS]), so that one
 * pointer walks a tile's broadcasts (a pointer per row spilled to the stack on AVX2). */
static void tile_scores(const float *queries, int64_t rows, int64_t head_dim,
                        const float *keys_t, const TileKeys *keys, float *scores) {
    for (int64_t r0 = 0; r0 < rows; r0 += TILE_ROWS) {
        const int64_t attended = block_keys(keys, r0);
        for (int64_t c0 = 0; c0 < attended; c0 += SCORE_VECTORS * LANES) {
            vec acc[TILE_ROWS][SCORE_VECTORS] = {{{0}}};
            const float *tile_queries = queries + r0 * head_dim;
            for (int64_t d = 0; d < head_dim; d++) {
                const float *k = keys_t + d * KEY_TILE + c0;
                vec kv[SCORE_VECTORS];
#pragma GCC unroll 8
                for (int v = 0; v < SCORE_VECTORS; v++) {
                    kv[v] = load(k + v * LANES);
                    IN_REGISTER(kv[v]);
                }
#pragma GCC unroll 8
                for (int r = 0; r < TILE_ROWS; r++) {
                    const vec q = splat(tile_queries[d * TILE_ROWS + r]);
#pragma GCC unroll 8
                    for (int v = 0; v < SCORE_VECTORS; v++) acc[r][v] += q * kv[v];
                }
            }
#pragma GCC unroll 8
            for (int r = 0; r < TILE_ROWS; r++)
#pragma GCC unroll 8
                for (int v = 0; v < SCORE_VECTORS; v++)
                    store(scores + (r0 + r) * KEY_TILE + c0 + v * LANES, acc[r][v]);
        }
    }
}

/* The online softmax of a key tile runs in three passes over its rows: each row's tile maximum
 * (row_tile_max), then every row's factor e^(old max - new max) that rescales what it summed
 * before, computed for all rows at once as vectors, then each row's probabilities and running
 * sum (row_probabilities). The sum is kept lane by lane, LANES floats a row, and summed across
 * lanes once, at the end of the query tile. Done row by row, the factor was a scalar e^x per
 * row and tile, a chain of dependent multiply-adds, and the sum across lanes a chain of LANES
 * dependent adds (GCC's reduction without -ffast-math): the softmax took as long as either
 * product. SmolLM2-135M's heads, 30 layers, 2 cores of an Intel Xeon (family 6 model 207), min
 * of 7 alternated: a 512-token chunk 47.7 vs 52.4 ms, 512 after a 512-token prefix 118.2 vs
 * 135.3, 1,024 tokens 162.6 vs 184.0, 64 after 300 9.2 vs 10.0 (outputs within 1.5e-6). */

/* The largest of a row's real scores [lo, hi) (-FLT_MAX when there are none); the scores
 * outside are set to -FLT_MAX on the way. */
static float row_tile_max(float *scores, int64_t lo, int64_t hi) {
    if (lo >= hi) return -FLT_MAX;
    if (lo > 0 || hi < KEY_TILE)
        for (int64_t j = 0; j < KEY_TILE; j++)
            if (j < lo || j >= hi) scores[j] = -FLT_MAX;
    vec top = load(scores);
    for (int v = 1; v < TILE_VECTORS; v++) top = greater_of(top, load(scores + v * LANES));
    return across_lanes_max(top);
}

/* A row's scores turned into probabilities against its running max, exactly 0 outside
 * [lo, hi); its running sum (LANES floats) rescaled and the probabilities added, lane by lane.
 * Most rows of most tiles are unmasked: they take the loops without a condition per score. */
static void row_probabilities(float *restrict scores, int64_t lo, int64_t hi, float max,
                              float rescale, float *sum) {
    if (lo >= hi) { /* nothing here: the row's max did not move, its factor is 1 */
        memset(scores, 0, sizeof(float) * KEY_TILE);
        return;
    }
#pragma omp simd
    for (int64_t j = 0; j < KEY_TILE; j++) scores[j] = exp_approx(scores[j] - max);
    if (lo > 0 || hi < KEY_TILE)
        for (int64_t j = 0; j < KEY_TILE; j++)
            if (j < lo || j >= hi) scores[j] = 0.f;
    vec total = load(sum) * splat(rescale);
    for (int v = 0; v < TILE_VECTORS; v++) total += load(scores + v * LANES);
    store(sum, total);
}

/* Columns [c0, c0 + width * LANES) of rows [r0, r0 + TILE_ROWS) of tile_values. `width` is
 * a literal at the call sites: each width gets its own code, with no test per vector in the
 * loop over the keys. */
static inline __attribute__((always_inline)) void value_columns(
    const float *probs, const float *values, int64_t dim_pad, const float *rescale,
    float *acc_rows, int64_t r0, int64_t c0, int width, int64_t keys) {
    vec acc[TILE_ROWS][VALUE_VECTORS];
    const float *tile_probs = probs + r0 * KEY_TILE;
#pragma GCC unroll 8
    for (int r = 0; r < TILE_ROWS; r++) {
        const vec scale = splat(rescale[r0 + r]);
#pragma GCC unroll 8
        for (int v = 0; v < width; v++)
            acc[r][v] = load(acc_rows + (r0 + r) * dim_pad + c0 + v * LANES) * scale;
    }
    for (int64_t j = 0; j < keys; j++) {
        const float *value = values + j * dim_pad + c0;
        vec vv[VALUE_VECTORS];
#pragma GCC unroll 8
        for (int v = 0; v < width; v++) {
            vv[v] = load(value + v * LANES);
            IN_REGISTER(vv[v]);
        }
#pragma GCC unroll 8
        for (int r = 0; r < TILE_ROWS; r++) {
            const vec p = splat(tile_probs[r * KEY_TILE + j]);
#pragma GCC unroll 8
            for (int v = 0; v < width; v++) acc[r][v] += p * vv[v];
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < TILE_ROWS; r++)
#pragma GCC unroll 8
        for (int v = 0; v < width; v++)
            store(acc_rows + (r0 + r) * dim_pad + c0 + v * LANES, acc[r][v]);
}

/* acc[r] = acc[r] * rescale[r] + probs[r] . values[tile] for rows [0, rows) (a multiple of
 * TILE_ROWS): each probability broadcast against whole vectors of a value row. */
static void tile_values(const float *probs, int64_t rows, const float *values, int64_t dim_pad,
                        const float *rescale, const TileKeys *keys, float *acc_rows) {
    for (int64_t r0 = 0; r0 < rows; r0 += TILE_ROWS) {
        const int64_t attended = block_keys(keys, r0);
        int64_t c0 = 0;
        for (; c0 + VALUE_VECTORS * LANES <= dim_pad; c0 += VALUE_VECTORS * LANES)
            value_columns(probs, values, dim_pad, rescale, acc_rows, r0, c0, VALUE_VECTORS,
                          attended);
        for (; c0 < dim_pad; c0 += LANES)
            value_columns(probs, values, dim_pad, rescale, acc_rows, r0, c0, 1, attended);
    }
}

/* A thread's scratch for one query tile of one KV head. */
typedef struct {
    float *queries; /* [rows_pad / TILE_ROWS][head_dim][TILE_ROWS], scaled (tile_scores) */
    float *scores;  /* [rows_pad][KEY_TILE] */
    float *acc;     /* [rows_pad][dim_pad] */
    float *max, *new_max, *rescale; /* [rows_pad] */
    float *sum;           /* [rows_pad][LANES]: each row's running sum, lane by lane */
} Scratch;

static int64_t padded_rows(int64_t group) {
    return round_up(QUERY_TILE * group, TILE_ROWS);
}

static int scratch_alloc(Scratch *s, int64_t rows_pad, int64_t dim_pad) {
    s->queries = calloc(rows_pad * dim_pad, sizeof(float));
    s->scores = malloc(sizeof(float) * rows_pad * KEY_TILE);
    s->acc = malloc(sizeof(float) * rows_pad * dim_pad);
    s->max = malloc(sizeof(float) * rows_pad * (3 + LANES));
    s->new_max = s->max + rows_pad;
    s->rescale = s->new_max + rows_pad;
    s->sum = s->rescale + rows_pad;
    return s->queries && s->scores && s->acc && s->max ? 0 : -1;
}

static void scratch_free(Scratch *s) {
    free(s->queries);
    free(s->scores);
    free(s->acc);
    free(s->max);
}

/* Query tile [i0, i1) of KV head g: rows r = (i - i0) * group + h for query head g*group + h. */
static void query_tile(Scratch *s, const PackedHead *packed, const float *q,
                       int64_t q_row_stride, float *out, int64_t i0, int64_t i1, int64_t g,
                       int64_t group, int64_t heads, int64_t head_dim, int64_t dim_pad,
                       int64_t prefix_len, int64_t first, int64_t window, float scale) {
    const int64_t rows = (i1 - i0) * group;
    const int64_t rows_pad = round_up(rows, TILE_ROWS);
    for (int64_t r = 0; r < rows_pad; r++) {
        float *row = s->queries + (r - r % TILE_ROWS) * head_dim + r % TILE_ROWS;
        if (r < rows) {
            const float *src = q + (i0 + r / group) * q_row_stride + (g * group + r % group) * head_dim;
            for (int64_t d = 0; d < head_dim; d++) row[d * TILE_ROWS] = src[d] * scale;
        } else {
            for (int64_t d = 0; d < head_dim; d++) row[d * TILE_ROWS] = 0.f;
        }
        s->max[r] = -FLT_MAX;
        memset(s->sum + r * LANES, 0, sizeof(float) * LANES);
    }
    memset(s->acc, 0, sizeof(float) * rows_pad * dim_pad);
    /* Keys the tile needs, relative to `first`: from its first query's window start to its
     * last query's position. */
    const int64_t last = prefix_len + i1 - 1 - first;
    int64_t lowest = 0;
    if (window > 0 && prefix_len + i0 - window + 1 > first) lowest = prefix_len + i0 - window + 1 - first;
    for (int64_t k0 = lowest - lowest % KEY_TILE; k0 <= last; k0 += KEY_TILE) {
        const int64_t position0 = prefix_len + i0 - first;
        const TileKeys keys = {rows, position0, group, k0, window};
        tile_scores(s->queries, rows_pad, head_dim, packed->keys_t + k0 * head_dim, &keys,
                    s->scores);
        int64_t lo, hi;
        for (int64_t r = 0; r < rows_pad; r++) {
            row_span(&keys, r, &lo, &hi);
            const float tile_max = row_tile_max(s->scores + r * KEY_TILE, lo, hi);
            s->new_max[r] = tile_max > s->max[r] ? tile_max : s->max[r];
        }
#pragma omp simd
        for (int64_t r = 0; r < rows_pad; r++) {
            s->rescale[r] = exp_approx(s->max[r] - s->new_max[r]);
            s->max[r] = s->new_max[r];
        }
        for (int64_t r = 0; r < rows_pad; r++) {
            row_span(&keys, r, &lo, &hi);
            row_probabilities(s->scores + r * KEY_TILE, lo, hi, s->max[r], s->rescale[r],
                              s->sum + r * LANES);
        }
        tile_values(s->scores, rows_pad, packed->values + k0 * dim_pad, dim_pad, s->rescale,
                    &keys, s->acc);
    }
    for (int64_t r = 0; r < rows; r++) {
        float *dst = out + ((i0 + r / group) * heads + g * group + r % group) * head_dim;
        const float inverse = 1.f / across_lanes_sum(load(s->sum + r * LANES));
        for (int64_t d = 0; d < head_dim; d++) dst[d] = s->acc[r * dim_pad + d] * inverse;
    }
}

/* Returns 0, or -1 when scratch memory could not be allocated. */
int paged_prefill_attention(const float *q, int64_t q_row_stride, const kv_t *key_cache,
                            const kv_t *value_cache, const int64_t *block_table, float *out,
                            int64_t chunk, int64_t prefix_len, int64_t heads, int64_t kv_heads,
                            int64_t head_dim, int64_t block_size, int64_t window, float scale,
                            int threads) {
    const int64_t group = heads / kv_heads, token_stride = kv_heads * head_dim;
    const int64_t context = prefix_len + chunk;
    const int64_t first = window > 0 && prefix_len + 1 > window ? prefix_len + 1 - window : 0;
    const int64_t dim_pad = round_up(head_dim, LANES);
    const int64_t keys_pad = round_up(context - first, KEY_TILE);
    const int64_t tiles = (chunk + QUERY_TILE - 1) / QUERY_TILE;
    PackedHead *packed = malloc(sizeof(PackedHead) * kv_heads);
    float *memory = malloc(sizeof(float) * kv_heads * keys_pad * (head_dim + dim_pad));
    if (packed == NULL || memory == NULL) {
        free(packed);
        free(memory);
        return -1;
    }
    const int64_t key_tiles = keys_pad / KEY_TILE;
    for (int64_t g = 0; g < kv_heads; g++) {
        packed[g].keys_t = memory + g * keys_pad * (head_dim + dim_pad);
        packed[g].values = packed[g].keys_t + keys_pad * head_dim;
    }
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t unit = 0; unit < kv_heads * key_tiles; unit++) {
            const int64_t g = unit / key_tiles;
            pack_tile(&packed[g], key_cache, value_cache, block_table, first, context, g,
                      unit % key_tiles, head_dim, dim_pad, block_size, token_stride);
        }
        Scratch scratch;
        if (scratch_alloc(&scratch, padded_rows(group), dim_pad) != 0) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        /* Last query tiles first: they attend to the most keys (dynamic balance). */
#pragma omp for schedule(dynamic, 1)
        for (int64_t unit = 0; unit < tiles * kv_heads; unit++) {
            if (failed) continue;
            const int64_t tile = tiles - 1 - unit / kv_heads, g = unit % kv_heads;
            const int64_t i0 = tile * QUERY_TILE;
            const int64_t i1 = i0 + QUERY_TILE < chunk ? i0 + QUERY_TILE : chunk;
            query_tile(&scratch, &packed[g], q, q_row_stride, out, i0, i1, g, group, heads,
                       head_dim, dim_pad, prefix_len, first, window, scale);
        }
        scratch_free(&scratch);
    }
    free(memory);
    free(packed);
    return failed ? -1 : 0;
}
