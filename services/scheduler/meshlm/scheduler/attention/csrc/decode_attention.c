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
 * A float32 pool with a float32 query (the float32 model) and D of 64 or 128, on a CPU with
 * AVX-512, takes one_request_f32: scores 16 keys at a time (one FMA accumulator per key, then
 * hsum16 reduces the 16 at once), the values of a group's query heads summed in registers over
 * a block, and the next block's prefetches spread over the block's heads (keys) and KV heads
 * (values) instead of a row at a time. On a 2-core Ice Lake Xeon (`python bench/bench_attention.py
 * --dtype float32 --threads 2 --baseline-rev <before>`, 30 layers): 0.78-0.92x the time of
 * one_request at batch 16 / 64 and 320 / 1024 tokens, 20-21 GB/s where two cores stream 23.5.
 *
 * A bf16 pool with a bf16 query (the bf16 model) and D of 64 or 128, on a CPU with
 * AVX512-BF16, takes one_request_bf16: q . k as VDPBF16PS (32 bf16 products a dot
 * instruction, exact products summed in float32; the keys are never converted to a float32
 * row) and V rows converted in registers, BLOCK keys at a time (one_request_bf16 says how, and
 * what that gained). The generic path converts every row into scratch
 * first and was bound by that work: 7.1 GB/s on one core of a 2-core AMX Xeon against 8.7 for
 * a float32 pool; the bf16 path reads 7.6 GB/s on one core, 13.7 on both, where two cores
 * stream ~16.6 from memory (`python bench/bench_attention.py --dtype bfloat16`).
 * With AMX (and use_amx, H <= 16) the bf16 path runs on tiles: the scores (scores_amx), a softmax
 * left unnormalised with a polynomial exp2 (exp2_nonpositive), and the values (values_amx: the
 * weights rounded to bf16 as an A tile, V rows interleaved in pairs as B tiles), divided by the
 * softmax's sum once at the end. Rounding the weights costs at most 2^-8 of sum_t p_t |v_t| (the
 * model rounds the output to bf16, 2^-9 of it, after). The value passes prefetch the next
 * block's rows spread over the block's work rather than in a burst at its start (a burst fills
 * the line fill buffers while the block computes and leaves them idle after; the scores pass,
 * whose blocks compute little, keeps its burst). On a 2-core AMX Xeon
 * (`python bench/bench_attention.py --dtype bfloat16 --threads 2 --baseline-rev <before>`, 30
 * layers, 2026-12-05): 0.89x the time of the float32-weight FMA value pass at batch 64 (320 and
 * 1024 tokens), 0.84x for 12 / 2 heads of 128 dims; in a C harness over this file, one core with
 * the KV in cache, 0.75x (36 -> 27 us for 1280 keys). A read of the same lines with no
 * arithmetic takes ~0.73 ms a layer at batch 64 / 320 tokens against the kernel's ~0.94: what is
 * left is compute the memory stream does not hide.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#define HAVE_AVX512 1
#if defined(__AVX512BF16__)
#define HAVE_AVX512_BF16 1
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define HAVE_AMX 1
#endif
#endif
#endif
#include "../../kernels/csrc/amx.h"

#define PREFETCH 12  /* tokens ahead */
#define BLOCK 16    /* keys a block in the bf16 path (hsum16 gathers 16 scores) */
#define VBLOCK 32   /* keys a block of the AMX value pass: the K depth of one TDPBF16PS */
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

/* The bf16 path's softmax of H rows of L raw scores (scores[h * L + t]): each becomes
 * exp(scale * (s - max s)), in place, and inv[h] the reciprocal of row h's sum. */
