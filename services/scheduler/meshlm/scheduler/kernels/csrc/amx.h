/* AMX set-up shared by the kernels that multiply tiles (included by kernels/csrc/gemm_amx.c and
 * attention/csrc/{decode_attention,extend_attention_amx}.c; kernels/build.py hashes it into each
 * library's cache key).
 * Include after <immintrin.h>, where the includer defines HAVE_AMX. */
#ifndef MESHLM_AMX_H
#define MESHLM_AMX_H
#ifdef HAVE_AMX
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* 1 when the process may use AMX tiles: Linux grants XTILEDATA per process on request (the
 * request is idempotent; torch's oneDNN makes the same one). Each library asks once. */
static int amx_permitted(void) {
    static volatile int state = 0; /* 0 not asked yet, 1 granted, -1 refused (a benign race: both ask) */
    if (state == 0) state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
    return state == 1;
}

/* Tile t: rows[t] rows (1-16) of 64 bytes (palette 1). Loading a configuration zeroes the tiles. */
static inline void amx_configure_rows(const uint8_t rows[8]) {
    uint8_t cfg[64] = {0};
    cfg[0] = 1; /* palette 1 */
    for (int t = 0; t < 8; t++) {
        cfg[16 + 2 * t] = 64; /* bytes a row (colsb, uint16 little-endian) */
        cfg[48 + t] = rows[t];
    }
    _tile_loadconfig(cfg);
}

/* All eight tiles 16 rows x 64 bytes; each kernel says what it keeps in which. */
static inline void amx_configure(void) {
    static const uint8_t full[8] = {16, 16, 16, 16, 16, 16, 16, 16};
    amx_configure_rows(full);
}
#endif
#endif
