/* Causal extend (prefill) attention on AMX tiles: a bf16 pool and bf16 queries, for CPUs with
 * AMX-BF16 (Sapphire Rapids and later). Same segments and layouts as extend_attention.c:
 *
 *   q           token t, head h, dim d at t * q_stride + h * D + d (bf16)
 *   out         token t, head h, dim d at t * out_stride + h * D + d (float32)
 *   k, v        slot s, KV head j, dim d at s * tok_stride + j * D + d (bf16)
 *   segment s   lens[s] new query tokens, rows starts[s] .. of q, after prefix[s] cached ones;
 *               query token a (absolute position prefix[s] + a) attends to the slots
 *               table[rows[s] * table_stride + t] for t in [0, prefix[s] + a].
 * Query head h reads KV head h / G, G = H / Hkv. D is 32, 64, 96 or 128.
 *
 * Two phases in one parallel region:
 *   1. per (segment, KV head), the segment's keys are packed once, in blocks of KB = 32 keys,
 *      into the tiles the second phase multiplies by: K rows as they are (tile (c, half): 16 keys
 *      x dims 32c .. 32c + 31) and V transposed (tile e: dims 16e .. 16e + 15 x the 32 keys).
 *      Keys past the segment are zero.
 *   2. per (segment, query head, block of QR = 16 query tokens), flash attention over the key
 *      blocks the block can see, with the scores transposed: S^T [32 x 16] = K . Q^T (C = D / 32
 *      TDPBF16PS into each of two score tiles; Q^T packed once per work item, held in tiles), so
 *      that a key's scores for the 16 queries are one vector and the scale, causal mask, running
 *      max and sum of each query are lane-wise AVX-512 (exp16: no horizontal reductions); then
 *      O^T [D x 16] += V^T . P^T (D / 16 TDPBF16PS, P^T as bf16 key pairs), O^T rescaled when a
 *      query's max grows; at the end out = (O^T)^T / sum. For D <= 64 attend_block_resident keeps
 *      O^T in tile registers across the key blocks and moves the running max lazily (only when a
 *      score passes it by TAU), so O^T is stored and rescaled only then, not every block:
 *      0.85-0.97x the time (`bench/bench_extend_attention.py --dtype bfloat16 --threads 2
 *      --baseline-rev <before>`, 1-8 requests of 256-1024 tokens, prefix 0 or 512; 0.97x at
 *      8 x 256 without a prefix, where the exps and the score tiles' trip through memory dominate).
 * Products are exact bf16 x bf16, summed in float32; P is rounded to bf16 for the second
 * product, as flash attention does on GPUs. Scores use a finite floor (NEG) instead of -inf,
 * since the fast build assumes finite math.
 *
 * Against torch's SDPA (its AMX flash attention) per request, `bench/bench_extend_attention.py
 * --dtype bfloat16 --threads 2` on a 2-core AMX Xeon: 1.4-1.9x for prompts of 256-1024 tokens
 * without a cached prefix, 1.5-2.4x after a 512-token prefix (one call for the whole batch, and
 * the packed keys serve every query head of their group).
 *
 * On a CPU with AVX512-BF16 but no AMX (AMD Zen 4 / 5) the same program runs on software tiles
 * (T_LOAD / T_ZERO / T_DP / T_STORE below: a tile points at its rows, a tile product is 256
 * VDPBF16PS). Against extend_attention.c's float32 FMAs on a 2-core AMD EPYC (Zen 5;
 * `bench/bench_extend_attention.py --dtype bfloat16 --threads 2`, 4 layers, 2026-12-07): 8 x 256
 * tokens 1.61 vs 3.11 ms a layer, 1 x 1024 2.38 vs 3.85, 8 x 1024 after a 512-token prefix 33.4
 * vs 55.2 (1.5-1.9x); a c=64 engine run's prompt attention 0.52 s against 0.81 s.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define HAVE_TILES 1
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define HAVE_AMX 1
#endif
#endif
#include "../../kernels/csrc/amx.h"

#define QR 16      /* query tokens a work item (rows of a tile) */
#define KB 32      /* keys a block (bf16 columns of a P tile row) */
#define NEG -1e30f /* score of a masked key: exp(NEG - m) underflows to 0 */
#define TILE 512   /* bf16 elements a 16 x 64-byte tile */