static inline void softmax_rows_unnormalised(float *scores, int H, int64_t L, float scale, float *inv) {
    for (int h = 0; h < H; h++) {
        float *s = scores + (int64_t)h * L;
        float m = s[0], sum = 0.f;
        for (int64_t t = 1; t < L; t++) m = s[t] > m ? s[t] : m;
        const float shift = m * scale;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < L; t++) {
            s[t] = expf(s[t] * scale - shift);
            sum += s[t];
        }
        inv[h] = 1.f / sum;
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

#ifdef HAVE_AVX512

/* 16 bf16 at p as float32 (exact: a bf16 is the top half of a float). */
static inline __m512 bf16x16_to_f32(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

#define LOG2E 1.4426950408889634f

/* 2^y for y <= 0: 2^f (f = y - round(y), |f| <= 1/2) by its Taylor polynomial of degree 6
 * (relative error under 2e-7) scaled by 2^round(y) with VSCALEFPS; 0 below 2^-126, so no
 * weight is a denormal (whose products would take microcode assists). */
static inline __m512 exp2_nonpositive(__m512 y) {
    const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(y, n);
    __m512 p = _mm512_set1_ps(1.5403530e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    return _mm512_maskz_scalef_ps(_mm512_cmp_ps_mask(y, _mm512_set1_ps(-126.f), _CMP_GE_OQ), p, n);
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
static inline int64_t amx_q_elems(int Hkv, int D) { return (int64_t)Hkv * (D / 32) * 512; }
static inline int64_t amx_scratch_elems(int Hkv, int D) {
    /* the Q tiles, then the larger of pass 1's gathered K rows and pass 2's A and B tiles */
    const int64_t k_rows = (int64_t)BLOCK * Hkv * D, ab = (int64_t)Hkv * 512 * 5;
    return amx_q_elems(Hkv, D) + (k_rows > ab ? k_rows : ab);
}

/* Pass 1 on AMX, for H <= 16: scores[t * 16 + h] = exp(scale * (q_h . k_t - max_t q_h . k_t)) for
 * t < L, the softmax weights before their division by inv[h]'s reciprocal, their sum (rows up to
 * the next multiple of BLOCK are written too; columns h >= H are not heads). Per KV head j and 32-dim chunk c
 * one TDPBF16PS multiplies BLOCK keys' dims (tile 1: rows of the pool in place when the block's
 * slots are consecutive, else gathered into scratch) by the group's queries (tile 2: Q tile
 * (j, c), columns of other groups' heads zero), so one S tile sums every (j, c) and holds each
 * head's score with its own KV head. Products are exact bf16 x bf16, summed in float32, as in the
 * VDPBF16PS pass. */
static void scores_amx(const uint16_t *qb, const uint16_t *k, int64_t tok_stride, const int64_t *slots, int64_t L,
                       int H, int Hkv, int C, float scale, float *scores, float *inv, uint16_t *scratch) {
    const int G = H / Hkv, D = 32 * C, n_el = Hkv * D;
    const int64_t row_bytes = (int64_t)n_el * 2;
    uint16_t *qt = scratch, *kbuf = scratch + amx_q_elems(Hkv, D);
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
    /* unnormalised softmax over keys, per head column (st[t * 16 + h]); inv[h] = 1 / its sum */
    __m512 m = _mm512_loadu_ps(scores);
    for (int64_t t = 1; t < L; t++) m = _mm512_max_ps(m, _mm512_loadu_ps(scores + t * 16));
    const __m512 a = _mm512_set1_ps(scale * LOG2E), b = _mm512_mul_ps(m, a);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < L; t++) {
        const __m512 e = exp2_nonpositive(_mm512_fmsub_ps(_mm512_loadu_ps(scores + t * 16), a, b));
        _mm512_storeu_ps(scores + t * 16, e);
        sum = _mm512_add_ps(sum, e);
    }
    _mm512_storeu_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.f), sum));
}

/* r[i] (16 x 16 int32, row i) becomes its transpose. Two unpack stages leave u[4i + k]'s 128-bit
 * lane l holding column 4l + k of rows 4i .. 4i + 3; two lane shuffles gather those four lanes. */
