/* Fused elementwise ops of a decoder layer, for CPUs: one pass over memory instead of one
 * eager torch op (and one temporary) per arithmetic step.
 *
 * Every op works on T rows; a row is contiguous, rows are `stride` elements apart.
 * dtype: 0 = float32, 1 = bfloat16. Arithmetic is float32; bfloat16 results are rounded to
 * nearest-even once, where the eager torch ops round after every step (so bf16 results can
 * differ from torch's in the last bit, float32 ones only by summation order).
 *
 *   add_rmsnorm  r = x + residual (stored into residual), out = r / sqrt(mean(r^2) + eps) * w
 *                (without residual: out = norm(x))
 *   rope_neox    q and k heads of a packed qkv row rotated in place by their position
 *                (HF "rotate_half" layout: dims i and i + D/2 form a pair)
 *   silu_mul     out[t, i] = silu(gu[t, i]) * gu[t, I + i] for a merged [gate | up] row of 2I
 *   argmax_rows  out[t] = the first index of row t's largest value (a NaN counts as the largest,
 *                and the first NaN wins), as torch.argmax: greedy sampling over the logits
 *
 * With AVX-512, bf16 rows whose width is a multiple of 16 take a vector path in add_rmsnorm:
 * 16 elements at a time straight from and to the bf16 rows (no float32 scratch rows), rounded
 * as f2bf does, so its results are bit for bit the scalar path's (in-process c=64 profile:
 * 0.18 vs 0.46 ms a prompt-chunk call). The same for silu_mul with an inline e^x was slower
 * than libmvec's expf (0.645 vs 0.568 ms at 1820 x 1536, hot) and is not used. silu_mul
 * clamps e^-x at e^88, so silu(x) of a very negative x is ~0 (the fast-math expf overflowed
 * to inf and made it NaN). float32 rows of add_rmsnorm and silu_mul are read and written in
 * place; other rows go through float32 scratch rows (load / store).
 */
#include <math.h>
#include <stdint.h>
#include <limits.h>
#include <string.h>

#define PAR_MIN_ELEMS (1 << 16) /* below this many elements a single thread is faster */

static inline float bf2f(uint16_t h) {
    union { uint32_t u; float f; } x;
    x.u = (uint32_t)h << 16;
    return x.f;
}

static inline uint16_t f2bf(float f) { /* round to nearest even; NaN stays NaN */
    union { uint32_t u; float f; } x;
    x.f = f;
    if ((x.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x.u >> 16) | 0x40);
    return (uint16_t)((x.u + 0x7fffu + ((x.u >> 16) & 1u)) >> 16);
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define HAVE_AVX512 1
/* 16 bf16 at p as float32 (exact). */
static inline __m512 bf16x16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* 16 floats rounded to bf16 as f2bf does (nearest-even, NaN kept quiet), stored at p. Integer
 * ops only: the build's -ffast-math may fold float NaN tests away. */
static inline void store_bf16x16(uint16_t *p, __m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd));
    const __mmask16 nan =
        _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
    r = _mm512_mask_or_epi32(r, nan, u, _mm512_set1_epi32(0x400000));
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
}
#endif

/* Row `t` of a float32 / bf16 matrix into float32 scratch, and back. */
static inline void load(const void *base, int dtype, int64_t off, int n, float *dst) {
    if (dtype == 0) {
        memcpy(dst, (const float *)base + off, (size_t)n * sizeof(float));
    } else {
        const uint16_t *p = (const uint16_t *)base + off;
#pragma omp simd
        for (int i = 0; i < n; i++) dst[i] = bf2f(p[i]);
    }
}

static inline void store(void *base, int dtype, int64_t off, int n, const float *src) {
    if (dtype == 0) {
        memcpy((float *)base + off, src, (size_t)n * sizeof(float));
    } else {
        uint16_t *p = (uint16_t *)base + off;
#pragma omp simd
        for (int i = 0; i < n; i++) p[i] = f2bf(src[i]);
    }
}

/* dst[i] = r[i] / sqrt(mean(r^2) + eps) * w[i] over a float32 row of H (dst may be r). */
static inline void rms_scale(const float *r, const float *w, int H, float eps, float *dst) {
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int i = 0; i < H; i++) ss += r[i] * r[i];
    const float inv = 1.f / sqrtf(ss / (float)H + eps);
