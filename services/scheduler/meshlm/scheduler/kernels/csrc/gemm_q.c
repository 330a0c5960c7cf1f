/* GEMM for GGUF-block weights on x86-64 CPUs with AVX2 + FMA: y[M, N] = x[M, K] W^T (+ b) for
 * decode batches too large for the GEMV kernels (csrc/gemv.c) and prompt chunks alike, with W
 * held as llama.cpp Q4_1 or Q8_0 blocks (0.75 / 1.125 byte a weight instead of 4).
 *
 * W is re-laid at load time into panels of NR = 16 output columns (kernels/gemm_q.py builds
 * them from the row-major blocks of kernels/gemv.py); N is padded to a multiple of 16 with zero
 * weights, K is a multiple of 32:
 *   q4_1   q [P][K][8] uint8: byte i holds the column-i weight's 4-bit q in its low nibble and
 *          the column-(8 + i) one's in its high nibble; d, m [P][K/32][16] float32:
 *          w = d * q + m for the 32-weight block of each column.
 *   q8_0   q [P][K][16] int8, d [P][K/32][16]: w = d * q.
 * A block of KC rows of one panel is dequantized into a float32 buffer of KC x 16 (in L1),
 * exactly as the GEMV kernels do (fma(d, q, m) rounds once, like numpy's d * q + m), and a
 * 6 x 16 register-blocked micro-kernel (12 accumulators) multiplies it with every 6 rows of x,
 * read in place (six row streams; packing x cost more than it saved). The
 * dequantization is amortized over the M rows; the weight crosses memory in its small format.
 *
 * Work: tasks are (block of <= MC rows, group of panels), split among threads, M divided evenly
 * among the row blocks; within a task, for each panel and K block: dequantize, then run the
 * micro-kernel over the block's micro-panels. Panel-major order streams each panel's packed
 * weights in address order, and the next tile is prefetched while this one is multiplied (the
 * task's rows of x, <= MC x K, are re-read from L2 or L3). The first K block stores (adding the
 * bias), later ones accumulate into y. Results equal the float32 product up to summation order.
 */
#include <stdint.h>
#include <stdlib.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2 1
#endif

#define QK 32      /* weights per quantized block along K */
#define MR 6       /* rows of x per micro-kernel */
#define NR 16      /* output columns per panel */
#define KC_MAX 256 /* dequantized block: KC x NR x 4 = 16 KiB, beside the 6 x KC (6 KiB) of x in L1 */
#define MC 144     /* rows per task at most: their x is re-read from L2 by each panel */

enum { FMT_Q4_1 = 0, FMT_Q8_0 = 1 };

int meshlm_gemm_q_available(void) {
#ifdef HAVE_AVX2
    return 1;
#else
    return 0;
#endif
}

#ifdef HAVE_AVX2
/* Rows in the K block starting at k0 (KC_MAX, or fewer for the last). */
static inline int k_block_len(int64_t K, int64_t k0) { return (int)(K - k0 < KC_MAX ? K - k0 : KC_MAX); }

/* Prefetch into L1 the packed tile of panel p, rows [k0, k0 + kc), that a later dequant_panel reads. */
static void prefetch_tile(int fmt, const uint8_t *q, const float *d, const float *m, int64_t K, int64_t p,
                          int64_t k0, int kc) {
    const int64_t row_bytes = fmt == FMT_Q4_1 ? NR / 2 : NR;
    const char *qs = (const char *)q + (p * K + k0) * row_bytes;
    for (int64_t o = 0; o < kc * row_bytes; o += 64) _mm_prefetch(qs + o, _MM_HINT_T0);
    const int64_t scale_off = (p * (K / QK) + k0 / QK) * NR, scale_bytes = (int64_t)(kc / QK) * NR * 4;
    for (int64_t o = 0; o < scale_bytes; o += 64) _mm_prefetch((const char *)(d + scale_off) + o, _MM_HINT_T0);
    if (fmt == FMT_Q4_1)
        for (int64_t o = 0; o < scale_bytes; o += 64) _mm_prefetch((const char *)(m + scale_off) + o, _MM_HINT_T0);
}

