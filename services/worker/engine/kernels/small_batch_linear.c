/* y = f(x) W^T for a few rows of x (CPU, float32 activations; float32 weights, int8 weights
 * with a scale per output row, or bfloat16 weights): the projections of a small decode step.
 * A bfloat16 model's rows go through bfloat16_small_batch_linear, which widens them to float32
 * around the same product.
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
 *   w    [outs, in] contiguous: an nn.Linear weight (float32 or bfloat16), or an Int8Linear's
 *        int8 weight with its bfloat16 scales [outs] (y = f(x) . q_n * scale_n)
 *   y    [rows, outs] contiguous
 * Vectors are GCC vector extensions: AVX-512 or AVX2 + FMA code with -march=native on x86 (FMA
 * by the default -ffp-contract=fast), NEON on ARM.
 */
#include <math.h>
#include <omp.h>
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

#include "bfloat16_vector.h"

typedef int8_t vecq __attribute__((vector_size(LANES)));

#define ALWAYS_INLINE static inline __attribute__((always_inline))

ALWAYS_INLINE vec loadv(const float *p) {
    vec v;
    memcpy(&v, p, sizeof v); /* unaligned load */
    return v;
}

/* What the weights are: float32, int8 scaled per output row after the dot product, or
 * bfloat16 (widened to float32 as they are read: the weights stream at half float32's bytes).
 * The kind is a literal wherever the inlined functions below take it, so each kind gets its
 * own code. */
typedef enum { WEIGHTS_FLOAT32, WEIGHTS_INT8, WEIGHTS_BFLOAT16 } weight_kind;

ALWAYS_INLINE int64_t weight_bytes(weight_kind kind) {
    return kind == WEIGHTS_FLOAT32 ? (int64_t)sizeof(float)
           : kind == WEIGHTS_INT8  ? (int64_t)sizeof(int8_t)
                                   : (int64_t)sizeof(uint16_t);
}

ALWAYS_INLINE vec weightsv(const void *w, int64_t index, weight_kind kind) {
    if (kind == WEIGHTS_FLOAT32) return loadv((const float *)w + index);
    if (kind == WEIGHTS_BFLOAT16) return bfloat16_vector((const uint16_t *)w + index);
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

ALWAYS_INLINE float weight1(const void *w, int64_t index, weight_kind kind) {
    if (kind == WEIGHTS_FLOAT32) return ((const float *)w)[index];
    if (kind == WEIGHTS_BFLOAT16) return bf16_to_float(((const uint16_t *)w)[index]);
    return (float)((const int8_t *)w)[index];
}

static inline float sumv(vec v) {
    float s = 0.f;
    for (int i = 0; i < LANES; i++) s += v[i];
    return s;
}

enum { WEIGHT_ROWS = 4 };

/* x rows xa and xb against weight rows 0..3 of w (row stride in): dots[r] and dots[4 + r]. */
ALWAYS_INLINE void two_rows(const float *restrict xa, const float *restrict xb, const void *w,
                            int64_t in, weight_kind kind, float dots[8]) {
    const int64_t body = in & ~(int64_t)(LANES - 1);
    vec a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0};
    for (int64_t k = 0; k < body; k += LANES) {
        vec va = loadv(xa + k), vb = loadv(xb + k);
        IN_REGISTER(va);
        IN_REGISTER(vb);
        vec u0 = weightsv(w, k, kind), u1 = weightsv(w, in + k, kind);
        vec u2 = weightsv(w, 2 * in + k, kind), u3 = weightsv(w, 3 * in + k, kind);
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
        for (int64_t k = body; k < in; k++) dot += weight1(w, row + k, kind) * x[k];
        dots[r] = dot;
    }
}

/* One x row against weight rows 0..3 of w: dots[r]. */
ALWAYS_INLINE void one_row(const float *restrict x, const void *w, int64_t in, weight_kind kind,
                           float dots[4]) {
    const int64_t body = in & ~(int64_t)(LANES - 1);
    vec a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    for (int64_t k = 0; k < body; k += LANES) {
        const vec v = loadv(x + k);
        a0 += weightsv(w, k, kind) * v, a1 += weightsv(w, in + k, kind) * v;
        a2 += weightsv(w, 2 * in + k, kind) * v, a3 += weightsv(w, 3 * in + k, kind) * v;
    }
    const vec sums[4] = {a0, a1, a2, a3};
    for (int r = 0; r < 4; r++) {
        float dot = sumv(sums[r]);
        for (int64_t k = body; k < in; k++) dot += weight1(w, r * in + k, kind) * x[k];
        dots[r] = dot;
    }
}

