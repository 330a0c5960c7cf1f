/* Causal extend (prefill) attention over the paged KV pool, for CPUs with AVX2 + FMA.
 *
 * Segment s of an extend batch is one request: its lens[s] new query tokens are rows
 * starts[s] .. starts[s] + lens[s] - 1 of q, and its new K/V are already stored in the pool
 * (after prefix[s] cached ones). Query token a (absolute position prefix[s] + a) attends to the
 * slots table[rows[s] * table_stride + t] for t in [0, prefix[s] + a], read in place.
 *
 * Layouts (element offsets), as in decode_attention.c:
 *   q, out      token t, head h, dim d at t * q_stride + h * D + d (out: t * out_stride + ...)
 *   k, v        slot s, KV head j, dim d at s * tok_stride + j * D + d
 * Query head h reads KV head h / G, G = H / Hkv (grouped-query attention).
 * kv_dtype: 0 = float32, 1 = bfloat16, 2 = float16.
 *
 * Work item = (segment, KV head, block of QB query positions). Its R = QB * G query rows
 * (position-major: row r is position a0 + r / G, head g * G + r % G) share every key they see,
 * so one pass over the keys serves all the heads of a KV group. Keys are taken KB at a time
 * (flash attention: a running max and sum per row, the output rescaled when the max grows):
 *   1. the block's K and V rows are gathered (and converted) into KBUF, VBUF [KB][D];
 *   2. S^T [KB][RS] = KBUF . QT, QT = the rows' queries, pre-scaled, packed as [RS/NR][D][NR];
 *   3. keys past a row's position are masked; exp(S - running max) in place;
 *   4. O [RS][D] += P . VBUF.
 * Steps 2 and 4 are the same register-blocked MR x NR micro-kernel (AVX2: 6 rows of two 8-float
 * vectors, 12 accumulators; AVX-512: 12 rows of two 16-float vectors, 24 accumulators), so the
 * scores never leave L1/L2 and the work is GEMM-shaped. An item's rows are padded to RS, a
 * multiple of 48 = lcm(MR, 16), and keys to a multiple of MR: padded queries are zero,
 * padded keys are masked, and neither is ever stored. Scores use a finite floor (NEG) instead of
 * -inf, since the fast build assumes finite math.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2 1
#endif

#if defined(HAVE_AVX2) && defined(__AVX512F__)
#define HAVE_AVX512 1
#define MR 12   /* rows of A per micro-kernel: two 16-float accumulators each */
#define NR 32   /* columns of B per micro-kernel (a D that is 16 mod 32 ends in a 16-column tail) */
#define ROWS 96 /* query rows per work item (QB = ROWS / G positions), lcm(MR, NR) */
#else
#define MR 6    /* rows of A per micro-kernel: two 8-float accumulators each */
#define NR 16   /* columns of B per micro-kernel */
#define ROWS 48 /* query rows per work item (QB = ROWS / G positions), lcm(MR, NR) */
#endif
#define RS_STEP 48 /* an item's rows are padded to a multiple of this: lcm(MR, 16) */
#define KB 48      /* keys per block: a multiple of MR */
#define NEG -1e30f /* score of a masked key: exp(NEG - m) underflows to 0 */

int meshlm_extend_attention_available(void) {
#ifdef HAVE_AVX2
    return 1;
#else
    return 0;
#endif
}

#ifdef HAVE_AVX2
static inline float bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } x;
    x.u = (uint32_t)h << 16;
    return x.f;
}

/* D elements of a pool row (any pool dtype) as float32 into dst. */
static inline void load_head(const void *base, int kv_dtype, int64_t off, int D, float *dst) {
    if (kv_dtype == 0) {
        memcpy(dst, (const float *)base + off, (size_t)D * sizeof(float));
    } else if (kv_dtype == 1) {
        const uint16_t *p = (const uint16_t *)base + off;
        for (int i = 0; i < D; i++) dst[i] = bf16_to_f32(p[i]);
    } else {
        const _Float16 *p = (const _Float16 *)base + off;
        for (int i = 0; i < D; i++) dst[i] = (float)p[i];
    }
}

