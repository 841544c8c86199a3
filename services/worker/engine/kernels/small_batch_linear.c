/* y = f(x) W^T for a few rows of x (CPU, float32): the projections of a small decode step.
 *
 * With one to a few rows, every weight is used for that many multiply-adds after being read
 * from memory, so the product runs exactly as fast as the weights stream in. The weight rows
 * are split into contiguous slabs, one per OpenMP thread, and each slab is read once: four
 * weight rows at a time, whose 8-float vectors are multiplied into every x row (two at a time,
 * eight accumulators) while the four rows are still in L1.
 *
 * At batch 1 the small element-wise work around each projection costs as much as a quarter
 * of the step in torch (each op is a dispatch), so it is folded in here:
 *   norm_weight != NULL  f(x) = RMSNorm(x) = x / sqrt(mean(x^2) + eps) * norm_weight
 *   gated                x is [gate | up] (2 * in wide) and f(x) = silu(gate) * up (SwiGLU)
 *   accumulate           y += f(x) W^T (the residual add) instead of y = f(x) W^T
 *
 * Layouts:
 *   x    [rows, in] (or [rows, 2 * in] gated), row stride x_stride, unit column stride
 *   w    [outs, in] contiguous (an nn.Linear weight)
 *   y    [rows, outs] contiguous
 * Vectors are GCC vector extensions: AVX2 + FMA code with -march=native on x86 (FMA by the
 * default -ffp-contract=fast), NEON on ARM.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float v8 __attribute__((vector_size(32)));

static inline v8 load8(const float *p) {
    v8 v;
    memcpy(&v, p, sizeof v); /* unaligned load */
    return v;
}

static inline float sum8(v8 v) {
    float s = 0.f;
    for (int i = 0; i < 8; i++) s += v[i];
    return s;
}

enum { WEIGHT_ROWS = 4 };

/* y[m, 0..3] for two x rows m, m + 1 against weight rows w[0..3] (dots[r], dots[4 + r]). */
static void two_rows(const float *restrict xa, const float *restrict xb, const float *restrict w,
                     int64_t in, float dots[8]) {
    const float *w0 = w, *w1 = w + in, *w2 = w + 2 * in, *w3 = w + 3 * in;
    const int64_t body = in & ~(int64_t)7;
    v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0};
    for (int64_t k = 0; k < body; k += 8) {
        const v8 va = load8(xa + k), vb = load8(xb + k);
        const v8 u0 = load8(w0 + k), u1 = load8(w1 + k), u2 = load8(w2 + k), u3 = load8(w3 + k);
        a0 += u0 * va, a1 += u1 * va, a2 += u2 * va, a3 += u3 * va;
        b0 += u0 * vb, b1 += u1 * vb, b2 += u2 * vb, b3 += u3 * vb;
    }
    const v8 sums[8] = {a0, a1, a2, a3, b0, b1, b2, b3};
    for (int r = 0; r < 8; r++) {
        const float *x = r < 4 ? xa : xb, *row = w + (r % 4) * in;
        float dot = sum8(sums[r]);
        for (int64_t k = body; k < in; k++) dot += row[k] * x[k];
        dots[r] = dot;
    }
}

/* y[m, 0..3] for one x row against weight rows w[0..3]. */
static void one_row(const float *restrict x, const float *restrict w, int64_t in, float dots[4]) {
    const float *w0 = w, *w1 = w + in, *w2 = w + 2 * in, *w3 = w + 3 * in;
    const int64_t body = in & ~(int64_t)7;
    v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    for (int64_t k = 0; k < body; k += 8) {
        const v8 v = load8(x + k);
        a0 += load8(w0 + k) * v, a1 += load8(w1 + k) * v;
        a2 += load8(w2 + k) * v, a3 += load8(w3 + k) * v;
    }
    const v8 sums[4] = {a0, a1, a2, a3};
    for (int r = 0; r < 4; r++) {
        const float *row = w + r * in;
        float dot = sum8(sums[r]);
        for (int64_t k = body; k < in; k++) dot += row[k] * x[k];
        dots[r] = dot;
    }
}

/* Output columns [n, n + 4) of every row: weight rows n..n+3 read from memory once. */
static void four_outputs(const float *x, int64_t rows, int64_t x_stride, const float *w,
                         int64_t in, float *y, int64_t outs, int accumulate) {
    float dots[8];
    for (int64_t m = 0; m < rows; m += 2) {
        const int pair = m + 1 < rows;
        if (pair)
            two_rows(x + m * x_stride, x + (m + 1) * x_stride, w, in, dots);
        else
            one_row(x + m * x_stride, w, in, dots);
        for (int64_t r = 0; r <= pair; r++) {
            float *out = y + (m + r) * outs;
            for (int c = 0; c < 4; c++) out[c] = dots[4 * r + c] + (accumulate ? out[c] : 0.f);
        }
    }
}

/* Output column n of every row (the last outs % 4 columns). */
static void one_output(const float *x, int64_t rows, int64_t x_stride, const float *w,
                       int64_t in, float *y, int64_t outs, int accumulate) {
    for (int64_t m = 0; m < rows; m++) {
        const float *xm = x + m * x_stride;
        float dot = 0.f;
        for (int64_t k = 0; k < in; k++) dot += w[k] * xm[k];
        y[m * outs] = dot + (accumulate ? y[m * outs] : 0.f);
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
    for (int64_t k = 0; k < in; k++) out[k] = gate_up[k] / (1.f + expf(-gate_up[k])) * up[k];
}

/* Returns 0, or -1 when the scratch rows for f(x) cannot be allocated. */
int small_batch_linear(const float *x, int64_t rows, int64_t x_stride, const float *norm_weight,
                       float eps, int gated, const float *w, int64_t in, int64_t outs, float *y,
                       int accumulate, int num_threads) {
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
    const int64_t groups = outs / WEIGHT_ROWS;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t g = 0; g < groups; g++)
        four_outputs(x, rows, x_stride, w + g * WEIGHT_ROWS * in, in, y + g * WEIGHT_ROWS, outs,
                     accumulate);
    for (int64_t n = groups * WEIGHT_ROWS; n < outs; n++)
        one_output(x, rows, x_stride, w + n * in, in, y + n, outs, accumulate);
    free(scratch);
    return 0;
}