static inline void transpose16_epi32(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int k = 0; k < 4; k++) {
        const __m512i x0 = _mm512_shuffle_i32x4(r[k], r[4 + k], 0x44), x1 = _mm512_shuffle_i32x4(r[k], r[4 + k], 0xEE);
        const __m512i y0 = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0x44);
        const __m512i y1 = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0xEE);
        t[k] = _mm512_shuffle_i32x4(x0, y0, 0x88), t[4 + k] = _mm512_shuffle_i32x4(x0, y0, 0xDD);
        t[8 + k] = _mm512_shuffle_i32x4(x1, y1, 0x88), t[12 + k] = _mm512_shuffle_i32x4(x1, y1, 0xDD);
    }
    for (int i = 0; i < 16; i++) r[i] = t[i];
}

/* Pass 2 on AMX, after scores_amx (H <= 16): out[h, :] = inv[h] * sum_t w(h, t) v_t, the weights
 * w = scores[t * 16 + h] rounded to bf16 (products exact, summed in float32 in the tiles). For a
 * block of VBLOCK keys and KV head j: C[h][n] += A_j[h][t] * B[t][n] with A_j the block's weights
 * (row h = head h's 32 keys, rows of other groups' heads zero, so one set of C tiles sums every
 * group with its own KV head) and B the V rows in VNNI pairs: row p of B tile (j, q) interleaves
 * keys 2p and 2p + 1 (VPUNPCK{L,H}WD of their 32-dim chunk q / 2), so column n of tile q holds dim
 * 32 (q / 2) + 8 (n / 4) + n % 4 + 4 (q % 2) of the 64-dim half `half`; the store at the end puts
 * the dims back in order. Tiles: 0-3 = C (64 dims), 4 = A_j, 5 = B; D = 128 takes two sweeps over
 * the keys, one per 64-dim half (each reads its own cache lines of the V rows). */
