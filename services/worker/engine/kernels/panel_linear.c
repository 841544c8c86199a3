/* Projections of many rows (larger decode steps, prefill chunks) on weights packed in panels
 * (CPU, float32; a bfloat16 model's on AVX-512 BF16 at the end of the file).
 *
 * y = x W^T (+ bias) (+ y): W [outs, ins] (nn.Linear's layout) is packed once into panels of
 * PANEL output columns, [panels][ins][PANEL] (the last panel's missing columns zero), so that
 * one step of the inner loop loads the PANEL weights of one input as two vectors and
 * multiplies them by one broadcast input of each of TILE_ROWS rows: TILE_ROWS x 2
 * accumulators, each weight used TILE_ROWS times from a register, each input once per panel.
 * A panel (ins x PANEL floats: 72 KiB for SmolLM2-135M's 576 inputs) stays in L2 while every
 * row tile of the step runs over it, so the weights are read from memory once a step; the
 * threads take whole panels.
 *
 * Against oneDNN's matmul on weights reordered into its layout (PackedLinear), on 2 cores of
 * an AMD EPYC Zen 5 (AVX-512), SmolLM2-135M's projections (every layer and lm_head), min of 7
 * alternated: 24 rows 22.2 vs 26.5 ms, 32 rows 28.9 vs 36.1, 64 rows 49.2 vs 55.7, 128 rows
 * 93.1 vs 93.9. Asking for the whole next panel ahead of the loop (software prefetch) made it
 * slower there.
 *
 * panel_linear_prefetching asks for the next panel while it runs the current one instead,
 * each row tile for its share of the next panel's cache lines, spread over its loop, so that
 * the next panel's read from memory overlaps the current panel's arithmetic rather than
 * following it. On 2 cores of an Intel Xeon (family 6 model 207, AVX-512), the same
 * projections without lm_head, min of 7 alternated: 8 rows 17.9 vs 26.3 ms, 16 rows 20.5 vs
 * 30.8, 32 rows 26.4 vs 41.0, 64 rows 44.4 vs 59.9, 128 rows 86.6 vs 102.3, 256 rows 175.4 vs
 * 183.9, 512 rows 351-356 vs 350-351 (a tie); lm_head at 32 rows 6.1 vs 10.3 ms. It also runs
 * the rows in blocks that stay in L2 (block_rows_max), since a step's rows are read again for
 * every panel: with x over L2 (1,024 rows of 576 inputs there) each reading came from L3 and
 * the projections fell from 317 to 290 GFLOP/s; in blocks, 314-334.
 *
 * Layouts (contiguous but x's rows, x_stride floats apart):
 *   x [rows, ins]   panels [ceil(outs / PANEL), ins, PANEL]   bias [outs] or NULL
 *   y [rows, outs]
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#if defined(__AVX512F__)
#define LANES 16
/* 14 x 2 accumulators, the two weight vectors and the broadcast: 31 of AVX-512's 32
 * registers. Each step of the inner loop then makes 16 loads (two weight vectors, 14
 * broadcasts) for 28 products instead of 10 for 16, and ran closer to the peak: on 2 cores
 * of an AMD EPYC Zen 4, SmolLM2-135M's four layer projections, 30 runs alternated, 14-row
 * against 8-row tiles, 8 rows 0.34 vs 0.36 ms, 32 rows 1.20 vs 1.28, 64 rows 2.24 vs 2.49,
 * 128 rows 4.45 vs 4.98 (204 vs 182 GFLOP/s; oneDNN 199), 512 rows 18.5 vs 19.9; 12 or 13
 * rows were in between. 8-row tiles ran at 81% of the peak on one thread too, and at 84% with
 * the panel in L1 (128 inputs): the tile's loads held it back, not the threads or the caches.
 * On a Zen 5, whose AVX-512 is full width, whole steps took the same time with 14- and 8-row
 * tiles (two processes each, alternated: a 32-row decode step 33.3-35.4 vs 32.8-33.7 ms, a
 * 512-token prefill step 268-279 vs 271-279). On an Intel Xeon (family 6 model 167) they
 * are the fastest with even tiles (EVEN_TILES, below); with 14 + 14 + 4 rows a 32-row decode
 * step took 1.03x the time of 8-row tiles. */
#define TILE_ROWS 14
#define SHORT_TILES(CASE)                                                                    \
    CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8) CASE(9) CASE(10)         \
    CASE(11) CASE(12) CASE(13)
#else
#define LANES 8
/* 6 x 2 accumulators, the two weight vectors and the broadcast: 15 of AVX2's 16. */
#define TILE_ROWS 6
#define SHORT_TILES(CASE) CASE(1) CASE(2) CASE(3) CASE(4) CASE(5)
#endif
#define PANEL (2 * LANES)
#define CACHE_LINE 64
/* The most rows panel_linear_prefetching streams; it runs larger steps as panel_linear does.
 * On 2 cores of an AMD EPYC Zen 3 (AVX2, 512 KiB of L2 a core), SmolLM2-135M's layer
 * projections, min of 7 alternated, streaming against not: 32 rows 0.82x the time, 128 rows
 * 0.99x, 256 rows 1.03x, 512 rows 1.04x, 1,024 rows 1.03x (without the row blocks 1.00-1.02x:
 * there the arithmetic hides the reading anyway). With AVX-512 streaming gained at every size
 * measured (Intel Xeons up to 1,024 rows, a Zen 4 up to 512; the comment above). */
