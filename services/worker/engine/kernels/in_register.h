/* Keeping a vector in a register (included by the kernels' .c files; kernel_build.py keys its
 * cache on the headers too). */
#ifndef KVMESH_IN_REGISTER_H
#define KVMESH_IN_REGISTER_H

/* After IN_REGISTER(v), v is used from a register. A vector loaded once and multiplied into
 * several accumulators is otherwise loaded again by each FMA (GCC folds the load into it), and
 * the loads, not the FMAs, bound the loop: AVX2 loads two vectors a cycle, and a tile of 4 x 2
 * accumulators took 12 loads for its 8 FMAs. An empty asm that says it may change v. */
#if defined(__x86_64__)
#define IN_REGISTER(v) __asm__("" : "+v"(v))
#elif defined(__aarch64__)
#define IN_REGISTER(v) __asm__("" : "+w"(v))
#else
#define IN_REGISTER(v) ((void)0)
#endif

#endif
