/* A vectorizable e^x for the kernels (included by their .c files; kernel_build.py keys its
 * cache on the headers too). */
#ifndef KVMESH_EXP_APPROX_H
#define KVMESH_EXP_APPROX_H
#include <stdint.h>
#include <string.h>

/* e^x within 1 ulp of expf (checked for every float in [-87, 88]): Cephes' expf, x = n ln2 + r, a
 * degree-5 polynomial in r, times 2^n, written so that a `#pragma omp simd` loop vectorizes it
 * (with -fno-trapping-math: kernel_build.py's CFLAGS). glibc's expf is a call per element without
 * -ffast-math, which made the SwiGLU of a 512-token step take 8x as long (AMD EPYC Zen 4).
 * Arguments are clamped to [-87.33, 88.37], where 2^n stays a normal float. */
static inline float exp_approx(float x) {
    x = x < 88.37f ? x : 88.37f;
    x = x > -87.33f ? x : -87.33f;
    /* n = round(x / ln2) by the 1.5 * 2^23 trick (round to nearest, the default mode). */
    const float n = (x * 1.44269504f + 12582912.f) - 12582912.f;
    /* r = x - n ln2, ln2 split in two so that n * high is exact. */
    const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const float e = p * r * r + r + 1.f;
    const int32_t bits = ((int32_t)n + 127) << 23; /* 2^n, n in [-126, 127] */
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return e * scale;
}

#endif