/* One product's operands. With float32 or int8 weights, y and bias are float32; with bfloat16
 * weights (a bfloat16 model's) they are bfloat16. */
typedef struct {
    const float *x;
    const uint16_t *x16; /* the same rows as bfloat16 (row stride in), or NULL */
    int64_t rows, x_stride;
    const void *w;
    const uint16_t *scales; /* int8 weights' scales, else NULL */
    const void *bias;       /* NULL: none */
    int64_t in, outs;
    void *y; /* [rows, outs] */
    int accumulate;
} Product;

/* Row m's outputs [n, n + count) from their dots: y (+)= dot * scale (int8) + bias. A bfloat16
 * model's outputs as oneDNN's product and torch's add_ give them: dot + bias rounded once to
 * bfloat16, and with accumulate added to y and rounded again. */
ALWAYS_INLINE void store(const Product *p, int64_t m, int64_t n, const float *dots,
                         int64_t count, weight_kind kind) {
    for (int64_t c = 0; c < count; c++) {
        const int64_t at = m * p->outs + n + c;
        if (kind == WEIGHTS_BFLOAT16) {
            const uint16_t *bias = p->bias;
            uint16_t *y = (uint16_t *)p->y + at;
            const uint16_t out =
                float_to_bf16(dots[c] + (bias == NULL ? 0.f : bf16_to_float(bias[n + c])));
            *y = p->accumulate ? float_to_bf16(bf16_to_float(*y) + bf16_to_float(out)) : out;
        } else {
            const float *bias = p->bias;
            float *y = (float *)p->y + at;
            const float scaled =
                kind == WEIGHTS_INT8 ? dots[c] * bf16_to_float(p->scales[n + c]) : dots[c];
            *y = scaled + (bias == NULL ? 0.f : bias[n + c]) + (p->accumulate ? *y : 0.f);
        }
    }
}

/* Outputs [n, n + 4) of every row, w pointing at output n's weight row: the four weight rows
 * are read from memory once. `next` is the group of four weight rows computed after them
 * (NULL if none): a slice of it is asked for at each pair of x rows (prefetch_slice), so it
 * comes in from memory while this group is computed on (with the hardware prefetcher alone the
 * two took turns: on 2 cores of an AMD EPYC Zen 5, SmolLM2-135M's projections of 8 rows took
 * 17.4-17.7 instead of 30.3-33.5 ms a step, of 16 rows 24.3-26.0 instead of 41.9-43.1, with
 * the 16-float vectors of AVX-512; oneDNN 17.3-18.6 and 19.8-20.9). */
ALWAYS_INLINE void four_outputs(const Product *p, int64_t n, const void *w, const void *next,
                                weight_kind kind) {
    const int64_t bytes = WEIGHT_ROWS * p->in * weight_bytes(kind);
    const int64_t pairs = (p->rows + 1) / 2;
    float dots[8];
    for (int64_t m = 0; m < p->rows; m += 2) {
        if (next != NULL) prefetch_slice(next, bytes, m / 2, pairs, PREFETCH_INTO_L1);
        const float *x = p->x + m * p->x_stride;
        const int pair = m + 1 < p->rows;
        if (pair)
            two_rows(x, x + p->x_stride, w, p->in, kind, dots);
        else
            one_row(x, w, p->in, kind, dots);
        for (int64_t r = 0; r <= pair; r++) store(p, m + r, n, dots + 4 * r, WEIGHT_ROWS, kind);
    }
}

/* Output n of every row, w pointing at its weight row (the four-row path's last outs % 4). */
ALWAYS_INLINE void last_output(const Product *p, int64_t n, const void *w, weight_kind kind) {
    for (int64_t m = 0; m < p->rows; m++) {
        const float *x = p->x + m * p->x_stride;
        float dot = 0.f;
        for (int64_t k = 0; k < p->in; k++) dot += weight1(w, k, kind) * x[k];
        store(p, m, n, &dot, 1, kind);
    }
}

/* Steps of up to this many rows stream one weight row at a time (weight_row); with more, four
 * weight rows at a time are multiplied into two x rows at a time (four_outputs), which loads
 * fewer vectors per multiply-add once the product is bound by arithmetic, not by memory
 * (measured on an AMD EPYC Zen 4, 1 thread: at 1 row the streamed rows read the weights 1.65x
 * faster, at 4 rows both take the same time, at 16 the four-row path 1.4x less). */
enum { STREAM_MAX_ROWS = 3 };

/* x rows [0, count) (row stride x_stride) against one weight row w: dots[m]. Two
 * accumulators per x row along k keep more than one multiply-add in flight at batch 1.
 * `count` is a literal at the call sites: each count gets its own unrolled code. */
