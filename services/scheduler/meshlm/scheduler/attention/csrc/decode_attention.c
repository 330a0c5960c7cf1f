/* Fused decode attention over the paged KV pool, for CPUs.
 *
 * One query token per request. Request b attends to the KV slots
 * table[rows[b] * table_stride + t] for t in [0, lens[b]): the slots are read in place from the
 * pool, never gathered into a padded copy, so each cached K and V row crosses memory once per
 * layer (the torch path reads it, writes a copy, then reads the copy).
 *
 * Layouts (element offsets):
 *   q           [B, H, D] float32 or bfloat16 (q_dtype 0 / 1), request b at q + b * q_stride
 *               (heads D apart)
 *   out         [B, H, D] float32 or bfloat16 (out_dtype 0 / 1), contiguous
 *   k, v        slot s, KV head j, dim d at s * tok_stride + j * D + d
 *   table       int64 req_to_token, row r at r * table_stride
 *   rows, lens  [B] int64
 * Query head h reads KV head h / (H / Hkv) (grouped-query attention).
 * kv_dtype: 0 = float32, 1 = bfloat16, 2 = float16.
 *
 * Memory is the bound (a 135M model's decode step reads ~1 GB of KV at batch 64), so each
 * token's whole row (all KV heads, contiguous) is consumed at once, and rows PREFETCH tokens
 * ahead are prefetched: the slots of a request are scattered, so the hardware prefetcher
 * cannot guess them, but req_to_token can. Measured on one Xeon core, cold cache: 12.5 GB/s
 * with the prefetch (the core's streaming bandwidth), 7.9 GB/s without. 12 tokens ahead
 * (~4.5 KB of a bf16 row of 3 KV heads) rather than 4: on a 2-core AMD EPYC (bf16, b=64)
 * 0.60-0.67 vs 0.70-0.76 ms a layer at 320 tokens, 1.64-1.92 vs 2.03-2.66 at 1024 (the cores
 * keep more lines in flight than 4 rows' worth; `bench_attention.py`, alternating runs).
 * Walking one KV head at a time in the V pass (the group's outputs in registers instead of
 * read and written a row at a time) was slower again: 0.80 vs 0.60 ms at b=64, 320 tokens.
 *
 * A bf16 pool with a bf16 query (the bf16 model) and D of 64 or 128, on a CPU with
 * AVX512-BF16, takes one_request_bf16: q . k as VDPBF16PS (32 bf16 products a dot
 * instruction, exact products summed in float32; the keys are never converted to a float32
 * row) and V rows converted in registers, BLOCK keys at a time (one_request_bf16 says how, and
 * what that gained). The generic path converts every row into scratch
 * first and was bound by that work: 7.1 GB/s on one core of a 2-core AMX Xeon against 8.7 for
 * a float32 pool; the bf16 path reads 7.6 GB/s on one core, 13.7 on both, where two cores
 * stream ~16.6 from memory (`python bench/bench_attention.py --dtype bfloat16`).
 * With AMX (and use_amx, H <= 16) the bf16 path's first pass, the scores, runs on tiles instead
 * (scores_amx); the value pass is the same. A C harness over this file (30 layers, 320 tokens,
 * 2 threads, alternating runs on a 2-core AMX Xeon): 0.74x the time with the KV in cache (one
 * core), 0.85-0.89x at batch 16, 0.93-0.99x at batch 64 (memory-bound there), 0.81x for one
 * request of 2000 tokens. The pass reading the same lines with no arithmetic at all bounds it:
 * 0.86x at batch 64 (two cores stream ~23 GB/s with this access pattern).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define HAVE_AVX512_BF16 1
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define HAVE_AMX 1
#endif
#endif
#include "../../kernels/csrc/amx.h"

#define PREFETCH 12  /* tokens ahead */
#define BLOCK 16    /* keys a block in the bf16 path (hsum16 gathers 16 scores) */
#define CACHE_LINE 64

static inline float bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } x;
    x.u = (uint32_t)h << 16;
    return x.f;
}