#if defined(__AVX512F__)
#define STREAMING_MAX_ROWS INT64_MAX
#else
#define STREAMING_MAX_ROWS 128
#endif

typedef float vec __attribute__((vector_size(LANES * sizeof(float))));

#include "vector_io.h"

/* Output columns per panel: the panels' layout for callers that size the buffer. */
int panel_linear_width(void) { return PANEL; }

/* Rows of the next row tile when `left` rows of a panel remain: TILE_ROWS, and the rest in a
 * last tile, unless the tiles that many rows need can be of sizes that differ by at most one
 * and all hold EVEN_TILE_ROWS_MIN rows or more: then those; and unless the last tile would
 * hold fewer than LAST_TILE_ROWS_MIN rows: then the last two tiles share them. On AVX2 a tile
 * of 6 rows keeps 12 sums, one of 5 rows 10, of 4 rows 8, just the FMA's 4-cycle latency on 2
 * pipes, which it keeps busy only in theory. SmolLM2-135M's projections of a step (every
 * layer and lm_head), 2 cores of an AMD EPYC Zen 3, min of 9-15 alternated, even tiles
 * against TILE_ROWS and a remainder: 20 rows (5+5+5+5) 0.92x the time, 25 rows 0.89-0.92x,
 * 32 rows (6+6+5+5+5+5) 0.95x, 33 rows 0.95x, 50 rows 0.97-0.98x, 64 rows a tie; with 4-row
 * tiles 13 rows (5+4+4) 1.04-1.11x, and 6+6+4+4 for 20 rows 1.10x. A row's sums are the same
 * whatever tile it falls in. AVX-512's tiles: below. */
#if TILE_ROWS == 6
#define EVEN_TILE_ROWS_MIN 5
#define LAST_TILE_ROWS_MIN 1
#elif defined(EVEN_TILES)
/* The build for Intel CPUs (linear_kernel.panel_library): AVX-512's 14-row tiles even from 10
 * rows (32 rows as 11+11+10, not 14+14+4). Whole steps of SmolLM2-135M on an Intel Xeon,
 * family 6 model 167 (2 cores), fastest of 12, two processes of each alternated: 32-row
 * decode 66.95-67.11 ms against 68.68-69.47 (with 16-token contexts 46.7-47.4 against
 * 48.5-50.1), 64 rows 117.8-119.5 against 119.1-119.5, a 128-token prefill 118.5-119.4
 * against 120.4-121.7, 24 rows a tie; 8-row tiles took 67.4 ms at 32 rows but 122.3-123.2 at
 * the 128-token prefill. */
#define EVEN_TILE_ROWS_MIN 10
#define LAST_TILE_ROWS_MIN 2
#else
/* With AVX-512's 14-row tiles, on the Zen 4 of TILE_ROWS' note, even tiles were slower (20
 * rows as 10+10 0.79-0.80 ms against 0.72 as 14+6, 32 rows 1.28 against 1.21) but for a last
 * tile of one row: 15 rows as 14+1 0.63 ms, as 8+7 0.57. */
#define EVEN_TILE_ROWS_MIN TILE_ROWS
#define LAST_TILE_ROWS_MIN 2
#endif
int64_t panel_linear_tile_rows(int64_t left) {
    const int64_t tiles = (left + TILE_ROWS - 1) / TILE_ROWS;
    if (tiles > 0 && left / tiles >= EVEN_TILE_ROWS_MIN) return (left + tiles - 1) / tiles;
    if (left > TILE_ROWS && left - TILE_ROWS < LAST_TILE_ROWS_MIN) return (left + 1) / 2;
    return left < TILE_ROWS ? left : TILE_ROWS;
}

/* panels[p][i][c] = weight[p * PANEL + c][i], zero past outs. */
void panel_linear_pack(const float *weight, int64_t outs, int64_t ins, float *panels) {
    const int64_t count = (outs + PANEL - 1) / PANEL;
    for (int64_t p = 0; p < count; p++)
        for (int64_t i = 0; i < ins; i++)
            for (int64_t c = 0; c < PANEL; c++) {
                const int64_t o = p * PANEL + c;
                panels[(p * ins + i) * PANEL + c] = o < outs ? weight[o * ins + i] : 0.f;
            }
}

/* Rows [0, rows) of x against one panel, written to columns [0, columns) of y (y's rows
 * `outs` floats apart). `rows` is a constant where panel_rows calls it, so the accumulators
 * are registers. */
static inline __attribute__((always_inline)) void row_tile(const float *x, int64_t x_stride,
                                                           int64_t ins, const float *panel,
                                                           const float *bias, int64_t columns,
                                                           float *y, int64_t outs,
                                                           int accumulate, int rows,
                                                           const char *ahead, int64_t lines) {
    vec acc[TILE_ROWS][2];
    for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = (vec){0};
    int64_t asked = 0; /* of the `lines` cache lines from `ahead`, asked for evenly over i */
    for (int64_t i = 0; i < ins; i++) {
        for (; asked * ins < (i + 1) * lines; asked++)
            __builtin_prefetch(ahead + asked * CACHE_LINE, 0, 2); /* into L2 */
        const vec w0 = load(panel + i * PANEL), w1 = load(panel + i * PANEL + LANES);
        for (int r = 0; r < rows; r++) {
            const float input = x[r * x_stride + i];
            acc[r][0] += input * w0;
            acc[r][1] += input * w1;
        }
    }
    /* The bias added before the old y, as oneDNN's product and then an add would. */
    for (int r = 0; r < rows; r++) {
        float *row = y + r * outs;
        if (columns == PANEL) {
            vec v0 = acc[r][0], v1 = acc[r][1];
            if (bias != NULL) v0 += load(bias), v1 += load(bias + LANES);
            if (accumulate) v0 = load(row) + v0, v1 = load(row + LANES) + v1;
            store(row, v0);
            store(row + LANES, v1);
            continue;
        }
        float out[PANEL]; /* the last panel, part of it past outs */
        store(out, acc[r][0]);
        store(out + LANES, acc[r][1]);
        for (int64_t c = 0; c < columns; c++) {
            const float value = bias != NULL ? out[c] + bias[c] : out[c];
            row[c] = accumulate ? row[c] + value : value;
        }
    }
}