static void values_amx(const uint16_t *v, int64_t tok_stride, const int64_t *slots, int64_t L, int H, int Hkv,
                       int C, const float *scores, const float *inv, float *out, uint16_t *scratch) {
    const int G = H / Hkv, D = 32 * C;
    uint16_t *a_tiles = scratch + amx_q_elems(Hkv, D), *b_tiles = a_tiles + (int64_t)Hkv * 512;
    /* bf16 lane 2h <- lane h of the first (low) row, 2h + 1 <- lane h of the second (high) */
    const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                           6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i first = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
    const __m512i second = _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
    memset(a_tiles, 0, (size_t)Hkv * 512 * sizeof(uint16_t)); /* rows of other groups stay zero */
    for (int half = 0; half < C / 2; half++) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t t0 = 0; t0 < L; t0 += VBLOCK) {
            const int n = L - t0 < VBLOCK ? (int)(L - t0) : VBLOCK;
            const uint16_t *rows[VBLOCK]; /* past the last key: key t0 again, weight 0 */
            for (int i = 0; i < VBLOCK; i++) rows[i] = v + slots[t0 + (i < n ? i : 0)] * tok_stride + 64 * half;
            __m512i w[16]; /* w[p] lane h: the bf16 weights of keys t0 + 2p, t0 + 2p + 1 of head h */
            for (int p = 0; p < 16; p++) {
                const int64_t t = t0 + 2 * p;
                const __m512 lo = t < L ? _mm512_loadu_ps(scores + t * 16) : _mm512_setzero_ps();
                const __m512 hi = t + 1 < L ? _mm512_loadu_ps(scores + (t + 1) * 16) : _mm512_setzero_ps();
                w[p] = _mm512_permutexvar_epi16(pairs, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
            }
            transpose16_epi32(w); /* w[h]: head h's 32 weights in key order, an A tile row */
            for (int h = 0; h < H; h++) _mm512_storeu_si512(a_tiles + (int64_t)(h / G) * 512 + h * 32, w[h]);
            for (int p = 0; p < 16; p++) {
                /* the next block's rows 2p, 2p + 1, spread over the pairs (a burst of them at the
                 * block's start leaves the line fill buffers idle while the block computes) */
                for (int i = 2 * p; i < 2 * p + 2 && t0 + VBLOCK + i < L; i++) {
                    const char *r = (const char *)(v + slots[t0 + VBLOCK + i] * tok_stride + 64 * half);
                    for (int j = 0; j < Hkv; j++) {
                        __builtin_prefetch(r + (int64_t)j * D * 2);
                        __builtin_prefetch(r + (int64_t)j * D * 2 + CACHE_LINE);
                    }
                }
                for (int j = 0; j < Hkv; j++)
                    for (int c = 0; c < 2; c++) {
                        const __m512i x = _mm512_loadu_si512(rows[2 * p] + (int64_t)j * D + 32 * c);
                        const __m512i y = _mm512_loadu_si512(rows[2 * p + 1] + (int64_t)j * D + 32 * c);
                        uint16_t *b = b_tiles + (int64_t)(j * 4 + 2 * c) * 512 + p * 32;
                        _mm512_storeu_si512(b, _mm512_unpacklo_epi16(x, y));
                        _mm512_storeu_si512(b + 512, _mm512_unpackhi_epi16(x, y));
                    }
            }
            for (int j = 0; j < Hkv; j++) {
                const uint16_t *b = b_tiles + (int64_t)j * 4 * 512;
                _tile_loadd(4, a_tiles + (int64_t)j * 512, 64);
                _tile_loadd(5, b, 64);
                _tile_dpbf16ps(0, 4, 5);
                _tile_loadd(5, b + 512, 64);
                _tile_dpbf16ps(1, 4, 5);
                _tile_loadd(5, b + 1024, 64);
                _tile_dpbf16ps(2, 4, 5);
                _tile_loadd(5, b + 1536, 64);
                _tile_dpbf16ps(3, 4, 5);
            }
        }
        float *acc = (float *)b_tiles; /* 4 C tiles of 16 x 16 floats (the B tiles are done) */
        _tile_stored(0, acc, 64);
        _tile_stored(1, acc + 256, 64);
        _tile_stored(2, acc + 512, 64);
        _tile_stored(3, acc + 768, 64);
        for (int h = 0; h < H; h++) {
            const __m512 f = _mm512_set1_ps(inv[h]);
            float *o = out + (int64_t)h * D + 64 * half;
            for (int c = 0; c < 2; c++) {
                const __m512 lo = _mm512_loadu_ps(acc + (2 * c) * 256 + h * 16);
                const __m512 hi = _mm512_loadu_ps(acc + (2 * c + 1) * 256 + h * 16);
                _mm512_storeu_ps(o + 32 * c, _mm512_mul_ps(f, _mm512_permutex2var_ps(lo, first, hi)));
                _mm512_storeu_ps(o + 32 * c + 16, _mm512_mul_ps(f, _mm512_permutex2var_ps(lo, second, hi)));
            }
        }
    }
}
#endif

#ifdef HAVE_AVX512_BF16
/* Request b's attention with a bf16 pool and bf16 queries qb [H, D] (D = 32 * C; C and GP are
 * compile-time constants at each call so the loops over them unroll), into out (float32 [H, D]):
 * on AMX tiles with amx_scratch (scores_amx, values_amx), else as follows. Both passes walk the keys in blocks of BLOCK rows (the next block prefetched), so a block's K
 * or V rows (BLOCK * Hkv * D * 2 bytes, 6 KB for SmolLM2) stay in L1 while every head uses them.
 * Pass 1: per query head, BLOCK dot products (C VDPBF16PS each: exact products summed in float32)
 * whose sums hsum16 gathers into one vector of BLOCK scores; the softmax is left unnormalised
 * (softmax_rows_unnormalised) and out divided by its sum at the end. Pass 2: per KV head, GP query heads
 * of its group at a time keep their outputs in registers (GP * 2C accumulators, 16 at most) over
 * the block, each V row converted once (16 dims a vector); the sum runs in key order, as a
 * per-key read-modify-write of out would. Against one key at a time (a horizontal reduction per
 * score, out read and written per key): 1.5x on one core with the KV in cache, 1.25-1.35x at
 * batch 16, 1.03-1.08x at batch 64 (320 tokens, 30 layers, cold: bound by the cores' line fill
 * buffers there, ~16 GB/s on two cores of a 2-core AMX Xeon that streams 31.6 GB/s
 * sequentially; prefetching further ahead was no better, into L2 instead 1.4x slower). */