#ifdef HAVE_AMX
#define T_ZERO(t) _tile_zero(t)
#define T_LOAD(t, p) _tile_loadd(t, p, 64)
#define T_STORE(t, p) _tile_stored(t, p, 64)
#define T_DP(c, a, b) _tile_dpbf16ps(c, a, b)
#define T_BEGIN() amx_configure()
#define T_END() _tile_release()
static int tiles_permitted(void) { return amx_permitted(); }
#elif defined(HAVE_TILES)
/* The eight tiles (16 rows x 64 bytes) in software, for AVX512-BF16 without AMX: the code above
 * the macros is the same, its TDPBF16PS done as 256 VDPBF16PS (row m of A as a broadcast pair,
 * row k of B as the vector: the same exact bf16 products summed in float32). A tile is where its
 * rows lie: T_LOAD points it at the source (no copy), T_ZERO at the thread's own zeroed rows,
 * and T_DP updates the accumulator's rows in place. So, unlike real tiles, a loaded tile follows
 * later writes to its source; every use here reloads a tile after rewriting its source (P^T,
 * Q^T) or rewrites the source only through the tile itself (O^T in ot), so the two agree. */
static _Thread_local void *tile_at[8];
static _Thread_local float tile_own[8][256] __attribute__((aligned(64)));
static inline void T_ZERO(int t) {
    memset(tile_own[t], 0, sizeof tile_own[t]);
    tile_at[t] = tile_own[t];
}
static inline void T_LOAD(int t, const void *p) { tile_at[t] = (void *)p; }
static inline void T_STORE(int t, void *p) {
    if (p != tile_at[t]) memcpy(p, tile_at[t], sizeof tile_own[t]);
}
/* C[m][n] += sum_k A[m][2k] B[k][2n] + A[m][2k + 1] B[k][2n + 1], m, n, k < 16 (TDPBF16PS) */
static inline __attribute__((always_inline)) void T_DP(int c, int a, int b) {
    float *C = (float *)tile_at[c];
    const int32_t *A = (const int32_t *)tile_at[a]; /* row m: 16 bf16 pairs at A + 16m */
    const uint16_t *B = (const uint16_t *)tile_at[b];
    __m512 acc[16];
    for (int m = 0; m < 16; m++) acc[m] = _mm512_loadu_ps(C + 16 * m);
    for (int k = 0; k < 16; k++) {
        const __m512bh bk = (__m512bh)_mm512_loadu_si512(B + 32 * k);
        for (int m = 0; m < 16; m++) acc[m] = _mm512_dpbf16_ps(acc[m], (__m512bh)_mm512_set1_epi32(A[16 * m + k]), bk);
    }
    for (int m = 0; m < 16; m++) _mm512_storeu_ps(C + 16 * m, acc[m]);
}
#define T_BEGIN() ((void)0)
#define T_END() ((void)0)
static int tiles_permitted(void) { return 1; }
#endif

int meshlm_extend_attention_amx_available(void) {
#ifdef HAVE_TILES
    return tiles_permitted();
#else
    return 0;
#endif
}

/* 1 when a segment's row, prefix, start, length or one of its slots lies outside the table, the
 * batch or the pool. */
static int bad_segment(const int64_t *table, int64_t table_rows, int64_t table_stride, int64_t num_slots, int64_t T,
                       int64_t row, int64_t prefix, int64_t start, int64_t len) {
    if (row < 0 || row >= table_rows || prefix < 0 || len < 1 || start < 0 || start + len > T ||
        prefix + len > table_stride)
        return 1;
    const int64_t *slots = table + row * table_stride;
    for (int64_t t = 0; t < prefix + len; t++)
        if (slots[t] < 0 || slots[t] >= num_slots) return 1;
    return 0;
}

#ifdef HAVE_TILES
/* Tiles (amx_configure): attend_block uses 0, 1 for scores (keys 0-15, 16-31 of a block), then
 * 0 = an output tile and 1 = P; 2 a K or V tile; 4 .. 4 + C - 1 the queries. */

