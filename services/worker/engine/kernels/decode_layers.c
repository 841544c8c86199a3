/* Every decoder layer of a step in one call (CPU, float32): a decode step, or a step with
 * prefill chunks (after its decode rows, if any).
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
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int (*Linear)(const float *x, int64_t rows, int64_t x_stride, const float *norm_weight,
                      float eps, int gated, const void *w, const uint16_t *scales,
                      const float *bias, int64_t in, int64_t outs, float *y, int accumulate,
                      int threads);
typedef void (*RopeStore)(float *qkv, int64_t tokens, int64_t row_stride, int64_t heads,
                          int64_t kv_heads, int64_t head_dim, const float *rotations,
                          const int64_t *slots, float *key_slots, float *value_slots,
                          int threads);
typedef int (*Attention)(const float *q, const float *key_cache, const float *value_cache,
                         const int64_t *block_tables, const int64_t *context_lens, float *out,
                         int64_t rows, int64_t heads, int64_t kv_heads, int64_t head_dim,
                         int64_t block_size, int64_t max_blocks, int64_t window, float scale,
                         int threads);
typedef int (*PrefillAttention)(const float *q, int64_t q_row_stride, const float *key_cache,
                                const float *value_cache, const int64_t *block_table,
                                float *out, int64_t chunk, int64_t prefix_len, int64_t heads,
                                int64_t kv_heads, int64_t head_dim, int64_t block_size,
                                int64_t window, float scale, int threads);
typedef void (*ProjectionInput)(const float *x, int64_t rows, int64_t x_stride,
                                const float *norm_weight, float eps, int gated, int64_t in,
                                float *out, int threads);
typedef void (*PanelLinear)(const float *x, int64_t rows, int64_t x_stride, int64_t ins,
                            const float *panels, const float *bias, int64_t outs, float *y,
                            int accumulate, int threads);

/* One projection as small_batch_linear takes it (scales: int8 weights' bfloat16 scales), and
 * its weights packed for panel_linear (NULL where steps of more rows do not run on it). */
typedef struct {
    const void *weight;
    const uint16_t *scales;
    const float *bias;
    const float *panels;
} Projection;

typedef struct {
    const float *input_norm, *post_attention_norm;
    Projection qkv, o, gate_up, down;
    float *key_cache, *value_cache; /* this layer's [blocks, block_size, kv_heads, head_dim] */
} Layer;

/* A prefill chunk: rows [row_start, row_start + rows) of the step, its sequence's
 * prefix_len tokens before it in the cache, its block table covering the whole context. */
typedef struct {
    int64_t row_start, rows, prefix_len;
    const int64_t *block_table;
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
 * [rows, 2 in] gated. scratch holds rows x in floats for f(x) on the panel path. */
static int project(const Model *model, const float *x, int64_t rows, int64_t x_stride,
                   const float *norm_weight, int gated, const Projection *projection, int64_t in,
                   int64_t outs, float *y, int accumulate, float *scratch) {
    if (rows <= model->small_rows)
        return model->linear(x, rows, x_stride, norm_weight, model->eps, gated,
                             projection->weight, projection->scales, projection->bias, in,
                             outs, y, accumulate, model->threads);
    if (norm_weight != NULL || gated) {
        model->projection_input(x, rows, x_stride, norm_weight, model->eps, gated, in, scratch,
                                model->threads);
        x = scratch;
        x_stride = in;
    }
    model->panel_linear(x, rows, x_stride, in, projection->panels, projection->bias, outs, y,
                        accumulate, model->threads);
    return 0;
}

/* The first decode_rows rows are decode rows (block_tables [decode_rows, max_blocks] and
 * context_lens theirs; unread when there are none), the chunks the rest.
 * Returns 0, -1 when scratch memory could not be allocated, or a kernel's own failure. */
int decode_layers(const Model *model, const Layer *layers, int64_t num_layers, float *hidden,
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
    float *qkv = malloc(sizeof(float) * rows * qkv_width);
    /* The decode kernel reads its rows' queries contiguous; chunks read theirs in qkv. */
    float *q = malloc(sizeof(float) * (decode_rows > 0 ? decode_rows : 1) * q_width);
    float *attn = malloc(sizeof(float) * rows * q_width);
    float *gate_up = malloc(sizeof(float) * rows * gate_up_width);
    /* f(x) of the panel path's projections: the normed hidden rows or the SwiGLU's. */
    float *scratch = panels ? malloc(sizeof(float) * rows * widest) : NULL;
    int status = qkv && q && attn && gate_up && (scratch || !panels) ? 0 : -1;
    for (int64_t l = 0; l < num_layers && status == 0; l++) {
        const Layer *layer = layers + l;
        status = project(model, hidden, rows, model->hidden, layer->input_norm, 0, &layer->qkv,
                         model->hidden, qkv_width, qkv, 0, scratch);
        if (status != 0) break;
        model->rope_store(qkv, rows, qkv_width, model->heads, model->kv_heads, model->head_dim,
                          rotations, slots, layer->key_cache, layer->value_cache, threads);
        if (decode_rows > 0) {
            for (int64_t r = 0; r < decode_rows; r++)
                memcpy(q + r * q_width, qkv + r * qkv_width, sizeof(float) * q_width);
            status = model->attention(q, layer->key_cache, layer->value_cache, block_tables,
                                      context_lens, attn, decode_rows, model->heads,
                                      model->kv_heads, model->head_dim, model->block_size,
                                      max_blocks, model->window, model->scale, threads);
        }
        for (int64_t c = 0; c < num_chunks && status == 0; c++) {
            const Chunk *chunk = chunks + c;
            status = model->prefill_attention(
                qkv + chunk->row_start * qkv_width, qkv_width, layer->key_cache,
                layer->value_cache, chunk->block_table, attn + chunk->row_start * q_width,
                chunk->rows, chunk->prefix_len, model->heads, model->kv_heads, model->head_dim,
                model->block_size, model->window, model->scale, threads);
        }
        if (status != 0) break;
        status = project(model, attn, rows, q_width, NULL, 0, &layer->o, q_width, model->hidden,
                         hidden, 1, scratch);
        if (status != 0) break;
        status = project(model, hidden, rows, model->hidden, layer->post_attention_norm, 0,
                         &layer->gate_up, model->hidden, gate_up_width, gate_up, 0, scratch);
        if (status != 0) break;
        status = project(model, gate_up, rows, gate_up_width, NULL, 1, &layer->down,
                         model->intermediate, model->hidden, hidden, 1, scratch);
    }
    free(qkv);
    free(q);
    free(attn);
    free(gate_up);
    free(scratch);
    return status;
}
