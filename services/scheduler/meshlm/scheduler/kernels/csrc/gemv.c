/* Small-batch linears for CPUs: y = x W^T (+ b) for 1..MAX_ROWS rows of x (decode-sized batches),
 * where the product is bound by reading W once. W is held in one of three formats:
 *
 *   f32    dense [N, K] float32.
 *   q4_1   llama.cpp's Q4_1 blocks along K: 32 weights w_j = d * q_j + m, q_j in 0..15, with d and
 *          m float16 values (stored here widened to float32, which is exact). 0.75 byte/weight.
 *   q8_0   llama.cpp's Q8_0 blocks: w_j = d * q_j, q_j in -127..127, d a float16. 1.125 byte/weight.
 *
 * A quantized format is used only where it reproduces the float32 weight bit for bit: a GGUF
 * model dequantized at load time holds exactly such weights, and `*_recover` finds the blocks
 * back from the float32 tensor (returning nonzero when any block is not exactly representable).
 * Dequantization is exact arithmetic: d has 11 significant bits and q at most 8, so d * q is
 * exact in float32 and fma(d, q, m) rounds once, as numpy's `d * q + m` does. Results then
 * equal the dense GEMV up to summation order.
 *
 * Block layout (q4_1): per block 16 bytes, byte j = q_j | q_{j+16} << 4 (llama.cpp's order);
 * blocks of row n at [n * K/32, (n+1) * K/32). q8_0: 32 int8 per block, same block order.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2 1
#endif

#define QK 32        /* weights per block */
#define MAX_ROWS 16  /* GEMV_MAX_ROWS in kernels/gemv.py */

/* Dense float32: threads split the rows of w, each streams its share sequentially (the hardware
 * prefetcher follows), and x stays in L1. x rows are x_stride apart, y is [M, N] contiguous. */
int meshlm_gemv_f32(const float *x, int64_t x_stride, const float *w, const float *bias, float *y,
                    int M, int64_t N, int K, int num_threads) {
    if (M <= 0 || M > MAX_ROWS || K <= 0) return 1;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const float *wr = w + n * K;
        for (int m = 0; m < M; m++) {
            const float *xr = x + m * x_stride;
            float acc = 0.f;
#pragma omp simd reduction(+ : acc)
            for (int k = 0; k < K; k++) acc += wr[k] * xr[k];
            y[(int64_t)m * N + n] = bias != NULL ? acc + bias[n] : acc;
        }
    }
    return 0;
}

/* The float value of the float16 nearest to x >= 0 (round to nearest even, subnormals kept). */
static float half_round(float x) {
    if (x == 0.f) return 0.f;
    int e;
    frexpf(x, &e);            /* x = f * 2^e, f in [0.5, 1): the leading bit is 2^(e-1) */
    int lead = e - 1;
    if (lead < -14) lead = -14; /* float16 subnormals share the quantum 2^-24 */
    const float quantum = ldexpf(1.f, lead - 10); /* 10 fraction bits below the leading one */
    return rintf(x / quantum) * quantum;          /* x / quantum is exact (a power of two) */
}

/* Does d reproduce the block: every w_j == fma(d, q_j, m) for some q_j in [lo, hi]? */
static int block_fits(const float *w, float d, float m, int lo, int hi, int *q) {
    for (int j = 0; j < QK; j++) {
        int v = d > 0.f ? (int)rintf((w[j] - m) / d) : 0;
        v = v < lo ? lo : (v > hi ? hi : v);
        if (fmaf(d, (float)v, m) != w[j]) return 0;
        q[j] = v;
    }
    return 1;
}

/* Try d = the float16 nearest to `estimate` and its two neighbours on either side. */
static int find_scale(const float *w, float estimate, float m, int lo, int hi, float *d_out, int *q) {
    const float d0 = half_round(estimate);
    int e;
    frexpf(d0 > 0.f ? d0 : 1.f, &e);
    const float step = ldexpf(1.f, (e - 1 < -14 ? -14 : e - 1) - 10);
    for (int k = 0; k < 5; k++) {
        const float d = d0 + (float)((k + 1) / 2 * (k % 2 ? 1 : -1)) * step; /* 0, +1, -1, +2, -2 */
        if (d < 0.f) continue;
        if (block_fits(w, d, m, lo, hi, q)) {
            *d_out = d;
            return 1;
        }
    }
    return 0;
}