/* Rows [k0, k0 + kc) of panel p as float32 [kc][16] into buf (k0, kc multiples of QK). */
static void dequant_panel(int fmt, const uint8_t *q, const float *d, const float *m, int64_t K, int64_t p,
                          int64_t k0, int kc, float *buf) {
    const int64_t kb0 = k0 / QK, nkb = K / QK;
    for (int b = 0; b < kc / QK; b++) {
        const float *db = d + (p * nkb + kb0 + b) * NR;
        const __m256 d0 = _mm256_loadu_ps(db), d1 = _mm256_loadu_ps(db + 8);
        float *out = buf + (int64_t)b * QK * NR;
        if (fmt == FMT_Q4_1) {
            const float *mb = m + (p * nkb + kb0 + b) * NR;
            const __m256 m0 = _mm256_loadu_ps(mb), m1 = _mm256_loadu_ps(mb + 8);
            const uint8_t *qb = q + (p * K + k0 + (int64_t)b * QK) * (NR / 2);
            const __m256i low4 = _mm256_set1_epi32(0x0F);
            for (int k = 0; k < QK; k++) {
                const __m256i raw = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qb + k * (NR / 2))));
                const __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(raw, low4));  /* columns 0..7 */
                const __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(raw, 4));    /* columns 8..15 */
                _mm256_store_ps(out + k * NR, _mm256_fmadd_ps(d0, lo, m0));
                _mm256_store_ps(out + k * NR + 8, _mm256_fmadd_ps(d1, hi, m1));
            }
        } else {
            const int8_t *qb = (const int8_t *)q + (p * K + k0 + (int64_t)b * QK) * NR;
            for (int k = 0; k < QK; k++) {
                const __m128i raw = _mm_loadu_si128((const __m128i *)(qb + k * NR));
                const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw));
                const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(raw, 8)));
                _mm256_store_ps(out + k * NR, _mm256_mul_ps(d0, lo));
                _mm256_store_ps(out + k * NR + 8, _mm256_mul_ps(d1, hi));
            }
        }
    }
}

/* c[rows][cols] (+)= a[rows][kc] . b (kc x 16); rows of a lda apart (read in place: x is not
 * packed), rows of c ldc apart. `first`: store, adding `bias` (16 values, or NULL); else
 * accumulate. */
static void micro_kernel(int kc, const float *a, int64_t lda, const float *b, float *c, int64_t ldc, int first,
                         const float *bias, int rows, int cols) {
    /* rows past `rows` re-read the last real row; their sums are never stored */
    const float *a0 = a, *a1 = a + (rows > 1 ? 1 : rows - 1) * lda, *a2 = a + (rows > 2 ? 2 : rows - 1) * lda;
    const float *a3 = a + (rows > 3 ? 3 : rows - 1) * lda, *a4 = a + (rows > 4 ? 4 : rows - 1) * lda;
    const float *a5 = a + (rows > 5 ? 5 : rows - 1) * lda;
    /* Twelve named accumulators: an array would be spilled to the stack at every k. */
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
    __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
    for (int k = 0; k < kc; k++) {
        const __m256 b0 = _mm256_load_ps(b + k * NR), b1 = _mm256_load_ps(b + k * NR + 8);
        __m256 av = _mm256_broadcast_ss(a0 + k);
        c00 = _mm256_fmadd_ps(av, b0, c00);
        c01 = _mm256_fmadd_ps(av, b1, c01);
        av = _mm256_broadcast_ss(a1 + k);
        c10 = _mm256_fmadd_ps(av, b0, c10);
        c11 = _mm256_fmadd_ps(av, b1, c11);
        av = _mm256_broadcast_ss(a2 + k);
        c20 = _mm256_fmadd_ps(av, b0, c20);
        c21 = _mm256_fmadd_ps(av, b1, c21);
        av = _mm256_broadcast_ss(a3 + k);
        c30 = _mm256_fmadd_ps(av, b0, c30);
        c31 = _mm256_fmadd_ps(av, b1, c31);
        av = _mm256_broadcast_ss(a4 + k);
        c40 = _mm256_fmadd_ps(av, b0, c40);
        c41 = _mm256_fmadd_ps(av, b1, c41);
        av = _mm256_broadcast_ss(a5 + k);
        c50 = _mm256_fmadd_ps(av, b0, c50);
        c51 = _mm256_fmadd_ps(av, b1, c51);
    }
    const __m256 acc[MR][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}, {c40, c41}, {c50, c51}};
    if (rows == MR && cols == NR) {
        for (int r = 0; r < MR; r++) {
            float *cr = c + r * ldc;
            __m256 lo = acc[r][0], hi = acc[r][1];
            if (!first) {
                lo = _mm256_add_ps(lo, _mm256_loadu_ps(cr));
                hi = _mm256_add_ps(hi, _mm256_loadu_ps(cr + 8));
            } else if (bias != NULL) {
                lo = _mm256_add_ps(lo, _mm256_loadu_ps(bias));
                hi = _mm256_add_ps(hi, _mm256_loadu_ps(bias + 8));
            }
            _mm256_storeu_ps(cr, lo);
            _mm256_storeu_ps(cr + 8, hi);
        }
        return;
    }
    float tile[MR * NR];
    for (int r = 0; r < MR; r++) {
        _mm256_storeu_ps(tile + r * NR, acc[r][0]);
        _mm256_storeu_ps(tile + r * NR + 8, acc[r][1]);
    }
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < cols; j++) {
            const float v = tile[r * NR + j];
            c[r * ldc + j] = first ? (bias != NULL ? v + bias[j] : v) : c[r * ldc + j] + v;
        }
}

