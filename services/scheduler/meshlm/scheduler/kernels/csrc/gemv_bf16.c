/* Small-batch linears of a bf16 model over the checkpoint's own GGUF blocks, for CPUs with
 * AVX512-BF16: y = x W^T (+ b) for 1..MAX_ROWS bf16 rows of x, W in the q4_1 / q8_0 formats of
 * gemv.c (blocks of 32 weights along K: w_j = d * q_j + m for q4_1, d * q_j for q8_0; d and m
 * float32 arrays, quants as there). The weights read are 0.75 / 1.125 byte each instead of
 * the 2 of a bf16 copy, and a decode batch of a few rows is bound by reading them.
 *
 * A block's dot product splits as  sum_j (d q_j + m) x_j = d * (q . x) + m * sum_j x_j:
 *   - q . x is one VDPBF16PS: the quants as bf16 (small integers, exact) against 32 bf16 of
 *     x, every product exact and summed in float32; d scales the block's 16 partial sums;
 *   - sum_j x_j of each block and row of x is computed once per call (s[m][b]), and the mins
 *     term of a whole row of W is a dot product of its mins with s.
 * Results are float32 sums (of exact products, in another order than a float32 GEMV) rounded
 * once to bf16. These are the checkpoint's exact weights, not their bf16 roundings: a bf16
 * model's oneDNN path multiplies the rounded weights, so outputs of the two paths differ by
 * about one bf16 rounding of the weights.
 *
 * x rows are x_stride elements apart; y is [M, N] bf16, contiguous; bias (may be NULL) float32.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define HAVE_AVX512_BF16 1
#endif

#define QK 32       /* weights per block */
#define MAX_ROWS 16 /* kernels/gemv_bf16.py: MAX_ROWS */

int meshlm_gemv_bf16_available(void) {
#ifdef HAVE_AVX512_BF16
    return 1;
#else
    return 0;
#endif
}

#ifdef HAVE_AVX512_BF16
static inline uint16_t f32_to_bf16(float f) { /* round to nearest even; NaN stays NaN */
    union { uint32_t u; float f; } x;
    x.f = f;
    if ((x.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x.u >> 16) | 0x40);
    return (uint16_t)((x.u + 0x7fffu + ((x.u >> 16) & 1u)) >> 16);
}

/* 16 bf16 at p as float32 (exact: a bf16 is the top half of a float). */
static inline __m512 bf16x16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* s[m * nb + b] = sum of block b of row m of x, in float32. */
static void block_sums(const uint16_t *x, int64_t x_stride, int M, int nb, float *s) {
    for (int m = 0; m < M; m++)
        for (int b = 0; b < nb; b++) {
            const uint16_t *xb = x + m * x_stride + (int64_t)b * QK;
            s[(int64_t)m * nb + b] = _mm512_reduce_add_ps(_mm512_add_ps(bf16x16(xb), bf16x16(xb + 16)));
        }
}

/* sum_b v[b] * s[b] over nb blocks. */
static inline float dot_blocks(const float *v, const float *s, int nb) {
    __m512 acc = _mm512_setzero_ps();
    int b = 0;
    for (; b + 16 <= nb; b += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(v + b), _mm512_loadu_ps(s + b), acc);
    const __mmask16 tail = (__mmask16)((1u << (nb - b)) - 1u);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, v + b), _mm512_maskz_loadu_ps(tail, s + b), acc);
    return _mm512_reduce_add_ps(acc);
}

/* The 32 quants of a q4_1 block (byte j = q_j | q_{j+16} << 4) as bf16, in order q_0..q_31. */
static inline __m512bh q4_block(const uint8_t *qb, __m512i table) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)qb), low4 = _mm_set1_epi8(0x0F);
    const __m256i q8 = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), low4), _mm_and_si128(raw, low4));
    return (__m512bh)_mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(q8), table); /* 0..15 -> bf16 */
}

/* The 32 quants of a q8_0 block (int8) as bf16 (exact: |q| <= 127). */
static inline __m512bh q8_block(const int8_t *qb) {
    const __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)qb)));
    const __m512 b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(qb + 16))));
    return _mm512_cvtne2ps_pbh(b, a);
}

/* Row n of W against M rows of x: out[m] = sum_b d_b * (q_b . x_mb) (the mins term is added by
 * the caller). M is a compile-time constant after inlining, so acc stays in registers. */
