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
 *   q            [chunk, heads, head_dim], rows `q_row_stride` elements apart (a view of the
 *                layer's fused Q/K projection output), of the caches' element type
 *   key_cache,
 *   value_cache  [num_blocks, block_size, kv_heads, head_dim] (one layer), contiguous
 *   block_table  [ceil(context / block_size)] int64
 *   out          [chunk, heads, head_dim], contiguous, of the caches' element type
 * Query i sits at position prefix_len + i and attends to positions [first, prefix_len + i],
 * first = 0, or with window > 0 (a sliding window) its last `window` positions only.
 *
 * Built with -DKV_BFLOAT16 (a library of its own, kernel_build.build's defines), the caches, q and
 * out hold bfloat16 (a bfloat16 model's): each K/V and query element is widened to the float32
 * it stands for as it is packed, and everything after that is this same float32 code, so its
 * result is bit for bit the float32 build's on q and the caches widened beforehand, rounded once
 * as it is written out. With -DBFLOAT16_PAIRS too (AVX-512 BF16; prefill_kernel.py chooses it by
 * vendor) both products run on bfloat16 pairs instead (vdpbf16ps, float32 sums): keys and
 * values are packed as pairs without widening, each row's probabilities are rounded to
 * bfloat16 for the second product (as torch's bfloat16 flash attention rounds them), and the
 * scale is applied to the float32 scores. With -DAMX_TILES too (where the CPU has AMX-BF16)
 * the pairs are multiplied on AMX tiles instead: the same packing, 16-row tiles of queries or
 * probabilities against the packed words as they lie, float32 sums; the softmax is the same
 * vector code. SmolLM2-135M's whole bfloat16 steps on 2 cores of an Intel Xeon with AMX
 * (family 6 model 167), against the widening build, alternated in one process, min of 11, two
 * runs: a 1,056-token prefill 0.79x the time (222-224 vs 282 ms), 512 tokens 0.86-0.87x, 256
 * and 128 tokens 0.94-0.96x, 32 after a 1,024-token prefix 0.81-0.82x, 128 after 512
 * 0.81-0.82x. (The vector pairs build took 1.25x the widening build's time there.)
 */
#include <float.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "exp_approx.h"
#include "in_register.h"
#include "kv_element.h"

#if defined(KV_BFLOAT16) && defined(BFLOAT16_PAIRS) && defined(__AVX512BF16__)
#include <immintrin.h>
#define PAIRS 1
#else
#define PAIRS 0
#endif

#if PAIRS && defined(AMX_TILES) && defined(__AMX_BF16__) && defined(__AMX_TILE__)
#include "amx_tiles.h"
#define AMX 1
#else
#define AMX 0
#endif

#if AMX
#define LANES 16
/* An AMX tile's rows: query rows (or probability rows) per product. */
#define TILE_ROWS AMX_TILE_ROWS
/* An AMX tile row: 16 float32 results, or 16 words of bfloat16 pairs as an operand. */
#define AMX_COLUMNS (AMX_TILE_BYTES / 4)
#define AMX_WORDS (AMX_TILE_BYTES / 4)
#elif defined(__AVX512F__)
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
/* Query positions per query tile (times the group's heads rows): QUERY_TILE, or fewer down to
 * MIN_QUERY_TILE where a chunk's tiles times its KV heads would leave fewer than
 * UNITS_PER_THREAD tiles a thread (query_tile_positions). */
#define QUERY_TILE 32
#define MIN_QUERY_TILE 8
#define UNITS_PER_THREAD 4

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

/* What the products read, packed: float32 (one element a word), or with PAIRS two bfloat16s a
 * word, the lower one first, that vdpbf16ps multiplies and adds as a pair. */
#if PAIRS
typedef uint32_t packed_t;
typedef __m512bh packed_vec;
#define PER_WORD 2
static inline packed_vec packed_load(const packed_t *p) {
    return (packed_vec)_mm512_loadu_si512(p);
}
static inline packed_vec packed_splat(packed_t x) {
    return (packed_vec)_mm512_set1_epi32((int)x);
}
/* acc + each lane's pair of a times b's, summed in float32. */
static inline vec multiply_add(vec acc, packed_vec a, packed_vec b) {
    return (vec)_mm512_dpbf16_ps((__m512)acc, a, b);
}
static inline packed_t pair_of(kv_t low, kv_t high) { return (uint32_t)low | (uint32_t)high << 16; }
#else
typedef float packed_t;
typedef vec packed_vec;
#define PER_WORD 1
static inline packed_vec packed_load(const packed_t *p) { return load(p); }
static inline packed_vec packed_splat(packed_t x) { return splat(x); }
static inline vec multiply_add(vec acc, packed_vec a, packed_vec b) { return acc + a * b; }
#endif

/* Words a row of head_dim elements packs into: with AMX, whole tile rows of them. */
static inline int64_t words_of(int64_t head_dim) {
    const int64_t words = (head_dim + PER_WORD - 1) / PER_WORD;
#if AMX
    return (words + AMX_WORDS - 1) / AMX_WORDS * AMX_WORDS;
#else
    return words;
#endif
}

/* Word w of a query or key row of head_dim elements, as the first product reads it: widened
 * and times `scale`, or with PAIRS elements 2w and 2w + 1 as they are (the scale goes on the
 * scores; an odd head_dim's last pair is padded with a zero). */
static inline packed_t row_word(const kv_t *row, int64_t w, int64_t head_dim, float scale) {
#if PAIRS
    (void)scale;
    if (2 * w >= head_dim) return 0; /* AMX's padding to whole tile rows */
    if (2 * w + 1 == head_dim) return pair_of(row[2 * w], 0);
    packed_t pair; /* one load: x86 is little-endian, element 2w is the lower half */
    memcpy(&pair, row + 2 * w, sizeof pair);
    return pair;
#else
    (void)head_dim;
    return kv_value(row[w]) * scale;
#endif
}

/* A key tile's scores as the softmax takes them: with PAIRS the queries were packed unscaled. */
static inline vec scaled_scores(vec acc, float scale) {
#if PAIRS
    return acc * splat(scale);
#else
    (void)scale;
    return acc;
#endif
}

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

/* One KV head's context, packed: keys transposed tile by tile [keys / KEY_TILE][words_of(
 * head_dim)][KEY_TILE] (one tile's rows contiguous: rows a whole context apart would be a
 * power-of-two stride, all in a few cache sets) and values [keys / PER_WORD][dim_pad] (with
 * PAIRS each word holds element d of two neighbouring keys), both zero-padded to whole key
 * tiles (keys) and whole vectors (dim_pad). Key 0 is position `first` of the sequence. */
typedef struct {
    packed_t *keys_t;
    packed_t *values;
} PackedHead;

/* Key t's value row (NULL past the context) into its word row: widened, or with PAIRS into
 * the words' lower halves (t even, first) or upper halves (t odd). */
static void pack_value(packed_t *words, const kv_t *value, int64_t t, int64_t head_dim,
                       int64_t dim_pad) {
#if PAIRS
    if (t % 2 == 0) {
        memset(words, 0, sizeof(packed_t) * dim_pad);
        if (value != NULL)
            for (int64_t d = 0; d < head_dim; d++) words[d] = value[d];
    } else if (value != NULL) {
        for (int64_t d = 0; d < head_dim; d++) words[d] |= (uint32_t)value[d] << 16;
    }
#else
    (void)t;
    if (value == NULL) {
        memset(words, 0, sizeof(packed_t) * dim_pad);
        return;
    }
    for (int64_t d = 0; d < head_dim; d++) words[d] = kv_value(value[d]);
    memset(words + head_dim, 0, sizeof(packed_t) * (dim_pad - head_dim));
#endif
}

/* Packs key tile `tile` of KV head `kv_head` (its keys [tile * KEY_TILE, + KEY_TILE), zeros
 * past the context). */
static void pack_tile(const PackedHead *packed, const kv_t *key_cache, const kv_t *value_cache,
                      const int64_t *table, int64_t first, int64_t context, int64_t kv_head,
                      int64_t tile, int64_t head_dim, int64_t dim_pad, int64_t block_size,
                      int64_t token_stride) {
    const int64_t words = words_of(head_dim);
    packed_t *keys_t = packed->keys_t + tile * words * KEY_TILE;
    for (int64_t j = 0; j < KEY_TILE; j++) {
        const int64_t t = tile * KEY_TILE + j, position = first + t;
        packed_t *value_words = packed->values + t / PER_WORD * dim_pad;
        if (position >= context) {
            for (int64_t w = 0; w < words; w++) keys_t[w * KEY_TILE + j] = 0;
            pack_value(value_words, NULL, t, head_dim, dim_pad);
            continue;
        }
        const int64_t offset = (table[position / block_size] * block_size + position % block_size)
                                   * token_stride + kv_head * head_dim;
        const kv_t *key = key_cache + offset;
        for (int64_t w = 0; w < words; w++)
            keys_t[w * KEY_TILE + j] = row_word(key, w, head_dim, 1.f);
        pack_value(value_words, value_cache + offset, t, head_dim, dim_pad);
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

#if AMX
/* AMX's tile registers as these products use them (all configured by amx_configure): 0-3
 * four 16-column blocks of float32 results (a key tile's scores, or 64 columns of the values'
 * sums), 4 the query or probability rows, 5-7 the other operand's words. */

/* Operand tile `t` (5-7) loaded with words [w, w + AMX_WORDS) of a row-major word matrix
 * `stride` words wide, then multiplied into result tile `c` with the query/probability rows in
 * tile 4. The tile numbers are instruction immediates, hence a macro. */
#define MULTIPLY_INTO(c, t, words_at, stride)                                                   \
    do {                                                                                        \
        _tile_loadd(t, words_at, (stride) * sizeof(packed_t));                                  \
        _tile_dpbf16ps(c, 4, t);                                                                \
    } while (0)

/* The first `blocks` (1-4) result tiles += tile 4's rows times the operand words at `words`
 * (`stride` words a row), AMX_COLUMNS columns a block. */
static inline void multiply_blocks(const packed_t *words, int64_t stride, int64_t blocks) {
    MULTIPLY_INTO(0, 5, words, stride);
    if (blocks > 1) MULTIPLY_INTO(1, 6, words + AMX_COLUMNS, stride);
    if (blocks > 2) MULTIPLY_INTO(2, 7, words + 2 * AMX_COLUMNS, stride);
    if (blocks > 3) MULTIPLY_INTO(3, 5, words + 3 * AMX_COLUMNS, stride);
}

/* The first `blocks` result tiles from float32 rows at `at`, `stride` bytes apart. */
static inline void load_results(float *at, int64_t stride, int64_t blocks) {
    _tile_loadd(0, at, stride);
    if (blocks > 1) _tile_loadd(1, at + AMX_COLUMNS, stride);
    if (blocks > 2) _tile_loadd(2, at + 2 * AMX_COLUMNS, stride);
    if (blocks > 3) _tile_loadd(3, at + 3 * AMX_COLUMNS, stride);
}

/* The first `blocks` result tiles into float32 rows at `at`, `stride` bytes apart. */
static inline void store_results(float *at, int64_t stride, int64_t blocks) {
    _tile_stored(0, at, stride);
    if (blocks > 1) _tile_stored(1, at + AMX_COLUMNS, stride);
    if (blocks > 2) _tile_stored(2, at + 2 * AMX_COLUMNS, stride);
    if (blocks > 3) _tile_stored(3, at + 3 * AMX_COLUMNS, stride);
}

/* scores[r][0:KEY_TILE] = queries[r] . keys[tile] for rows [0, rows) (a multiple of
 * TILE_ROWS), 16 rows by up to four 16-key blocks on AMX: the queries row by row ([rows][words],
 * query_word), the keys' transposed word rows a B operand as they are packed. Blocks after a
 * row tile's last attended key are neither computed nor stored. */
static void tile_scores(const packed_t *queries, int64_t rows, int64_t words,
                        const packed_t *keys_t, const TileKeys *keys, float scale,
                        float *scores) {
    for (int64_t r0 = 0; r0 < rows; r0 += TILE_ROWS) {
        const int64_t blocks = (block_keys(keys, r0) + AMX_COLUMNS - 1) / AMX_COLUMNS;
        if (blocks == 0) continue;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t w = 0; w < words; w += AMX_WORDS) {
            _tile_loadd(4, queries + r0 * words + w, words * sizeof(packed_t));
            multiply_blocks(keys_t + w * KEY_TILE, KEY_TILE, blocks);
        }
        float *out = scores + r0 * KEY_TILE;
        store_results(out, KEY_TILE * sizeof(float), blocks);
        for (int r = 0; r < TILE_ROWS; r++)
            for (int64_t b = 0; b < blocks; b++) {
                float *row = out + r * KEY_TILE + b * AMX_COLUMNS;
                store(row, scaled_scores(load(row), scale));
            }
    }
}
#else
/* scores[r][0:KEY_TILE] = queries[r] . keys[tile] for rows [0, rows) (rows a multiple of
 * TILE_ROWS): each query word broadcast against whole vectors of transposed key words. The
 * queries are interleaved by row tile ([rows / TILE_ROWS][words][TILE_ROWS]), so that one
 * pointer walks a tile's broadcasts (a pointer per row spilled to the stack on AVX2). */
static void tile_scores(const packed_t *queries, int64_t rows, int64_t words,
                        const packed_t *keys_t, const TileKeys *keys, float scale,
                        float *scores) {
    for (int64_t r0 = 0; r0 < rows; r0 += TILE_ROWS) {
        const int64_t attended = block_keys(keys, r0);
        for (int64_t c0 = 0; c0 < attended; c0 += SCORE_VECTORS * LANES) {
            vec acc[TILE_ROWS][SCORE_VECTORS] = {{{0}}};
            const packed_t *tile_queries = queries + r0 * words;
            for (int64_t w = 0; w < words; w++) {
                const packed_t *k = keys_t + w * KEY_TILE + c0;
                packed_vec kv[SCORE_VECTORS];
#pragma GCC unroll 8
                for (int v = 0; v < SCORE_VECTORS; v++) {
                    kv[v] = packed_load(k + v * LANES);
                    IN_REGISTER(kv[v]);
                }
#pragma GCC unroll 8
                for (int r = 0; r < TILE_ROWS; r++) {
                    const packed_vec q = packed_splat(tile_queries[w * TILE_ROWS + r]);
#pragma GCC unroll 8
                    for (int v = 0; v < SCORE_VECTORS; v++)
                        acc[r][v] = multiply_add(acc[r][v], q, kv[v]);
                }
            }
#pragma GCC unroll 8
            for (int r = 0; r < TILE_ROWS; r++)
#pragma GCC unroll 8
                for (int v = 0; v < SCORE_VECTORS; v++)
                    store(scores + (r0 + r) * KEY_TILE + c0 + v * LANES,
                          scaled_scores(acc[r][v], scale));
        }
    }
}
#endif

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

/* A row's probabilities as the second product reads them, KEY_TILE / PER_WORD words: with
 * PAIRS rounded to bfloat16 pairs of neighbouring keys (the float32 build reads the scores
 * themselves). */
#if PAIRS
static void probability_words(const float *probs, packed_t *words) {
    for (int v = 0; v < TILE_VECTORS; v += 2)
        _mm512_storeu_si512(words + v * LANES / 2,
                            (__m512i)_mm512_cvtne2ps_pbh(load(probs + (v + 1) * LANES),
                                                          load(probs + v * LANES)));
}
#endif

#if AMX
/* acc[r] = acc[r] * rescale[r] + probs[r] . values[tile] for rows [0, rows) (a multiple of
 * TILE_ROWS) on AMX: each row tile's sums rescaled in place, then loaded as result tiles 64
 * columns at a time, the probability words of 32 keys at a time multiplied into them. Key
 * blocks after a row tile's last attended key are skipped (their probabilities are 0). */
static void tile_values(const packed_t *probs, int64_t rows, const packed_t *values,
                        int64_t dim_pad, const float *rescale, const TileKeys *keys,
                        float *acc_rows) {
    const int64_t row_words = KEY_TILE / PER_WORD, stride = dim_pad * sizeof(float);
    for (int64_t r0 = 0; r0 < rows; r0 += TILE_ROWS) {
        for (int64_t r = r0; r < r0 + TILE_ROWS; r++) {
            const vec factor = splat(rescale[r]);
            for (int64_t c = 0; c < dim_pad; c += LANES)
                store(acc_rows + r * dim_pad + c, load(acc_rows + r * dim_pad + c) * factor);
        }
        const int64_t steps = (block_keys(keys, r0) + PER_WORD * AMX_WORDS - 1)
                              / (PER_WORD * AMX_WORDS);
        for (int64_t c0 = 0; c0 < dim_pad && steps > 0; c0 += 4 * AMX_COLUMNS) {
            const int64_t blocks = (dim_pad - c0) / AMX_COLUMNS < 4 ? (dim_pad - c0) / AMX_COLUMNS
                                                                    : 4;
            float *acc = acc_rows + r0 * dim_pad + c0;
            load_results(acc, stride, blocks);
            for (int64_t step = 0; step < steps; step++) {
                _tile_loadd(4, probs + r0 * row_words + step * AMX_WORDS,
                            row_words * sizeof(packed_t));
                multiply_blocks(values + step * AMX_WORDS * dim_pad + c0, dim_pad, blocks);
            }
            store_results(acc, stride, blocks);
        }
    }
}
#else
/* Columns [c0, c0 + width * LANES) of rows [r0, r0 + TILE_ROWS) of tile_values. `width` is
 * a literal at the call sites: each width gets its own code, with no test per vector in the
 * loop over the keys. */
static inline __attribute__((always_inline)) void value_columns(
    const packed_t *probs, const packed_t *values, int64_t dim_pad, const float *rescale,
    float *acc_rows, int64_t r0, int64_t c0, int width, int64_t keys) {
    vec acc[TILE_ROWS][VALUE_VECTORS];
    const int64_t row_words = KEY_TILE / PER_WORD;
    const packed_t *tile_probs = probs + r0 * row_words;
#pragma GCC unroll 8
    for (int r = 0; r < TILE_ROWS; r++) {
        const vec scale = splat(rescale[r0 + r]);
#pragma GCC unroll 8
        for (int v = 0; v < width; v++)
            acc[r][v] = load(acc_rows + (r0 + r) * dim_pad + c0 + v * LANES) * scale;
    }
    /* With PAIRS a key past `keys` may share the last word: its probability is 0. */
    for (int64_t j = 0; j < (keys + PER_WORD - 1) / PER_WORD; j++) {
        const packed_t *value = values + j * dim_pad + c0;
        packed_vec vv[VALUE_VECTORS];
#pragma GCC unroll 8
        for (int v = 0; v < width; v++) {
            vv[v] = packed_load(value + v * LANES);
            IN_REGISTER(vv[v]);
        }
#pragma GCC unroll 8
        for (int r = 0; r < TILE_ROWS; r++) {
            const packed_vec p = packed_splat(tile_probs[r * row_words + j]);
#pragma GCC unroll 8
            for (int v = 0; v < width; v++) acc[r][v] = multiply_add(acc[r][v], p, vv[v]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < TILE_ROWS; r++)
#pragma GCC unroll 8
        for (int v = 0; v < width; v++)
            store(acc_rows + (r0 + r) * dim_pad + c0 + v * LANES, acc[r][v]);
}

/* acc[r] = acc[r] * rescale[r] + probs[r] . values[tile] for rows [0, rows) (a multiple of
 * TILE_ROWS): each probability word broadcast against whole vectors of a value word row. */
static void tile_values(const packed_t *probs, int64_t rows, const packed_t *values,
                        int64_t dim_pad, const float *rescale, const TileKeys *keys,
                        float *acc_rows) {
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
#endif

/* A thread's scratch for one query tile of one KV head. */
typedef struct {
    packed_t *queries; /* query_word's layout (tile_scores, row_word) */
    float *scores;     /* [rows_pad][KEY_TILE] */
    packed_t *probs;   /* [rows_pad][KEY_TILE / PER_WORD]: `scores` itself but with PAIRS */
    float *acc;     /* [rows_pad][dim_pad] */
    float *max, *new_max, *rescale; /* [rows_pad] */
    float *sum;           /* [rows_pad][LANES]: each row's running sum, lane by lane */
} Scratch;

/* Where word w of query row r sits in the scratch: interleaved by row tile
 * ([rows / TILE_ROWS][words][TILE_ROWS]) for the vector products, so that one pointer walks a
 * tile's broadcasts; row by row ([rows][words]) for AMX, whose tiles load whole rows. */
static inline int64_t query_word(int64_t r, int64_t w, int64_t words) {
#if AMX
    return r * words + w;
#else
    return (r - r % TILE_ROWS) * words + w * TILE_ROWS + r % TILE_ROWS;
#endif
}

static int64_t padded_rows(int64_t group) {
    return round_up(QUERY_TILE * group, TILE_ROWS);
}

static int scratch_alloc(Scratch *s, int64_t rows_pad, int64_t dim_pad) {
    s->queries = calloc(rows_pad * dim_pad, sizeof(float)); /* dim_pad >= words */
    s->scores = malloc(sizeof(float) * rows_pad * KEY_TILE);
#if PAIRS
    s->probs = malloc(sizeof(packed_t) * rows_pad * KEY_TILE / PER_WORD);
#else
    s->probs = s->scores;
#endif
    s->acc = malloc(sizeof(float) * rows_pad * dim_pad);
    s->max = malloc(sizeof(float) * rows_pad * (3 + LANES));
    s->new_max = s->max + rows_pad;
    s->rescale = s->new_max + rows_pad;
    s->sum = s->rescale + rows_pad;
    return s->queries && s->scores && s->probs && s->acc && s->max ? 0 : -1;
}

static void scratch_free(Scratch *s) {
    free(s->queries);
    if (s->probs != (packed_t *)s->scores) free(s->probs);
    free(s->scores);
    free(s->acc);
    free(s->max);
}

/* Query tile [i0, i1) of KV head g: rows r = (i - i0) * group + h for query head g*group + h. */
static void query_tile(Scratch *s, const PackedHead *packed, const kv_t *q,
                       int64_t q_row_stride, kv_t *out, int64_t i0, int64_t i1, int64_t g,
                       int64_t group, int64_t heads, int64_t head_dim, int64_t dim_pad,
                       int64_t prefix_len, int64_t first, int64_t window, float scale) {
    const int64_t rows = (i1 - i0) * group;
    const int64_t rows_pad = round_up(rows, TILE_ROWS), words = words_of(head_dim);
    packed_t *queries = s->queries;
    for (int64_t r = 0; r < rows_pad; r++) {
        if (r < rows) {
            const kv_t *src =
                q + (i0 + r / group) * q_row_stride + (g * group + r % group) * head_dim;
            for (int64_t w = 0; w < words; w++)
                queries[query_word(r, w, words)] = row_word(src, w, head_dim, scale);
        } else {
            for (int64_t w = 0; w < words; w++) queries[query_word(r, w, words)] = 0;
        }
        s->max[r] = -FLT_MAX;
        memset(s->sum + r * LANES, 0, sizeof(float) * LANES);
    }
    memset(s->acc, 0, sizeof(float) * rows_pad * dim_pad);
    /* Keys the tile needs, relative to `first`: from its first query's window start to its
     * last query's position. */
    const int64_t last = prefix_len + i1 - 1 - first;
    int64_t lowest = 0;
    if (window > 0 && prefix_len + i0 - window + 1 > first)
        lowest = prefix_len + i0 - window + 1 - first;
    for (int64_t k0 = lowest - lowest % KEY_TILE; k0 <= last; k0 += KEY_TILE) {
        const int64_t position0 = prefix_len + i0 - first;
        const TileKeys keys = {rows, position0, group, k0, window};
        tile_scores(s->queries, rows_pad, words, packed->keys_t + k0 * words, &keys, scale,
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
#if PAIRS
            probability_words(s->scores + r * KEY_TILE, s->probs + r * KEY_TILE / PER_WORD);
#endif
        }
        tile_values(s->probs, rows_pad, packed->values + k0 / PER_WORD * dim_pad, dim_pad,
                    s->rescale, &keys, s->acc);
    }
    for (int64_t r = 0; r < rows; r++) {
        kv_t *dst = out + ((i0 + r / group) * heads + g * group + r % group) * head_dim;
        const float inverse = 1.f / across_lanes_sum(load(s->sum + r * LANES));
        for (int64_t d = 0; d < head_dim; d++)
            dst[d] = kv_rounded(s->acc[r * dim_pad + d] * inverse);
    }
}

/* Query positions per query tile for a chunk: halved from QUERY_TILE while its tiles times
 * the KV heads leave fewer than UNITS_PER_THREAD tiles a thread. A 32-token chunk after a long
 * prefix was a single tile per KV head: SmolLM2-135M's 3 tiles on 2 threads, one idle a third
 * of the time. Halving down to 8 positions there (2 cores of an AMD EPYC Zen 4, whole steps
 * alternated, min of 11-15): 0.93-0.94x the step's time in bfloat16 and in float32. */
static int64_t query_tile_positions(int64_t chunk, int64_t kv_heads, int threads) {
    int64_t positions = QUERY_TILE;
    while (positions > MIN_QUERY_TILE
           && (chunk + positions - 1) / positions * kv_heads < UNITS_PER_THREAD * threads)
        positions /= 2;
    return positions;
}

/* Whether this build multiplies bfloat16 pairs (PAIRS). */
int paged_prefill_attention_pairs(void) { return PAIRS; }

/* Whether this build runs its products on AMX tiles: 1 where it does and Linux lets this
 * process use them, -1 where it was built for them but Linux refused, 0 where not built so. */
int paged_prefill_attention_tiles(void) {
#if AMX
    return amx_permitted() ? 1 : -1;
#else
    return 0;
#endif
}

/* One chunk of a call: its queries (rows q_row_stride apart) and output rows, its block table,
 * and what the call derives from them: the context's first key (a window's start), its
 * key tiles, its query tiles of `positions` positions, and its KV heads' packed context. */
typedef struct {
    const kv_t *q;
    kv_t *out;
    const int64_t *table;
    int64_t chunk, prefix_len, first, key_tiles, positions, tiles;
    PackedHead *packed;
} Chunk;

/* The chunks' attention in one parallel region: every chunk's key tiles packed (shared out
 * statically), then every chunk's query tiles shared out dynamically, each chunk's last (the
 * most keys) first.
 * Returns 0, or -1 when memory could not be allocated. */
static int attend_chunks(Chunk *chunks, int64_t count, int64_t q_row_stride,
                         const kv_t *key_cache, const kv_t *value_cache, int64_t heads,
                         int64_t kv_heads, int64_t head_dim, int64_t block_size, int64_t window,
                         float scale, int threads) {
    const int64_t group = heads / kv_heads, token_stride = kv_heads * head_dim;
    const int64_t dim_pad = round_up(head_dim, LANES), words = words_of(head_dim);
    const int64_t tile_words = KEY_TILE * (words + dim_pad / PER_WORD);
    int64_t pack_units = 0, tile_units = 0, all_tiles = 0;
    for (int64_t c = 0; c < count; c++) {
        Chunk *k = &chunks[c];
        const int64_t prefix_len = k->prefix_len;
        k->first = window > 0 && prefix_len + 1 > window ? prefix_len + 1 - window : 0;
        k->key_tiles = round_up(prefix_len + k->chunk - k->first, KEY_TILE) / KEY_TILE;
        k->positions = query_tile_positions(k->chunk, kv_heads, threads);
        k->tiles = (k->chunk + k->positions - 1) / k->positions;
        pack_units += kv_heads * k->key_tiles;
        tile_units += kv_heads * k->tiles;
        all_tiles += k->key_tiles;
    }
    PackedHead *packed = malloc(sizeof(PackedHead) * count * kv_heads);
    packed_t *memory = malloc(sizeof(packed_t) * kv_heads * all_tiles * tile_words);
    if (packed == NULL || memory == NULL) {
        free(packed);
        free(memory);
        return -1;
    }
    packed_t *next = memory;
    for (int64_t c = 0; c < count; c++) {
        chunks[c].packed = packed + c * kv_heads;
        for (int64_t g = 0; g < kv_heads; g++) {
            const int64_t keys_pad = chunks[c].key_tiles * KEY_TILE;
            chunks[c].packed[g].keys_t = next;
            chunks[c].packed[g].values = next + keys_pad * words;
            next += chunks[c].key_tiles * tile_words;
        }
    }
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        /* Unit u is chunk c's (u - its first unit)-th: c found by walking the chunks, in
         * order as u grows within a thread's static range. */
#pragma omp for schedule(static)
        for (int64_t unit = 0; unit < pack_units; unit++) {
            int64_t c = 0, u = unit;
            while (u >= kv_heads * chunks[c].key_tiles) u -= kv_heads * chunks[c++].key_tiles;
            const Chunk *k = &chunks[c];
            const int64_t g = u / k->key_tiles;
            pack_tile(&k->packed[g], key_cache, value_cache, k->table, k->first,
                      k->prefix_len + k->chunk, g, u % k->key_tiles, head_dim, dim_pad,
                      block_size, token_stride);
        }
        Scratch scratch;
        if (scratch_alloc(&scratch, padded_rows(group), dim_pad) != 0) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
#if AMX
        amx_configure();
#endif
        /* Each chunk's last query tiles first: they attend to the most keys (dynamic
         * balance); the chunks in turn. */
#pragma omp for schedule(dynamic, 1)
        for (int64_t unit = 0; unit < tile_units; unit++) {
            if (failed) continue;
            int64_t c = 0, u = unit;
            while (u >= kv_heads * chunks[c].tiles) u -= kv_heads * chunks[c++].tiles;
            const Chunk *k = &chunks[c];
            const int64_t tile = k->tiles - 1 - u / kv_heads, g = u % kv_heads;
            const int64_t i0 = tile * k->positions;
            const int64_t i1 = i0 + k->positions < k->chunk ? i0 + k->positions : k->chunk;
            query_tile(&scratch, &k->packed[g], k->q, q_row_stride, k->out, i0, i1, g, group,
                       heads, head_dim, dim_pad, k->prefix_len, k->first, window, scale);
        }
#if AMX
        _tile_release();
#endif
        scratch_free(&scratch);
    }
    free(memory);
    free(packed);
    return failed ? -1 : 0;
}

/* One chunk. Returns 0, or -1 when memory could not be allocated. */
int paged_prefill_attention(const kv_t *q, int64_t q_row_stride, const kv_t *key_cache,
                            const kv_t *value_cache, const int64_t *block_table, kv_t *out,
                            int64_t chunk, int64_t prefix_len, int64_t heads, int64_t kv_heads,
                            int64_t head_dim, int64_t block_size, int64_t window, float scale,
                            int threads) {
    Chunk one = {.q = q, .out = out, .table = block_table, .chunk = chunk,
                 .prefix_len = prefix_len};
    return attend_chunks(&one, 1, q_row_stride, key_cache, value_cache, heads, kv_heads,
                         head_dim, block_size, window, scale, threads);
}

/* `count` chunks of one step, in one parallel region: chunk c's queries are rows
 * [starts[c], starts[c + 1]) of q (rows q_row_stride apart), its output the same rows of out
 * ([starts[count], heads, head_dim]), its context prefix_lens[c] cached tokens and its own,
 * read through tables[c]. The same numbers as a call per chunk. Returns 0, or -1 when memory
 * could not be allocated. */
int paged_prefill_attention_chunks(int64_t count, const kv_t *q, int64_t q_row_stride,
                                   const int64_t *starts, const int64_t *prefix_lens,
                                   const int64_t *const *tables, const kv_t *key_cache,
                                   const kv_t *value_cache, kv_t *out, int64_t heads,
                                   int64_t kv_heads, int64_t head_dim, int64_t block_size,
                                   int64_t window, float scale, int threads) {
    Chunk *chunks = malloc(sizeof(Chunk) * count);
    if (chunks == NULL) return -1;
    for (int64_t c = 0; c < count; c++)
        chunks[c] = (Chunk){.q = q + starts[c] * q_row_stride,
                            .out = out + starts[c] * heads * head_dim,
                            .table = tables[c],
                            .chunk = starts[c + 1] - starts[c],
                            .prefix_len = prefix_lens[c]};
    const int status = attend_chunks(chunks, count, q_row_stride, key_cache, value_cache, heads,
                                     kv_heads, head_dim, block_size, window, scale, threads);
    free(chunks);
    return status;
}