/* Token row `slot` (n = Hkv * D elements of any pool dtype) as float32: in place for float32,
 * else converted into buf. */
static inline const float *load_row(const void *base, int kv_dtype, int64_t off, int n, float *buf) {
    if (kv_dtype == 0) return (const float *)base + off;
    if (kv_dtype == 1) {
        const uint16_t *p = (const uint16_t *)base + off;
        for (int i = 0; i < n; i++) buf[i] = bf16_to_f32(p[i]);
    } else {
        const _Float16 *p = (const _Float16 *)base + off;
        for (int i = 0; i < n; i++) buf[i] = (float)p[i];
    }
    return buf;
}

static inline void prefetch_row(const void *base, int64_t off, int64_t bytes, int elem) {
    const char *p = (const char *)base + off * elem;
    for (int64_t c = 0; c < bytes; c += CACHE_LINE) __builtin_prefetch(p + c);
}

static inline __attribute__((always_inline)) float dot(const float *restrict a, const float *restrict b, int D) {
    float acc = 0.f;
#pragma omp simd reduction(+ : acc)
    for (int d = 0; d < D; d++) acc += a[d] * b[d];
    return acc;
}

/* Each of the H rows of L scores (scores[h * L + t]) becomes its softmax, in place. */
static inline void softmax_rows(float *scores, int H, int64_t L) {
    for (int h = 0; h < H; h++) {
        float *s = scores + (int64_t)h * L;
        float m = s[0], sum = 0.f;
        for (int64_t t = 1; t < L; t++) m = s[t] > m ? s[t] : m;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < L; t++) {
            s[t] = expf(s[t] - m);
            sum += s[t];
        }
        const float inv = 1.f / sum;
#pragma omp simd
        for (int64_t t = 0; t < L; t++) s[t] *= inv;
    }
}

/* Scratch: scores[h * L + t] (H * L floats) is head h's weight of token t; buf (Hkv * D floats)
 * holds a converted row when the pool is not float32. */
static inline __attribute__((always_inline)) void one_request(
    const float *q, const void *k, const void *v, int kv_dtype, int64_t tok_stride,
    const int64_t *slots, int64_t L, int H, int Hkv, int D, float scale, float *out,
    float *scores, float *buf) {
    const int G = H / Hkv, n = Hkv * D, elem = kv_dtype == 0 ? 4 : 2;
    const int64_t row_bytes = (int64_t)n * elem;
    for (int64_t t = 0; t < L; t++) {
        if (t + PREFETCH < L) prefetch_row(k, slots[t + PREFETCH] * tok_stride, row_bytes, elem);
        const float *kr = load_row(k, kv_dtype, slots[t] * tok_stride, n, buf);
        for (int h = 0; h < H; h++)
            scores[(int64_t)h * L + t] = scale * dot(q + (int64_t)h * D, kr + (h / G) * D, D);
    }
    softmax_rows(scores, H, L);
    memset(out, 0, (size_t)H * D * sizeof(float));
    for (int64_t t = 0; t < L; t++) {
        if (t + PREFETCH < L) prefetch_row(v, slots[t + PREFETCH] * tok_stride, row_bytes, elem);
        const float *vr = load_row(v, kv_dtype, slots[t] * tok_stride, n, buf);
        for (int h = 0; h < H; h++) {
            const float p = scores[(int64_t)h * L + t];
            const float *vh = vr + (h / G) * D;
            float *o = out + (int64_t)h * D;
#pragma omp simd
            for (int d = 0; d < D; d++) o[d] += p * vh[d];
        }
    }
}

#ifdef HAVE_AVX512_BF16

