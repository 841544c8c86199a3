/* AMX's tile registers as the kernels use them (included where they are built for AMX-BF16):
 * all eight tiles configured alike, 16 rows of 64 bytes (16 float32 sums, or 16 words of
 * bfloat16 pairs), and the permission Linux wants a process to ask for first. */
#ifndef KVMESH_AMX_TILES_H
#define KVMESH_AMX_TILES_H
#include <immintrin.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_TILE_ROWS 16
#define AMX_TILE_BYTES 64

/* The calling thread's tile configuration (palette 1): a thread's own state, and oneDNN's
 * kernels on the same thread load configurations of their own, so each call loads it. */
static inline void amx_configure(void) {
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t bytes_per_row[16];
        uint8_t rows[16];
    } config = {.palette = 1};
    for (int t = 0; t < 8; t++) {
        config.bytes_per_row[t] = AMX_TILE_BYTES;
        config.rows[t] = AMX_TILE_ROWS;
    }
    _tile_loadconfig(&config);
}

/* Linux hands a process AMX's tile data registers once it asks for them (arch_prctl
 * ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); oneDNN asks too, and asking again is harmless. */
static inline int amx_permitted(void) { return syscall(SYS_arch_prctl, 0x1023, 18) == 0; }

#endif