static inline __attribute__((always_inline)) void one_request_bf16(
    const uint16_t *qb, const uint16_t *k, const uint16_t *v, int64_t tok_stride, const int64_t *slots, int64_t L,
    int H, int Hkv, const int C, const int GP, float scale, float *out, float *scores, float *inv,
    uint16_t *amx_scratch) {
    const int G = H / Hkv, D = 32 * C;
    const int64_t row_bytes = (int64_t)Hkv * D * 2;
#ifdef HAVE_AMX
    if (amx_scratch != NULL) {
        scores_amx(qb, k, tok_stride, slots, L, H, Hkv, C, scale, scores, inv, amx_scratch);
        values_amx(v, tok_stride, slots, L, H, Hkv, C, scores, inv, out, amx_scratch);
        return;
    }
#else
    (void)amx_scratch;
#endif
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
            _mm512_mask_storeu_ps(scores + (int64_t)h * L + t0, (__mmask16)((1u << n) - 1), hsum16(acc));
        }
    }
    softmax_rows_unnormalised(scores, H, L, scale, inv);
    memset(out, 0, (size_t)H * D * sizeof(float));
    for (int64_t t0 = 0; t0 < L; t0 += BLOCK) {
        const uint16_t *rows[BLOCK];
        const int n = L - t0 < BLOCK ? (int)(L - t0) : BLOCK;
        for (int i = 0; i < n; i++) rows[i] = v + slots[t0 + i] * tok_stride;
        for (int j = 0; j < Hkv; j++)
            for (int g0 = 0; g0 < G; g0 += GP) {
                float *o = out + (int64_t)(j * G + g0) * D; /* query head j * G + g0 + g at o + g * D */
                const float *p = scores + (int64_t)(j * G + g0) * L + t0; /* head g, key i: p[g * L + i] */
                __m512 acc[4][8];
                for (int g = 0; g < GP; g++)
                    if (g0 + g < G)
                        for (int c = 0; c < 2 * C; c++) acc[g][c] = _mm512_loadu_ps(o + (int64_t)g * D + 16 * c);
                for (int i = 0; i < n; i++) {
                    /* the next block's row i, spread over the block's keys (see values_amx) */
                    if (j == 0 && g0 == 0 && t0 + BLOCK + i < L)
                        prefetch_row(v, slots[t0 + BLOCK + i] * tok_stride, row_bytes, 2);
                    __m512 vf[8];
                    for (int c = 0; c < 2 * C; c++) vf[c] = bf16x16_to_f32(rows[i] + (int64_t)j * D + 16 * c);
                    for (int g = 0; g < GP; g++)
                        if (g0 + g < G) {
                            const __m512 pg = _mm512_set1_ps(p[(int64_t)g * L + i]);
                            for (int c = 0; c < 2 * C; c++) acc[g][c] = _mm512_fmadd_ps(pg, vf[c], acc[g][c]);
                        }
                }
                for (int g = 0; g < GP; g++)
                    if (g0 + g < G)
                        for (int c = 0; c < 2 * C; c++) _mm512_storeu_ps(o + (int64_t)g * D + 16 * c, acc[g][c]);
            }
    }
    for (int h = 0; h < H; h++) { /* the softmax's division, once a head */
        const __m512 f = _mm512_set1_ps(inv[h]);
        for (int c = 0; c < 2 * C; c++)
            _mm512_storeu_ps(out + (int64_t)h * D + 16 * c, _mm512_mul_ps(f, _mm512_loadu_ps(out + (int64_t)h * D + 16 * c)));
    }
}
#endif

/* The rows of keys t0 .. t0 + BLOCK - 1 of a pool of `elem`-byte values (past the last key:
 * key t0 again, as block_rows); returns the block's real key count. Nothing is prefetched here:
 * the passes spread the next block's prefetches over their work. */
