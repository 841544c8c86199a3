/* y = f(x) W^T for a few rows of x (CPU, float32 activations; float32 weights, or int8 weights
 * with a scale per output row): the projections of a small decode step.
 *
 * With one to a few rows, every weight is used for that many multiply-adds after being read
 * from memory, so the product runs exactly as fast as the weights stream in. The weight rows
 * are split into contiguous slabs, one per OpenMP thread, and each slab is read once: for up
 * to three rows one weight row after another, each multiplied into every x row while it is in
 * L1; for more, four weight rows at a time, whose vectors are multiplied into every x row (two
 * at a time, eight accumulators) while the four rows are still in L1, the next four already
 * being read.
 *
 * At batch 1 the small element-wise work around each projection costs as much as a quarter
 * of the step in torch (each op is a dispatch), so it is folded in here:
 *   norm_weight != NULL  f(x) = RMSNorm(x) = x / sqrt(mean(x^2) + eps) * norm_weight
 *   gated                x is [gate | up] (2 * in wide) and f(x) = silu(gate) * up (SwiGLU)
 *   bias != NULL         y = f(x) W^T + bias (Qwen2's Q/K/V), added as each output is stored
 *   accumulate           y += f(x) W^T (the residual add) instead of y = f(x) W^T
 *
 * Layouts:
 *   x    [rows, in] (or [rows, 2 * in] gated), row stride x_stride, unit column stride
 *   w    [outs, in] contiguous: an nn.Linear weight (float32), or an Int8Linear's int8 weight
 *        with its bfloat16 scales [outs] (y = f(x) . q_n * scale_n)
 *   y    [rows, outs] contiguous
 * Vectors are GCC vector extensions: AVX-512 or AVX2 + FMA code with -march=native on x86 (FMA
 * by the default -ffp-contract=fast), NEON on ARM.
 */
#include <math.h>
#include <stdint.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <stdlib.h>
#include <string.h>

#include "bfloat16.h"
#include "exp_approx.h"
#include "in_register.h"
#include "prefetch_slice.h"

/* A vector: 16 floats with AVX-512 (whose FMAs take twice the floats of AVX2's on every CPU
 * that runs them at full width), else 8. */
#if defined(__AVX512F__)
#define LANES 16
#else
#define LANES 8
#endif
typedef float vec __attribute__((vector_size(LANES * sizeof(float))));

typedef int8_t vecq __attribute__((vector_size(LANES)));

#define ALWAYS_INLINE static inline __attribute__((always_inline))

ALWAYS_INLINE vec loadv(const float *p) {
    vec v;
    memcpy(&v, p, sizeof v); /* unaligned load */
    return v;
}

/* Weights are float32, or int8 (quantized != 0) scaled per output row after the dot product.
 * `quantized` is always a literal at the call sites, so each kind gets its own code. */
ALWAYS_INLINE vec weightsv(const void *w, int64_t index, int quantized) {
    if (!quantized) return loadv((const float *)w + index);
    /* GCC turns the generic conversion (the last branch) into one conversion per lane. */
#if defined(__AVX512F__)
    const __m128i q = _mm_loadu_si128((const __m128i *)((const int8_t *)w + index));
    return (vec)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q));
#elif defined(__AVX2__)
    const __m128i q = _mm_loadl_epi64((const __m128i *)((const int8_t *)w + index));
    return (vec)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
#else
    vecq q;
    memcpy(&q, (const int8_t *)w + index, sizeof q);
    return __builtin_convertvector(q, vec);
#endif
}

ALWAYS_INLINE float weight1(const void *w, int64_t index, int quantized) {
    return quantized ? (float)((const int8_t *)w)[index] : ((const float *)w)[index];
}

static inline float sumv(vec v) {
    float s = 0.f;
    for (int i = 0; i < LANES; i++) s += v[i];
    return s;
}

enum { WEIGHT_ROWS = 4 };