/* exp(x) over 16 lanes (relative error ~1e-7; below -87.3 it returns ~1e-38, not 0): 2^n * e^r
 * with n = round(x / ln 2) and a degree-6 polynomial on |r| <= ln 2 / 2. */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x); /* ln 2 in two parts */
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
    __m512 p = _mm512_set1_ps(1.f / 720.f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

/* r[0 .. 15] (16 rows of 16 32-bit values) becomes its transpose: 64 shuffles. */
static inline __attribute__((always_inline)) void transpose16(__m512 r[16]) {
    __m512 t[16], u[16];
    for (int i = 0; i < 16; i += 2) { /* per 128-bit lane: rows i, i + 1 interleaved */
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    /* u[4g + c], 128-bit lane L: column 4L + c of rows 4g .. 4g + 3 */
    for (int g = 0; g < 4; g++) {
        u[4 * g] = _mm512_shuffle_ps(t[4 * g], t[4 * g + 2], 0x44);
        u[4 * g + 1] = _mm512_shuffle_ps(t[4 * g], t[4 * g + 2], 0xEE);
        u[4 * g + 2] = _mm512_shuffle_ps(t[4 * g + 1], t[4 * g + 3], 0x44);
        u[4 * g + 3] = _mm512_shuffle_ps(t[4 * g + 1], t[4 * g + 3], 0xEE);
    }
    for (int c = 0; c < 4; c++) { /* column 4L + c = lane L of u[c], u[4 + c], u[8 + c], u[12 + c] */
        const __m512 v0 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x88), v1 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xDD);
        const __m512 w0 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x88);
        const __m512 w1 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xDD);
        r[c] = _mm512_shuffle_f32x4(v0, w0, 0x88);
        r[8 + c] = _mm512_shuffle_f32x4(v0, w0, 0xDD);
        r[4 + c] = _mm512_shuffle_f32x4(v1, w1, 0x88);
        r[12 + c] = _mm512_shuffle_f32x4(v1, w1, 0xDD);
    }
}

/* Keys [32 kb, 32 kb + 32) of one KV head into its tiles (see the header; keys past L zero):
 * kt gets 2C tiles, (c, half) at kt + (2c + half) * TILE, row i = dims 32c .. 32c + 31 of key
 * 16 half + i (the K rows as they are); vt gets D / 16 tiles, e at vt + e * TILE, row d = dim
 * 16e + d of the block's 32 keys (V transposed). */
static void pack_block(const uint16_t *k, const uint16_t *v, int64_t tok_stride, const int64_t *slots, int64_t L,
                       int64_t kb, int64_t head_off, int D, uint16_t *kt, uint16_t *vt, uint16_t *vbuf) {
    const int C = D / 32;
    for (int i = 0; i < KB; i++) { /* K rows into their tiles; V rows into vbuf [KB][D] */
        const int64_t t = kb * KB + i;
        uint16_t *vr = vbuf + (int64_t)i * D;
        if (t >= L) {
            for (int c = 0; c < C; c++) memset(kt + (int64_t)(2 * c + i / 16) * TILE + (i % 16) * 32, 0, 64);
            memset(vr, 0, (size_t)D * 2);
            continue;
        }
        const uint16_t *kr = k + slots[t] * tok_stride + head_off;
        for (int c = 0; c < C; c++) memcpy(kt + (int64_t)(2 * c + i / 16) * TILE + (i % 16) * 32, kr + 32 * c, 64);
        memcpy(vr, v + slots[t] * tok_stride + head_off, (size_t)D * 2);
    }
    /* V^T: dims d, d + 1 of 16 keys as one dword gather, split into the two rows' halves */
    const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32(D / 2));
    for (int d = 0; d < D; d += 2) {
        uint16_t *row = vt + (int64_t)(d / 16) * TILE + (d % 16) * 32; /* row d; row d + 1 is 32 further */
        for (int half = 0; half < 2; half++) {
            const __m512i pair = _mm512_i32gather_epi32(idx, (const int *)(vbuf + (int64_t)16 * half * D + d), 4);
            _mm256_storeu_si256((__m256i *)(row + 16 * half), _mm512_cvtepi32_epi16(pair));
            _mm256_storeu_si256((__m256i *)(row + 32 + 16 * half), _mm512_cvtepi32_epi16(_mm512_srli_epi32(pair, 16)));
        }
    }
}

/* One work item: query tokens a0 .. a0 + n - 1 (n <= QR) of a segment, query head h, attending
 * to the key blocks packed at kt for its KV head (4C tiles a block: K, then V). Scores are kept
 * transposed (S^T = K . Q^T: a key's scores for the 16 queries are one vector), so the running
 * max, sum and rescale of each query are lane-wise, and the output is O^T = V^T . P^T. Writes
 * its rows of out. Scratch: ot [D][16], st [KB][16] float32, pt [KB / 2][32] and qt [C][512] bf16. */
