/* Reading the next piece of a kernel's data while computing on the current one (included by
 * the kernels' .c files; kernel_build.py keys its cache on the headers too). */
#ifndef KVMESH_PREFETCH_SLICE_H
#define KVMESH_PREFETCH_SLICE_H
#include <stdint.h>

/* Where a kernel's prefetches put the lines: L1 for a next piece that fits beside the current
 * one, L2 for one that does not (see paged_decode_attention.c). */
typedef enum { PREFETCH_INTO_L1, PREFETCH_INTO_L2 } prefetch_level;

/* Asks for slice `part` of `parts` of the cache lines of [start, start + bytes). A kernel calls
 * it once per step of its loop over the current piece, with part counting those steps, so the
 * requests for the next piece are spread over the loop instead of coming in one burst. With
 * the hardware prefetcher alone, reading a piece and computing on the last took turns. `level`
 * is a constant at every call, so the branch folds away once inlined. */
static inline void prefetch_slice(const void *start, int64_t bytes, int64_t part, int64_t parts,
                                  prefetch_level level) {
    const int64_t lines = bytes / 64;
    for (int64_t line = part * lines / parts; line < (part + 1) * lines / parts; line++) {
        const char *address = (const char *)start + line * 64;
        if (level == PREFETCH_INTO_L2)
            __builtin_prefetch(address, 0, 2);
        else
            __builtin_prefetch(address, 0, 3);
    }
}

#endif
