/* Every decoder layer of a step in one call (CPU, float32 or bfloat16): a decode step, or a
 * step with prefill chunks (after its decode rows, if any).
 *
 * A batch-1 decode step is ~30 layers of small work: five kernel calls a layer, and around
 * them Python builds views, checks shapes and reads each weight's address again. That glue
 * took about a quarter of the step (8.8 of 33.9 ms, SmolLM2-135M on 2 cores of an Intel Xeon)
 * and ran on one thread while the other waited. This file calls the same kernels in the same
 * order with the same arguments, so the step's numbers are bit for bit those of the layer-by-
 * layer path, without the glue: the other kernels' functions come in as pointers (each lives
 * in its own library), the per-layer weights as a table built once.
 *
 * Steps of more rows than the small-batch kernel takes run their projections as the layer-by-
 * layer path runs them there when it runs them on the panel kernel: the norm or SwiGLU into
 * scratch rows (projection_input), then panel_linear on the weights' packed panels. Without
 * the glue, 17-64-row steps took 0.89-0.93x the time (medians; Zen 4, 2 cores).
 *
 * Prefill chunks take their attention from paged_prefill_attention, one call a chunk, as the
 * layer-by-layer path calls it (the chunk's queries read in place from qkv); there the glue
 * was ~16 ms of a 128-token prefill step's ~177 ms (the main thread's Python, the other
 * thread waiting at the next parallel region meanwhile; perf, Zen 4, 2 cores).
 *
 * Per layer, hidden [rows, hidden] updated in place:
 *   qkv    = RMSNorm(hidden) Wqkv^T (+ bias)            small_batch_linear or panels
 *   Q, K rotated in qkv, K and V stored at their slots  rope_and_store
 *   attn   = attention of Q over each row's context     paged_decode_attention (decode
 *                                                       rows), paged_prefill_attention
 *                                                       (each chunk)
 *   hidden += attn Wo^T                                 small_batch_linear or panels, accumulate
 *   gu     = RMSNorm(hidden) Wgate_up^T                 small_batch_linear or panels
 *   hidden += SwiGLU(gu) Wdown^T                        small_batch_linear or panels, accumulate
 *
 * Built with -DKV_BFLOAT16 (kernel_build.KV_BUILDS), it runs a bfloat16 model's layers: the
 * activations, weights and cache are bfloat16, the projections the bfloat16 builds'
 * (bfloat16_small_batch_linear, or bfloat16_projection_input then panel_linear_bfloat16), and
 * around the decode attention, which takes float32, the queries are widened and the output
 * rounded once, as the layer-by-layer path's q.float() and out.to(bfloat16) do (the prefill
 * attention reads and writes bfloat16 itself): the same numbers as that path, bit for bit, as
 * in float32.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kv_element.h"

/* A model's activations, weights and KV cache are of one dtype: float32, or bfloat16 in the
 * KV_BFLOAT16 build. The decode attention takes float32 queries and gives float32 outputs in
 * both; the prefill attention reads and writes this dtype. */
typedef kv_t element;

#if defined(KV_BFLOAT16)
/* bfloat16_small_batch_linear (no int8 weights: no scales). */
typedef int (*Linear)(const element *x, int64_t rows, int64_t x_stride,
                      const element *norm_weight, float eps, int gated, const void *w,
                      const element *bias, int64_t in, int64_t outs, element *y, int accumulate,
                      int threads);
#define SCALES_OF(projection)
#else
/* small_batch_linear: float32 or int8 weights (with their bfloat16 scales). */
typedef int (*Linear)(const element *x, int64_t rows, int64_t x_stride,
                      const element *norm_weight, float eps, int gated, const void *w,
                      const uint16_t *scales, const element *bias, int64_t in, int64_t outs,
                      element *y, int accumulate, int threads);
#define SCALES_OF(projection) (projection)->scales,
#endif
typedef void (*RopeStore)(element *qkv, int64_t tokens, int64_t row_stride, int64_t heads,
                          int64_t kv_heads, int64_t head_dim, const float *rotations,
                          const int64_t *slots, element *key_slots, element *value_slots,
                          int threads);
typedef int (*Attention)(const float *q, const element *key_cache, const element *value_cache,
                         const int64_t *block_tables, const int64_t *context_lens, float *out,
                         int64_t rows, int64_t heads, int64_t kv_heads, int64_t head_dim,
                         int64_t block_size, int64_t max_blocks, int64_t window, float scale,
                         int threads);
typedef int (*PrefillAttention)(const element *q, int64_t q_row_stride,
                                const element *key_cache, const element *value_cache,
                                const int64_t *block_table, element *out, int64_t chunk,
                                int64_t prefix_len, int64_t heads, int64_t kv_heads,
                                int64_t head_dim, int64_t block_size, int64_t window,
                                float scale, int threads);
typedef int (*ProjectionInput)(const element *x, int64_t rows, int64_t x_stride,
                               const element *norm_weight, float eps, int gated, int64_t in,
                               element *out, int threads);
