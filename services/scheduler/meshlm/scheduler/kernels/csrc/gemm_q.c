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
 * On CPUs with AVX-512 the same tasks run on 512-bit registers: two neighbouring panels are
 * dequantized side by side into a KC x 32 buffer and an 8 x 32 micro-kernel (16 accumulators,
 * each a zmm of 16 columns) multiplies it with every 8 rows of x. Each output's sum runs over
 * the same K blocks in the same order of FMAs as in the AVX2 kernel, so the two give the same
 * bits (meshlm_gemm_q_avx2 keeps the AVX2 kernel callable on such CPUs for that check).
 *
 * Work: tasks are (block of <= MC rows, group of units), split among threads, M divided evenly
 * among the row blocks; a unit is one panel (AVX2) or two (AVX-512), and one driver,
 * gemm_q_run, serves both. Within a task, for each unit and K block: dequantize, then run the
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
#if defined(__AVX512F__)
#define HAVE_AVX512 1
#endif
#endif

#define QK 32      /* weights per quantized block along K */
#define MR 6       /* rows of x per micro-kernel */
#define NR 16      /* output columns per panel */
#define KC_MAX 256 /* dequantized block: KC x NR x 4 = 16 KiB, beside the 6 x KC (6 KiB) of x in L1 */
#define MC 144     /* rows per task at most: their x is re-read from L2 by each panel */
#define MR512 8    /* rows of x per AVX-512 micro-kernel */
#define NR512 32   /* columns per AVX-512 micro-kernel: two panels */

enum { FMT_Q4_1 = 0, FMT_Q8_0 = 1 };

int meshlm_gemm_q_available(void) {
#ifdef HAVE_AVX2
    return 1;
#else
    return 0;
#endif
}

/* 512 when meshlm_gemm_q runs the AVX-512 kernel, 256 for the AVX2 one, 0 without either. */
int meshlm_gemm_q_vector_bits(void) {
#if defined(HAVE_AVX512)
    return 512;
#elif defined(HAVE_AVX2)
    return 256;
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

/* Rows [k0, k0 + kc) of panel p as float32 [kc][16] into buf, its rows `ld` floats apart (k0, kc
 * multiples of QK). */
static void dequant_panel(int fmt, const uint8_t *q, const float *d, const float *m, int64_t K, int64_t p,
                          int64_t k0, int kc, float *buf, int ld) {
    const int64_t kb0 = k0 / QK, nkb = K / QK;
    for (int b = 0; b < kc / QK; b++) {
        const float *db = d + (p * nkb + kb0 + b) * NR;
        const __m256 d0 = _mm256_loadu_ps(db), d1 = _mm256_loadu_ps(db + 8);
        float *out = buf + (int64_t)b * QK * ld;
        if (fmt == FMT_Q4_1) {
            const float *mb = m + (p * nkb + kb0 + b) * NR;
            const __m256 m0 = _mm256_loadu_ps(mb), m1 = _mm256_loadu_ps(mb + 8);
            const uint8_t *qb = q + (p * K + k0 + (int64_t)b * QK) * (NR / 2);
            const __m256i low4 = _mm256_set1_epi32(0x0F);
            for (int k = 0; k < QK; k++) {
                const __m256i raw = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qb + k * (NR / 2))));
                const __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(raw, low4));  /* columns 0..7 */
                const __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(raw, 4));    /* columns 8..15 */
                _mm256_store_ps(out + k * ld, _mm256_fmadd_ps(d0, lo, m0));
                _mm256_store_ps(out + k * ld + 8, _mm256_fmadd_ps(d1, hi, m1));
            }
        } else {
            const int8_t *qb = (const int8_t *)q + (p * K + k0 + (int64_t)b * QK) * NR;
            for (int k = 0; k < QK; k++) {
                const __m128i raw = _mm_loadu_si128((const __m128i *)(qb + k * NR));
                const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw));
                const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(raw, 8)));
                _mm256_store_ps(out + k * ld, _mm256_mul_ps(d0, lo));
                _mm256_store_ps(out + k * ld + 8, _mm256_mul_ps(d1, hi));
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

#ifdef HAVE_AVX512
/* c[rows][cols] (+)= a[rows][kc] . b (kc x 32, rows 32 floats apart: two panels side by side);
 * as micro_kernel, on zmm registers: 8 rows x 2 halves of 16 columns. */