/* 16 bf16 at p as float32 (exact: a bf16 is the top half of a float). */
static inline __m512 bf16x16_to_f32(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* Lane i of the result is the sum of v[i]'s 16 lanes, for i < 16: a transposing add tree of
 * 15 adds and 30 shuffles, against 16 * 8 ops for 16 separate horizontal reductions. */
static inline __m512 hsum16(const __m512 *v) {
    __m512 x[8], y[4];
    /* x[i], in each 128-bit lane: [a0 + a2, b0 + b2, a1 + a3, b1 + b3] for a = v[2i], b = v[2i + 1] */
    for (int i = 0; i < 8; i++)
        x[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    /* y[i], in each 128-bit lane: that lane's partial sums of v[4i .. 4i + 3] */
    for (int i = 0; i < 4; i++)
        y[i] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0xEE));
    /* z0 lanes: [y0 l0 + l1, y0 l2 + l3, y1 l0 + l1, y1 l2 + l3]; z1 the same of y2, y3 */
    const __m512 z0 = _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], 0x88), _mm512_shuffle_f32x4(y[0], y[1], 0xDD));
    const __m512 z1 = _mm512_add_ps(_mm512_shuffle_f32x4(y[2], y[3], 0x88), _mm512_shuffle_f32x4(y[2], y[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(z0, z1, 0x88), _mm512_shuffle_f32x4(z0, z1, 0xDD));
}

/* The rows of keys t0 .. t0 + BLOCK - 1 of a pool (past the last key: key t0 again, so a
 * short block reads valid rows whose results are dropped), with the next block's rows
 * prefetched; returns the block's real key count. */
static inline int block_rows(const uint16_t *pool, int64_t tok_stride, const int64_t *slots, int64_t L, int64_t t0,
                             int64_t row_bytes, const uint16_t *rows[BLOCK]) {
    const int n = L - t0 < BLOCK ? (int)(L - t0) : BLOCK;
    for (int i = 0; i < BLOCK; i++) rows[i] = pool + slots[t0 + (i < n ? i : 0)] * tok_stride;
    for (int i = 0; i < BLOCK && t0 + BLOCK + i < L; i++)
        prefetch_row(pool, slots[t0 + BLOCK + i] * tok_stride, row_bytes, 2);
    return n;
}

#ifdef HAVE_AMX
/* Tiles of the scores pass (amx_configure: all 16 rows x 64 bytes): 0 = S (16 keys x 16 heads,
 * float32), 1 = K (16 keys x 32 dims, bf16), 2 .. 7 = Q tiles (16 dim pairs x 16 heads x 2, bf16,
 * VNNI order): all of a request's when Hkv * D / 32 <= 6, else tile 2 reloaded per chunk. */

/* AMX scratch of one thread, in uint16 elements: the Q tiles of a request (Hkv * C of 512) and a
 * block's K rows gathered (BLOCK * Hkv * D). */
static inline int64_t amx_scratch_elems(int Hkv, int D) { return (int64_t)Hkv * (D / 32) * 512 + (int64_t)BLOCK * Hkv * D; }

/* Pass 1 on AMX, for H <= 16: scores[t * 16 + h] = scale * q_h . k_t for t < L (rows up to the
 * next multiple of BLOCK are written too; columns h >= H hold 0). Per KV head j and 32-dim chunk c
 * one TDPBF16PS multiplies BLOCK keys' dims (tile 1: rows of the pool in place when the block's
 * slots are consecutive, else gathered into scratch) by the group's queries (tile 2: Q tile
 * (j, c), columns of other groups' heads zero), so one S tile sums every (j, c) and holds each
 * head's score with its own KV head. Products are exact bf16 x bf16, summed in float32, as in the
 * VDPBF16PS pass. */
static void scores_amx(const uint16_t *qb, const uint16_t *k, int64_t tok_stride, const int64_t *slots, int64_t L,
                       int H, int Hkv, int C, float scale, float *scores, uint16_t *scratch) {
    const int G = H / Hkv, D = 32 * C, n_el = Hkv * D;
    const int64_t row_bytes = (int64_t)n_el * 2;
    uint16_t *qt = scratch, *kbuf = scratch + (int64_t)Hkv * C * 512;
    /* Q tile (j, c), row r, column h, element e (at qt + (j * C + c) * 512 + r * 32 + h * 2 + e) =
     * dim 32c + 2r + e of query head h when h / G == j, else 0. */
    memset(qt, 0, (size_t)Hkv * C * 512 * sizeof(uint16_t));
    for (int h = 0; h < H; h++)
        for (int c = 0; c < C; c++) {
            uint32_t *dst = (uint32_t *)(qt + (int64_t)((h / G) * C + c) * 512) + h;
            const uint32_t *src = (const uint32_t *)(qb + (int64_t)h * D + 32 * c);
            for (int r = 0; r < 16; r++) dst[r * 16] = src[r];
        }
    const int nq = Hkv * C, resident = nq <= 6;
    if (resident) {
#define Q_LOAD(i, T) \
    if ((i) < nq) _tile_loadd(T, qt + (int64_t)(i) * 512, 64);
        Q_LOAD(0, 2) Q_LOAD(1, 3) Q_LOAD(2, 4) Q_LOAD(3, 5) Q_LOAD(4, 6) Q_LOAD(5, 7)
#undef Q_LOAD
    }
    for (int64_t t0 = 0; t0 < L; t0 += BLOCK) {
        const uint16_t *rows[BLOCK];
        block_rows(k, tok_stride, slots, L, t0, row_bytes, rows);
        int consecutive = 1;
        for (int i = 1; i < BLOCK; i++) consecutive &= rows[i] == rows[0] + i * tok_stride;
        const uint16_t *base = rows[0];
        int64_t stride = tok_stride * 2;
        if (!consecutive) {
            for (int i = 0; i < BLOCK; i++) memcpy(kbuf + (int64_t)i * n_el, rows[i], (size_t)row_bytes);
            base = kbuf, stride = row_bytes;
        }
        _tile_zero(0);
        if (resident) { /* Q tile i in tile register 2 + i (loaded before the first block) */
#define QK_STEP(i, T)                                                                               \
    if ((i) < nq) {                                                                                 \
        _tile_loadd(1, base + (int64_t)((i) / C) * D + 32 * ((i) % C), stride);                      \
        _tile_dpbf16ps(0, 1, T);                                                              \
    }
            QK_STEP(0, 2) QK_STEP(1, 3) QK_STEP(2, 4) QK_STEP(3, 5) QK_STEP(4, 6) QK_STEP(5, 7)
#undef QK_STEP
        } else
            for (int j = 0; j < Hkv; j++)
                for (int c = 0; c < C; c++) {
                    _tile_loadd(1, base + (int64_t)j * D + 32 * c, stride);
                    _tile_loadd(2, qt + (int64_t)(j * C + c) * 512, 64);
                    _tile_dpbf16ps(0, 1, 2);
                }
        _tile_stored(0, scores + t0 * 16, 64);
    }
    /* softmax over keys, per head column: st[t * 16 + h] */
    float m[16], sum[16];
#pragma omp simd
    for (int h = 0; h < 16; h++) m[h] = scores[h] * scale, sum[h] = 0.f;
    for (int64_t t = 0; t < L; t++) {
        float *s = scores + t * 16;
#pragma omp simd
        for (int h = 0; h < 16; h++) {
            s[h] *= scale;
            m[h] = s[h] > m[h] ? s[h] : m[h];
        }
    }
    for (int64_t t = 0; t < L; t++) {
        float *s = scores + t * 16;
#pragma omp simd
        for (int h = 0; h < 16; h++) {
            s[h] = expf(s[h] - m[h]);
            sum[h] += s[h];
        }
    }
#pragma omp simd
    for (int h = 0; h < 16; h++) sum[h] = 1.f / sum[h];
    for (int64_t t = 0; t < L; t++) {
        float *s = scores + t * 16;
#pragma omp simd
        for (int h = 0; h < 16; h++) s[h] *= sum[h];
    }
}
#endif

/* Request b's attention with a bf16 pool and bf16 queries qb [H, D] (D = 32 * C; C and GP are
 * compile-time constants at each call so the loops over them unroll), into out (float32 [H, D]).
 * Both passes walk the keys in blocks of BLOCK rows (the next block prefetched), so a block's K
 * or V rows (BLOCK * Hkv * D * 2 bytes, 6 KB for SmolLM2) stay in L1 while every head uses them.
 * Pass 1: per query head, BLOCK dot products (C VDPBF16PS each: exact products summed in float32)
 * whose sums hsum16 gathers into one vector of BLOCK scores. Pass 2: per KV head, GP query heads
 * of its group at a time keep their outputs in registers (GP * 2C accumulators, 16 at most) over
 * the block, each V row converted once (16 dims a vector); the sum runs in key order, as a
 * per-key read-modify-write of out would. Against one key at a time (a horizontal reduction per
 * score, out read and written per key): 1.5x on one core with the KV in cache, 1.25-1.35x at
 * batch 16, 1.03-1.08x at batch 64 (320 tokens, 30 layers, cold: bound by the cores' line fill
 * buffers there, ~16 GB/s on two cores of a 2-core AMX Xeon that streams 31.6 GB/s
 * sequentially; prefetching further ahead was no better, into L2 instead 1.4x slower). */
static inline __attribute__((always_inline)) void one_request_bf16(
    const uint16_t *qb, const uint16_t *k, const uint16_t *v, int64_t tok_stride, const int64_t *slots, int64_t L,
    int H, int Hkv, const int C, const int GP, float scale, float *out, float *scores, uint16_t *amx_scratch) {
    const int G = H / Hkv, D = 32 * C;
    const int64_t row_bytes = (int64_t)Hkv * D * 2;
    int64_t sh = L, st = 1; /* score of head h, key t at scores[h * sh + t * st] */
#ifdef HAVE_AMX
    if (amx_scratch != NULL) {
        scores_amx(qb, k, tok_stride, slots, L, H, Hkv, C, scale, scores, amx_scratch);
        sh = 1, st = 16;
    } else
#else
    (void)amx_scratch;
#endif
    {
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int64_t t0 = 0; t0 < L; t0 += BLOCK) {
        const uint16_t *rows[BLOCK];
        const int n = block_rows(k, tok_stride, slots, L, t0, row_bytes, rows);
        for (int h = 0; h < H; h++) {
            const int64_t kh = (int64_t)(h / G) * D;
            __m512bh qv[4];
            for (int c = 0; c < C; c++) qv[c] = (__m512bh)_mm512_loadu_si512(qb + (int64_t)h * D + 32 * c);
            __m512 acc[BLOCK];
            for (int i = 0; i < BLOCK; i++) {
                __m512 a = _mm512_setzero_ps();
                for (int c = 0; c < C; c++)
                    a = _mm512_dpbf16_ps(a, qv[c], (__m512bh)_mm512_loadu_si512(rows[i] + kh + 32 * c));
                acc[i] = a;
            }
            _mm512_mask_storeu_ps(scores + (int64_t)h * L + t0, (__mmask16)((1u << n) - 1),
                                  _mm512_mul_ps(vscale, hsum16(acc)));
        }
    }
    softmax_rows(scores, H, L);
    }
    memset(out, 0, (size_t)H * D * sizeof(float));
    for (int64_t t0 = 0; t0 < L; t0 += BLOCK) {
        const uint16_t *rows[BLOCK];
        const int n = block_rows(v, tok_stride, slots, L, t0, row_bytes, rows);
        for (int j = 0; j < Hkv; j++)
            for (int g0 = 0; g0 < G; g0 += GP) {
                float *o = out + (int64_t)(j * G + g0) * D; /* query head j * G + g0 + g at o + g * D */
                const float *p = scores + (int64_t)(j * G + g0) * sh + t0 * st; /* head g, key i: p[g * sh + i * st] */
                __m512 acc[4][8];
                for (int g = 0; g < GP; g++)
                    if (g0 + g < G)
                        for (int c = 0; c < 2 * C; c++) acc[g][c] = _mm512_loadu_ps(o + (int64_t)g * D + 16 * c);
                for (int i = 0; i < n; i++) {
                    __m512 vf[8];
                    for (int c = 0; c < 2 * C; c++) vf[c] = bf16x16_to_f32(rows[i] + (int64_t)j * D + 16 * c);
                    for (int g = 0; g < GP; g++)
                        if (g0 + g < G) {
                            const __m512 pg = _mm512_set1_ps(p[(int64_t)g * sh + i * st]);
                            for (int c = 0; c < 2 * C; c++) acc[g][c] = _mm512_fmadd_ps(pg, vf[c], acc[g][c]);
                        }
                }
                for (int g = 0; g < GP; g++)
                    if (g0 + g < G)
                        for (int c = 0; c < 2 * C; c++) _mm512_storeu_ps(o + (int64_t)g * D + 16 * c, acc[g][c]);
            }
    }
}
#endif