/* Q4_1 block b: the minimum quantizes to 0 (w = m exactly), the maximum to 15. */
static int q4_1_block(const float *wb, int64_t b, float *d, float *mins, void *quants) {
    float lo = wb[0], hi = wb[0];
    for (int j = 1; j < QK; j++) {
        lo = wb[j] < lo ? wb[j] : lo;
        hi = wb[j] > hi ? wb[j] : hi;
    }
    int qs[QK];
    if (!find_scale(wb, (hi - lo) / 15.f, lo, 0, 15, &d[b], qs)) return 0;
    mins[b] = lo;
    uint8_t *q = (uint8_t *)quants + b * 16;
    for (int j = 0; j < QK / 2; j++) q[j] = (uint8_t)(qs[j] | (qs[j + 16] << 4));
    return 1;
}

/* Q8_0 block b: the element of largest magnitude quantizes to +-127. */
static int q8_0_block(const float *wb, int64_t b, float *d, float *mins, void *quants) {
    (void)mins;
    float amax = 0.f;
    for (int j = 0; j < QK; j++) amax = fabsf(wb[j]) > amax ? fabsf(wb[j]) : amax;
    int qs[QK];
    if (!find_scale(wb, amax / 127.f, 0.f, -127, 127, &d[b], qs)) return 0;
    int8_t *q = (int8_t *)quants + b * QK;
    for (int j = 0; j < QK; j++) q[j] = (int8_t)qs[j];
    return 1;
}

typedef int (*block_fn)(const float *wb, int64_t b, float *d, float *mins, void *quants);

/* Every block of w [N, K] through `fit`; nonzero when one is not exactly representable. */
static int recover(block_fn fit, const float *w, int64_t N, int K, float *d, float *mins, void *quants,
                   int num_threads) {
    if (K <= 0 || K % QK) return 2;
    const int64_t blocks = N * (K / QK);
    int bad = 0;
#pragma omp parallel for num_threads(num_threads) schedule(static) reduction(| : bad)
    for (int64_t b = 0; b < blocks; b++) {
        if (!bad && !fit(w + b * QK, b, d, mins, quants)) bad = 1;
    }
    return bad;
}

int meshlm_q4_1_recover(const float *w, int64_t N, int K, float *d, float *mins, uint8_t *q,
                        int num_threads) {
    return recover(q4_1_block, w, N, K, d, mins, q, num_threads);
}

int meshlm_q8_0_recover(const float *w, int64_t N, int K, float *d, int8_t *q, int num_threads) {
    return recover(q8_0_block, w, N, K, d, NULL, q, num_threads);
}

#ifdef HAVE_AVX2
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Independent FMA chains per row of x: one chain per row runs at the FMA latency (4 cycles
 * a block here), so few rows split their sum over P partial accumulators (summed at the end). */
#define CHAINS(M) ((M) == 1 ? 4 : ((M) == 2 ? 2 : 1))

/* acc[m][*] += the block's 4 x 8 weights (w[0..3]) times row m of x at offset k. */
static inline __attribute__((always_inline)) void dot_block(const float *x, int64_t x_stride, int k,
                                                            const __m256 w[4], __m256 acc[][4], const int M) {
    const int P = CHAINS(M);
#pragma GCC unroll 16
    for (int m = 0; m < M; m++) {
        const float *xb = x + m * x_stride + k;
#pragma GCC unroll 4
        for (int s = 0; s < 4; s++) acc[m][s % P] = _mm256_fmadd_ps(w[s], _mm256_loadu_ps(xb + 8 * s), acc[m][s % P]);
    }
}

static inline __attribute__((always_inline)) void sum_chains(__m256 acc[][4], float *out, const int M) {
    const int P = CHAINS(M);
#pragma GCC unroll 16
    for (int m = 0; m < M; m++) {
        __m256 t = acc[m][0];
        for (int p = 1; p < P; p++) t = _mm256_add_ps(t, acc[m][p]);
        out[m] = hsum(t);
    }
}

/* Row n of a q4_1 weight against M rows of x (M a compile-time constant after inlining). */
static inline __attribute__((always_inline)) void q4_1_row(const float *x, int64_t x_stride, const float *d,
                                                           const float *mins, const uint8_t *q, int nb, int64_t b0,
                                                           float *out, const int M) {
    __m256 acc[MAX_ROWS][4];
#pragma GCC unroll 16
    for (int m = 0; m < M; m++)
        for (int p = 0; p < 4; p++) acc[m][p] = _mm256_setzero_ps();
    const __m128i low4 = _mm_set1_epi8(0x0F);
    for (int b = 0; b < nb; b++) {
        const __m128i raw = _mm_loadu_si128((const __m128i *)(q + (b0 + b) * 16));
        const __m128i lo = _mm_and_si128(raw, low4);                    /* q_0..q_15 */
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low4); /* q_16..q_31 */
        const __m256 vd = _mm256_set1_ps(d[b0 + b]), vm = _mm256_set1_ps(mins[b0 + b]);
        const __m256 w[4] = {
            _mm256_fmadd_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), vm),
            _mm256_fmadd_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), vm),
            _mm256_fmadd_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), vm),
            _mm256_fmadd_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), vm),
        };
        dot_block(x, x_stride, b * QK, w, acc, M);
    }
    sum_chains(acc, out, M);
}