#define ROW_TILE(n)                                                                          \
    case n:                                                                                  \
        row_tile(x, x_stride, ins, panel, bias, columns, y, outs, accumulate, n, ahead,      \
                 lines);                                                                     \
        break;

/* The rows of x against one panel: the work run_panels shares out, for float32 (panel_rows)
 * or bfloat16 (bfloat16_panel_rows) operands. */
typedef void (*panel_rows_fn)(const void *x, int64_t rows, int64_t x_stride, int64_t ins,
                              const void *panel, const void *bias, int64_t columns, void *y,
                              int64_t outs, int accumulate, const void *next);

/* The cache lines of `next` (the panel to run after this one, panel_bytes long, or NULL) that
 * a panel's row tiles share out to ask for (0 without one). */
static int64_t next_lines(const void *next, int64_t panel_bytes) {
    return next != NULL ? panel_bytes / CACHE_LINE : 0;
}

/* Where the row tile whose share starts `asked` lines into `next` asks from (NULL: nowhere),
 * and in *lines how many lines it asks for, of the panel's panel_lines. */
static const char *tile_ahead(const void *next, int64_t panel_lines, int64_t asked,
                              int64_t share, int64_t *lines) {
    *lines = panel_lines - asked < share ? panel_lines - asked : share;
    return next != NULL ? (const char *)next + asked * CACHE_LINE : NULL;
}

/* Every row of x against one panel, in the row tiles of panel_linear_tile_rows; the tiles
 * share out the cache lines of `next` (the panel to run after this one, or NULL) to ask for. */
static void panel_rows(const void *x_rows, int64_t rows, int64_t x_stride, int64_t ins,
                       const void *panel_weights, const void *bias_of_panel, int64_t columns,
                       void *y_rows, int64_t outs, int accumulate, const void *next) {
    const float *x = x_rows, *panel = panel_weights, *bias = bias_of_panel;
    float *y = y_rows;
    const int64_t tiles = (rows + TILE_ROWS - 1) / TILE_ROWS;
    const int64_t panel_lines = next_lines(next, ins * PANEL * (int64_t)sizeof(float));
    const int64_t share = (panel_lines + tiles - 1) / tiles;
    for (int64_t r0 = 0, asked = 0, tile = 0; r0 < rows; r0 += tile, x += tile * x_stride,
                 y += tile * outs, asked += share) {
        tile = panel_linear_tile_rows(rows - r0);
        int64_t lines;
        const char *ahead = tile_ahead(next, panel_lines, asked, share, &lines);
        switch (tile) {
            SHORT_TILES(ROW_TILE)
        default:
            row_tile(x, x_stride, ins, panel, bias, columns, y, outs, accumulate, TILE_ROWS, ahead,
                     lines);
        }
    }
}

/* The most rows of x a row block of the streaming variant holds: the block's rows are read
 * again for every panel, so they should stay in L2 (three quarters of it, the rest for the
 * panel and the next one). */
static int64_t block_rows_max(int64_t row_bytes) {
    static int64_t l2_bytes = 0;
    if (l2_bytes == 0) {
        const long size = sysconf(_SC_LEVEL2_CACHE_SIZE);
        l2_bytes = size > 0 ? size : 1 << 20;
    }
    const int64_t rows = l2_bytes * 3 / 4 / row_bytes;
    return rows > TILE_ROWS ? rows : TILE_ROWS;
}

/* How run_panels reads one product's operands: x's elements of `x_element` bytes, bias's and
 * y's of `element`, panels of `panel_bytes` each, the rows of one panel run by `run`. */
typedef struct {
    int64_t x_element, element, panel_bytes;
    panel_rows_fn run;
} Format;

/* `streaming`: each thread asks for its next panel while it runs the current one, and the
 * rows go in blocks of at most block_rows_max (of equal size), every panel over one block
 * before the next block: (block, panel) pairs shared out among the threads in that order. */
