/* LANES bfloat16 values widened to a vector of floats (included by the kernels' .c files after
 * they define `vec` as LANES floats; kernel_build.py keys its cache on the headers too). */
#ifndef KVMESH_BFLOAT16_VECTOR_H
#define KVMESH_BFLOAT16_VECTOR_H
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <stdint.h>

#include "bfloat16.h"

/* Each value's bits are its float's upper half. Written with intrinsics: GCC 12 lowers the
 * portable widening (__builtin_convertvector of 16 uint16 to 16 uint32) for AVX-512 into two
 * halves and an insert, six instructions for these two. With it, the bfloat16 build of the
 * decode attention (32 rows of 300 tokens x 30 layers, blocks scattered, 2 cores of an AMD
 * EPYC Zen 4) took 11.1-11.3 ms with the caches in L3 and 12.9-13.6 from memory; with these,
 * 8.9-10.1 and 11.4-12.7. */
static inline __attribute__((always_inline)) vec bfloat16_vector(const uint16_t *p) {
#if defined(__AVX512F__)
    const __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return (vec)_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
#elif defined(__AVX2__)
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    return (vec)_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16);
#else
    vec v;
    for (int i = 0; i < LANES; i++) v[i] = bf16_to_float(p[i]);
    return v;
#endif
}

#endif