/* 1 when a row, length or slot of request b lies outside the table or the pool. Reading the
 * table row first costs 8 bytes per token against the 2 * Hkv * D elements of KV it guards. */
static int bad_request(const int64_t *table, int64_t table_rows, int64_t table_stride,
                       int64_t num_slots, int64_t row, int64_t len) {
    if (row < 0 || row >= table_rows || len < 1 || len > table_stride) return 1;
    const int64_t *slots = table + row * table_stride;
    for (int64_t t = 0; t < len; t++)
        if (slots[t] < 0 || slots[t] >= num_slots) return 1;
    return 0;
}

/* The store half of a decode step: request b's new K and V rows (Hkv * D elements of the pool's
 * dtype, starting src_off elements into src) are copied to slot loc[b] before anything is read, so the
 * new token attends to itself. */
static inline void store_row(void *pool, const void *src, int elem, int64_t tok_stride, int64_t slot,
                             int64_t src_off, int n) {
    memcpy((char *)pool + slot * tok_stride * elem, (const char *)src + src_off * elem, (size_t)n * elem);
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even; NaN stays NaN */
    union { uint32_t u; float f; } x;
    x.f = f;
    if ((x.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x.u >> 16) | 0x40);
    return (uint16_t)((x.u + 0x7fffu + ((x.u >> 16) & 1u)) >> 16);
}