static inline int block_rows_f32(const void *pool, int elem, int64_t tok_stride, const int64_t *slots, int64_t L,
                                 int64_t t0, const char *rows[BLOCK]) {
    const int n = L - t0 < BLOCK ? (int)(L - t0) : BLOCK;
    for (int i = 0; i < BLOCK; i++) rows[i] = (const char *)pool + slots[t0 + (i < n ? i : 0)] * tok_stride * elem;
    return n;
}

/* 16 pool values starting `off` values into `row` as float32: a float32 pool (kvb 0) loaded,
 * a bf16 one (kvb 1) widened exactly. kvb is a constant at every call, so each instance of
 * one_request_f32 has one kind of load. */
static inline __attribute__((always_inline)) __m512 load16(const char *row, int64_t off, const int kvb) {
    return kvb ? bf16x16_to_f32((const uint16_t *)row + off) : _mm512_loadu_ps((const float *)row + off);
}

/* one_request for a float32 query over a float32 pool (kvb 0) or a bf16 one (kvb 1, the
 * float32 model with --kv-cache-dtype bfloat16: half the bytes read, each value widened exactly
 * in registers) with D = 16 * C (64 or 128) on AVX-512: the shape of one_request_bf16 without
 * bf16 arithmetic. Scores BLOCK keys at a time (one accumulator per key, C FMAs, then hsum16
 * turns the 16 accumulators into 16 scores at once, where one_request reduces each dot product
 * on its own), the softmax left unnormalised, and the values of GP query heads of a group
 * summed in registers over a block's keys (the output loaded and stored once a block instead
 * of once a key); the division once a head at the end. Only the order of the float32 sums
 * differs from one_request. */