static void run_panels(const void *x_rows, int64_t rows, int64_t x_stride, int64_t ins,
                       const void *all_panels, const void *all_bias, int64_t outs, void *y_rows,
                       int accumulate, Format format, int threads, int streaming) {
    if (rows <= 0) return;
    const int64_t count = (outs + PANEL - 1) / PANEL, element = format.element;
    const int64_t most = streaming ? block_rows_max(ins * format.x_element) : rows;
    const int64_t blocks = (rows + most - 1) / most;
    /* Whole row tiles a block, but the last. */
    const int64_t tiles = (rows + TILE_ROWS - 1) / TILE_ROWS;
    const int64_t per_block = (tiles + blocks - 1) / blocks * TILE_ROWS;
    const int team = count * blocks < threads ? (int)(count * blocks) : threads;
    const char *x = x_rows, *panels = all_panels, *bias = all_bias;
    char *y = y_rows;
    /* Dynamic, two panels at a time: a thread the hypervisor takes the core from for a while
     * leaves its panels to the other instead of making it wait at the barrier (a 64-row
     * decode step, 2 cores of an AMD EPYC Zen 4: 137-140 vs 141-149 ms, three runs each;
     * 1,024-token prefill steps alike). Static when streaming: each thread asks for panel
     * p + 1 while it runs p, which only holds where a thread runs a contiguous range. */
    omp_set_schedule(streaming ? omp_sched_static : omp_sched_dynamic, streaming ? 0 : 2);
#pragma omp parallel for collapse(2) schedule(runtime) num_threads(team)
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t p = 0; p < count; p++) {
            const int64_t first = p * PANEL, row0 = b * per_block;
            const int64_t columns = outs - first < PANEL ? outs - first : PANEL;
            const int64_t block = rows - row0 < per_block ? rows - row0 : per_block;
            const char *next = streaming && p + 1 < count ? panels + (p + 1) * format.panel_bytes
                                                          : NULL;
            if (block > 0)
                format.run(x + row0 * x_stride * format.x_element, block, x_stride, ins,
                           panels + p * format.panel_bytes,
                           bias != NULL ? bias + first * element : NULL, columns,
                           y + (row0 * outs + first) * element, outs, accumulate, next);
        }
}

/* The float32 format of panel_linear and panel_linear_prefetching. */
static Format float_format(int64_t ins) {
    const int64_t element = (int64_t)sizeof(float);
    return (Format){element, element, ins * PANEL * element, panel_rows};
}

/* y (=, or += with accumulate) x W^T + bias, W packed by panel_linear_pack. */
void panel_linear(const float *x, int64_t rows, int64_t x_stride, int64_t ins,
                  const float *panels, const float *bias, int64_t outs, float *y, int accumulate,
                  int threads) {
    run_panels(x, rows, x_stride, ins, panels, bias, outs, y, accumulate, float_format(ins),
               threads, 0);
}

/* panel_linear, asking for each thread's next panel while it runs the current one, its rows
 * in blocks that stay in L2 (steps of up to STREAMING_MAX_ROWS rows). */
void panel_linear_prefetching(const float *x, int64_t rows, int64_t x_stride, int64_t ins,
                              const float *panels, const float *bias, int64_t outs, float *y,
                              int accumulate, int threads) {
    run_panels(x, rows, x_stride, ins, panels, bias, outs, y, accumulate, float_format(ins),
               threads, rows <= STREAMING_MAX_ROWS);
}

/* A bfloat16 model's projections (AVX-512 BF16 only): x, W, the bias and y in bfloat16, W
 * packed in panels of pairs, [panels][ceil(ins / 2)][PANEL][2] (input pairs 2i and 2i + 1 of
 * each column side by side; zeros past outs and ins), so that vdpbf16ps multiplies one
 * broadcast pair of a row's inputs by the pairs of 16 columns and adds both products into
 * their float32 sums in one instruction, twice the float32 kernel's products a cycle. Each
 * output is rounded once after the bias is added in float32, and a residual added after that
 * and rounded again, as oneDNN's bfloat16 product and torch's add_ do. Against oneDNN on its
 * reordered weights (PackedLinear), SmolLM2-135M's projections of a step (every layer and
 * lm_head), 2 cores of an AMD EPYC Zen 4, min of 5 alternated: 5 rows 9.2 vs 13.3 ms, 8 rows
 * 10.0 vs 14.6, 16 rows 14.5 vs 18.7, 32 rows 24.9 vs 28.2, 64 rows 45.8 vs 48.4; the layers
 * alone at 128-512 rows within 3% of it. */
#if defined(__AVX512BF16__)
#include <immintrin.h>

#include "bfloat16.h"
#include "bfloat16_vector.h"

/* Whole tiles of 8 rows and the rest in a last one. 14-row tiles ran the float32 product
 * closer to the peak (TILE_ROWS) but this one slower: on the Zen 4 of TILE_ROWS' note, 16 rows
 * 0.31 vs 0.29 ms, 128 rows 2.33 vs 2.21, 512 rows 9.28 vs 8.70. */
#define BFLOAT16_TILE_ROWS 8

int panel_linear_bfloat16_built(void) { return 1; }

#if defined(AMX_TILES) && defined(__AMX_BF16__) && defined(__AMX_TILE__)
#include "amx_tiles.h"
#define AMX 1
/* An AMX tile: 16 rows of 64 bytes (16 float32 sums, or 16 input pairs). */
#define AMX_ROWS AMX_TILE_ROWS
#define AMX_PAIRS (AMX_TILE_BYTES / 4)
#else
#define AMX 0
#endif

/* Input pairs a panel holds for `ins` inputs: ins rounded up to pairs, and with AMX to whole
 * tiles of pairs (the pad zero). */
static int64_t bfloat16_pairs(int64_t ins) {
    const int64_t pairs = (ins + 1) / 2;
#if AMX
    return (pairs + AMX_PAIRS - 1) / AMX_PAIRS * AMX_PAIRS;
#else
    return pairs;
#endif
}