/* exp(x) as 2^n * p(r), x = n ln2 + r, |r| <= ln2 / 2, p a degree-7 polynomial (relative error
 * ~2e-7), evaluated by exp8 (AVX2) and exp16 (AVX-512) with these constants; 0 below EXP_LO
 * (where expf leaves the normal range), so masked scores (NEG) cost nothing special, unlike
 * libm's slow underflow path. */
#define EXP_LO -87.3f
#define EXP_HI 88.3f
#define EXP_LOG2E 1.44269504089f
#define EXP_LN2_HI 0.693359375f /* ln2 in two parts */
#define EXP_LN2_LO -2.12194440e-4f
#define EXP_P5 1.9875691500e-4f
#define EXP_P4 1.3981999507e-3f
#define EXP_P3 8.3334519073e-3f
#define EXP_P2 4.1665795894e-2f
#define EXP_P1 1.6666665459e-1f
#define EXP_P0 5.0000001201e-1f

/* exp(x) for 8 floats (see above). */
static inline __m256 exp8(__m256 x) {
    const __m256 zero_below = _mm256_cmp_ps(x, _mm256_set1_ps(EXP_LO), _CMP_LT_OQ);
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(EXP_HI)), _mm256_set1_ps(EXP_LO));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_HI), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_LO), r);
    __m256 p = _mm256_set1_ps(EXP_P5);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P4));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P1));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P0));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(zero_below, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

#ifdef HAVE_AVX512
/* exp(x) for 16 floats: exp8's steps and constants on 512-bit vectors. */
static inline __m512 exp16(__m512 x) {
    const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(EXP_LO), _CMP_GE_OQ);
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(EXP_HI)), _mm512_set1_ps(EXP_LO));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(EXP_LOG2E)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_HI), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_LO), r);
    __m512 p = _mm512_set1_ps(EXP_P5);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P4));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P1));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P0));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mul_ps(keep, p, _mm512_castsi512_ps(e));
}

/* c[12][16 * W] (+)= A . b over kc on 512-bit registers (same arguments as the micro-kernel
 * below, b rows 16 * W floats), W = 1 or 2 a constant at each call. W = 2 is the AVX-512
 * micro-kernel: 24 accumulators, so each k issues 12 broadcasts and 2 loads for 24 FMAs and the
 * FMA ports, not the load ports, set the pace (a 12 x 16 tile issues 13 loads for 12 FMAs and
 * ran at half the FMA peak); W = 1 is the tail of a head dim that is 16 mod 32. */
static inline __attribute__((always_inline)) void tile_512(int kc, const float *a, int64_t ars, int64_t aks,
                                                           const float *b, int64_t ldb, float *c, int64_t ldc,
                                                           int acc, const int W) {
    __m512 t[MR][2];
#pragma GCC unroll 12
    for (int r = 0; r < MR; r++) t[r][0] = t[r][1] = _mm512_setzero_ps();
    for (int k = 0; k < kc; k++) {
        const __m512 b0 = _mm512_loadu_ps(b + k * ldb), b1 = W == 2 ? _mm512_loadu_ps(b + k * ldb + 16) : b0;
        const float *ak = a + k * aks;
#pragma GCC unroll 12
        for (int r = 0; r < MR; r++) {
            const __m512 av = _mm512_set1_ps(ak[r * ars]);
            t[r][0] = _mm512_fmadd_ps(av, b0, t[r][0]);
            if (W == 2) t[r][1] = _mm512_fmadd_ps(av, b1, t[r][1]);
        }
    }
#pragma GCC unroll 12
    for (int r = 0; r < MR; r++)
        for (int w = 0; w < W; w++) {
            float *cw = c + r * ldc + 16 * w;
            _mm512_storeu_ps(cw, acc ? _mm512_add_ps(t[r][w], _mm512_loadu_ps(cw)) : t[r][w]);
        }
}

static inline __attribute__((always_inline)) void micro_kernel(int kc, const float *a, int64_t ars, int64_t aks,
                                                               const float *b, int64_t ldb, float *c, int64_t ldc,
                                                               int acc) {
    tile_512(kc, a, ars, aks, b, ldb, c, ldc, acc, 2);
}