ALWAYS_INLINE void weight_row(const float *x, int64_t x_stride, int count, const void *w,
                              int64_t in, weight_kind kind, float dots[STREAM_MAX_ROWS]) {
    const int64_t body = in & ~(int64_t)(2 * LANES - 1);
    vec lo[STREAM_MAX_ROWS] = {{0}}, hi[STREAM_MAX_ROWS] = {{0}};
    for (int64_t k = 0; k < body; k += 2 * LANES) {
        const vec u = weightsv(w, k, kind), u2 = weightsv(w, k + LANES, kind);
        for (int m = 0; m < count; m++) {
            lo[m] += u * loadv(x + m * x_stride + k);
            hi[m] += u2 * loadv(x + m * x_stride + k + LANES);
        }
    }
    for (int m = 0; m < count; m++) {
        float dot = sumv(lo[m] + hi[m]);
        for (int64_t k = body; k < in; k++) dot += weight1(w, k, kind) * x[m * x_stride + k];
        dots[m] = dot;
    }
}

/* Output n of every row (at most STREAM_MAX_ROWS), w pointing at its weight row. */
ALWAYS_INLINE void streamed_output(const Product *p, int64_t n, const void *w, weight_kind kind) {
    float dots[STREAM_MAX_ROWS];
    switch (p->rows) {
    case 0: return;
    case 1: weight_row(p->x, p->x_stride, 1, w, p->in, kind, dots); break;
    case 2: weight_row(p->x, p->x_stride, 2, w, p->in, kind, dots); break;
    default: weight_row(p->x, p->x_stride, 3, w, p->in, kind, dots); break;
    }
    for (int64_t r = 0; r < p->rows; r++) store(p, r, n, dots + r, 1, kind);
}

/* Weight rows [first, last) read one row after another (rows <= STREAM_MAX_ROWS). */
ALWAYS_INLINE void streamed_slab(const Product *p, int64_t first, int64_t last,
                                 weight_kind kind) {
    const char *weights = p->w;
    const int64_t row_bytes = p->in * weight_bytes(kind);
    for (int64_t n = first; n < last; n++) streamed_output(p, n, weights + n * row_bytes, kind);
}

/* Groups of four weight rows [first, last), and with `tail` the last outs % 4 rows (more rows
 * than STREAM_MAX_ROWS). */
ALWAYS_INLINE void grouped_slab(const Product *p, int64_t first, int64_t last, int tail,
                                weight_kind kind) {
    const char *weights = p->w;
    const int64_t row_bytes = p->in * weight_bytes(kind), group_bytes = WEIGHT_ROWS * row_bytes;
    for (int64_t g = first; g < last; g++)
        four_outputs(p, g * WEIGHT_ROWS, weights + g * group_bytes,
                     g + 1 < last ? weights + (g + 1) * group_bytes : NULL, kind);
    if (!tail) return;
    for (int64_t n = p->outs / WEIGHT_ROWS * WEIGHT_ROWS; n < p->outs; n++)
        last_output(p, n, weights + n * row_bytes, kind);
}

/* BFLOAT16_WIDENED builds the path of CPUs without AVX-512 BF16 anywhere (the tests run both). */
#if defined(__AVX512BF16__) && !defined(BFLOAT16_WIDENED)
#define BFLOAT16_PAIRS 1
#else
#define BFLOAT16_PAIRS 0
#endif

#if BFLOAT16_PAIRS
/* With AVX-512 BF16, a bfloat16 model's rows meet the weights as bfloat16 pairs: vdpbf16ps
 * multiplies 32 pairs and adds them into 16 float32 sums in one instruction, where widening
 * each weight first takes three, and from 2 rows that work, not memory, bounded the product.
 * Each weight row is read once and multiplied into every x row (four at a time, two sums
 * each); the products of bfloat16 values are exact in float32, so only the order of the sums
 * differs from the widened path's. */
enum { PAIR_ROW_GROUP = 4, PAIRS = 32 };

/* x rows [0, count) against one weight row w: dots[m]. `count` is a literal at the call
 * sites. */
