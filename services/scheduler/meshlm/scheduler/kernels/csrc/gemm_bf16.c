/* Dense bf16 GEMM for CPUs with AVX512-BF16: y = x W^T (+ b), x [M, K] bf16, W [N, K] bf16,
 * y [M, N] bf16 (float32 sums rounded once), b float32 (may be NULL).
 *
 * Layout of the packed weight (meshlm_gemm_bf16_pack): W's N rows are cut into 16-column
 * panels (N % 16 == 0), panels into groups of G = 3 (the last group may hold 1 or 2). Within
 * a group of P panels the weight is k-pair major:
 *
 *     packed[g][k2][p][c] = (W[n][2 k2] | W[n][2 k2 + 1] << 16),  n = (g G + p) 16 + c
 *
 * so one 64-byte load gives the 16 columns of one panel at one pair of k (VDPBF16PS's pairs),
 * and a group is one sequential stream of K/2 x P x 64 bytes. Group g starts at
 * g G (K/2) 16 int32 (every group but the last is full).
 *
 * The product runs a micro-tile of up to RT = 8 rows of x by the P <= 3 panels of a group:
 * 8 x 3 float32 accumulators (24 zmm) plus the 3 weight vectors and one broadcast pair of x
 * fit the 32 registers. Per k pair: 3 weight loads, 8 broadcasts, 24 VDPBF16PS. A decode
 * batch of a few rows is one tile per group, a pure stream of the weights; a larger batch
 * runs its tiles over the group while it sits in L2. Rows come in blocks of MB = 256 so
 * that a prompt chunk's rows stay in L2 across the groups; (row block, group) pairs are handed
 * out dynamically in runs of about 1/8 of a thread's share (consecutive groups: sequential
 * streams), so a core preempted by another process (the ring's relays share the cores) holds
 * up only its current run, not a static half (ring c=64: 558 / 523 vs 532 / 519 tok/s).
 *
 * Why not oneDNN: at 8-64 rows oneDNN's bf16 GEMM streams the weights at ~15-20 GB/s on a
 * 2-core AVX512-BF16 CPU without AMX, where this reaches 30-40 GB/s at 8 rows and the
 * VDPBF16PS peak at 64 (bench/bench_gemm_bf16.py).
 */
#include <stdint.h>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define HAVE_AVX512_BF16 1
#endif

#define G 3    /* panels a group */
#define RT 8   /* rows a micro-tile */
#define MB 256 /* rows a block */

int meshlm_gemm_bf16_available(void) {
#ifdef HAVE_AVX512_BF16
    return 1;
#else
    return 0;
#endif
}

/* Panels in group g of a weight with np panels. */
static inline int group_panels(int64_t np, int64_t g) { return (int)(np - g * G < G ? np - g * G : G); }

/* W [N, K] bf16 (rows contiguous) -> packed (N K / 2 int32). 0, or 1 for a bad shape. */
int meshlm_gemm_bf16_pack(const uint16_t *w, int64_t n, int64_t k, int32_t *packed) {
    if (n <= 0 || k <= 0 || n % 16 || k % 2) return 1;
    const int64_t np = n / 16, k2n = k / 2, ng = (np + G - 1) / G;
    for (int64_t g = 0; g < ng; g++) {
        const int P = group_panels(np, g);
        int32_t *dst = packed + g * G * k2n * 16;
        for (int64_t k2 = 0; k2 < k2n; k2++)
            for (int p = 0; p < P; p++)
                for (int c = 0; c < 16; c++) {
                    const uint16_t *row = w + ((g * G + p) * 16 + c) * k;
                    dst[(k2 * P + p) * 16 + c] = (int32_t)((uint32_t)row[2 * k2] | (uint32_t)row[2 * k2 + 1] << 16);
                }
    }
    return 0;
}

#ifdef HAVE_AVX512_BF16
/* y[r][p 16 + c] for the R rows at x (pairs of k as int32, x2_stride apart) and the P panels
 * of one group at w. R and P are compile-time constants after inlining (see tile), so the
 * accumulators stay in registers. */