static inline __attribute__((always_inline)) void micro_kernel16(int kc, const float *a, int64_t ars, int64_t aks,
                                                                 const float *b, int64_t ldb, float *c, int64_t ldc,
                                                                 int acc) {
    tile_512(kc, a, ars, aks, b, ldb, c, ldc, acc, 1);
}
#else
/* c[6][16] (+)= A . b over kc: A(r, k) = a[r * ars + k * aks], b row k at b + k * ldb (16
 * contiguous floats), c rows ldc apart; `acc`: add to c, else store. */
static inline void micro_kernel(int kc, const float *a, int64_t ars, int64_t aks, const float *b, int64_t ldb,
                                float *c, int64_t ldc, int acc) {
    const float *a0 = a, *a1 = a + ars, *a2 = a + 2 * ars, *a3 = a + 3 * ars, *a4 = a + 4 * ars, *a5 = a + 5 * ars;
    /* Twelve named accumulators: an array would be spilled to the stack at every k. */
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
    __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
    for (int k = 0; k < kc; k++) {
        const __m256 b0 = _mm256_loadu_ps(b + k * ldb), b1 = _mm256_loadu_ps(b + k * ldb + 8);
        const int64_t o = k * aks;
        __m256 av = _mm256_broadcast_ss(a0 + o);
        c00 = _mm256_fmadd_ps(av, b0, c00);
        c01 = _mm256_fmadd_ps(av, b1, c01);
        av = _mm256_broadcast_ss(a1 + o);
        c10 = _mm256_fmadd_ps(av, b0, c10);
        c11 = _mm256_fmadd_ps(av, b1, c11);
        av = _mm256_broadcast_ss(a2 + o);
        c20 = _mm256_fmadd_ps(av, b0, c20);
        c21 = _mm256_fmadd_ps(av, b1, c21);
        av = _mm256_broadcast_ss(a3 + o);
        c30 = _mm256_fmadd_ps(av, b0, c30);
        c31 = _mm256_fmadd_ps(av, b1, c31);
        av = _mm256_broadcast_ss(a4 + o);
        c40 = _mm256_fmadd_ps(av, b0, c40);
        c41 = _mm256_fmadd_ps(av, b1, c41);
        av = _mm256_broadcast_ss(a5 + o);
        c50 = _mm256_fmadd_ps(av, b0, c50);
        c51 = _mm256_fmadd_ps(av, b1, c51);
    }
    const __m256 out[MR][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}, {c40, c41}, {c50, c51}};
    for (int r = 0; r < MR; r++) {
        float *cr = c + r * ldc;
        __m256 lo = out[r][0], hi = out[r][1];
        if (acc) {
            lo = _mm256_add_ps(lo, _mm256_loadu_ps(cr));
            hi = _mm256_add_ps(hi, _mm256_loadu_ps(cr + 8));
        }
        _mm256_storeu_ps(cr, lo);
        _mm256_storeu_ps(cr + 8, hi);
    }
}
#endif

/* Per-thread scratch, sized for RS rows and head dim D. */
typedef struct {
    float *qt;   /* [RS / NR][D][NR] pre-scaled queries, column-panel packed */
    float *st;   /* [KB][RS] scores, then probabilities (key-major) */
    float *o;    /* [RS][D] unnormalized output */
    float *kbuf; /* [KB][D] */
    float *vbuf; /* [KB][D] */
    float *m;    /* [RS] running max */
    float *l;    /* [RS] running sum */
    float *alpha, *bmax, *bsum; /* [RS] per-block temporaries */
    int64_t *lim; /* [RS] last visible key of each row */
} scratch_t;