/* Inputs a panel's columns hold, the pad included: its size is that times PANEL. */
int64_t panel_linear_bfloat16_depth(int64_t ins) { return 2 * bfloat16_pairs(ins); }

/* panels[p][i][c][j] = weight[p * PANEL + c][2 * i + j], zero past outs and ins. */
void panel_linear_bfloat16_pack(const uint16_t *weight, int64_t outs, int64_t ins,
                                uint16_t *panels) {
    const int64_t count = (outs + PANEL - 1) / PANEL, pairs = bfloat16_pairs(ins);
    for (int64_t p = 0; p < count; p++)
        for (int64_t i = 0; i < pairs; i++)
            for (int64_t c = 0; c < PANEL; c++)
                for (int64_t j = 0; j < 2; j++) {
                    const int64_t o = p * PANEL + c, k = 2 * i + j;
                    panels[((p * pairs + i) * PANEL + c) * 2 + j] =
                        o < outs && k < ins ? weight[o * ins + k] : 0;
                }
}

/* Input pair i of every row of the tile times the pairs of one step of the panel (`weights`),
 * added into the sums. `alone`, a constant where it is called: the pair is the last input
 * of an odd ins, beside a zero. */
static inline __attribute__((always_inline)) void add_pair(__m512 acc[BFLOAT16_TILE_ROWS][2],
                                                           const uint16_t *weights,
                                                           const uint16_t *x, int64_t x_stride,
                                                           int64_t i, int rows, int alone) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(weights);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(weights + PANEL);
    for (int r = 0; r < rows; r++) {
        uint32_t pair = x[r * x_stride + 2 * i];
        if (!alone) memcpy(&pair, x + r * x_stride + 2 * i, sizeof pair);
        const __m512bh input = (__m512bh)_mm512_set1_epi32((int)pair);
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], w0, input);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], w1, input);
    }
}

/* One row's float32 sums (PANEL of them) into its columns of y: each rounded once after the
 * bias is added, then the old y added (accumulate) and rounded again. */
static inline void bfloat16_row_outputs(const float *sums, const uint16_t *bias, int64_t columns,
                                        uint16_t *row, int accumulate) {
    for (int64_t c = 0; c < columns; c++) {
        const float sum = sums[c] + (bias != NULL ? bf16_to_float(bias[c]) : 0.f);
        const uint16_t out = float_to_bf16(sum);
        row[c] = accumulate ? float_to_bf16(bf16_to_float(row[c]) + bf16_to_float(out)) : out;
    }
}

/* A row tile's float32 sums (`rows` rows of PANEL) into its columns of y. */
static inline __attribute__((always_inline)) void bfloat16_outputs(
    const __m512 (*acc)[2], int rows, const uint16_t *bias, int64_t columns, uint16_t *y,
    int64_t outs, int accumulate) {
    for (int r = 0; r < rows; r++) {
        float sums[PANEL];
        _mm512_storeu_ps(sums, acc[r][0]);
        _mm512_storeu_ps(sums + LANES, acc[r][1]);
        bfloat16_row_outputs(sums, bias, columns, y + r * outs, accumulate);
    }
}

/* bfloat16_panel_rows' row_tile: `rows` a constant where it is called. */
static inline __attribute__((always_inline)) void bfloat16_row_tile(
    const uint16_t *x, int64_t x_stride, int64_t ins, const uint16_t *panel,
    const uint16_t *bias, int64_t columns, uint16_t *y, int64_t outs, int accumulate, int rows,
    const char *ahead, int64_t lines) {
    __m512 acc[BFLOAT16_TILE_ROWS][2];
    for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const int64_t whole = ins / 2;
    int64_t asked = 0; /* of the `lines` cache lines from `ahead`, asked for evenly over i */
    for (int64_t i = 0; i < whole; i++) {
        for (; asked * whole < (i + 1) * lines; asked++)
            __builtin_prefetch(ahead + asked * CACHE_LINE, 0, 2); /* into L2 */
        add_pair(acc, panel + i * 2 * PANEL, x, x_stride, i, rows, 0);
    }
    if (ins % 2) add_pair(acc, panel + whole * 2 * PANEL, x, x_stride, whole, rows, 1);
    bfloat16_outputs((const __m512(*)[2])acc, rows, bias, columns, y, outs, accumulate);
}

#define BFLOAT16_ROW_TILE(n)                                                                 \
    case n:                                                                                  \
        bfloat16_row_tile(x, x_stride, ins, panel, bias, columns, y, outs, accumulate, n,    \
                          ahead, lines);                                                     \
        break;

/* Bytes of one bfloat16 panel. */
static int64_t bfloat16_panel_bytes(int64_t ins) {
    return panel_linear_bfloat16_depth(ins) * PANEL * (int64_t)sizeof(uint16_t);
}

/* panel_rows for bfloat16 operands, in tiles of BFLOAT16_TILE_ROWS rows that share out the
 * cache lines of `next` as panel_rows' tiles do. */