#endif

/* y [M, N] (rows N apart) = x [M, K] (rows x_stride apart) . W^T (+ bias [N]); W in the panel
 * layout of `fmt` (0 = q4_1 with mins `m`, 1 = q8_0, m unused). Returns 0; 1 on bad arguments,
 * 2 where this build has no AVX2, 3 when scratch memory could not be allocated. */
int meshlm_gemm_q(int fmt, const float *x, int64_t x_stride, int64_t M, const uint8_t *q, const float *d,
                  const float *m, const float *bias, float *y, int64_t N, int64_t K, int num_threads) {
#ifndef HAVE_AVX2
    (void)fmt, (void)x, (void)x_stride, (void)M, (void)q, (void)d, (void)m, (void)bias, (void)y, (void)N, (void)K,
        (void)num_threads;
    return 2;
#else
    if (M <= 0 || N <= 0 || K <= 0 || K % QK != 0 || x_stride < K || num_threads < 1) return 1;
    if (fmt != FMT_Q4_1 && fmt != FMT_Q8_0) return 1;
    const int64_t panels = (N + NR - 1) / NR;
    const int64_t k_blocks = (K + KC_MAX - 1) / KC_MAX; /* KC_MAX is a multiple of QK */
    const int64_t m_blocks = (M + MC - 1) / MC;
    /* rows per task: M split evenly among the row blocks, rounded up to whole micro-panels */
    const int64_t mc = ((M + m_blocks - 1) / m_blocks + MR - 1) / MR * MR;
    int64_t groups = (4 * (int64_t)num_threads + m_blocks - 1) / m_blocks;
    if (groups > panels) groups = panels;
    const int64_t tasks = m_blocks * groups;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *buf = aligned_alloc(64, sizeof(float) * KC_MAX * NR);
        failed |= buf == NULL;
        /* dynamic: a thread the OS preempts (another process on these cores) hands its tasks on */
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < tasks; t++) {
            if (buf == NULL) continue;
            const int64_t i0 = (t / groups) * mc;
            const int64_t rows = M - i0 < mc ? M - i0 : mc;
            const int64_t g = t % groups, p_end = (g + 1) * panels / groups;
            for (int64_t p = g * panels / groups; p < p_end; p++) {
                const int cols = (int)(N - p * NR < NR ? N - p * NR : NR);
                const float *bias_p = bias != NULL ? bias + p * NR : NULL;
                for (int64_t kb = 0; kb < k_blocks; kb++) {
                    const int64_t k0 = kb * KC_MAX;
                    const int kc = k_block_len(K, k0);
                    /* the next tile: this panel's next K block, else the next panel's first */
                    if (kb + 1 < k_blocks)
                        prefetch_tile(fmt, q, d, m, K, p, k0 + KC_MAX, k_block_len(K, k0 + KC_MAX));
                    else if (p + 1 < p_end)
                        prefetch_tile(fmt, q, d, m, K, p + 1, 0, k_block_len(K, 0));
                    dequant_panel(fmt, q, d, m, K, p, k0, kc, buf);
                    for (int64_t r0 = 0; r0 < rows; r0 += MR)
                        micro_kernel(kc, x + (i0 + r0) * x_stride + k0, x_stride, buf, y + (i0 + r0) * N + p * NR,
                                     N, kb == 0, bias_p, (int)(rows - r0 < MR ? rows - r0 : MR), cols);
                }
            }
        }
        free(buf);
    }
    return failed ? 3 : 0;
#endif
}