static inline __attribute__((always_inline)) void micro_tile(const int R, const int P, const int32_t *restrict x,
                                                             int64_t x2_stride, const int32_t *restrict w,
                                                             int64_t k2n, uint16_t *restrict y, int64_t y_stride,
                                                             const float *restrict bias) {
    __m512 acc[RT][G];
    for (int r = 0; r < R; r++)
        for (int p = 0; p < P; p++) acc[r][p] = _mm512_setzero_ps();
    for (int64_t k2 = 0; k2 < k2n; k2++) {
        __m512i wv[G];
        for (int p = 0; p < P; p++) wv[p] = _mm512_loadu_si512(w + (k2 * P + p) * 16);
        for (int r = 0; r < R; r++) {
            const __m512i xr = _mm512_set1_epi32(x[r * x2_stride + k2]);
            for (int p = 0; p < P; p++) acc[r][p] = _mm512_dpbf16_ps(acc[r][p], (__m512bh)wv[p], (__m512bh)xr);
        }
    }
    for (int r = 0; r < R; r++)
        for (int p = 0; p < P; p++) {
            __m512 v = acc[r][p];
            if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + p * 16));
            _mm256_storeu_si256((__m256i *)(y + r * y_stride + p * 16), (__m256i)_mm512_cvtneps_pbh(v));
        }
}

#define TILE_ROWS(P)                                                           \
    switch (R) {                                                               \
    case 1: micro_tile(1, P, x, x2_stride, w, k2n, y, y_stride, bias); break; \
    case 2: micro_tile(2, P, x, x2_stride, w, k2n, y, y_stride, bias); break; \
    case 3: micro_tile(3, P, x, x2_stride, w, k2n, y, y_stride, bias); break; \
    case 4: micro_tile(4, P, x, x2_stride, w, k2n, y, y_stride, bias); break; \
    case 5: micro_tile(5, P, x, x2_stride, w, k2n, y, y_stride, bias); break; \
    case 6: micro_tile(6, P, x, x2_stride, w, k2n, y, y_stride, bias); break; \
    case 7: micro_tile(7, P, x, x2_stride, w, k2n, y, y_stride, bias); break; \
    default: micro_tile(8, P, x, x2_stride, w, k2n, y, y_stride, bias); break; \
    }

static void tile(int R, int P, const int32_t *x, int64_t x2_stride, const int32_t *w, int64_t k2n, uint16_t *y,
                 int64_t y_stride, const float *bias) {
    if (P == 3) {
        TILE_ROWS(3)
    } else if (P == 2) {
        TILE_ROWS(2)
    } else {
        TILE_ROWS(1)
    }
}
#endif

/* y [m, n] = x [m, k] (rows x_stride elements apart, x_stride even) @ W^T (+ bias), W packed
 * by meshlm_gemm_bf16_pack. 0, 1 for a bad shape, 2 when this build lacks AVX512-BF16. */
int meshlm_gemm_bf16(const uint16_t *x, int64_t x_stride, const int32_t *packed, const float *bias, uint16_t *y,
                     int64_t m, int64_t n, int64_t k, int num_threads) {
#ifndef HAVE_AVX512_BF16
    (void)x, (void)x_stride, (void)packed, (void)bias, (void)y, (void)m, (void)n, (void)k, (void)num_threads;
    return 2;
#else
    if (m < 0 || n <= 0 || k <= 0 || n % 16 || k % 2 || x_stride < k || x_stride % 2) return 1;
    const int64_t np = n / 16, k2n = k / 2, ng = (np + G - 1) / G, nmb = (m + MB - 1) / MB;
    const int64_t x2_stride = x_stride / 2; /* a row of x as pairs of k (int32) */
    const int64_t tasks = nmb * ng, run = tasks / (8 * (int64_t)num_threads), chunk = run > 1 ? run : 1;
#pragma omp parallel for collapse(2) schedule(dynamic, chunk) num_threads(num_threads)
    for (int64_t mb = 0; mb < nmb; mb++)
        for (int64_t g = 0; g < ng; g++) {
            const int P = group_panels(np, g);
            const int32_t *wg = packed + g * G * k2n * 16;
            const int64_t col = g * G * 16, end = (mb + 1) * MB < m ? (mb + 1) * MB : m;
            for (int64_t r0 = mb * MB; r0 < end; r0 += RT) {
                const int R = (int)(end - r0 < RT ? end - r0 : RT);
                tile(R, P, (const int32_t *)(x + r0 * x_stride), x2_stride, wg, k2n, y + r0 * n + col, n,
                     bias ? bias + col : NULL);
            }
        }
    return 0;
#endif
}