static inline __attribute__((always_inline)) void one_request_f32(
    const float *q, const void *k, const void *v, const int kvb, int64_t tok_stride, const int64_t *slots, int64_t L,
    int H, int Hkv, const int C, const int GP, float scale, float *out, float *scores, float *inv) {
    const int G = H / Hkv, D = 16 * C, elem = kvb ? 2 : 4;
    const int64_t row_bytes = (int64_t)Hkv * D * elem;
    for (int64_t t0 = 0; t0 < L; t0 += BLOCK) {
        const char *rows[BLOCK];
        const int n = block_rows_f32(k, elem, tok_stride, slots, L, t0, rows);
        for (int h = 0; h < H; h++) {
            const int64_t kh = (int64_t)(h / G) * D;
            __m512 qv[8];
            for (int c = 0; c < C; c++) qv[c] = _mm512_loadu_ps(q + (int64_t)h * D + 16 * c);
            __m512 acc[BLOCK];
            /* the next block's row h, h + H, ...: its rows spread over this block's heads */
            for (int i = h; i < BLOCK && t0 + BLOCK + i < L; i += H)
                prefetch_row(k, slots[t0 + BLOCK + i] * tok_stride, row_bytes, elem);
            for (int i = 0; i < BLOCK; i++) {
                __m512 a = _mm512_mul_ps(qv[0], load16(rows[i], kh, kvb));
                for (int c = 1; c < C; c++) a = _mm512_fmadd_ps(qv[c], load16(rows[i], kh + 16 * c, kvb), a);
                acc[i] = a;
            }
            _mm512_mask_storeu_ps(scores + (int64_t)h * L + t0, (__mmask16)((1u << n) - 1), hsum16(acc));
        }
    }
    softmax_rows_unnormalised(scores, H, L, scale, inv);
    memset(out, 0, (size_t)H * D * sizeof(float));
    for (int64_t t0 = 0; t0 < L; t0 += BLOCK) {
        const char *rows[BLOCK];
        const int n = L - t0 < BLOCK ? (int)(L - t0) : BLOCK;
        for (int i = 0; i < n; i++) rows[i] = (const char *)v + slots[t0 + i] * tok_stride * elem;
        for (int j = 0; j < Hkv; j++)
            for (int g0 = 0; g0 < G; g0 += GP) {
                float *o = out + (int64_t)(j * G + g0) * D; /* query head j * G + g0 + g at o + g * D */
                const float *p = scores + (int64_t)(j * G + g0) * L + t0; /* head g, key i: p[g * L + i] */
                __m512 acc[4][8];
                for (int g = 0; g < GP; g++)
                    if (g0 + g < G)
                        for (int c = 0; c < C; c++) acc[g][c] = _mm512_loadu_ps(o + (int64_t)g * D + 16 * c);
                for (int i = 0; i < n; i++) {
                    /* KV head j of the next block's row i: the block's prefetches spread over
                     * its keys and KV heads */
                    if (g0 == 0 && t0 + BLOCK + i < L)
                        prefetch_row(v, slots[t0 + BLOCK + i] * tok_stride + (int64_t)j * D, (int64_t)D * elem, elem);
                    __m512 vf[8];
                    for (int c = 0; c < C; c++) vf[c] = load16(rows[i], (int64_t)j * D + 16 * c, kvb);
                    for (int g = 0; g < GP; g++)
                        if (g0 + g < G) {
                            const __m512 pg = _mm512_set1_ps(p[(int64_t)g * L + i]);
                            for (int c = 0; c < C; c++) acc[g][c] = _mm512_fmadd_ps(pg, vf[c], acc[g][c]);
                        }
                }
                for (int g = 0; g < GP; g++)
                    if (g0 + g < G)
                        for (int c = 0; c < C; c++) _mm512_storeu_ps(o + (int64_t)g * D + 16 * c, acc[g][c]);
            }
    }
    for (int h = 0; h < H; h++) { /* the softmax's division, once a head */
        const __m512 f = _mm512_set1_ps(inv[h]);
        for (int c = 0; c < C; c++)
            _mm512_storeu_ps(out + (int64_t)h * D + 16 * c, _mm512_mul_ps(f, _mm512_loadu_ps(out + (int64_t)h * D + 16 * c)));
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

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even; NaN stays NaN */
    union { uint32_t u; float f; } x;
    x.f = f;
    if ((x.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x.u >> 16) | 0x40);
    return (uint16_t)((x.u + 0x7fffu + ((x.u >> 16) & 1u)) >> 16);
}

/* The store half of a decode step: request b's new K and V rows (n elements of new_dtype,
 * starting src_off elements into src) are written to slot loc[b] before anything is read, so
 * the new token attends to itself: copied where new_dtype is the pool's, rounded to nearest
 * even where a float32 row goes to a bf16 pool (the only conversion the entry point accepts). */
static inline void store_row(void *pool, int kv_dtype, const void *src, int new_dtype, int64_t tok_stride,
                             int64_t slot, int64_t src_off, int n) {
    const int elem = kv_dtype == 0 ? 4 : 2;
    if (new_dtype == kv_dtype) {
        memcpy((char *)pool + slot * tok_stride * elem, (const char *)src + src_off * elem, (size_t)n * elem);
        return;
    }
    uint16_t *dst = (uint16_t *)pool + slot * tok_stride;
    const float *from = (const float *)src + src_off;
    for (int i = 0; i < n; i++) dst[i] = f32_to_bf16(from[i]);
}

/* Whether requests take one_request_f32: a float32 query over a float32 or bf16 pool. */
static int f32_path(int kv_dtype, int q_dtype, int D) {
#ifdef HAVE_AVX512
    return (kv_dtype == 0 || kv_dtype == 1) && q_dtype == 0 && (D == 64 || D == 128);
#else
    (void)kv_dtype, (void)q_dtype, (void)D;
    return 0;
#endif
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
 * new_k + b * kn_stride, new_v + b * vn_stride, of new_dtype: the pool's, or float32 for a bf16
 * pool) into slot loc[b]. */
int meshlm_decode_attention_store(const void *q, int q_dtype, int64_t q_stride, const void *k, const void *v,
                                  int kv_dtype, int64_t tok_stride, int64_t num_slots,
                                  const int64_t *table, int64_t table_rows, int64_t table_stride,
                                  const int64_t *rows, const int64_t *lens, int64_t B, int H, int Hkv,
                                  int D, float scale, void *out, int out_dtype, int num_threads,
                                  const void *new_k, int64_t kn_stride, const void *new_v, int64_t vn_stride,
                                  const int64_t *loc, int use_amx, int new_dtype) {
    if (H <= 0 || Hkv <= 0 || H % Hkv != 0 || D <= 0 || (q_dtype != 0 && q_dtype != 1) ||
        (out_dtype != 0 && out_dtype != 1))
        return 1;
    if (new_k != NULL && new_dtype != kv_dtype && !(new_dtype == 0 && kv_dtype == 1)) return 1;
    for (int64_t b = 0; b < B; b++) {
        if (bad_request(table, table_rows, table_stride, num_slots, rows[b], lens[b])) return 3;
        if (new_k != NULL && (loc[b] < 0 || loc[b] >= num_slots)) return 3;
    }
    int64_t max_len = 1;
    for (int64_t b = 0; b < B; b++) max_len = lens[b] > max_len ? lens[b] : max_len;
    const int fast = bf16_path(kv_dtype, q_dtype, D);
    const int fast32 = f32_path(kv_dtype, q_dtype, D);
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
        float *inv = (float *)malloc((size_t)(H > 16 ? H : 16) * sizeof(float)); /* 1 / softmax sums */
        uint16_t *amx_scratch = NULL;
#ifdef HAVE_AMX
        if (amx) {
            amx_scratch = (uint16_t *)aligned_alloc(CACHE_LINE, ((size_t)amx_scratch_elems(Hkv, D) * 2 + 63) / 64 * 64);
            amx_configure();
        }
#endif
        const int ok = scores != NULL && buf != NULL && qf != NULL && of != NULL && inv != NULL && (!amx || amx_scratch != NULL);
        failed |= !ok;
#pragma omp for schedule(dynamic, 1)
        for (int64_t b = 0; b < B; b++) {
            if (!ok) continue;
            if (new_k != NULL) { /* slots are distinct per request: no other thread touches loc[b] */
                store_row((void *)k, kv_dtype, new_k, new_dtype, tok_stride, loc[b], b * kn_stride, Hkv * D);
                store_row((void *)v, kv_dtype, new_v, new_dtype, tok_stride, loc[b], b * vn_stride, Hkv * D);
            }
            const int64_t *slots = table + rows[b] * table_stride;
            float *ob = out_dtype == 0 ? (float *)out + b * HD : of;
            if (fast) {
#ifdef HAVE_AVX512_BF16
                const uint16_t *qb = (const uint16_t *)q + b * q_stride;
                if (D == 64)
                    one_request_bf16(qb, k, v, tok_stride, slots, lens[b], H, Hkv, 2, 4, scale, ob, scores, inv, amx_scratch);
                else
                    one_request_bf16(qb, k, v, tok_stride, slots, lens[b], H, Hkv, 4, 2, scale, ob, scores, inv, amx_scratch);
#endif
            } else if (fast32) {
#ifdef HAVE_AVX512
                const float *qb = (const float *)q + b * q_stride;
                /* one instance per pool dtype and head dim: constants the loops unroll over */
                if (kv_dtype == 0 && D == 64)
                    one_request_f32(qb, k, v, 0, tok_stride, slots, lens[b], H, Hkv, 4, 4, scale, ob, scores, inv);
                else if (kv_dtype == 0)
                    one_request_f32(qb, k, v, 0, tok_stride, slots, lens[b], H, Hkv, 8, 2, scale, ob, scores, inv);
                else if (D == 64)
                    one_request_f32(qb, k, v, 1, tok_stride, slots, lens[b], H, Hkv, 4, 4, scale, ob, scores, inv);
                else
                    one_request_f32(qb, k, v, 1, tok_stride, slots, lens[b], H, Hkv, 8, 2, scale, ob, scores, inv);
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
        free(inv);
    }
    return failed ? 2 : 0;
}