static void micro_kernel_512(int kc, const float *a, int64_t lda, const float *b, float *c, int64_t ldc, int first,
                             const float *bias, int rows, int cols) {
    /* rows past `rows` re-read the last real row; their sums are never stored */
#define ROW_PTR(r) const float *a##r = a + (rows > r ? r : rows - 1) * lda
    ROW_PTR(0);
    ROW_PTR(1);
    ROW_PTR(2);
    ROW_PTR(3);
    ROW_PTR(4);
    ROW_PTR(5);
    ROW_PTR(6);
    ROW_PTR(7);
#undef ROW_PTR
    /* Sixteen named accumulators (an array would be spilled at every k), cR0 / cR1 = row R's
     * columns 0..15 / 16..31. */
    __m512 c00 = _mm512_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, c31 = c00;
    __m512 c40 = c00, c41 = c00, c50 = c00, c51 = c00, c60 = c00, c61 = c00, c70 = c00, c71 = c00;
    for (int k = 0; k < kc; k++) {
        const __m512 b0 = _mm512_load_ps(b + k * NR512), b1 = _mm512_load_ps(b + k * NR512 + 16);
#define ROW_FMA(r)                                          \
    do {                                                    \
        const __m512 av = _mm512_set1_ps(a##r[k]);          \
        c##r##0 = _mm512_fmadd_ps(av, b0, c##r##0);         \
        c##r##1 = _mm512_fmadd_ps(av, b1, c##r##1);         \
    } while (0)
        ROW_FMA(0);
        ROW_FMA(1);
        ROW_FMA(2);
        ROW_FMA(3);
        ROW_FMA(4);
        ROW_FMA(5);
        ROW_FMA(6);
        ROW_FMA(7);
#undef ROW_FMA
    }
    const __m512 acc[MR512][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31},
                                  {c40, c41}, {c50, c51}, {c60, c61}, {c70, c71}};
    if (rows == MR512 && cols == NR512) {
        for (int r = 0; r < MR512; r++) {
            float *cr = c + r * ldc;
            __m512 lo = acc[r][0], hi = acc[r][1];
            if (!first) {
                lo = _mm512_add_ps(lo, _mm512_loadu_ps(cr));
                hi = _mm512_add_ps(hi, _mm512_loadu_ps(cr + 16));
            } else if (bias != NULL) {
                lo = _mm512_add_ps(lo, _mm512_loadu_ps(bias));
                hi = _mm512_add_ps(hi, _mm512_loadu_ps(bias + 16));
            }
            _mm512_storeu_ps(cr, lo);
            _mm512_storeu_ps(cr + 16, hi);
        }
        return;
    }
    float tile[MR512 * NR512];
    for (int r = 0; r < MR512; r++) {
        _mm512_storeu_ps(tile + r * NR512, acc[r][0]);
        _mm512_storeu_ps(tile + r * NR512 + 16, acc[r][1]);
    }
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < cols; j++) {
            const float v = tile[r * NR512 + j];
            c[r * ldc + j] = first ? (bias != NULL ? v + bias[j] : v) : c[r * ldc + j] + v;
        }
}
#endif

#ifdef HAVE_AVX2
/* The arguments meshlm_gemm_q checks (1 when bad). */
static int bad_args(int fmt, int64_t x_stride, int64_t M, int64_t N, int64_t K, int num_threads) {
    if (M <= 0 || N <= 0 || K <= 0 || K % QK != 0 || x_stride < K || num_threads < 1) return 1;
    return fmt != FMT_Q4_1 && fmt != FMT_Q8_0;
}

/* Tasks of `units` column units (panels, or pairs of panels) over M rows in row blocks of at
 * most MC, rounded to whole micro-panels of `mr` rows: a task is (row block, group of units). */
typedef struct {
    int64_t mc, groups, tasks;
} Split;

static Split split_tasks(int64_t M, int64_t units, int mr, int num_threads) {
    const int64_t m_blocks = (M + MC - 1) / MC;
    Split s;
    /* rows per task: M split evenly among the row blocks, rounded up to whole micro-panels */
    s.mc = ((M + m_blocks - 1) / m_blocks + mr - 1) / mr * mr;
    s.groups = (4 * (int64_t)num_threads + m_blocks - 1) / m_blocks;
    if (s.groups > units) s.groups = units;
    s.tasks = m_blocks * s.groups;
    return s;
}

/* One driver for both kernels (see the header). A unit is `per` neighbouring panels: one for the
 * AVX2 kernel (6 x 16 micro-kernels), two for the AVX-512 one (8 x 32; `wide`, an AVX-512 build
 * only). A last unit of fewer panels leaves the rest of its buffer zero, and those columns are
 * never stored. */