ALWAYS_INLINE void pairs_row(const uint16_t *x, int64_t in, int count, const uint16_t *w,
                             float dots[PAIR_ROW_GROUP]) {
    const int64_t body = in & ~(int64_t)(2 * PAIRS - 1);
    __m512 lo[PAIR_ROW_GROUP], hi[PAIR_ROW_GROUP];
    for (int m = 0; m < count; m++) lo[m] = hi[m] = _mm512_setzero_ps();
    for (int64_t k = 0; k < body; k += 2 * PAIRS) {
        const __m512bh u = (__m512bh)_mm512_loadu_si512(w + k);
        const __m512bh u2 = (__m512bh)_mm512_loadu_si512(w + k + PAIRS);
        for (int m = 0; m < count; m++) {
            lo[m] = _mm512_dpbf16_ps(lo[m], u, (__m512bh)_mm512_loadu_si512(x + m * in + k));
            hi[m] = _mm512_dpbf16_ps(hi[m], u2,
                                     (__m512bh)_mm512_loadu_si512(x + m * in + k + PAIRS));
        }
    }
    for (int m = 0; m < count; m++) {
        float dot = _mm512_reduce_add_ps(_mm512_add_ps(lo[m], hi[m]));
        for (int64_t k = body; k < in; k++)
            dot += bf16_to_float(w[k]) * bf16_to_float(x[m * in + k]);
        dots[m] = dot;
    }
}

/* Weight rows [first, last), each against every row of p->x16. */
static void pairs_slab(const Product *p, int64_t first, int64_t last) {
    const uint16_t *weights = p->w;
    float dots[PAIR_ROW_GROUP];
    for (int64_t n = first; n < last; n++) {
        const uint16_t *w = weights + n * p->in;
        for (int64_t m = 0; m < p->rows; m += PAIR_ROW_GROUP) {
            const int64_t count = p->rows - m < PAIR_ROW_GROUP ? p->rows - m : PAIR_ROW_GROUP;
            const uint16_t *x = p->x16 + m * p->in;
            switch (count) {
            case 1: pairs_row(x, p->in, 1, w, dots); break;
            case 2: pairs_row(x, p->in, 2, w, dots); break;
            case 3: pairs_row(x, p->in, 3, w, dots); break;
            default: pairs_row(x, p->in, 4, w, dots); break;
            }
            for (int64_t r = 0; r < count; r++) store(p, m + r, n, dots + r, 1, WEIGHTS_BFLOAT16);
        }
    }
}
#endif

/* This thread's contiguous share [first, last) of `count` items, as schedule(static) splits;
 * returns whether it is the last thread's. */
static int thread_share(int64_t count, int64_t *first, int64_t *last) {
    const int64_t threads = omp_get_num_threads(), thread = omp_get_thread_num();
    *first = count * thread / threads;
    *last = count * (thread + 1) / threads;
    return thread == threads - 1;
}

/* The product over the threads, each reading a contiguous slab of weight rows once. With up to
 * STREAM_MAX_ROWS rows, one row after another: a single sequential stream, which the hardware
 * prefetcher follows at the memory's read bandwidth (four rows read interleaved reached ~0.6x
 * of it on an AMD EPYC Zen 4); with more, four at a time (four_outputs). The slab functions
 * are inlined with a literal kind in each case, so each kind is compiled for itself. */
static void product(const Product *p, weight_kind kind, int num_threads) {
#if BFLOAT16_PAIRS
    if (kind == WEIGHTS_BFLOAT16 && p->x16 != NULL) {
#pragma omp parallel num_threads(num_threads)
        {
            int64_t first, last;
            thread_share(p->outs, &first, &last);
            pairs_slab(p, first, last);
        }
        return;
    }
#endif
    const int streamed = p->rows <= STREAM_MAX_ROWS;
    const int64_t items = streamed ? p->outs : p->outs / WEIGHT_ROWS;
#pragma omp parallel num_threads(num_threads)
    {
        int64_t first, last;
        const int tail = thread_share(items, &first, &last);
        switch (kind) {
        case WEIGHTS_FLOAT32:
            if (streamed) streamed_slab(p, first, last, WEIGHTS_FLOAT32);
            else grouped_slab(p, first, last, tail, WEIGHTS_FLOAT32);
            break;
        case WEIGHTS_INT8:
            if (streamed) streamed_slab(p, first, last, WEIGHTS_INT8);
            else grouped_slab(p, first, last, tail, WEIGHTS_INT8);
            break;
        case WEIGHTS_BFLOAT16:
            if (streamed) streamed_slab(p, first, last, WEIGHTS_BFLOAT16);
            else grouped_slab(p, first, last, tail, WEIGHTS_BFLOAT16);
            break;
        }
    }
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
 * front of the larger steps' matmuls, which the kernel does not compute. out [rows, in].
 * Returns 0 (it allocates nothing: the status of bfloat16_projection_input's signature). */
int projection_input(const float *x, int64_t rows, int64_t x_stride, const float *norm_weight,
                     float eps, int gated, int64_t in, float *out, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t m = 0; m < rows; m++) {
        if (gated)
            swiglu_row(x + m * x_stride, in, out + m * in);
        else
            rms_norm_row(x + m * x_stride, norm_weight, eps, in, out + m * in);
    }
    return 0;
}

/* Row m of a bfloat16 model's x widened into `row` (width floats), and f(x) in float32 into
 * `result` (in floats): the norm with its weight widened in `weight`, or the SwiGLU when gated;
 * returns the widened row itself when there is neither. */
static const float *bfloat16_input_row(const uint16_t *x, int64_t width, const float *weight,
                                       float eps, int gated, int64_t in, float *row,
                                       float *result) {
    for (int64_t k = 0; k < width; k++) row[k] = bf16_to_float(x[k]);
    if (gated)
        swiglu_row(row, in, result);
    else if (weight != NULL)
        rms_norm_row(row, weight, eps, in, result);
    else
        return row;
    return result;
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
            const float *result = bfloat16_input_row(
                x + m * x_stride, width, norm_weight == NULL ? NULL : scratch + width, eps, gated,
                in, scratch, scratch + width + in);
            for (int64_t k = 0; k < in; k++) out[m * in + k] = float_to_bf16(result[k]);
        }
        free(scratch);
    }
    return failed ? -1 : 0;
}