/* Row n of a q8_0 weight against M rows of x. */
static inline __attribute__((always_inline)) void q8_0_row(const float *x, int64_t x_stride, const float *d,
                                                           const int8_t *q, int nb, int64_t b0, float *out,
                                                           const int M) {
    __m256 acc[MAX_ROWS][4];
#pragma GCC unroll 16
    for (int m = 0; m < M; m++)
        for (int p = 0; p < 4; p++) acc[m][p] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const int8_t *qb = q + (b0 + b) * QK;
        const __m256 vd = _mm256_set1_ps(d[b0 + b]);
        const __m128i r0 = _mm_loadu_si128((const __m128i *)qb);
        const __m128i r1 = _mm_loadu_si128((const __m128i *)(qb + 16));
        const __m256 w[4] = {
            _mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(r0))),
            _mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(r0, 8)))),
            _mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(r1))),
            _mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(r1, 8)))),
        };
        dot_block(x, x_stride, b * QK, w, acc, M);
    }
    sum_chains(acc, out, M);
}

/* One switch case per row count, so that every row kernel is compiled for a constant M. */
#define ROW_CASES(CALL)                                                                          \
    case 1: CALL(1); break; case 2: CALL(2); break; case 3: CALL(3); break; case 4: CALL(4); break; \
    case 5: CALL(5); break; case 6: CALL(6); break; case 7: CALL(7); break; case 8: CALL(8); break; \
    case 9: CALL(9); break; case 10: CALL(10); break; case 11: CALL(11); break;                   \
    case 12: CALL(12); break; case 13: CALL(13); break; case 14: CALL(14); break;                 \
    case 15: CALL(15); break; case 16: CALL(16); break;
#endif

int meshlm_gemv_q4_1(const float *x, int64_t x_stride, const float *d, const float *mins,
                     const uint8_t *q, const float *bias, float *y, int M, int64_t N, int K,
                     int num_threads) {
    if (M <= 0 || M > MAX_ROWS || K <= 0 || K % QK) return 1;
    const int nb = K / QK;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const int64_t b0 = n * nb;
        float out[MAX_ROWS] = {0};
#ifdef HAVE_AVX2
#define Q4_ROW(R) q4_1_row(x, x_stride, d, mins, q, nb, b0, out, R)
        switch (M) { ROW_CASES(Q4_ROW) }
#undef Q4_ROW
#else
        for (int m = 0; m < M; m++) out[m] = 0.f;
        for (int b = 0; b < nb; b++) {
            const uint8_t *qb = q + (b0 + b) * 16;
            float wv[QK];
            for (int j = 0; j < QK / 2; j++) {
                wv[j] = fmaf(d[b0 + b], (float)(qb[j] & 0x0F), mins[b0 + b]);
                wv[j + 16] = fmaf(d[b0 + b], (float)(qb[j] >> 4), mins[b0 + b]);
            }
            for (int m = 0; m < M; m++) {
                const float *xb = x + m * x_stride + b * QK;
                for (int j = 0; j < QK; j++) out[m] += wv[j] * xb[j];
            }
        }
#endif
        for (int m = 0; m < M; m++) y[(int64_t)m * N + n] = bias != NULL ? out[m] + bias[n] : out[m];
    }
    return 0;
}

int meshlm_gemv_q8_0(const float *x, int64_t x_stride, const float *d, const int8_t *q,
                     const float *bias, float *y, int M, int64_t N, int K, int num_threads) {
    if (M <= 0 || M > MAX_ROWS || K <= 0 || K % QK) return 1;
    const int nb = K / QK;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const int64_t b0 = n * nb;
        float out[MAX_ROWS] = {0};
#ifdef HAVE_AVX2
#define Q8_ROW(R) q8_0_row(x, x_stride, d, q, nb, b0, out, R)
        switch (M) { ROW_CASES(Q8_ROW) }
#undef Q8_ROW
#else
        for (int m = 0; m < M; m++) out[m] = 0.f;
        for (int b = 0; b < nb; b++) {
            const int8_t *qb = q + (b0 + b) * QK;
            for (int m = 0; m < M; m++) {
                const float *xb = x + m * x_stride + b * QK;
                for (int j = 0; j < QK; j++) out[m] += (d[b0 + b] * (float)qb[j]) * xb[j];
            }
        }
#endif
        for (int m = 0; m < M; m++) y[(int64_t)m * N + n] = bias != NULL ? out[m] + bias[n] : out[m];
    }
    return 0;
}