typedef void (*PanelLinear)(const element *x, int64_t rows, int64_t x_stride, int64_t ins,
                            const element *panels, const element *bias, int64_t outs,
                            element *y, int accumulate, int threads);

/* One projection as the small-batch kernel takes it (scales: int8 weights' bfloat16 scales,
 * float32 build only), and its weights packed for the panel kernel (NULL where steps of more
 * rows do not run on it). */
typedef struct {
    const void *weight;
    const uint16_t *scales;
    const element *bias;
    const element *panels;
} Projection;

typedef struct {
    const element *input_norm, *post_attention_norm;
    Projection qkv, o, gate_up, down;
    element *key_cache, *value_cache; /* this layer's [blocks, block_size, kv_heads, head_dim] */
} Layer;

/* A prefill chunk: rows [row_start, row_start + rows) of the step, its sequence's
 * prefix_len tokens before it in the cache, its block table covering the whole context;
 * want_logits: whether its last row's output is wanted (the chunk reaches its prompt's end). */
typedef struct {
    int64_t row_start, rows, prefix_len;
    const int64_t *block_table;
    int64_t want_logits;
} Chunk;

typedef struct {
    Linear linear;
    RopeStore rope_store;
    Attention attention;
    PrefillAttention prefill_attention; /* NULL when no step with chunks comes here */
    /* Steps of more than small_rows rows: projection_input then panel_linear (NULL when the
     * model's steps never have more). */
    ProjectionInput projection_input;
    PanelLinear panel_linear;
    int64_t small_rows;
    int64_t hidden, heads, kv_heads, head_dim, intermediate, block_size, window;
    float eps, scale;
    int threads;
} Model;

/* y (=, or += with accumulate) f(x) W^T + bias, as the layer-by-layer path computes it for
 * `rows` rows: f the norm (norm_weight), the SwiGLU (gated) or nothing; x [rows, in], or
 * [rows, 2 in] gated. scratch holds rows x in elements for f(x) on the panel path. */
static int project(const Model *model, const element *x, int64_t rows, int64_t x_stride,
                   const element *norm_weight, int gated, const Projection *projection,
                   int64_t in, int64_t outs, element *y, int accumulate, element *scratch) {
    if (rows <= model->small_rows)
        return model->linear(x, rows, x_stride, norm_weight, model->eps, gated,
                             projection->weight, SCALES_OF(projection) projection->bias, in,
                             outs, y, accumulate, model->threads);
    if (norm_weight != NULL || gated) {
        const int status = model->projection_input(x, rows, x_stride, norm_weight, model->eps,
                                                   gated, in, scratch, model->threads);
        if (status != 0) return status;
        x = scratch;
        x_stride = in;
    }
    model->panel_linear(x, rows, x_stride, in, projection->panels, projection->bias, outs, y,
                        accumulate, model->threads);
    return 0;
}

/* The first `count` rows of qkv's queries (its first q_width elements a row) as float32 rows
 * of q, q_width apart, as the decode attention reads them: copied, or widened from bfloat16. */
static void widen_queries(const element *qkv, int64_t qkv_width, int64_t q_width, int64_t count,
                          float *q) {
    for (int64_t r = 0; r < count; r++)
        for (int64_t k = 0; k < q_width; k++)
            q[r * q_width + k] = kv_value(qkv[r * qkv_width + k]);
}

/* The attention of a chunk's `count` queries from row `first` of the step (the whole chunk,
 * or its last row alone) into rows [out_row, out_row + count) of out, its queries read in
 * place in qkv. Each sees the chunk's K/V before it, already in the cache. */
static int attend_chunk(const Model *model, const Layer *layer, const Chunk *chunk,
                        int64_t first, int64_t count, const element *qkv, int64_t qkv_width,
                        int64_t q_width, element *out, int64_t out_row) {
    return model->prefill_attention(qkv + first * qkv_width, qkv_width, layer->key_cache,
                                    layer->value_cache, chunk->block_table,
                                    out + out_row * q_width, count,
                                    chunk->prefix_len + first - chunk->row_start, model->heads,
                                    model->kv_heads, model->head_dim, model->block_size,
                                    model->window, model->scale, model->threads);
}

/* The decode rows' float32 attention output rounded into the o projection's input (the same
 * buffer in the float32 build). */
static void round_decode_rows(const float *attn_out, int64_t decode_rows, int64_t q_width,
                              element *attn) {
    if (!KV_ELEMENT_IS_FLOAT)
        for (int64_t k = 0; k < decode_rows * q_width; k++) attn[k] = kv_rounded(attn_out[k]);
}

/* The last layer past its K/V computes only the rows whose output is read: the decode rows
 * and the last row of each chunk that wants logits, moved to the front of hidden in that
 * order (the runner's LastLayerRows). Attends those rows into out; returns how many rows
 * there are, or -1 with *status set when an attention kernel failed. */