static inline __attribute__((always_inline)) void row_dots(const uint16_t *x, int64_t x_stride, const float *d,
                                                           const uint8_t *q, int is_q4, int nb, __m512i table,
                                                           float *out, const int M) {
    __m512 acc[MAX_ROWS];
#pragma GCC unroll 16
    for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const __m512bh qv = is_q4 ? q4_block(q + (int64_t)b * (QK / 2), table) : q8_block((const int8_t *)q + (int64_t)b * QK);
        const __m512 vd = _mm512_set1_ps(d[b]);
#pragma GCC unroll 16
        for (int m = 0; m < M; m++) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * x_stride + (int64_t)b * QK);
            acc[m] = _mm512_fmadd_ps(vd, _mm512_dpbf16_ps(_mm512_setzero_ps(), qv, xv), acc[m]);
        }
    }
#pragma GCC unroll 16
    for (int m = 0; m < M; m++) out[m] = _mm512_reduce_add_ps(acc[m]);
}

#define PF_ROWS 4 /* rows of W prefetched ahead */

static inline void prefetch_bytes(const void *p, int64_t bytes) {
    for (int64_t c = 0; c < bytes; c += 64) __builtin_prefetch((const char *)p + c);
}

#define ROW_CASES(CALL)                                                                          \
    case 1: CALL(1); break; case 2: CALL(2); break; case 3: CALL(3); break; case 4: CALL(4); break; \
    case 5: CALL(5); break; case 6: CALL(6); break; case 7: CALL(7); break; case 8: CALL(8); break; \
    case 9: CALL(9); break; case 10: CALL(10); break; case 11: CALL(11); break;                   \
    case 12: CALL(12); break; case 13: CALL(13); break; case 14: CALL(14); break;                 \
    case 15: CALL(15); break; case 16: CALL(16); break;
#endif

/* is_q4: 1 = q4_1 (mins given), 0 = q8_0 (mins NULL). Returns 0, 1 on bad shapes, 2 without
 * AVX512-BF16 in this build, 3 when scratch memory could not be allocated. */
int meshlm_gemv_blocks_bf16(const uint16_t *x, int64_t x_stride, const float *d, const float *mins,
                            const void *q, int is_q4, const float *bias, uint16_t *y, int M, int64_t N, int K,
                            int num_threads) {
    if (M <= 0 || M > MAX_ROWS || K <= 0 || K % QK || (is_q4 && mins == NULL)) return 1;
#ifndef HAVE_AVX512_BF16
    (void)x, (void)x_stride, (void)d, (void)q, (void)bias, (void)y, (void)N, (void)num_threads;
    return 2;
#else
    const int nb = K / QK;
    float *s = NULL;
    if (is_q4) {
        s = (float *)malloc((size_t)M * nb * sizeof(float));
        if (s == NULL) return 3;
        block_sums(x, x_stride, M, nb, s);
    }
    /* bf16 bit patterns of 0.0 .. 15.0, indexed by a q4 quant (the upper 16 entries unused) */
    static const uint16_t values[32] = {0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0, 0x40e0,
                                        0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};
    const __m512i table = _mm512_loadu_si512(values);
    const int64_t qbytes = is_q4 ? QK / 2 : QK; /* bytes of quants per block */
    const int64_t row_q = nb * qbytes, row_s = nb * (int64_t)sizeof(float); /* bytes of a row of W */
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *qn = (const uint8_t *)q + n * row_q;
        const float *dn = d + n * nb;
        if (n + PF_ROWS < N) { /* three streams per row: the hardware prefetcher alone lags */
            prefetch_bytes(qn + PF_ROWS * row_q, row_q);
            prefetch_bytes(dn + PF_ROWS * nb, row_s);
            if (is_q4) prefetch_bytes(mins + (n + PF_ROWS) * nb, row_s);
        }
        float out[MAX_ROWS];
#define ROW(R) row_dots(x, x_stride, dn, qn, is_q4, nb, table, out, R)
        switch (M) { ROW_CASES(ROW) }
#undef ROW
        for (int m = 0; m < M; m++) {
            float v = out[m];
            if (is_q4) v += dot_blocks(mins + n * nb, s + (int64_t)m * nb, nb);
            if (bias != NULL) v += bias[n];
            y[(int64_t)m * N + n] = f32_to_bf16(v);
        }
    }
    free(s);
    return 0;
#endif
}