/* The floats in the kernel's vectors as compiled for this CPU (8 with AVX2, 16 with AVX-512):
 * how many rows it beats the larger steps' matmul up to depends on it (linear_kernel.py). */
int small_batch_linear_lanes(void) { return LANES; }

/* 1 where a bfloat16 model's rows meet the weights as bfloat16 pairs (AVX-512 BF16), 0 where
 * each weight is widened first: how many rows the kernel beats oneDNN up to (linear_kernel.py). */
int bfloat16_small_batch_pairs(void) { return BFLOAT16_PAIRS; }

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
    const Product p = {x, NULL, rows, x_stride, w, scales, bias, in, outs, y, accumulate};
    product(&p, scales == NULL ? WEIGHTS_FLOAT32 : WEIGHTS_INT8, num_threads);
    free(scratch);
    return 0;
}

/* small_batch_linear for a bfloat16 model (PackedProject, linear_kernel.py): x, the norm's
 * weight, w, bias and y are bfloat16. It computes what oneDNN's bfloat16 product computes
 * there, in float32 from the same bfloat16 values: f(x) rounded once to bfloat16 (as
 * bfloat16_projection_input rounds it), the product and its bias in float32, rounded once, and
 * the residual added after, rounded again (as torch's add_ of two bfloat16 tensors). The
 * weights stream at half float32's bytes, so a batch-1 step can run twice as fast as float32's;
 * oneDNN's bfloat16 code reads them far slower at a few rows. Returns 0, or -1 when its scratch
 * rows cannot be allocated. */
int bfloat16_small_batch_linear(const uint16_t *x, int64_t rows, int64_t x_stride,
                                const uint16_t *norm_weight, float eps, int gated,
                                const uint16_t *w, const uint16_t *bias, int64_t in,
                                int64_t outs, uint16_t *y, int accumulate, int num_threads) {
    const int64_t width = gated ? 2 * in : in;
    /* f(x) as floats [rows, in], a widened row, the norm's weight; then f(x) as bfloat16. */
    float *inputs = malloc(sizeof(float) * (size_t)(rows * in + width + in) +
                           sizeof(uint16_t) * (size_t)(rows * in));
    if (inputs == NULL) return -1;
    float *row = inputs + rows * in, *weight = row + width;
    uint16_t *inputs16 = (uint16_t *)(weight + in);
    if (norm_weight != NULL)
        for (int64_t k = 0; k < in; k++) weight[k] = bf16_to_float(norm_weight[k]);
    for (int64_t m = 0; m < rows; m++) {
        float *input = inputs + m * in;
        const float *result = bfloat16_input_row(x + m * x_stride, width,
                                                 norm_weight == NULL ? NULL : weight, eps, gated,
                                                 in, row, input);
        for (int64_t k = 0; k < in; k++) {
            /* f(x) rounded once; the row itself (no f) is its own bfloat16 again. */
            inputs16[m * in + k] = float_to_bf16(result[k]);
            input[k] = bf16_to_float(inputs16[m * in + k]);
        }
    }
    const Product p = {inputs, inputs16, rows, in, w, NULL, bias, in, outs, y, accumulate};
    product(&p, WEIGHTS_BFLOAT16, num_threads);
    free(inputs);
    return 0;
}
