/* Reading the next piece of a kernel's data while computing on the current one (included by
 * the kernels' .c files; kernel_build.py keys its cache on the headers too). */
#ifndef KVMESH_PREFETCH_SLICE_H
#define KVMESH_PREFETCH_SLICE_H
#include <stdint.h>

/* Asks for slice `part` of `parts` of the cache lines of [start, start + bytes). A kernel calls
 * it once per step of its loop over the current piece, with part counting those steps, so the
 * requests for the next piece are spread over the loop instead of coming in one burst. With
 * the hardware prefetcher alone, reading a piece and computing on the last took turns. */
static inline void prefetch_slice(const void *start, int64_t bytes, int64_t part,
                                  int64_t parts) {
    const int64_t lines = bytes / 64;
    for (int64_t line = part * lines / parts; line < (part + 1) * lines / parts; line++)
        __builtin_prefetch((const char *)start + line * 64, 0, 3);
}

#endif