static void bfloat16_panel_rows(const void *x_rows, int64_t rows, int64_t x_stride, int64_t ins,
                                const void *panel_weights, const void *bias_of_panel,
                                int64_t columns, void *y_rows, int64_t outs, int accumulate,
                                const void *next) {
    const uint16_t *x = x_rows, *panel = panel_weights, *bias = bias_of_panel;
    uint16_t *y = y_rows;
    const int64_t panel_lines = next_lines(next, bfloat16_panel_bytes(ins));
    const int64_t tiles = (rows + BFLOAT16_TILE_ROWS - 1) / BFLOAT16_TILE_ROWS;
    const int64_t share = (panel_lines + tiles - 1) / tiles;
    for (int64_t r0 = 0, asked = 0, tile = 0; r0 < rows; r0 += tile, x += tile * x_stride,
                 y += tile * outs, asked += share) {
        tile = rows - r0 < BFLOAT16_TILE_ROWS ? rows - r0 : BFLOAT16_TILE_ROWS;
        int64_t lines;
        const char *ahead = tile_ahead(next, panel_lines, asked, share, &lines);
        switch (tile) {
            BFLOAT16_ROW_TILE(1)
            BFLOAT16_ROW_TILE(2)
            BFLOAT16_ROW_TILE(3)
            BFLOAT16_ROW_TILE(4)
            BFLOAT16_ROW_TILE(5)
            BFLOAT16_ROW_TILE(6)
            BFLOAT16_ROW_TILE(7)
        default:
            bfloat16_row_tile(x, x_stride, ins, panel, bias, columns, y, outs, accumulate,
                              BFLOAT16_TILE_ROWS, ahead, lines);
        }
    }
}

#if defined(BFLOAT16_FMA)
/* The build for Intel CPUs (linear_kernel.panel_library): the same sums on float32 FMAs. x is
 * widened to float32 once a call, each panel step's weight pairs in registers (a pair's high
 * half is its odd input, its low half shifted up its even one), and each sum takes the odd
 * input's product, then the even one's, which is the order in which vdpbf16ps adds them (the
 * tests check both builds against oneDNN; on the Intel Xeon below their outputs were the same
 * bits). On 2 cores of an Intel Xeon (family 6 model 207, AVX-512 BF16 without AMX),
 * SmolLM2-135M in bfloat16, whole steps alternated in one process with float32's, min of 9,
 * two runs, against vdpbf16ps: a 512-token prefill 0.66-0.67x the time (447-453 ms; float32
 * 445-458), a 128-token one 0.66-0.76x, decode steps of 8 rows 0.92-0.93x, 32 rows
 * 0.77-0.84x (46.0-56.6 ms; float32 54.5-67.0), 64 rows 0.67-0.81x: there vdpbf16ps did no
 * more products a cycle than two FMAs.
 * 12-row tiles: 24 sums, four widened weight vectors and two broadcasts in 32 registers. */
#define FMA_TILE_ROWS 12

/* fma_panel_rows' row tile over x's widened rows (x_stride floats apart, ins rounded up to
 * pairs, the pad zero): `rows` a constant where it is called. */
static inline __attribute__((always_inline)) void fma_row_tile(
    const float *x, int64_t x_stride, int64_t pairs, const uint16_t *panel, const uint16_t *bias,
    int64_t columns, uint16_t *y, int64_t outs, int accumulate, int rows, const char *ahead,
    int64_t lines) {
    __m512 acc[FMA_TILE_ROWS][2];
    for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);
    int64_t asked = 0; /* of the `lines` cache lines from `ahead`, asked for evenly over i */
    for (int64_t i = 0; i < pairs; i++) {
        for (; asked * pairs < (i + 1) * lines; asked++)
            __builtin_prefetch(ahead + asked * CACHE_LINE, 0, 2); /* into L2 */
        __m512 odd[2], even[2];
        for (int half = 0; half < 2; half++) {
            const __m512i w = _mm512_loadu_si512(panel + (i * 2 + half) * PANEL);
            odd[half] = _mm512_castsi512_ps(_mm512_and_si512(w, high));
            even[half] = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
        }
        for (int r = 0; r < rows; r++) {
            const __m512 x_odd = _mm512_set1_ps(x[r * x_stride + 2 * i + 1]);
            const __m512 x_even = _mm512_set1_ps(x[r * x_stride + 2 * i]);
            for (int half = 0; half < 2; half++) {
                acc[r][half] = _mm512_fmadd_ps(x_odd, odd[half], acc[r][half]);
                acc[r][half] = _mm512_fmadd_ps(x_even, even[half], acc[r][half]);
            }
        }
    }
    bfloat16_outputs((const __m512(*)[2])acc, rows, bias, columns, y, outs, accumulate);
}

#define FMA_ROW_TILE(n)                                                                      \
    case n:                                                                                  \
        fma_row_tile(x, x_stride, pairs, panel, bias, columns, y, outs, accumulate, n, ahead, \
                     lines);                                                                 \
        break;

