/* Lane-wise operations on the kernels' float vectors, shared by the attention kernels. A .c
 * file includes this after it defines `vec` (LANES floats) and `lane_index` (LANES int32s);
 * kernel_build.py keys its cache on the headers too. */
#ifndef KVMESH_VECTOR_OPS_H
#define KVMESH_VECTOR_OPS_H

/* Lane by lane, the greater of a and b: a compare and a blend through the lanes' bits. */
static inline vec greater_of(vec a, vec b) {
    const lane_index a_greater = a > b; /* all ones where a is greater */
    return (vec)(((lane_index)a & a_greater) | ((lane_index)b & ~a_greater));
}

#endif
