/* One layer's rotary embedding and KV-cache write in one pass (CPU, float32 or bfloat16).
 *
 * The fused Q/K/V projection output of a step's tokens is rotated in place (Q and K heads,
 * rotary pairs adjacent: (x0, x1) -> (x0 c - x1 s, x0 s + x1 c)) and each token's rotated K
 * and its V go straight into its cache slot. In torch this is six small ops for the rotation
 * (a complex product through views and a copy) and two index_copy_ calls, each a dispatch and
 * a pass over memory; a decode step does them 30 times (once per layer).
 *
 * Built with -DKV_BFLOAT16 (kernel_build.build's defines), Q/K/V and the caches hold bfloat16 (a
 * bfloat16 model's): each pair is widened to float32, rotated in float32 and rounded once back
 * to bfloat16, as torch's path (models/llama.apply_rope) computes it. Both builds may fuse a
 * product and the sum into one multiply-add where torch rounds the product first: float32
 * results within a float32 step of torch's, bfloat16 ones within a bfloat16 step.
 *
 * Layouts:
 *   qkv          [tokens, heads + 2 * kv_heads, head_dim], rows `row_stride` elements apart
 *   rotations    [tokens, head_dim / 2, 2]: (cos, sin) of each token's position, each pair
 *                (float32 in both builds)
 *   slots        [tokens] int64: block * block_size + offset of each token's K/V
 *   key_slots,
 *   value_slots  [num_blocks * block_size, kv_heads, head_dim] (one layer), contiguous
 */
#include <stdint.h>
#include <string.h>

#include "kv_element.h"

/* Tokens below which one thread does it all: the rotation is a few hundred multiply-adds per
 * token, less than a thread team's start-up. */
#define TOKENS_PER_THREAD 64

static void rotate_heads(kv_t *restrict row, const float *restrict rotation, int64_t heads,
                         int64_t head_dim) {
    for (int64_t h = 0; h < heads; h++) {
        kv_t *x = row + h * head_dim;
#pragma omp simd
        for (int64_t p = 0; p < head_dim / 2; p++) {
            const float c = rotation[2 * p], s = rotation[2 * p + 1];
            const float x0 = kv_value(x[2 * p]), x1 = kv_value(x[2 * p + 1]);
            x[2 * p] = kv_rounded(x0 * c - x1 * s);
            x[2 * p + 1] = kv_rounded(x0 * s + x1 * c);
        }
    }
}

void rope_and_store(kv_t *qkv, int64_t tokens, int64_t row_stride, int64_t heads,
                    int64_t kv_heads, int64_t head_dim, const float *rotations,
                    const int64_t *slots, kv_t *key_slots, kv_t *value_slots,
                    int threads) {
    const int64_t kv_size = kv_heads * head_dim;
    const int team = tokens < TOKENS_PER_THREAD * threads
                         ? (int)(tokens / TOKENS_PER_THREAD > 0 ? tokens / TOKENS_PER_THREAD : 1)
                         : threads;
#pragma omp parallel for schedule(static) num_threads(team) if (team > 1)
    for (int64_t t = 0; t < tokens; t++) {
        kv_t *row = qkv + t * row_stride;
        rotate_heads(row, rotations + t * head_dim, heads + kv_heads, head_dim);
        memcpy(key_slots + slots[t] * kv_size, row + heads * head_dim, sizeof(kv_t) * kv_size);
        memcpy(value_slots + slots[t] * kv_size, row + (heads + kv_heads) * head_dim,
               sizeof(kv_t) * kv_size);
    }
}