/* bfloat16_panel_rows on x's rows widened to float32 (x_stride floats apart). */
static void fma_panel_rows(const void *x_rows, int64_t rows, int64_t x_stride, int64_t ins,
                           const void *panel_weights, const void *bias_of_panel, int64_t columns,
                           void *y_rows, int64_t outs, int accumulate, const void *next) {
    const float *x = x_rows;
    const uint16_t *panel = panel_weights, *bias = bias_of_panel;
    uint16_t *y = y_rows;
    const int64_t pairs = (ins + 1) / 2;
    const int64_t panel_lines = next_lines(next, bfloat16_panel_bytes(ins));
    const int64_t tiles = (rows + FMA_TILE_ROWS - 1) / FMA_TILE_ROWS;
    const int64_t share = (panel_lines + tiles - 1) / tiles;
    for (int64_t r0 = 0, asked = 0, tile = 0; r0 < rows; r0 += tile, x += tile * x_stride,
                 y += tile * outs, asked += share) {
        tile = rows - r0 < FMA_TILE_ROWS ? rows - r0 : FMA_TILE_ROWS;
        int64_t lines;
        const char *ahead = tile_ahead(next, panel_lines, asked, share, &lines);
        switch (tile) {
            FMA_ROW_TILE(1)
            FMA_ROW_TILE(2)
            FMA_ROW_TILE(3)
            FMA_ROW_TILE(4)
            FMA_ROW_TILE(5)
            FMA_ROW_TILE(6)
            FMA_ROW_TILE(7)
            FMA_ROW_TILE(8)
            FMA_ROW_TILE(9)
            FMA_ROW_TILE(10)
            FMA_ROW_TILE(11)
        default:
            fma_row_tile(x, x_stride, pairs, panel, bias, columns, y, outs, accumulate,
                         FMA_TILE_ROWS, ahead, lines);
        }
    }
}

/* x's rows as float32 rows `width` apart (ins rounded up to pairs, the pad zero). */
static void widen_rows(const uint16_t *x, int64_t rows, int64_t x_stride, int64_t ins,
                       int64_t width, float *widened) {
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *row = x + r * x_stride;
        float *out = widened + r * width;
        int64_t k = 0;
        for (; k + LANES <= ins; k += LANES) store(out + k, bfloat16_vector(row + k));
        for (; k < width; k++) out[k] = k < ins ? bf16_to_float(row[k]) : 0.f;
    }
}
#endif

#if AMX
/* The build for CPUs with AMX (linear_kernel.panel_library): the products on AMX tiles. A
 * panel's pairs are a B operand as they lie (16 pairs of 16 columns a tile, rows PANEL pairs
 * apart), x's rows the A operand (copied first into rows of whole tiles of pairs, and zero rows
 * after them), 32 rows by the panel's 32 columns in four float32 result
 * tiles; the sums then rounded as the other builds round them. The tiles add each tile's 16
 * pairs in their own order, so the bits may differ from vdpbf16ps's by float32 rounding.
 * SmolLM2-135M's whole bfloat16 steps on 2 cores of an Intel Xeon with AMX (family 6 model
 * 167), against the FMA build, two processes of each alternated, min of 11 (decode rows over
 * 300-token contexts): 8 rows 14.6-15.4 vs 18.3-18.5 ms, 16 rows 18.3-18.6 vs 24.5-24.6, 32
 * rows 26.8-27.2 vs 39.3-39.5, 64 rows 46.4-47.4 vs 61.0, prefills of 128 and 512 tokens a
 * tie (oneDNN, measured faster from 128 rows now and from 32 before, runs most of those). */

/* The tiles (all configured by amx_configure): 0-3 the sums of rows [0, 16) and [16, 32) of a
 * row pair by the panel's two column halves; 4-5 those rows' inputs; 6-7 the halves' weights. */

/* bfloat16_panel_rows on AMX tiles, over x's rows padded (x_stride elements apart, whole tiles
 * of pairs, zero rows after them): sharing out the cache lines of `next` as the others do. */
static void amx_panel_rows(const void *x_rows, int64_t rows, int64_t x_stride, int64_t ins,
                           const void *panel_weights, const void *bias_of_panel, int64_t columns,
                           void *y_rows, int64_t outs, int accumulate, const void *next) {
    const uint16_t *x = x_rows, *panel = panel_weights, *bias = bias_of_panel;
    uint16_t *y = y_rows;
    const int64_t steps = bfloat16_pairs(ins) / AMX_PAIRS, pair_row = 2 * PANEL;
    const int64_t x_bytes = x_stride * (int64_t)sizeof(uint16_t);
    const int64_t w_bytes = pair_row * (int64_t)sizeof(uint16_t);
    const int64_t panel_lines = next_lines(next, bfloat16_panel_bytes(ins));
    const int64_t tiles = (rows + 2 * AMX_ROWS - 1) / (2 * AMX_ROWS);
    const int64_t share = (panel_lines + tiles - 1) / tiles;
    float sums[2 * AMX_ROWS][PANEL];
    amx_configure();
    for (int64_t r0 = 0, asked = 0; r0 < rows; r0 += 2 * AMX_ROWS, asked += share) {
        const int two = rows - r0 > AMX_ROWS;
        int64_t lines, fetched = 0;
        const char *ahead = tile_ahead(next, panel_lines, asked, share, &lines);
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t step = 0; step < steps; step++) {
            for (; fetched * steps < (step + 1) * lines; fetched++)
                __builtin_prefetch(ahead + fetched * CACHE_LINE, 0, 2); /* into L2 */
            const uint16_t *w = panel + step * AMX_PAIRS * pair_row;
            const uint16_t *in = x + r0 * x_stride + step * 2 * AMX_PAIRS;
            _tile_loadd(6, w, w_bytes);
            _tile_loadd(7, w + PANEL, w_bytes); /* column PANEL / 2's pair onwards */
            _tile_loadd(4, in, x_bytes);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            if (two) {
                _tile_loadd(5, in + AMX_ROWS * x_stride, x_bytes);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
        }
        const int64_t sum_bytes = PANEL * (int64_t)sizeof(float);
        _tile_stored(0, sums[0], sum_bytes);
        _tile_stored(1, sums[0] + AMX_ROWS, sum_bytes);
        if (two) {
            _tile_stored(2, sums[AMX_ROWS], sum_bytes);
            _tile_stored(3, sums[AMX_ROWS] + AMX_ROWS, sum_bytes);
        }
        const int64_t real = rows - r0 < 2 * AMX_ROWS ? rows - r0 : 2 * AMX_ROWS;
        for (int64_t r = 0; r < real; r++)
            bfloat16_row_outputs(sums[r], bias, columns, y + (r0 + r) * outs, accumulate);
    }
    _tile_release();
}

