/* One KV-cache element as the kernels that read or write the cache see it (included by their
 * .c files; kernel_build.py keys its cache on the headers too): a float32 in the default build,
 * a bfloat16 in the KV_BFLOAT16 one (kernel_build.KV_BUILDS), widened to the float32 it stands
 * for to compute and rounded once to store. A model's cache holds its dtype, so decode_layers.c
 * takes its activations' element from here too; KV_ELEMENT_IS_FLOAT says which build it is. */
#ifndef KVMESH_KV_ELEMENT_H
#define KVMESH_KV_ELEMENT_H
#include <stdint.h>

#include "bfloat16.h"

#if defined(KV_BFLOAT16)
#define KV_ELEMENT_IS_FLOAT 0
typedef uint16_t kv_t;
static inline float kv_value(kv_t x) { return bf16_to_float(x); }
static inline kv_t kv_rounded(float x) { return float_to_bf16(x); }
#else
#define KV_ELEMENT_IS_FLOAT 1
typedef float kv_t;
static inline float kv_value(kv_t x) { return x; }
static inline kv_t kv_rounded(float x) { return x; }
#endif

#endif