/* x rows xa and xb against weight rows 0..3 of w (row stride in): dots[r] and dots[4 + r]. */
ALWAYS_INLINE void two_rows(const float *restrict xa, const float *restrict xb, const void *w,
                            int64_t in, int quantized, float dots[8]) {
    const int64_t body = in & ~(int64_t)(LANES - 1);
    vec a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0};
    for (int64_t k = 0; k < body; k += LANES) {
        vec va = loadv(xa + k), vb = loadv(xb + k);
        IN_REGISTER(va);
        IN_REGISTER(vb);
        vec u0 = weightsv(w, k, quantized), u1 = weightsv(w, in + k, quantized);
        vec u2 = weightsv(w, 2 * in + k, quantized), u3 = weightsv(w, 3 * in + k, quantized);
        IN_REGISTER(u0);
        IN_REGISTER(u1);
        IN_REGISTER(u2);
        IN_REGISTER(u3);
        a0 += u0 * va, a1 += u1 * va, a2 += u2 * va, a3 += u3 * va;
        b0 += u0 * vb, b1 += u1 * vb, b2 += u2 * vb, b3 += u3 * vb;
    }
    const vec sums[8] = {a0, a1, a2, a3, b0, b1, b2, b3};
    for (int r = 0; r < 8; r++) {
        const float *x = r < 4 ? xa : xb;
        const int64_t row = (r % 4) * in;
        float dot = sumv(sums[r]);
        for (int64_t k = body; k < in; k++) dot += weight1(w, row + k, quantized) * x[k];
        dots[r] = dot;
    }
}

/* One x row against weight rows 0..3 of w: dots[r]. */
ALWAYS_INLINE void one_row(const float *restrict x, const void *w, int64_t in, int quantized,
                           float dots[4]) {
    const int64_t body = in & ~(int64_t)(LANES - 1);
    vec a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    for (int64_t k = 0; k < body; k += LANES) {
        const vec v = loadv(x + k);
        a0 += weightsv(w, k, quantized) * v, a1 += weightsv(w, in + k, quantized) * v;
        a2 += weightsv(w, 2 * in + k, quantized) * v, a3 += weightsv(w, 3 * in + k, quantized) * v;
    }
    const vec sums[4] = {a0, a1, a2, a3};
    for (int r = 0; r < 4; r++) {
        float dot = sumv(sums[r]);
        for (int64_t k = body; k < in; k++) dot += weight1(w, r * in + k, quantized) * x[k];
        dots[r] = dot;
    }
}

/* y[m, n] (+)= dot * scale of output n (+ bias of output n), for the outputs [n, n + count)
 * of row m. */
static inline void store(float *y, const float *dots, const uint16_t *scales, const float *bias,
                         int64_t count, int accumulate) {
    for (int64_t c = 0; c < count; c++) {
        const float value = scales == NULL ? dots[c] : dots[c] * bf16_to_float(scales[c]);
        y[c] = value + (bias == NULL ? 0.f : bias[c]) + (accumulate ? y[c] : 0.f);
    }
}

/* Outputs [n, n + 4) of every row, w, scales and bias pointing at output n: the four weight
 * rows are read from memory once. `next` is the group of four weight rows computed after them
 * (NULL if none): a slice of it is asked for at each pair of x rows (prefetch_slice), so it
 * comes in from memory while this group is computed on (with the hardware prefetcher alone the
 * two took turns: on 2 cores of an AMD EPYC Zen 5, SmolLM2-135M's projections of 8 rows took
 * 17.4-17.7 instead of 30.3-33.5 ms a step, of 16 rows 24.3-26.0 instead of 41.9-43.1, with
 * the 16-float vectors of AVX-512; oneDNN 17.3-18.6 and 19.8-20.9). */