static int gemm_q_run(int wide, int fmt, const float *x, int64_t x_stride, int64_t M, const uint8_t *q,
                      const float *d, const float *m, const float *bias, float *y, int64_t N, int64_t K,
                      int num_threads) {
    const int per = wide ? 2 : 1, ld = per * NR, mr = wide ? MR512 : MR;
    const int64_t panels = (N + NR - 1) / NR, units = (panels + per - 1) / per;
    const int64_t k_blocks = (K + KC_MAX - 1) / KC_MAX; /* KC_MAX is a multiple of QK */
    const Split sp = split_tasks(M, units, mr, num_threads);
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *buf = aligned_alloc(64, sizeof(float) * KC_MAX * ld);
        failed |= buf == NULL;
        if (buf != NULL)
            for (int64_t i = 0; i < (int64_t)KC_MAX * ld; i++) buf[i] = 0.0f;
        /* dynamic: a thread the OS preempts (another process on these cores) hands its tasks on */
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < sp.tasks; t++) {
            if (buf == NULL) continue;
            const int64_t i0 = (t / sp.groups) * sp.mc;
            const int64_t rows = M - i0 < sp.mc ? M - i0 : sp.mc;
            const int64_t g = t % sp.groups, u_end = (g + 1) * units / sp.groups;
            for (int64_t u = g * units / sp.groups; u < u_end; u++) {
                const int64_t p = per * u, col0 = p * NR;
                const int cols = (int)(N - col0 < ld ? N - col0 : ld);
                const float *bias_p = bias != NULL ? bias + col0 : NULL;
                for (int64_t kb = 0; kb < k_blocks; kb++) {
                    const int64_t k0 = kb * KC_MAX;
                    const int kc = k_block_len(K, k0);
                    /* the next tiles: this unit's next K block, else the next unit's first */
                    const int64_t next_p = kb + 1 < k_blocks ? p : p + per;
                    const int64_t next_k0 = kb + 1 < k_blocks ? k0 + KC_MAX : 0;
                    if (kb + 1 < k_blocks || u + 1 < u_end)
                        for (int64_t np = next_p; np < next_p + per && np < panels; np++)
                            prefetch_tile(fmt, q, d, m, K, np, next_k0, k_block_len(K, next_k0));
                    for (int64_t j = p; j < p + per && j < panels; j++)
                        dequant_panel(fmt, q, d, m, K, j, k0, kc, buf + (j - p) * NR, ld);
                    for (int64_t r0 = 0; r0 < rows; r0 += mr) {
                        const float *xr = x + (i0 + r0) * x_stride + k0;
                        float *yr = y + (i0 + r0) * N + col0;
                        const int r = (int)(rows - r0 < mr ? rows - r0 : mr);
#ifdef HAVE_AVX512
                        if (wide) {
                            micro_kernel_512(kc, xr, x_stride, buf, yr, N, kb == 0, bias_p, r, cols);
                            continue;
                        }
#endif
                        micro_kernel(kc, xr, x_stride, buf, yr, N, kb == 0, bias_p, r, cols);
                    }
                }
            }
        }
        free(buf);
    }
    return failed ? 3 : 0;
}
#endif

/* y [M, N] (rows N apart) = x [M, K] (rows x_stride apart) . W^T (+ bias [N]); W in the panel
 * layout of `fmt` (0 = q4_1 with mins `m`, 1 = q8_0, m unused), on the widest kernel this build
 * has (meshlm_gemm_q_vector_bits). Returns 0; 1 on bad arguments, 2 where this build has no
 * AVX2, 3 when scratch memory could not be allocated. */
int meshlm_gemm_q(int fmt, const float *x, int64_t x_stride, int64_t M, const uint8_t *q, const float *d,
                  const float *m, const float *bias, float *y, int64_t N, int64_t K, int num_threads) {
#ifndef HAVE_AVX2
    (void)fmt, (void)x, (void)x_stride, (void)M, (void)q, (void)d, (void)m, (void)bias, (void)y, (void)N, (void)K,
        (void)num_threads;
    return 2;
#else
    if (bad_args(fmt, x_stride, M, N, K, num_threads)) return 1;
#ifdef HAVE_AVX512
    return gemm_q_run(1, fmt, x, x_stride, M, q, d, m, bias, y, N, K, num_threads);
#else
    return gemm_q_run(0, fmt, x, x_stride, M, q, d, m, bias, y, N, K, num_threads);
#endif
#endif
}

/* meshlm_gemm_q on the AVX2 kernel whatever this build has (the AVX-512 one must equal it). */
int meshlm_gemm_q_avx2(int fmt, const float *x, int64_t x_stride, int64_t M, const uint8_t *q, const float *d,
                       const float *m, const float *bias, float *y, int64_t N, int64_t K, int num_threads) {
#ifndef HAVE_AVX2
    (void)fmt, (void)x, (void)x_stride, (void)M, (void)q, (void)d, (void)m, (void)bias, (void)y, (void)N, (void)K,
        (void)num_threads;
    return 2;
#else
    if (bad_args(fmt, x_stride, M, N, K, num_threads)) return 1;
    return gemm_q_run(0, fmt, x, x_stride, M, q, d, m, bias, y, N, K, num_threads);
#endif
}
