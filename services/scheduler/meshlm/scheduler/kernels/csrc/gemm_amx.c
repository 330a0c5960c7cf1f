/* Dense bf16 GEMM for decode batches on AMX tiles: y = x W^T (+ b), x [M, K] bf16 (rows
 * x_stride elements apart), W [N, K] packed once by meshlm_gemm_amx_pack, y [M, N] bf16 (the
 * float32 sums, plus b, rounded once), b float32 [N] or NULL. N % 16 == 0, K % 32 == 0.
 *
 * Why: at decode sizes (up to a few dozen rows) the product is bound by reading W, and oneDNN's
 * AMX GEMM streams it at about half the bandwidth two cores get. Here W is stored in the order
 * the multiplies read it, one contiguous stream a 16-column block:
 *
 *     packed[nb][kc][p][n][2] = W[16 nb + n][32 kc + 2 p + {0, 1}]
 *
 * i.e. for each block of 16 output columns (nb) and chunk of 32 k (kc), the 1 KB B tile AMX
 * wants ("VNNI": row p holds the k-pair (2p, 2p + 1) of each of the 16 columns). x needs no
 * packing: 16 rows by 32 k of x, x_stride * 2 bytes apart, are an A tile as they are.
 *
 * Tiles: C 0-3 are a 2 x 2 grid of 16 x 16 float32 sums (row blocks i, column blocks j:
 * tile 2 i + j), A 4-5 the two row blocks' x, B 6-7 the two column blocks' W. Per k-chunk:
 * two A loads (x, from L1/L2), two B loads (W, from memory), four multiplies. The rows are
 * walked in pairs of row blocks (32 rows) inside each pair of column blocks, so W crosses
 * memory once (every pass after the first finds the 2 x 16 x K panel in L2) and x is re-read
 * from L2 for each pair: meant for decode batches (up to a few hundred rows). A last pass of fewer than 32 rows (not a multiple of 16) reads them from a
 * zero-padded copy, so every tile is 16 full rows and nothing past x is read; only the real
 * rows are written to y.
 *
 * Column-block pairs are handed out dynamically in runs of a few, so a core preempted by
 * another process holds up only its current run, not the whole product.
 *
 * Needs AMX-TILE and AMX-BF16 in the build (-march=native on such a CPU) and the kernel's
 * permission to use the tile state (Linux: arch_prctl ARCH_REQ_XCOMP_PERM, asked for by
 * meshlm_gemm_amx_available; it holds for the whole process).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && defined(__AVX512BF16__) && \
    defined(__linux__)
#include <immintrin.h>
#define HAVE_AMX 1
#include "amx.h"
#endif

#define TILE_N 16 /* output columns a column block */
#define TILE_K 32 /* k (bf16) a chunk: one 64-byte tile row */

/* 1 when this build has the AMX path and the OS lets this process use the tiles. */
int meshlm_gemm_amx_available(void) {
#ifdef HAVE_AMX
    return amx_permitted();
#else
    return 0;
#endif
}

/* W [N, K] bf16 row-major -> packed (N * K bf16, layout above). 1 for a shape it cannot take. */
int meshlm_gemm_amx_pack(const uint16_t *w, int64_t n, int64_t k, uint16_t *packed) {
    if (n <= 0 || k <= 0 || n % TILE_N || k % TILE_K) return 1;
    const int64_t kc_n = k / TILE_K;
    for (int64_t nb = 0; nb < n / TILE_N; nb++)
        for (int64_t kc = 0; kc < kc_n; kc++) {
            uint16_t *tile = packed + (nb * kc_n + kc) * (TILE_N * TILE_K);
            for (int p = 0; p < TILE_K / 2; p++)
                for (int c = 0; c < TILE_N; c++) {
                    const uint16_t *src = w + (nb * TILE_N + c) * k + kc * TILE_K + 2 * p;
                    tile[(p * TILE_N + c) * 2] = src[0];
                    tile[(p * TILE_N + c) * 2 + 1] = src[1];
                }
        }
    return 0;
}

#ifdef HAVE_AMX
/* Sums of tile c plus bias -> its first r rows as bf16 at y, n_stride apart. */
static inline void store_rows(int c, int r, const float *bias, uint16_t *y, int64_t n_stride) {
    float buf[16 * 16] __attribute__((aligned(64)));
    switch (c) { /* tile numbers are immediates */
    case 0: _tile_stored(0, buf, 64); break;
    case 1: _tile_stored(1, buf, 64); break;
    case 2: _tile_stored(2, buf, 64); break;
    default: _tile_stored(3, buf, 64); break;
    }
    const __m512 b = bias != NULL ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
    for (int i = 0; i < r; i++)
        _mm256_storeu_si256((__m256i *)(y + i * n_stride),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(_mm512_load_ps(buf + 16 * i), b)));
}

/* One pass over K: the 16-row A tiles at a0 (and a0 + 16 rows when MR == 2), a_stride bytes a
 * row, against the panels of column blocks b0 (and the next when NR == 2), into C tiles 2 i + j.
 * MR, NR are compile-time after inlining (tile numbers must be immediates). */