ALWAYS_INLINE void four_outputs(const float *x, int64_t rows, int64_t x_stride, const void *w,
                                const void *next, const uint16_t *scales, const float *bias,
                                int quantized, int64_t in, float *y, int64_t outs,
                                int accumulate) {
    const int64_t bytes = WEIGHT_ROWS * in * (quantized ? 1 : (int64_t)sizeof(float));
    const int64_t pairs = (rows + 1) / 2;
    float dots[8];
    for (int64_t m = 0; m < rows; m += 2) {
        if (next != NULL) prefetch_slice(next, bytes, m / 2, pairs, PREFETCH_INTO_L1);
        const int pair = m + 1 < rows;
        if (pair)
            two_rows(x + m * x_stride, x + (m + 1) * x_stride, w, in, quantized, dots);
        else
            one_row(x + m * x_stride, w, in, quantized, dots);
        for (int64_t r = 0; r <= pair; r++)
            store(y + (m + r) * outs, dots + 4 * r, scales, bias, WEIGHT_ROWS, accumulate);
    }
}

/* Output n of every row (the four-row path's last outs % 4 outputs). */
static void last_output(const float *x, int64_t rows, int64_t x_stride, const void *w,
                       const uint16_t *scales, const float *bias, int64_t in, float *y,
                       int64_t outs, int accumulate) {
    for (int64_t m = 0; m < rows; m++) {
        const float *xm = x + m * x_stride;
        float dot = 0.f;
        for (int64_t k = 0; k < in; k++) dot += weight1(w, k, scales != NULL) * xm[k];
        store(y + m * outs, &dot, scales, bias, 1, accumulate);
    }
}

/* Steps of fewer rows stream one weight row at a time (weight_row); from this many rows, four
 * weight rows at a time are multiplied into two x rows at a time (four_outputs), which loads
 * fewer vectors per multiply-add once the product is bound by arithmetic, not by memory
 * (measured on an AMD EPYC Zen 4, 1 thread: at 1 row the streamed rows read the weights 1.65x
 * faster, at 4 rows both take the same time, at 16 the four-row path 1.4x less). */
enum { STREAM_MAX_ROWS = 3, ROW_GROUP = 3 };

/* x rows [0, count) (row stride x_stride) against one weight row w: dots[m]. Two
 * accumulators per x row along k keep more than one multiply-add in flight at batch 1.
 * `count` is a literal at the call sites: each count gets its own unrolled code. */
ALWAYS_INLINE void weight_row(const float *x, int64_t x_stride, int count, const void *w,
                              int64_t in, int quantized, float dots[ROW_GROUP]) {
    const int64_t body = in & ~(int64_t)(2 * LANES - 1);
    vec lo[ROW_GROUP] = {{0}}, hi[ROW_GROUP] = {{0}};
    for (int64_t k = 0; k < body; k += 2 * LANES) {
        const vec u = weightsv(w, k, quantized), u2 = weightsv(w, k + LANES, quantized);
        for (int m = 0; m < count; m++) {
            lo[m] += u * loadv(x + m * x_stride + k);
            hi[m] += u2 * loadv(x + m * x_stride + k + LANES);
        }
    }
    for (int m = 0; m < count; m++) {
        float dot = sumv(lo[m] + hi[m]);
        for (int64_t k = body; k < in; k++) dot += weight1(w, k, quantized) * x[m * x_stride + k];
        dots[m] = dot;
    }
}

/* Output n (w pointing at its weight row, scale its int8 scale or 1, bias its bias or 0) of
 * every row. */
ALWAYS_INLINE void streamed_output(const float *x, int64_t rows, int64_t x_stride, const void *w,
                                   float scale, float bias, int quantized, int64_t in, float *y,
                                   int64_t outs, int accumulate) {
    float dots[ROW_GROUP];
    for (int64_t m = 0; m < rows; m += ROW_GROUP) {
        const int64_t count = rows - m < ROW_GROUP ? rows - m : ROW_GROUP;
        const float *xm = x + m * x_stride;
        switch (count) {
        case 1: weight_row(xm, x_stride, 1, w, in, quantized, dots); break;
        case 2: weight_row(xm, x_stride, 2, w, in, quantized, dots); break;
        default: weight_row(xm, x_stride, 3, w, in, quantized, dots); break;
        }
        for (int64_t r = 0; r < count; r++) {
            float *out = y + (m + r) * outs;
            *out = dots[r] * scale + bias + (accumulate ? *out : 0.f);
        }
    }
}