static int scratch_alloc(scratch_t *s, int RS, int D) {
    memset(s, 0, sizeof(*s));
    const size_t f = sizeof(float);
    s->qt = aligned_alloc(64, f * RS * D);
    s->st = aligned_alloc(64, f * KB * RS);
    s->o = aligned_alloc(64, f * RS * D);
    s->kbuf = aligned_alloc(64, f * KB * D);
    s->vbuf = aligned_alloc(64, f * KB * D);
    s->m = malloc(f * RS * 5);
    s->lim = malloc(sizeof(int64_t) * RS);
    if (!s->qt || !s->st || !s->o || !s->kbuf || !s->vbuf || !s->m || !s->lim) return 0;
    s->l = s->m + RS, s->alpha = s->m + 2 * RS, s->bmax = s->m + 3 * RS, s->bsum = s->m + 4 * RS;
    return 1;
}

static void scratch_free(scratch_t *s) {
    free(s->qt), free(s->st), free(s->o), free(s->kbuf), free(s->vbuf), free(s->m), free(s->lim);
}

typedef struct {
    int64_t seg, a0, a1; /* segment, query positions [a0, a1) */
    int g;               /* KV head */
} item_t;

/* One work item: rows of positions [a0, a1) of a segment, KV head g. Inlined at each call so
 * that a literal D reaches the micro-kernels: the K rows' stride is then an immediate offset of
 * each broadcast (as a variable it took a register per row, and the rest spilled). */