/* x's rows copied `width` elements apart (whole tiles of pairs), then zero rows (padded_rows
 * in all). */
static void pad_rows(const uint16_t *x, int64_t rows, int64_t x_stride, int64_t ins,
                     int64_t width, int64_t padded_rows, uint16_t *padded) {
    for (int64_t r = 0; r < rows; r++) {
        memcpy(padded + r * width, x + r * x_stride, sizeof(uint16_t) * (size_t)ins);
        memset(padded + r * width + ins, 0, sizeof(uint16_t) * (size_t)(width - ins));
    }
    memset(padded + rows * width, 0, sizeof(uint16_t) * (size_t)((padded_rows - rows) * width));
}
#endif

/* Whether this build multiplies on AMX tiles: 1 where it does and Linux lets this process use
 * them, -1 where it was built for them but Linux refused, 0 where not built so. */
int panel_linear_bfloat16_tiles(void) {
#if AMX
    return amx_permitted() ? 1 : -1;
#else
    return 0;
#endif
}

/* y (=, or += with accumulate) x W^T + bias in bfloat16 on W's panels, streaming or not. In
 * the AMX_TILES build on AMX tiles, in the BFLOAT16_FMA build on float32 FMAs, where their
 * copies of x's rows can be allocated, else on vdpbf16ps: the same sums (BFLOAT16_FMA's
 * note; AMX's adds in their own order). */
static void bfloat16_product(const uint16_t *x, int64_t rows, int64_t x_stride, int64_t ins,
                             const uint16_t *panels, const uint16_t *bias, int64_t outs,
                             uint16_t *y, int accumulate, int threads, int streaming) {
    const int64_t element = (int64_t)sizeof(uint16_t), panel_bytes = bfloat16_panel_bytes(ins);
#if AMX
    const int64_t width = panel_linear_bfloat16_depth(ins);
    /* A tile's 16 rows start at a real row: at most 15 past the last (a row block's last tile
     * too, whatever row the block starts at). */
    const int64_t padded_rows = rows + AMX_ROWS - 1;
    uint16_t *padded = rows > 0 ? malloc(sizeof(uint16_t) * (size_t)(padded_rows * width)) : NULL;
    if (padded != NULL) {
        pad_rows(x, rows, x_stride, ins, width, padded_rows, padded);
        const Format format = {element, element, panel_bytes, amx_panel_rows};
        run_panels(padded, rows, width, ins, panels, bias, outs, y, accumulate, format, threads,
                   streaming);
        free(padded);
        return;
    }
#elif defined(BFLOAT16_FMA)
    const int64_t width = (ins + 1) / 2 * 2;
    float *widened = rows > 0 ? malloc(sizeof(float) * (size_t)(rows * width)) : NULL;
    if (widened != NULL) {
        widen_rows(x, rows, x_stride, ins, width, widened);
        const Format format = {(int64_t)sizeof(float), element, panel_bytes, fma_panel_rows};
        run_panels(widened, rows, width, ins, panels, bias, outs, y, accumulate, format,
                   threads, streaming);
        free(widened);
        return;
    }
#endif
    const Format format = {element, element, panel_bytes, bfloat16_panel_rows};
    run_panels(x, rows, x_stride, ins, panels, bias, outs, y, accumulate, format, threads,
               streaming);
}

/* y (=, or += with accumulate) x W^T + bias in bfloat16, W packed by
 * panel_linear_bfloat16_pack. */
void panel_linear_bfloat16(const uint16_t *x, int64_t rows, int64_t x_stride, int64_t ins,
                           const uint16_t *panels, const uint16_t *bias, int64_t outs,
                           uint16_t *y, int accumulate, int threads) {
    bfloat16_product(x, rows, x_stride, ins, panels, bias, outs, y, accumulate, threads, 0);
}

/* panel_linear_bfloat16, streaming as panel_linear_prefetching does. On 2 cores of an Intel
 * Xeon (family 6 model 207, AVX-512 BF16 without AMX), SmolLM2-135M in bfloat16 on
 * vdpbf16ps, whole steps alternated in one process, min of 9, streaming against not (two
 * runs, the second on a host running slow): decode steps of 8 rows 0.71-0.89x the time, 32
 * rows 0.87-0.94x, 64 rows 0.92-0.95x, a 128-token prefill 0.84-0.98x, a 512-token prefill
 * 0.98-1.02x (a tie). */
void panel_linear_bfloat16_prefetching(const uint16_t *x, int64_t rows, int64_t x_stride,
                                       int64_t ins, const uint16_t *panels,
                                       const uint16_t *bias, int64_t outs, uint16_t *y,
                                       int accumulate, int threads) {
    bfloat16_product(x, rows, x_stride, ins, panels, bias, outs, y, accumulate, threads, 1);
}
#else
int panel_linear_bfloat16_built(void) { return 0; }
#endif