/* Each thread reads a contiguous slab of weight rows one row after another: a single
 * sequential stream, which the hardware prefetcher follows at the memory's read bandwidth
 * (four rows read interleaved reached ~0.6x of it on an AMD EPYC Zen 4). One loop per weight
 * kind, so that each is compiled for its kind. */
static void streamed_rows(const float *x, int64_t rows, int64_t x_stride, const void *w,
                          const uint16_t *scales, const float *bias, int64_t in, int64_t outs,
                          float *y, int accumulate, int num_threads) {
    if (scales == NULL) {
#pragma omp parallel for schedule(static) num_threads(num_threads)
        for (int64_t n = 0; n < outs; n++)
            streamed_output(x, rows, x_stride, (const float *)w + n * in, 1.f,
                            bias == NULL ? 0.f : bias[n], 0, in, y + n, outs, accumulate);
    } else {
#pragma omp parallel for schedule(static) num_threads(num_threads)
        for (int64_t n = 0; n < outs; n++)
            streamed_output(x, rows, x_stride, (const int8_t *)w + n * in,
                            bf16_to_float(scales[n]), bias == NULL ? 0.f : bias[n], 1, in, y + n,
                            outs, accumulate);
    }
}

static void four_row_groups(const float *x, int64_t rows, int64_t x_stride, const void *w,
                            const uint16_t *scales, const float *bias, int64_t in, int64_t outs,
                            float *y, int accumulate, int num_threads) {
    const int64_t groups = outs / WEIGHT_ROWS, group_size = WEIGHT_ROWS * in;
    const size_t weight_bytes = scales == NULL ? sizeof(float) : 1;
    const char *weights = w;
    /* One loop per weight kind, so that each is compiled for its kind. */
    if (scales == NULL) {
#pragma omp parallel for schedule(static) num_threads(num_threads)
        for (int64_t g = 0; g < groups; g++)
            four_outputs(x, rows, x_stride, (const float *)w + g * group_size,
                         g + 1 < groups ? (const float *)w + (g + 1) * group_size : NULL, NULL,
                         bias == NULL ? NULL : bias + g * WEIGHT_ROWS, 0, in, y + g * WEIGHT_ROWS,
                         outs, accumulate);
    } else {
#pragma omp parallel for schedule(static) num_threads(num_threads)
        for (int64_t g = 0; g < groups; g++)
            four_outputs(x, rows, x_stride, (const int8_t *)w + g * group_size,
                         g + 1 < groups ? (const int8_t *)w + (g + 1) * group_size : NULL,
                         scales + g * WEIGHT_ROWS, bias == NULL ? NULL : bias + g * WEIGHT_ROWS, 1,
                         in, y + g * WEIGHT_ROWS, outs, accumulate);
    }
    for (int64_t n = groups * WEIGHT_ROWS; n < outs; n++)
        last_output(x, rows, x_stride, weights + (size_t)(n * in) * weight_bytes,
                   scales == NULL ? NULL : scales + n, bias == NULL ? NULL : bias + n, in, y + n,
                   outs, accumulate);
}

static void rms_norm_row(const float *restrict x, const float *restrict weight, float eps,
                         int64_t in, float *restrict out) {
    float squares = 0.f;
#pragma omp simd reduction(+ : squares)
    for (int64_t k = 0; k < in; k++) squares += x[k] * x[k];
    const float scale = 1.f / sqrtf(squares / (float)in + eps);
#pragma omp simd
    for (int64_t k = 0; k < in; k++) out[k] = x[k] * scale * weight[k];
}

static void swiglu_row(const float *restrict gate_up, int64_t in, float *restrict out) {
    const float *up = gate_up + in;
#pragma omp simd
    for (int64_t k = 0; k < in; k++)
        out[k] = gate_up[k] / (1.f + exp_approx(-gate_up[k])) * up[k];
}

/* out = f(x) for `rows` rows (the norm, or the SwiGLU when gated), rows split over the
 * threads: one pass over x where torch's ops take six (RMSNorm) or two (SwiGLU). Used in
 * front of the larger steps' matmuls, which the kernel does not compute. out [rows, in]. */