#pragma omp simd
    for (int i = 0; i < H; i++) dst[i] = r[i] * inv * w[i];
}

#define MAX_ROW 32768 /* scratch per row (hidden size or 2 x intermediate size / 2) */

int meshlm_add_rmsnorm(const void *x, void *residual, const void *weight, void *out, int dtype,
                       int64_t T, int H, int64_t x_stride, int64_t r_stride, int64_t o_stride,
                       float eps, int has_residual, int num_threads) {
    if (H <= 0 || H > MAX_ROW) return 1;
    const int par = T * (int64_t)H >= PAR_MIN_ELEMS ? num_threads : 1;
#pragma omp parallel num_threads(par)
    {
        float r[MAX_ROW], w[MAX_ROW], tmp[MAX_ROW];
        load(weight, dtype, 0, H, w);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) {
#ifdef HAVE_AVX512
            if (dtype == 1 && H % 16 == 0) { /* bf16 rows: r's rounded bf16 row is the residual itself */
                const uint16_t *xr = (const uint16_t *)x + t * x_stride;
                uint16_t *rr = has_residual ? (uint16_t *)residual + t * r_stride : (uint16_t *)xr;
                uint16_t *o = (uint16_t *)out + t * o_stride;
                __m512 ss = _mm512_setzero_ps();
                for (int i = 0; i < H; i += 16) {
                    __m512 v = bf16x16(xr + i);
                    if (has_residual) {
                        store_bf16x16(rr + i, _mm512_add_ps(v, bf16x16(rr + i)));
                        v = bf16x16(rr + i); /* the stored bf16 value */
                    }
                    ss = _mm512_fmadd_ps(v, v, ss);
                }
                const __m512 inv = _mm512_set1_ps(1.f / sqrtf(_mm512_reduce_add_ps(ss) / (float)H + eps));
                for (int i = 0; i < H; i += 16)
                    store_bf16x16(o + i, _mm512_mul_ps(_mm512_mul_ps(bf16x16(rr + i), inv), _mm512_loadu_ps(w + i)));
                continue;
            }
#endif
            if (dtype == 0) { /* float32 rows: read and written in place, no scratch copies */
                const float *xr = (const float *)x + t * x_stride;
                float *rr = has_residual ? (float *)residual + t * r_stride : NULL, *o = (float *)out + t * o_stride;
                if (rr != NULL) {
#pragma omp simd
                    for (int i = 0; i < H; i++) rr[i] += xr[i];
                    xr = rr;
                }
                rms_scale(xr, w, H, eps, o);
                continue;
            }
            load(x, dtype, t * x_stride, H, r);
            if (has_residual) {
                load(residual, dtype, t * r_stride, H, tmp);
#pragma omp simd
                for (int i = 0; i < H; i++) r[i] += tmp[i];
                store(residual, dtype, t * r_stride, H, r);
                if (dtype == 1) load(residual, dtype, t * r_stride, H, r); /* the stored bf16 value */
            }
            rms_scale(r, w, H, eps, tmp);
            store(out, dtype, t * o_stride, H, tmp);
        }
    }
    return 0;
}

/* qkv: T rows of (nq + 2 * nk) heads of D, `stride` elements apart; q heads first, then k.
 * cos / sin: float32 [max_pos, D] tables (both halves of a row equal); positions [T]. */
int meshlm_rope_neox(void *qkv, int dtype, int64_t T, int64_t stride, int nq, int nk, int D,
                     const int64_t *positions, const float *cos_tab, const float *sin_tab,
                     int64_t max_pos, int num_threads) {
    if (D <= 0 || D % 2 || D > 1024) return 1;
    for (int64_t t = 0; t < T; t++)
        if (positions[t] < 0 || positions[t] >= max_pos) return 3;
    const int half = D / 2, heads = nq + nk;
    const int par = T * (int64_t)heads * D >= PAR_MIN_ELEMS ? num_threads : 1;
#pragma omp parallel for num_threads(par) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos_tab + positions[t] * D, *s = sin_tab + positions[t] * D;
        float row[1024], rot[1024];
        for (int h = 0; h < heads; h++) {
            const int64_t off = t * stride + (int64_t)h * D;
            load(qkv, dtype, off, D, row);
#pragma omp simd
            for (int i = 0; i < half; i++) {
                rot[i] = row[i] * c[i] - row[i + half] * s[i];
                rot[i + half] = row[i + half] * c[i + half] + row[i] * s[i + half];
            }
            store(qkv, dtype, off, D, rot);
        }
    }
    return 0;
}

