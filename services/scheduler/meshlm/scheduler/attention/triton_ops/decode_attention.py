"""Paged decode attention in Triton: split-KV ("flash-decoding") over the KV pool.

Every request b has exactly one query token (q[b], all Hq heads) whose own KV is already in the
pool. Its KV positions 0 .. seq_lens[b] - 1 live at slots req_to_token[req_pool_indices[b], pos].

Stage 1, grid (B, Hkv, NUM_SPLITS): the positions of request b are cut into NUM_SPLITS chunks of
split_len = cdiv(seq_lens[b], NUM_SPLITS); split s covers [s * split_len, min((s + 1) * split_len,
seq_len)), empty when s * split_len >= seq_len. One program attends the G = Hq / Hkv query heads
of one KV head (query head j uses KV head j // G) over one split, and writes the normalized
partial output mid_o[b, j, s] and its natural-log sum-exp mid_lse[b, j, s] (fp32). Empty splits
write nothing.

Stage 2, grid (B, Hq): out[b, j] = sum_s exp(lse_s - max) * o_s / sum_s exp(lse_s - max) over the
non-empty splits, recomputed from seq_lens[b] exactly as in stage 1.

The split length is derived from seq_lens inside the kernels, so the launch grid depends only on
the batch size: both launches can be captured in a CUDA graph and replayed with new seq_lens
values. The wrapper neither allocates nor syncs with the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Module constants a @triton.jit body may read (globals must be constexpr there).
_LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
_LN2: tl.constexpr = tl.constexpr(0.6931471805599453)


@triton.jit
def _decode_split_kernel(
    Q,
    K,
    V,
    ReqToToken,
    ReqPoolIdx,
    SeqLens,
    MidO,
    MidLse,
    sm_scale,
    stride_qb,
    stride_qh,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_r2t,
    stride_mob,
    stride_moh,
    stride_mos,
    stride_mlb,
    stride_mlh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # Rows of the [BLOCK_H, BLOCK_D] query tile: the GROUP query heads of this KV head, padded
    # to BLOCK_H (>= 16 so tl.dot has a legal M); padded rows are masked on load and store.
    offs_g = tl.arange(0, BLOCK_H)
    mask_h = offs_g < GROUP
    heads = kv_head * GROUP + offs_g
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM

    seq_len = tl.load(SeqLens + b).to(tl.int32)
    row = tl.load(ReqPoolIdx + b).to(tl.int64)
    split_len = tl.cdiv(seq_len, NUM_SPLITS)
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    q = tl.load(
        Q + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=mask_h[:, None] & mask_d[None, :],
        other=0.0,
    )
    # Scores are kept in base 2: exp(x * sm_scale) == exp2(x * sm_scale * log2(e)).
    qk_scale = sm_scale * _LOG2E

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        slots = tl.load(ReqToToken + row * stride_r2t + offs_n, mask=mask_n, other=0).to(tl.int64)
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(K + slots[:, None] * stride_kn + kv_head * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * qk_scale
        s = tl.where(mask_n[None, :], s, float("-inf"))
        # Every block holds at least one position < end, so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + slots[:, None] * stride_vn + kv_head * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
        m_i = m_new

    # An empty split stores nothing; stage 2 skips it by the same arithmetic.
    nonempty = start < end
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    mid_row = MidO + b.to(tl.int64) * stride_mob + split * stride_mos
    tl.store(
        mid_row + heads[:, None] * stride_moh + offs_d[None, :],
        acc / l_safe[:, None],
        mask=nonempty & mask_h[:, None] & mask_d[None, :],
    )
    # Back to natural log: ln(sum exp(x)) = (m2 + log2(l)) * ln(2) with m2 in base-2 units.
    lse = (m_i + tl.log2(l_safe)) * _LN2
    tl.store(MidLse + b.to(tl.int64) * stride_mlb + heads * stride_mlh + split, lse, mask=nonempty & mask_h)


@triton.jit
def _decode_combine_kernel(
    MidO,
    MidLse,
    SeqLens,
    Out,
    stride_mob,
    stride_moh,
    stride_mos,
    stride_mlb,
    stride_mlh,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0)
    head = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    offs_s = tl.arange(0, BLOCK_S)

    seq_len = tl.load(SeqLens + b).to(tl.int32)
    split_len = tl.cdiv(seq_len, NUM_SPLITS)
    # Split s is non-empty iff s * split_len < seq_len (the same bounds as stage 1).
    valid = (offs_s < NUM_SPLITS) & (offs_s * split_len < seq_len)

    lse_row = MidLse + b.to(tl.int64) * stride_mlb + head * stride_mlh
    lse = tl.load(lse_row + offs_s, mask=valid, other=float("-inf"))
    m = tl.max(lse, 0)
    # seq_len == 0 (a padded row) has no valid split: m is -inf; output zeros instead of NaN.
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.where(valid, tl.exp(lse - m), 0.0)
    denom = tl.sum(w, 0)
    denom = tl.where(denom > 0.0, denom, 1.0)

    mid_row = MidO + b.to(tl.int64) * stride_mob + head * stride_moh
    o = tl.load(
        mid_row + offs_s[:, None] * stride_mos + offs_d[None, :], mask=valid[:, None] & mask_d[None, :], other=0.0
    )
    acc = tl.sum(w[:, None] * o, 0) / denom
    tl.store(Out + b.to(tl.int64) * stride_ob + head * stride_oh + offs_d, acc.to(Out.dtype.element_ty), mask=mask_d)


def decode_attention_fwd(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    out: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    mid_o: torch.Tensor,
    mid_lse: torch.Tensor,
    sm_scale: float,
    num_kv_splits: int,
    *,
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
) -> None:
    """Write the decode attention of q [B, Hq, D] over the paged pool into out [B, Hq, D].

    k_buf / v_buf: [slots, Hkv, D] pool buffers (any float dtype; cast to q's dtype for the
    products, accumulated in fp32). req_to_token: [rows, max_context] slot table;
    req_pool_indices / seq_lens: [B] int32 or int64 on q's device, seq_lens[b] >= 1 counting the
    query token itself (0 yields a zero row). mid_o [>= B, Hq, num_kv_splits, D] and
    mid_lse [>= B, Hq, num_kv_splits] are fp32 scratch; only their first B rows are touched.
    Hq must be a multiple of Hkv. The last dim of q, out, k_buf, v_buf, mid_o, mid_lse and
    req_to_token must be contiguous (stride 1). No allocation, no host sync.
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_buf.shape[1]
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if batch == 0:
        return
    group = num_heads // num_kv_heads
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_h = max(16, triton.next_power_of_2(group))
    precision = "ieee" if q.dtype == torch.float32 else "tf32"

    _decode_split_kernel[(batch, num_kv_heads, num_kv_splits)](
        q,
        k_buf,
        v_buf,
        req_to_token,
        req_pool_indices,
        seq_lens,
        mid_o,
        mid_lse,
        sm_scale,
        q.stride(0),
        q.stride(1),
        k_buf.stride(0),
        k_buf.stride(1),
        v_buf.stride(0),
        v_buf.stride(1),
        req_to_token.stride(0),
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        NUM_SPLITS=num_kv_splits,
        DOT_PRECISION=precision,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    _decode_combine_kernel[(batch, num_heads)](
        mid_o,
        mid_lse,
        seq_lens,
        out,
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        NUM_SPLITS=num_kv_splits,
        BLOCK_S=triton.next_power_of_2(num_kv_splits),
        num_warps=4 if block_d >= 128 else 2,
    )