static void attend_block(const uint16_t *q, int64_t q_stride, int64_t start, int64_t prefix, int64_t a0, int n,
                         int h, int D, float scale, const uint16_t *kt, void *out, int64_t out_stride, int out_bf16, float *ot,
                         float *st, uint16_t *pt, uint16_t *qt) {
    const int C = D / 32, E = D / 16;
    const int64_t tiles_kb = 4 * C; /* 2C K tiles + D / 16 = 2C V tiles a key block */
    /* Q^T tile c: row r (dims 32c + 2r, +1), column j = query j (zero past n): the queries'
     * dwords 16c .. 16c + 15, transposed */
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const uint16_t *q0 = q + (start + a0) * q_stride + (int64_t)h * D;
    for (int c = 0; c < C; c++) {
        __m512 r[16];
        for (int j = 0; j < 16; j++)
            r[j] = j < n ? _mm512_loadu_ps((const float *)(q0 + j * q_stride + 32 * c)) : _mm512_setzero_ps();
        transpose16(r);
        for (int i = 0; i < 16; i++) _mm512_storeu_ps((float *)(qt + (int64_t)c * TILE + i * 32), r[i]);
    }
    T_LOAD(4, qt);
    if (C > 1) T_LOAD(5, qt + TILE);
    if (C > 2) T_LOAD(6, qt + 2 * TILE);
    if (C > 3) T_LOAD(7, qt + 3 * TILE);
    memset(ot, 0, (size_t)D * 16 * sizeof(float));
    /* query j at position prefix + a0 + j (rows past n: the last row's, never written out) */
    const __m512i pos = _mm512_add_epi32(_mm512_set1_epi32((int)(prefix + a0)),
                                         _mm512_min_epi32(lane, _mm512_set1_epi32(n - 1)));
    const int64_t first = prefix + a0, last = prefix + a0 + n - 1; /* keys 0 .. last are seen */
    const __m512 sc = _mm512_set1_ps(scale), negv = _mm512_set1_ps(NEG);
    /* interleave two keys' bf16 weights per query: lanes (j, j + 16) -> (2j, 2j + 1) */
    const __m512i pair_idx = _mm512_setr_epi32(0x00100000, 0x00110001, 0x00120002, 0x00130003, 0x00140004,
                                               0x00150005, 0x00160006, 0x00170007, 0x00180008, 0x00190009,
                                               0x001A000A, 0x001B000B, 0x001C000C, 0x001D000D, 0x001E000E,
                                               0x001F000F);
    __m512 m = negv, l = _mm512_setzero_ps();
    const int64_t nkb = last / KB + 1;
    for (int64_t kb = 0; kb < nkb; kb++) {
        const uint16_t *kbt = kt + kb * tiles_kb * TILE, *vbt = kbt + 2 * C * TILE;
        T_ZERO(0);
        T_ZERO(1);
        T_LOAD(2, kbt);
        T_DP(0, 2, 4);
        T_LOAD(2, kbt + TILE);
        T_DP(1, 2, 4);
        if (C > 1) {
            T_LOAD(2, kbt + 2 * TILE);
            T_DP(0, 2, 5);
            T_LOAD(2, kbt + 3 * TILE);
            T_DP(1, 2, 5);
        }
        if (C > 2) {
            T_LOAD(2, kbt + 4 * TILE);
            T_DP(0, 2, 6);
            T_LOAD(2, kbt + 5 * TILE);
            T_DP(1, 2, 6);
        }
        if (C > 3) {
            T_LOAD(2, kbt + 6 * TILE);
            T_DP(0, 2, 7);
            T_LOAD(2, kbt + 7 * TILE);
            T_DP(1, 2, 7);
        }
        T_STORE(0, st); /* st[i * 16 + j]: key 32 kb + i, query j */
        T_STORE(1, st + 256);
        const int masked = kb * KB + KB - 1 > first; /* some key of the block is past some query */
        __m512 s[KB], mx = m;
        for (int i = 0; i < KB; i++) {
            s[i] = _mm512_mul_ps(_mm512_loadu_ps(st + i * 16), sc);
            if (masked)
                s[i] = _mm512_mask_blend_ps(_mm512_cmpgt_epi32_mask(_mm512_set1_epi32((int)(kb * KB + i)), pos), s[i],
                                            negv);
            mx = _mm512_max_ps(mx, s[i]);
        }
        const __m512 alpha = exp16(_mm512_sub_ps(m, mx));
        m = mx;
        __m512 sum = _mm512_setzero_ps();
        for (int i = 0; i < KB; i += 2) {
            const __m512 p0 = exp16(_mm512_sub_ps(s[i], mx)), p1 = exp16(_mm512_sub_ps(s[i + 1], mx));
            sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
            /* row i / 2 of the P^T tile: (p_i[j], p_i+1[j]) for query j */
            _mm512_storeu_si512(pt + (i / 2) * 32,
                                _mm512_permutexvar_epi16(pair_idx, (__m512i)_mm512_cvtne2ps_pbh(p1, p0)));
        }
        l = _mm512_fmadd_ps(l, alpha, sum);
        if (kb > 0)
            for (int d = 0; d < D; d++) _mm512_storeu_ps(ot + d * 16, _mm512_mul_ps(alpha, _mm512_loadu_ps(ot + d * 16)));
        T_LOAD(1, pt);
        for (int e = 0; e < E; e++) {
            T_LOAD(0, ot + e * 256);
            T_LOAD(2, vbt + (int64_t)e * TILE);
            T_DP(0, 2, 1);
            T_STORE(0, ot + e * 256);
        }
    }
    /* out row j, dims 16e .. 16e + 15 = ot[16e .. 16e + 15][j] / l[j], gathered 16 floats apart
     * (1.4x faster here than loading ot's rows and transposing them in registers) */
    float inv[16];
    _mm512_storeu_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.f), l));
    const __m512i oidx = _mm512_mullo_epi32(lane, _mm512_set1_epi32(16));
    for (int j = 0; j < n; j++) {
        const int64_t at = (start + a0 + j) * out_stride + (int64_t)h * D;
        const __m512 s_j = _mm512_set1_ps(inv[j]);
        for (int e = 0; e < E; e++) {
            const __m512 o = _mm512_mul_ps(s_j, _mm512_i32gather_ps(oidx, ot + e * 256 + j, 4));
            if (out_bf16) /* round to nearest even, as a float32 output's .to(bfloat16) would */
                _mm256_storeu_si256((__m256i *)((uint16_t *)out + at + 16 * e), (__m256i)_mm512_cvtneps_pbh(o));
            else
                _mm512_storeu_ps((float *)out + at + 16 * e, o);
        }
    }
}