static inline __attribute__((always_inline)) void attend_block(const float *q, int64_t q_stride, const void *k, const void *v, int kv_dtype,
                         int64_t tok_stride, const int64_t *slots, int64_t pre, int64_t q0, int64_t a0, int64_t a1,
                         int g, int G, int D, float scale, float *out, int64_t out_stride, scratch_t *s) {
    const int R = (int)(a1 - a0) * G;
    /* Rows padded to a multiple of RS_STEP only: an item of few rows (a short segment, the end
     * of a long one) is not padded to ROWS. QT's panels are NR wide but the last, which is 16
     * wide when RS is 16 mod NR (AVX-512). */
    const int RS = (R + RS_STEP - 1) / RS_STEP * RS_STEP;
    /* 1. queries: row r < R is position a0 + r / G, head g * G + r % G; rows >= R are zero and
     * see every key of the item (so they stay finite) */
    for (int r = 0; r < RS; r++) {
        const int p0 = r / NR * NR, w = RS - p0 < NR ? RS - p0 : NR;
        float *col = s->qt + (int64_t)p0 * D + (r - p0);
        if (r < R) {
            const float *src = q + (q0 + a0 + r / G) * q_stride + (int64_t)(g * G + r % G) * D;
            for (int d = 0; d < D; d++) col[d * w] = src[d] * scale;
            s->lim[r] = pre + a0 + r / G;
        } else {
            for (int d = 0; d < D; d++) col[d * w] = 0.f;
            s->lim[r] = pre + a1 - 1;
        }
        s->m[r] = NEG, s->l[r] = 0.f;
    }
    memset(s->o, 0, sizeof(float) * RS * D);
    const int64_t n_keys = pre + a1;
    for (int64_t k0 = 0; k0 < n_keys; k0 += KB) {
        const int kb = (int)(n_keys - k0 < KB ? n_keys - k0 : KB);
        const int kbp = (kb + MR - 1) / MR * MR;
        /* 1. gather the block's K and V rows of head g; padded keys are zero */
        for (int j = 0; j < kb; j++) {
            const int64_t off = slots[k0 + j] * tok_stride + (int64_t)g * D;
            load_head(k, kv_dtype, off, D, s->kbuf + (int64_t)j * D);
            load_head(v, kv_dtype, off, D, s->vbuf + (int64_t)j * D);
        }
        if (kbp > kb) {
            memset(s->kbuf + (int64_t)kb * D, 0, sizeof(float) * (kbp - kb) * D);
            memset(s->vbuf + (int64_t)kb * D, 0, sizeof(float) * (kbp - kb) * D);
        }
        /* 2. S^T[j][r] = K_j . q_r */
        for (int j0 = 0; j0 < kbp; j0 += MR) {
            int p0 = 0;
            for (; p0 + NR <= RS; p0 += NR)
                micro_kernel(D, s->kbuf + (int64_t)j0 * D, D, 1, s->qt + (int64_t)p0 * D, NR,
                             s->st + (int64_t)j0 * RS + p0, RS, 0);
#ifdef HAVE_AVX512
            if (p0 < RS) /* the 16-wide last panel */
                micro_kernel16(D, s->kbuf + (int64_t)j0 * D, D, 1, s->qt + (int64_t)p0 * D, 16,
                               s->st + (int64_t)j0 * RS + p0, RS, 0);
#endif
        }
        /* 3. mask (only blocks reaching past the first row's position have masked keys),
         * running max, exp, running sum */
        if (k0 + kbp - 1 > pre + a0) {
            for (int j = 0; j < kbp; j++) {
                float *row = s->st + (int64_t)j * RS;
                const int64_t key = j < kb ? k0 + j : INT64_MAX;
#pragma omp simd
                for (int r = 0; r < RS; r++) row[r] = key > s->lim[r] ? NEG : row[r];
            }
        }
        for (int r = 0; r < RS; r++) s->bmax[r] = s->m[r], s->bsum[r] = 0.f;
        for (int j = 0; j < kbp; j++) {
            const float *row = s->st + (int64_t)j * RS;
#pragma omp simd
            for (int r = 0; r < RS; r++) s->bmax[r] = row[r] > s->bmax[r] ? row[r] : s->bmax[r];
        }
        for (int j = 0; j < kbp; j++) {
            float *row = s->st + (int64_t)j * RS;
#ifdef HAVE_AVX512
            for (int r = 0; r < RS; r += 16) { /* RS is a multiple of 16 */
                const __m512 p = exp16(_mm512_sub_ps(_mm512_loadu_ps(row + r), _mm512_loadu_ps(s->bmax + r)));
                _mm512_storeu_ps(row + r, p);
                _mm512_storeu_ps(s->bsum + r, _mm512_add_ps(_mm512_loadu_ps(s->bsum + r), p));
            }
#else
            for (int r = 0; r < RS; r += 8) { /* RS is a multiple of 8 */
                const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(row + r), _mm256_loadu_ps(s->bmax + r)));
                _mm256_storeu_ps(row + r, p);
                _mm256_storeu_ps(s->bsum + r, _mm256_add_ps(_mm256_loadu_ps(s->bsum + r), p));
            }
#endif
        }
        for (int r = 0; r < RS; r += 8) { /* alpha = 0 on the first block (m = NEG) */
            const __m256 bm = _mm256_loadu_ps(s->bmax + r);
            const __m256 alpha = exp8(_mm256_sub_ps(_mm256_loadu_ps(s->m + r), bm));
            _mm256_storeu_ps(s->alpha + r, alpha);
            _mm256_storeu_ps(s->l + r, _mm256_fmadd_ps(_mm256_loadu_ps(s->l + r), alpha, _mm256_loadu_ps(s->bsum + r)));
            _mm256_storeu_ps(s->m + r, bm);
        }
        if (k0 > 0)
            for (int r = 0; r < RS; r++) {
                float *orow = s->o + (int64_t)r * D;
                const float a = s->alpha[r];
#pragma omp simd
                for (int d = 0; d < D; d++) orow[d] *= a;
            }
        /* 4. O[r] += sum_j P[j][r] V_j */
        for (int r0 = 0; r0 < RS; r0 += MR) {
            int d0 = 0;
            for (; d0 + NR <= D; d0 += NR)
                micro_kernel(kbp, s->st + r0, 1, RS, s->vbuf + d0, D, s->o + (int64_t)r0 * D + d0, D, 1);
#ifdef HAVE_AVX512
            if (d0 < D) /* D = 16 mod 32 */
                micro_kernel16(kbp, s->st + r0, 1, RS, s->vbuf + d0, D, s->o + (int64_t)r0 * D + d0, D, 1);
#endif
        }
    }
    for (int r = 0; r < R; r++) {
        float *dst = out + (q0 + a0 + r / G) * out_stride + (int64_t)(g * G + r % G) * D;
        const float *orow = s->o + (int64_t)r * D;
        const float inv = 1.f / s->l[r];
#pragma omp simd
        for (int d = 0; d < D; d++) dst[d] = orow[d] * inv;
    }
}
#endif