/* Whether requests take one_request_bf16 (see the header). */
static int bf16_path(int kv_dtype, int q_dtype, int D) {
#ifdef HAVE_AVX512_BF16
    return kv_dtype == 1 && q_dtype == 1 && (D == 64 || D == 128);
#else
    (void)kv_dtype, (void)q_dtype, (void)D;
    return 0;
#endif
}

/* Returns 0 on success, 1 on bad shapes, 2 when scratch memory could not be allocated, 3 when
 * a request names a table row, length or KV slot out of range (nothing is read or written out
 * of bounds).
 *
 * q: request b's heads start at q + b * q_stride elements (heads D apart), of q_dtype; out is
 * of out_dtype. With new_k / new_v non-NULL, request b first stores its new K / V row (at
 * new_k + b * kn_stride, new_v + b * vn_stride, in the pool's dtype) into slot loc[b]. */
int meshlm_decode_attention_store(const void *q, int q_dtype, int64_t q_stride, const void *k, const void *v,
                                  int kv_dtype, int64_t tok_stride, int64_t num_slots,
                                  const int64_t *table, int64_t table_rows, int64_t table_stride,
                                  const int64_t *rows, const int64_t *lens, int64_t B, int H, int Hkv,
                                  int D, float scale, void *out, int out_dtype, int num_threads,
                                  const void *new_k, int64_t kn_stride, const void *new_v, int64_t vn_stride,
                                  const int64_t *loc, int use_amx) {
    if (H <= 0 || Hkv <= 0 || H % Hkv != 0 || D <= 0 || (q_dtype != 0 && q_dtype != 1) ||
        (out_dtype != 0 && out_dtype != 1))
        return 1;
    for (int64_t b = 0; b < B; b++) {
        if (bad_request(table, table_rows, table_stride, num_slots, rows[b], lens[b])) return 3;
        if (new_k != NULL && (loc[b] < 0 || loc[b] >= num_slots)) return 3;
    }
    int64_t max_len = 1;
    for (int64_t b = 0; b < B; b++) max_len = lens[b] > max_len ? lens[b] : max_len;
    const int elem = kv_dtype == 0 ? 4 : 2, fast = bf16_path(kv_dtype, q_dtype, D);
    const int64_t HD = (int64_t)H * D;
#ifdef HAVE_AMX
    const int amx = fast && use_amx && H <= 16 && amx_permitted();
    /* the AMX pass keeps 16 score columns per key, up to the block past the last key */
    const int64_t n_scores = amx && ((max_len + BLOCK - 1) / BLOCK) * BLOCK * 16 > max_len * H
                                 ? ((max_len + BLOCK - 1) / BLOCK) * BLOCK * 16 : max_len * H;
#else
    const int amx = 0;
    const int64_t n_scores = max_len * H;
    (void)use_amx;
#endif
    int failed = 0;
    /* Every thread must reach the worksharing loop, so a thread without scratch still runs it
     * and only skips its requests (reported as failed). */
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *scores = (float *)malloc((size_t)n_scores * sizeof(float));
        float *buf = (float *)malloc((size_t)Hkv * D * sizeof(float));
        float *qf = (float *)malloc((size_t)HD * sizeof(float)); /* a bf16 query as float32 */
        float *of = (float *)malloc((size_t)HD * sizeof(float)); /* float32 output before bf16 */
        uint16_t *amx_scratch = NULL;
#ifdef HAVE_AMX
        if (amx) {
            amx_scratch = (uint16_t *)aligned_alloc(CACHE_LINE, ((size_t)amx_scratch_elems(Hkv, D) * 2 + 63) / 64 * 64);
            amx_configure();
        }
#endif
        const int ok = scores != NULL && buf != NULL && qf != NULL && of != NULL && (!amx || amx_scratch != NULL);
        failed |= !ok;
#pragma omp for schedule(dynamic, 1)
        for (int64_t b = 0; b < B; b++) {
            if (!ok) continue;
            if (new_k != NULL) { /* slots are distinct per request: no other thread touches loc[b] */
                store_row((void *)k, new_k, elem, tok_stride, loc[b], b * kn_stride, Hkv * D);
                store_row((void *)v, new_v, elem, tok_stride, loc[b], b * vn_stride, Hkv * D);
            }
            const int64_t *slots = table + rows[b] * table_stride;
            float *ob = out_dtype == 0 ? (float *)out + b * HD : of;
            if (fast) {
#ifdef HAVE_AVX512_BF16
                const uint16_t *qb = (const uint16_t *)q + b * q_stride;
                if (D == 64)
                    one_request_bf16(qb, k, v, tok_stride, slots, lens[b], H, Hkv, 2, 4, scale, ob, scores, amx_scratch);
                else
                    one_request_bf16(qb, k, v, tok_stride, slots, lens[b], H, Hkv, 4, 2, scale, ob, scores, amx_scratch);
#endif
            } else {
                const float *qb = (const float *)q + b * q_stride;
                if (q_dtype == 1) {
                    const uint16_t *qh = (const uint16_t *)q + b * q_stride;
                    for (int64_t i = 0; i < HD; i++) qf[i] = bf16_to_f32(qh[i]);
                    qb = qf;
                }
                /* A constant head dim lets the compiler unroll and vectorize the row loops fully. */
                switch (D) {
                case 64:
                    one_request(qb, k, v, kv_dtype, tok_stride, slots, lens[b], H, Hkv, 64, scale, ob, scores, buf);
                    break;
                case 128:
                    one_request(qb, k, v, kv_dtype, tok_stride, slots, lens[b], H, Hkv, 128, scale, ob, scores, buf);
                    break;
                default:
                    one_request(qb, k, v, kv_dtype, tok_stride, slots, lens[b], H, Hkv, D, scale, ob, scores, buf);
                }
            }
            if (out_dtype == 1) {
                uint16_t *oh = (uint16_t *)out + b * HD;
                for (int64_t i = 0; i < HD; i++) oh[i] = f32_to_bf16(of[i]);
            }
        }
#ifdef HAVE_AMX
        if (amx) _tile_release();
#endif
        free(amx_scratch);
        free(scores);
        free(buf);
        free(qf);
        free(of);
    }
    return failed ? 2 : 0;
}
