/* bfloat16 values as the kernels read them (included by the kernels' .c files; kernel_build.py
 * keys its cache on the headers too). */
#ifndef KVMESH_BFLOAT16_H
#define KVMESH_BFLOAT16_H
#include <stdint.h>
#include <string.h>

/* A bfloat16 as a float: its bits are a float's upper half. */
static inline float bf16_to_float(uint16_t bits) {
    const uint32_t wide = (uint32_t)bits << 16;
    float f;
    memcpy(&f, &wide, sizeof f);
    return f;
}

/* A float rounded to the nearest bfloat16 (ties to even), as torch rounds; a NaN stays a NaN. */
static inline uint16_t float_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

#endif
