/* Loading and storing the kernels' float vectors, shared by the kernels that run on `vec`. A
 * .c file includes this after it defines `vec` (LANES floats); kernel_build.py keys its cache
 * on the headers too. */
#ifndef KVMESH_VECTOR_IO_H
#define KVMESH_VECTOR_IO_H
#include <string.h>

/* LANES floats from p, which need not be aligned. */
static inline vec load(const float *p) {
    vec v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store(float *p, vec v) { memcpy(p, &v, sizeof v); }

#endif