static int64_t attend_kept_rows(const Model *model, const Layer *layer, const Chunk *chunks,
                                int64_t num_chunks, int64_t decode_rows, element *hidden,
                                const element *qkv, int64_t qkv_width, int64_t q_width,
                                element *out, int *status) {
    int64_t kept = decode_rows;
    for (int64_t c = 0; c < num_chunks; c++) {
        const Chunk *chunk = chunks + c;
        if (!chunk->want_logits) continue;
        const int64_t last = chunk->row_start + chunk->rows - 1;
        *status = attend_chunk(model, layer, chunk, last, 1, qkv, qkv_width, q_width, out, kept);
        if (*status != 0) return -1;
        /* kept <= last: rows move only forward, each before its place is written. */
        memmove(hidden + kept * model->hidden, hidden + last * model->hidden,
                sizeof(element) * model->hidden);
        kept++;
    }
    return kept;
}

/* The first decode_rows rows are decode rows (block_tables [decode_rows, max_blocks] and
 * context_lens theirs; unread when there are none), the chunks the rest. With chunks, hidden
 * ends holding the kept rows' output at its front (attend_kept_rows), else every row's.
 * Returns 0, -1 when scratch memory could not be allocated, or a kernel's own failure. */
int decode_layers(const Model *model, const Layer *layers, int64_t num_layers, element *hidden,
                  int64_t rows, const float *rotations, const int64_t *slots,
                  int64_t decode_rows, const int64_t *block_tables, const int64_t *context_lens,
                  int64_t max_blocks, const Chunk *chunks, int64_t num_chunks) {
    const int64_t q_width = model->heads * model->head_dim;
    const int64_t qkv_width = q_width + 2 * model->kv_heads * model->head_dim;
    const int64_t gate_up_width = 2 * model->intermediate;
    const int threads = model->threads;
    const int64_t widest = model->intermediate > model->hidden ? model->intermediate
                                                                : model->hidden;
    const int panels = rows > model->small_rows;
    element *qkv = malloc(sizeof(element) * rows * qkv_width);
    /* The decode kernel reads its rows' queries contiguous, in float32; the chunks read
     * theirs in qkv. */
    const int64_t decode_slots = decode_rows > 0 ? decode_rows : 1;
    float *q = malloc(sizeof(float) * decode_slots * q_width);
    /* The o projection's input, where the chunks' attention writes; the decode rows'
     * float32 output goes to attn_out first in the bfloat16 build (round_decode_rows). */
    element *attn = malloc(sizeof(element) * rows * q_width);
    float *attn_out = KV_ELEMENT_IS_FLOAT ? (float *)attn
                                          : malloc(sizeof(float) * decode_slots * q_width);
    element *gate_up = malloc(sizeof(element) * rows * gate_up_width);
    /* f(x) of the panel path's projections: the normed hidden rows or the SwiGLU's. */
    element *scratch = panels ? malloc(sizeof(element) * rows * widest) : NULL;
    int status = qkv && q && attn_out && attn && gate_up && (scratch || !panels) ? 0 : -1;
    int64_t out_rows = rows; /* fewer in the last layer of a step with chunks */
    for (int64_t l = 0; l < num_layers && status == 0; l++) {
        const Layer *layer = layers + l;
        status = project(model, hidden, rows, model->hidden, layer->input_norm, 0, &layer->qkv,
                         model->hidden, qkv_width, qkv, 0, scratch);
        if (status != 0) break;
        model->rope_store(qkv, rows, qkv_width, model->heads, model->kv_heads, model->head_dim,
                          rotations, slots, layer->key_cache, layer->value_cache, threads);
        if (decode_rows > 0) {
            widen_queries(qkv, qkv_width, q_width, decode_rows, q);
            status = model->attention(q, layer->key_cache, layer->value_cache, block_tables,
                                      context_lens, attn_out, decode_rows, model->heads,
                                      model->kv_heads, model->head_dim, model->block_size,
                                      max_blocks, model->window, model->scale, threads);
        }
        if (status != 0) break;
        if (l == num_layers - 1 && num_chunks > 0) {
            out_rows = attend_kept_rows(model, layer, chunks, num_chunks, decode_rows, hidden,
                                        qkv, qkv_width, q_width, attn, &status);
            if (status != 0 || out_rows == 0) break; /* no row's output is read */
        } else {
            for (int64_t c = 0; c < num_chunks && status == 0; c++)
                status = attend_chunk(model, layer, chunks + c, chunks[c].row_start,
                                      chunks[c].rows, qkv, qkv_width, q_width, attn,
                                      chunks[c].row_start);
            if (status != 0) break;
        }
        round_decode_rows(attn_out, decode_rows, q_width, attn);
        status = project(model, attn, out_rows, q_width, NULL, 0, &layer->o, q_width,
                         model->hidden, hidden, 1, scratch);
        if (status != 0) break;
        status = project(model, hidden, out_rows, model->hidden, layer->post_attention_norm, 0,
                         &layer->gate_up, model->hidden, gate_up_width, gate_up, 0, scratch);
        if (status != 0) break;
        status = project(model, gate_up, out_rows, gate_up_width, NULL, 1, &layer->down,
                         model->intermediate, model->hidden, hidden, 1, scratch);
    }
    free(qkv);
    free(q);
    if ((void *)attn_out != (void *)attn) free(attn_out);
    free(attn);
    free(gate_up);
    free(scratch);
    return status;
}