static inline __attribute__((always_inline)) void pass(const int MR, const int NR, const uint16_t *a0,
                                                       int64_t a_stride, const uint16_t *b0, int64_t kc_n) {
    const int64_t tile = TILE_N * TILE_K;
    const uint16_t *a1 = a0 + 16 * (a_stride / 2), *b1 = b0 + kc_n * tile;
    _tile_zero(0);
    if (NR > 1) _tile_zero(1);
    if (MR > 1) _tile_zero(2);
    if (MR > 1 && NR > 1) _tile_zero(3);
    for (int64_t kc = 0; kc < kc_n; kc++) {
        _tile_loadd(6, b0 + kc * tile, 64);
        _tile_loadd(4, a0 + kc * TILE_K, a_stride);
        _tile_dpbf16ps(0, 4, 6);
        if (NR > 1) {
            _tile_loadd(7, b1 + kc * tile, 64);
            _tile_dpbf16ps(1, 4, 7);
        }
        if (MR > 1) {
            _tile_loadd(5, a1 + kc * TILE_K, a_stride);
            _tile_dpbf16ps(2, 5, 6);
            if (NR > 1) _tile_dpbf16ps(3, 5, 7);
        }
    }
}

/* Rows [0, rows) (1-32) at a0 times column blocks nb0 (and nb0 + 1 when nr == 2) into y's
 * rows [0, rows) (y already offset to the pass's first row), plus bias. */
static void pass_block(int rows, int nr, const uint16_t *a0, int64_t a_stride, const uint16_t *packed, int64_t nb0,
                       int64_t n, int64_t kc_n, const float *bias, uint16_t *y) {
    const uint16_t *b0 = packed + nb0 * kc_n * TILE_N * TILE_K;
    const int mr = rows > 16 ? 2 : 1, r0 = rows < 16 ? rows : 16, r1 = rows - r0;
    if (mr == 2 && nr == 2) pass(2, 2, a0, a_stride, b0, kc_n);
    else if (mr == 2) pass(2, 1, a0, a_stride, b0, kc_n);
    else if (nr == 2) pass(1, 2, a0, a_stride, b0, kc_n);
    else pass(1, 1, a0, a_stride, b0, kc_n);
    const float *bias0 = bias != NULL ? bias + nb0 * TILE_N : NULL, *bias1 = bias0 != NULL ? bias0 + TILE_N : NULL;
    uint16_t *y0 = y + nb0 * TILE_N;
    store_rows(0, r0, bias0, y0, n);
    if (nr > 1) store_rows(1, r0, bias1, y0 + TILE_N, n);
    if (mr > 1) {
        store_rows(2, r1, bias0, y0 + 16 * n, n);
        if (nr > 1) store_rows(3, r1, bias1, y0 + 16 * n + TILE_N, n);
    }
}
#endif

/* 0 on success, 1 for a shape the kernel does not take, 2 when this build or process cannot
 * use AMX, 3 when the padded copy's 64 * K bytes cannot be allocated. packed: from
 * meshlm_gemm_amx_pack(w, n, k). */
int meshlm_gemm_amx(const uint16_t *x, int64_t x_stride, int64_t m, const uint16_t *packed, int64_t n, int64_t k,
                    const float *bias, uint16_t *y, int num_threads) {
    if (m < 0 || n <= 0 || k <= 0 || n % TILE_N || k % TILE_K || x_stride < k) return 1;
#ifdef HAVE_AMX
    if (m == 0) return 0;
    const int64_t nb_n = n / TILE_N, pairs = (nb_n + 1) / 2, passes = (m + 31) / 32, kc_n = k / TILE_K;
    const int64_t tail = m - 32 * (passes - 1); /* rows of the last pass, 1-32 */
    /* The last pass's rows, zero-padded to 32, so every tile is 16 full rows. */
    uint16_t *pad = NULL;
    if (tail % 16) {
        pad = aligned_alloc(64, (size_t)(32 * k * 2));
        if (pad == NULL) return 3;
        memset(pad, 0, (size_t)(32 * k * 2));
        for (int64_t r = 0; r < tail; r++) memcpy(pad + r * k, x + (32 * (passes - 1) + r) * x_stride, (size_t)k * 2);
    }
    /* Column-block pairs a thread takes at a time: about 8 runs a thread. */
    int64_t run = pairs / (8 * (num_threads > 0 ? num_threads : 1));
    if (run < 1) run = 1;
#pragma omp parallel num_threads(num_threads)
    {
        amx_configure(); /* every tile 16 full rows: the padding above keeps A tiles inside x */
#pragma omp for schedule(dynamic, 1)
        for (int64_t g = 0; g < (pairs + run - 1) / run; g++)
            for (int64_t pr = g * run; pr < (g + 1) * run && pr < pairs; pr++) {
                const int nr = 2 * pr + 1 < nb_n ? 2 : 1;
                for (int64_t ps = 0; ps < passes; ps++) { /* 32 rows a pass; the panel stays in L2 */
                    const int last = ps + 1 == passes, padded = last && pad != NULL;
                    const uint16_t *a0 = padded ? pad : x + 32 * ps * x_stride;
                    pass_block(last ? (int)tail : 32, nr, a0, (padded ? k : x_stride) * 2, packed, 2 * pr, n, kc_n,
                               bias, y + 32 * ps * n);
                }
            }
        _tile_release();
    }
    free(pad);
    return 0;
#else
    (void)x, (void)packed, (void)bias, (void)y, (void)num_threads, (void)x_stride;
    return 2;
#endif
}