/* Returns 0 on success; 1 on bad shapes (H % Hkv, D not a multiple of 16 or > 256, a segment
 * outside q); 2 where this build has no AVX2 or scratch memory could not be allocated; 3 when a
 * segment names a table row, length or KV slot out of range (checked before anything is read).
 *
 * Segments: rows[s] (table row), prefix[s] (cached tokens), starts[s] (first row of q), lens[s]
 * (new tokens, >= 1); q has T rows. Writes only the segments' rows of out. */
int meshlm_extend_attention(const float *q, int64_t q_stride, int64_t T, const void *k, const void *v,
                            int kv_dtype, int64_t tok_stride, int64_t num_slots, const int64_t *table,
                            int64_t table_rows, int64_t table_stride, const int64_t *rows, const int64_t *prefix,
                            const int64_t *starts, const int64_t *lens, int64_t S, int H, int Hkv, int D,
                            float scale, float *out, int64_t out_stride, int num_threads) {
#ifndef HAVE_AVX2
    (void)q, (void)q_stride, (void)T, (void)k, (void)v, (void)kv_dtype, (void)tok_stride, (void)num_slots,
        (void)table, (void)table_rows, (void)table_stride, (void)rows, (void)prefix, (void)starts, (void)lens,
        (void)S, (void)H, (void)Hkv, (void)D, (void)scale, (void)out, (void)out_stride, (void)num_threads;
    return 2;
#else
    if (H <= 0 || Hkv <= 0 || H % Hkv != 0 || D <= 0 || D % 16 != 0 || D > 256 || num_threads < 1) return 1;
    const int G = H / Hkv;
    const int qb = ROWS / G > 0 ? ROWS / G : 1;             /* query positions per work item */
    const int RS = (qb * G + RS_STEP - 1) / RS_STEP * RS_STEP; /* the most rows an item pads to */
    int64_t n_items = 0;
    for (int64_t s = 0; s < S; s++) {
        if (lens[s] < 1 || prefix[s] < 0 || starts[s] < 0 || starts[s] + lens[s] > T) return 1;
        const int64_t row = rows[s], n = prefix[s] + lens[s];
        if (row < 0 || row >= table_rows || n > table_stride) return 3;
        for (int64_t t = 0; t < n; t++)
            if (table[row * table_stride + t] < 0 || table[row * table_stride + t] >= num_slots) return 3;
        n_items += (lens[s] + qb - 1) / qb * Hkv;
    }
    item_t *items = malloc(sizeof(item_t) * (n_items > 0 ? n_items : 1));
    if (items == NULL) return 2;
    /* Items of one (segment, KV head) are consecutive, so the threads taking them in turn
     * re-read the same K/V rows from cache; within it, longest first. */
    int64_t i = 0;
    for (int64_t s = 0; s < S; s++)
        for (int g = 0; g < Hkv; g++)
            for (int64_t a0 = (lens[s] - 1) / qb * qb; a0 >= 0; a0 -= qb) {
                const int64_t a1 = a0 + qb < lens[s] ? a0 + qb : lens[s];
                items[i++] = (item_t){s, a0, a1, g};
            }
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        scratch_t s;
        const int ok = scratch_alloc(&s, RS, D);
        failed |= !ok;
        /* every thread reaches the loop; one without scratch only skips its items */
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < n_items; t++) {
            if (!ok) continue;
            const item_t *it = &items[t];
            const int64_t *slots = table + rows[it->seg] * table_stride;
#define ATTEND(DIM)                                                                                       \
    attend_block(q, q_stride, k, v, kv_dtype, tok_stride, slots, prefix[it->seg], starts[it->seg], it->a0, \
                 it->a1, it->g, G, DIM, scale, out, out_stride, &s)
            if (D == 64)
                ATTEND(64);
            else if (D == 128)
                ATTEND(128);
            else
                ATTEND(D);
#undef ATTEND
        }
        scratch_free(&s);
    }
    free(items);
    return failed ? 2 : 0;
#endif
}