/* attend_block for D <= 64 (C + E + 2 <= 8 tiles): the output O^T stays in tile registers over
 * all key blocks instead of a store, rescale and reload of its E tiles a block. Its running max
 * moves lazily: a block's weights are exp(s - m) with m the query's max so far unless some score
 * passes m + TAU, and only then are the O^T tiles stored, scaled by exp(m_old - m_new) and
 * reloaded (the weights stay below e^TAU, well inside float32 and bf16; out = O^T / l is the same
 * for any m). Tiles: 0 = scores of 16 keys, then P^T; 1 = a K or V^T tile; 2 .. 2 + C - 1 = Q^T;
 * 4 .. 4 + E - 1 = O^T. Same arguments and scratch as attend_block. */
#define TAU 8.f
static void attend_block_resident(const uint16_t *q, int64_t q_stride, int64_t start, int64_t prefix, int64_t a0,
                                  int n, int h, int D, float scale, const uint16_t *kt, void *out,
                                  int64_t out_stride, int out_bf16, float *ot, float *st, uint16_t *pt, uint16_t *qt) {
    const int C = D / 32, E = D / 16;
    const int64_t tiles_kb = 4 * C;
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const uint16_t *q0 = q + (start + a0) * q_stride + (int64_t)h * D;
    for (int c = 0; c < C; c++) { /* Q^T tile c, as in attend_block */
        __m512 r[16];
        for (int j = 0; j < 16; j++)
            r[j] = j < n ? _mm512_loadu_ps((const float *)(q0 + j * q_stride + 32 * c)) : _mm512_setzero_ps();
        transpose16(r);
        for (int i = 0; i < 16; i++) _mm512_storeu_ps((float *)(qt + (int64_t)c * TILE + i * 32), r[i]);
    }
    T_LOAD(2, qt);
    if (C > 1) T_LOAD(3, qt + TILE);
    T_ZERO(4);
    T_ZERO(5);
    if (E > 2) {
        T_ZERO(6);
        T_ZERO(7);
    }
    const __m512i pos = _mm512_add_epi32(_mm512_set1_epi32((int)(prefix + a0)),
                                         _mm512_min_epi32(lane, _mm512_set1_epi32(n - 1)));
    const int64_t first = prefix + a0, last = prefix + a0 + n - 1;
    const __m512 sc = _mm512_set1_ps(scale), negv = _mm512_set1_ps(NEG), tau = _mm512_set1_ps(TAU);
    const __m512i pair_idx = _mm512_setr_epi32(0x00100000, 0x00110001, 0x00120002, 0x00130003, 0x00140004,
                                               0x00150005, 0x00160006, 0x00170007, 0x00180008, 0x00190009,
                                               0x001A000A, 0x001B000B, 0x001C000C, 0x001D000D, 0x001E000E,
                                               0x001F000F);
    __m512 m = negv, l = _mm512_setzero_ps();
    const int64_t nkb = last / KB + 1;
    for (int64_t kb = 0; kb < nkb; kb++) {
        const uint16_t *kbt = kt + kb * tiles_kb * TILE, *vbt = kbt + 2 * C * TILE;
        for (int half = 0; half < 2; half++) { /* S^T of keys 16 half .. 16 half + 15 into st */
            T_ZERO(0);
            T_LOAD(1, kbt + half * TILE);
            T_DP(0, 1, 2);
            if (C > 1) {
                T_LOAD(1, kbt + (2 + half) * TILE);
                T_DP(0, 1, 3);
            }
            T_STORE(0, st + 256 * half);
        }
        const int masked = kb * KB + KB - 1 > first;
        __m512 s[KB], mx = m;
        for (int i = 0; i < KB; i++) {
            s[i] = _mm512_mul_ps(_mm512_loadu_ps(st + i * 16), sc);
            if (masked)
                s[i] = _mm512_mask_blend_ps(_mm512_cmpgt_epi32_mask(_mm512_set1_epi32((int)(kb * KB + i)), pos), s[i],
                                            negv);
            mx = _mm512_max_ps(mx, s[i]);
        }
        /* key 0 is in block 0 and every query sees it, so m is finite from block 0 on */
        if (kb == 0) {
            m = mx;
        } else if (_mm512_cmp_ps_mask(mx, _mm512_add_ps(m, tau), _CMP_GT_OQ)) {
            const __m512 alpha = exp16(_mm512_sub_ps(m, mx)); /* 1 where the max did not grow */
            T_STORE(4, ot);
            T_STORE(5, ot + 256);
            if (E > 2) {
                T_STORE(6, ot + 512);
                T_STORE(7, ot + 768);
            }
            for (int d = 0; d < D; d++) _mm512_storeu_ps(ot + d * 16, _mm512_mul_ps(alpha, _mm512_loadu_ps(ot + d * 16)));
            T_LOAD(4, ot);
            T_LOAD(5, ot + 256);
            if (E > 2) {
                T_LOAD(6, ot + 512);
                T_LOAD(7, ot + 768);
            }
            l = _mm512_mul_ps(l, alpha);
            m = mx;
        }
        for (int i = 0; i < KB; i += 2) {
            const __m512 p0 = exp16(_mm512_sub_ps(s[i], m)), p1 = exp16(_mm512_sub_ps(s[i + 1], m));
            l = _mm512_add_ps(l, _mm512_add_ps(p0, p1));
            _mm512_storeu_si512(pt + (i / 2) * 32,
                                _mm512_permutexvar_epi16(pair_idx, (__m512i)_mm512_cvtne2ps_pbh(p1, p0)));
        }
        T_LOAD(0, pt);
        T_LOAD(1, vbt);
        T_DP(4, 1, 0);
        T_LOAD(1, vbt + TILE);
        T_DP(5, 1, 0);
        if (E > 2) {
            T_LOAD(1, vbt + 2 * TILE);
            T_DP(6, 1, 0);
            T_LOAD(1, vbt + 3 * TILE);
            T_DP(7, 1, 0);
        }
    }
    T_STORE(4, ot);
    T_STORE(5, ot + 256);
    if (E > 2) {
        T_STORE(6, ot + 512);
        T_STORE(7, ot + 768);
    }
    float inv[16];
    _mm512_storeu_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.f), l));
    const __m512i oidx = _mm512_mullo_epi32(lane, _mm512_set1_epi32(16));
    for (int j = 0; j < n; j++) {
        const int64_t at = (start + a0 + j) * out_stride + (int64_t)h * D;
        const __m512 s_j = _mm512_set1_ps(inv[j]);
        for (int e = 0; e < E; e++) {
            const __m512 o = _mm512_mul_ps(s_j, _mm512_i32gather_ps(oidx, ot + e * 256 + j, 4));
            if (out_bf16) /* round to nearest even, as a float32 output's .to(bfloat16) would */
                _mm256_storeu_si256((__m256i *)((uint16_t *)out + at + 16 * e), (__m256i)_mm512_cvtneps_pbh(o));
            else
                _mm512_storeu_ps((float *)out + at + 16 * e, o);
        }
    }
}
#endif