void projection_input(const float *x, int64_t rows, int64_t x_stride, const float *norm_weight,
                      float eps, int gated, int64_t in, float *out, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t m = 0; m < rows; m++) {
        if (gated)
            swiglu_row(x + m * x_stride, in, out + m * in);
        else
            rms_norm_row(x + m * x_stride, norm_weight, eps, in, out + m * in);
    }
}

/* projection_input for a bfloat16 model's rows (PackedProject, linear_kernel.py): each row
 * widened to float32, f(x) computed as above, rounded once to bfloat16 into out [rows, in].
 * torch's bfloat16 RMSNorm converts to float32 and back around its passes, and its SwiGLU rounds
 * after each of its two: with this, SmolLM2-135M's 512-token prefill step took 148.8 instead of
 * 165.8 ms, a 32-row decode step 46.1 instead of 52.0, a batch-1 one 22.4 instead of 24.7 (2
 * cores of an Intel Xeon with AMX, min of 7, side by side). Returns 0, or -1 when a thread's
 * scratch rows cannot be allocated. */
int bfloat16_projection_input(const uint16_t *x, int64_t rows, int64_t x_stride,
                              const uint16_t *norm_weight, float eps, int gated, int64_t in,
                              uint16_t *out, int num_threads) {
    const int64_t width = gated ? 2 * in : in;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        /* The row widened, the norm's weight widened, and f(x) before rounding. Every thread
         * takes its share of the loop even without scratch (the loop ends at a barrier). */
        float *scratch = malloc(sizeof(float) * (size_t)(width + 2 * in));
        if (scratch != NULL && norm_weight != NULL)
            for (int64_t k = 0; k < in; k++) scratch[width + k] = bf16_to_float(norm_weight[k]);
#pragma omp for schedule(static)
        for (int64_t m = 0; m < rows; m++) {
            if (scratch == NULL) {
#pragma omp atomic write
                failed = 1;
                continue;
            }
            float *row = scratch, *weight = scratch + width, *result = weight + in;
            for (int64_t k = 0; k < width; k++) row[k] = bf16_to_float(x[m * x_stride + k]);
            if (gated)
                swiglu_row(row, in, result);
            else
                rms_norm_row(row, weight, eps, in, result);
            for (int64_t k = 0; k < in; k++) out[m * in + k] = float_to_bf16(result[k]);
        }
        free(scratch);
    }
    return failed ? -1 : 0;
}

/* The floats in the kernel's vectors as compiled for this CPU (8 with AVX2, 16 with AVX-512):
 * how many rows it beats the larger steps' matmul up to depends on it (linear_kernel.py). */
int small_batch_linear_lanes(void) { return LANES; }

/* Returns 0, or -1 when the scratch rows for f(x) cannot be allocated. w is float32, or int8
 * when scales (bfloat16, one per output) is not NULL; bias (float32, one per output) or NULL. */
int small_batch_linear(const float *x, int64_t rows, int64_t x_stride, const float *norm_weight,
                       float eps, int gated, const void *w, const uint16_t *scales,
                       const float *bias, int64_t in, int64_t outs, float *y, int accumulate,
                       int num_threads) {
    float *scratch = NULL;
    if (norm_weight != NULL || gated) {
        scratch = malloc((size_t)(rows * in) * sizeof(float));
        if (scratch == NULL) return -1;
        for (int64_t m = 0; m < rows; m++) {
            if (gated)
                swiglu_row(x + m * x_stride, in, scratch + m * in);
            else
                rms_norm_row(x + m * x_stride, norm_weight, eps, in, scratch + m * in);
        }
        x = scratch;
        x_stride = in;
    }
    if (rows <= STREAM_MAX_ROWS)
        streamed_rows(x, rows, x_stride, w, scales, bias, in, outs, y, accumulate, num_threads);
    else
        four_row_groups(x, rows, x_stride, w, scales, bias, in, outs, y, accumulate, num_threads);
    free(scratch);
    return 0;
}