int meshlm_silu_mul(const void *gu, void *out, int dtype, int64_t T, int I, int64_t gu_stride,
                    int64_t o_stride, int num_threads) {
    if (I <= 0 || I > MAX_ROW) return 1;
    const int par = T * (int64_t)I >= PAR_MIN_ELEMS ? num_threads : 1;
#pragma omp parallel num_threads(par)
    {
        float g[MAX_ROW], u[MAX_ROW];
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) {
            if (dtype == 0) { /* float32 rows: read and written in place (0.59x the time of copying
                               * them through g and u, 2048 x 1536 on a 2-core Ice Lake) */
                const float *gr = (const float *)gu + t * gu_stride, *ur = gr + I;
                float *o = (float *)out + t * o_stride;
#pragma omp simd
                for (int i = 0; i < I; i++) o[i] = gr[i] / (1.f + expf(fminf(-gr[i], 88.f))) * ur[i];
                continue;
            }
            load(gu, dtype, t * gu_stride, I, g);
            load(gu, dtype, t * gu_stride + I, I, u);
#pragma omp simd
            for (int i = 0; i < I; i++) g[i] = g[i] / (1.f + expf(fminf(-g[i], 88.f))) * u[i]; /* no overflow to inf */
            store(out, dtype, t * o_stride, I, g);
        }
    }
    return 0;
}

/* Floats compared as integers: the build's -ffast-math lets the compiler assume there are no
 * NaNs or infinities, and logits hold both (a grammar mask writes -inf). key() orders every
 * non-NaN float as its value does (-0 as +0); NaNs are found from their bits. */
static inline int32_t key(uint32_t u) {
    u = u == 0x80000000u ? 0u : u;
    return (int32_t)(u ^ ((uint32_t)((int32_t)u >> 31) >> 1));
}

static inline int is_nan(uint32_t u) { return (u & 0x7fffffffu) > 0x7f800000u; }

/* The first index of the largest value of x[off .. off + n), or of its first NaN. Blocks of
 * ARGMAX_BLOCK keep a running max per lane; only a block that raises the maximum (or holds a
 * NaN) is scanned in order, so the first occurrence wins. */
#define ARGMAX_BLOCK 64
static int64_t argmax_row(const void *base, int dtype, int64_t off, int64_t n) {
    int32_t best = 0;
    int64_t at = -1;
    uint32_t u[ARGMAX_BLOCK];
    for (int64_t i0 = 0; i0 < n; i0 += ARGMAX_BLOCK) {
        const int m = n - i0 < ARGMAX_BLOCK ? (int)(n - i0) : ARGMAX_BLOCK;
        if (dtype == 0) {
            memcpy(u, (const uint32_t *)base + off + i0, (size_t)m * sizeof(uint32_t));
        } else {
            const uint16_t *p = (const uint16_t *)base + off + i0;
#pragma omp simd
            for (int i = 0; i < m; i++) u[i] = (uint32_t)p[i] << 16;
        }
        int32_t bmax = INT32_MIN;
        int nan = 0;
#pragma omp simd reduction(max : bmax) reduction(| : nan)
        for (int i = 0; i < m; i++) {
            const int32_t k = key(u[i]);
            bmax = k > bmax ? k : bmax;
            nan |= is_nan(u[i]);
        }
        if (nan) {
            for (int i = 0; i < m; i++)
                if (is_nan(u[i])) return i0 + i;
        }
        if (at < 0 || bmax > best) {
            for (int i = 0; i < m; i++)
                if (key(u[i]) == bmax) {
                    at = i0 + i;
                    break;
                }
            best = bmax;
        }
    }
    return at;
}

int meshlm_argmax_rows(const void *x, int dtype, int64_t T, int64_t V, int64_t stride, int64_t *out,
                       int num_threads) {
    if (V <= 0) return 1;
    const int par = T * V >= PAR_MIN_ELEMS && T > 1 ? num_threads : 1;
#pragma omp parallel for num_threads(par) schedule(static)
    for (int64_t t = 0; t < T; t++) out[t] = argmax_row(x, dtype, t * stride, V);
    return 0;
}