/* Token t's new K / V row (Hkv * D bf16 at new_k + t * kn_stride, new_v + t * vn_stride) into
 * slot loc[t] of the pool (k, v: slot s at s * tok_stride), for t in [0, T): what the model's
 * set_kv_buffer does with two index_put, in one parallel pass. Returns 0, or 3 (nothing written)
 * when a loc[t] lies outside [0, num_slots). Slots are distinct per token (the allocator's). */
int meshlm_kv_store_bf16(void *k, void *v, int64_t tok_stride, int64_t num_slots, const void *new_k,
                         int64_t kn_stride, const void *new_v, int64_t vn_stride, const int64_t *loc, int64_t T,
                         int Hkv, int D, int num_threads) {
    for (int64_t t = 0; t < T; t++)
        if (loc[t] < 0 || loc[t] >= num_slots) return 3;
    const size_t row = (size_t)Hkv * D * sizeof(uint16_t);
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        memcpy((uint16_t *)k + loc[t] * tok_stride, (const uint16_t *)new_k + t * kn_stride, row);
        memcpy((uint16_t *)v + loc[t] * tok_stride, (const uint16_t *)new_v + t * vn_stride, row);
    }
    return 0;
}

/* The arguments of meshlm_extend_attention (extend_attention.c), q in bf16 and kv_dtype 1 (bf16)
 * only, plus out_dtype: 0 float32, 1 bf16 (the float32 result rounded to nearest even, as
 * .to(bfloat16) would). Returns 0 on success, 1 on an unsupported shape or dtype (or no AMX), 2
 * when scratch memory could not be allocated, 3 when a segment names a row, prefix, start,
 * length or slot out of range (checked before anything is read). */
int meshlm_extend_attention_amx_out(const void *q, int64_t q_stride, int64_t T, const void *k, const void *v,
                                    int kv_dtype, int64_t tok_stride, int64_t num_slots, const int64_t *table,
                                    int64_t table_rows, int64_t table_stride, const int64_t *rows,
                                    const int64_t *prefix, const int64_t *starts, const int64_t *lens, int64_t S,
                                    int H, int Hkv, int D, float scale, void *out, int64_t out_stride, int out_dtype,
                                    int num_threads) {
#ifndef HAVE_TILES
    (void)q, (void)q_stride, (void)T, (void)k, (void)v, (void)kv_dtype, (void)tok_stride, (void)num_slots, (void)table;
    (void)table_rows, (void)table_stride, (void)rows, (void)prefix, (void)starts, (void)lens, (void)S, (void)H;
    (void)Hkv, (void)D, (void)scale, (void)out, (void)out_stride, (void)num_threads, (void)out_dtype;
    return 1;
#else
    if (kv_dtype != 1 || H <= 0 || Hkv <= 0 || H % Hkv != 0 || D % 32 != 0 || D < 32 || D > 128 ||
        (out_dtype != 0 && out_dtype != 1) || !tiles_permitted())
        return 1;
    for (int64_t s = 0; s < S; s++)
        if (bad_segment(table, table_rows, table_stride, num_slots, T, rows[s], prefix[s], starts[s], lens[s]))
            return 3;
    const int out_bf16 = out_dtype == 1;
    if (S == 0) return 0;
    const int G = H / Hkv, C = D / 32;
    /* packed tiles: segment s, KV head j at pack + (off[s] * Hkv + j * nkb(s)) * 4C tiles */
    int64_t *off = (int64_t *)malloc((size_t)(S + 1) * sizeof(int64_t));
    int64_t *item = (int64_t *)malloc((size_t)(S + 1) * sizeof(int64_t)); /* first work item of segment s */
    if (off == NULL || item == NULL) {
        free(off);
        free(item);
        return 2;
    }
    off[0] = item[0] = 0;
    for (int64_t s = 0; s < S; s++) {
        off[s + 1] = off[s] + (prefix[s] + lens[s] + KB - 1) / KB;
        item[s + 1] = item[s] + (int64_t)H * ((lens[s] + QR - 1) / QR);
    }
    const int64_t tiles_kb = 4 * C;
    uint16_t *pack = (uint16_t *)aligned_alloc(64, (size_t)off[S] * Hkv * tiles_kb * TILE * sizeof(uint16_t));
    if (pack == NULL) {
        free(off);
        free(item);
        return 2;
    }
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        uint16_t *vbuf = (uint16_t *)aligned_alloc(64, (size_t)KB * D * sizeof(uint16_t));
        failed |= vbuf == NULL;
        /* Packing is static and the work items follow it in order (guided: the first, largest
         * chunks go to threads in turn), so a thread mostly reads the tiles it packed itself, from
         * its own L2: 8 x 256 tokens 1.00-1.04 ms on two threads against 1.49-1.51 with both
         * loops dynamic (items interleaved between the cores), and 1.46-1.49 dynamic in chunks of 4
         * or 8. */
#pragma omp for schedule(static) collapse(2)
        for (int64_t s = 0; s < S; s++)
            for (int j = 0; j < Hkv; j++) {
                if (vbuf == NULL) continue;
                const int64_t L = prefix[s] + lens[s], nkb = off[s + 1] - off[s];
                const int64_t *slots = table + rows[s] * table_stride;
                uint16_t *base = pack + (off[s] * Hkv + (int64_t)j * nkb) * tiles_kb * TILE;
                for (int64_t kb = 0; kb < nkb; kb++) {
                    uint16_t *kt = base + kb * tiles_kb * TILE;
                    pack_block((const uint16_t *)k, (const uint16_t *)v, tok_stride, slots, L, kb, (int64_t)j * D, D,
                               kt, kt + 2 * C * TILE, vbuf);
                }
            }
        free(vbuf);
        float *o = (float *)aligned_alloc(64, (size_t)D * QR * sizeof(float));
        float *sc = (float *)aligned_alloc(64, (size_t)KB * QR * sizeof(float));
        uint16_t *p = (uint16_t *)aligned_alloc(64, (size_t)TILE * sizeof(uint16_t));
        uint16_t *qpad = (uint16_t *)aligned_alloc(64, (size_t)C * TILE * sizeof(uint16_t));
        const int ok = o != NULL && sc != NULL && p != NULL && qpad != NULL;
        failed |= !ok;
        if (ok) T_BEGIN();
        /* Every thread reaches the worksharing loop; one without scratch skips its items. */
#pragma omp for schedule(guided)
        for (int64_t w = 0; w < item[S]; w++) {
            if (!ok) continue;
            int64_t s = 0;
            while (item[s + 1] <= w) s++; /* segments are few: a linear search */
            const int64_t blocks = (lens[s] + QR - 1) / QR, local = w - item[s];
            const int h = (int)(local / blocks);
            const int64_t a0 = (local % blocks) * QR;
            const int n = lens[s] - a0 < QR ? (int)(lens[s] - a0) : QR;
            const int64_t nkb = off[s + 1] - off[s];
            const uint16_t *kt = pack + (off[s] * Hkv + (int64_t)(h / G) * nkb) * tiles_kb * TILE;
            if (D <= 64)
                attend_block_resident((const uint16_t *)q, q_stride, starts[s], prefix[s], a0, n, h, D, scale, kt,
                                      out, out_stride, out_bf16, o, sc, p, qpad);
            else
                attend_block((const uint16_t *)q, q_stride, starts[s], prefix[s], a0, n, h, D, scale, kt, out,
                             out_stride, out_bf16, o, sc, p, qpad);
        }
        if (ok) T_END();
        free(o);
        free(sc);
        free(p);
        free(qpad);
    }
    free(pack);
    free(off);
    free(item);
    return failed ? 2 : 0;
#endif
}

/* meshlm_extend_attention_amx_out with a float32 out (ExtendKernel's call). */
int meshlm_extend_attention_amx(const void *q, int64_t q_stride, int64_t T, const void *k, const void *v,
                                int kv_dtype, int64_t tok_stride, int64_t num_slots, const int64_t *table,
                                int64_t table_rows, int64_t table_stride, const int64_t *rows, const int64_t *prefix,
                                const int64_t *starts, const int64_t *lens, int64_t S, int H, int Hkv, int D,
                                float scale, float *out, int64_t out_stride, int num_threads) {
    return meshlm_extend_attention_amx_out(q, q_stride, T, k, v, kv_dtype, tok_stride, num_slots, table, table_rows,
                                           table_stride, rows, prefix, starts, lens, S, H, Hkv, D, scale, out,
                                           out_stride, 0, num_threads);
}
