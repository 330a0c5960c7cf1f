"""Paged extend (prefill) attention in Triton, reading the whole sequence through req_to_token.

Request i has prefix_lens[i] cached tokens followed by extend_seq_lens[i] new tokens, all of
whose KV is already in the pool: position p (0 <= p < prefix_i + extend_i) lives at slot
req_to_token[req_pool_indices[i], p]. Its new tokens' queries are rows
extend_start_loc[i] + m (0 <= m < extend_i) of the packed q [T, Hq, D]; query m sits at absolute
position prefix_i + m and attends causally to positions 0 .. prefix_i + m. Query head j uses KV
head j // (Hq / Hkv).

Grid (num_reqs, Hq, cdiv(max_extend_len, BLOCK_M)): program (i, j, blk) computes query rows
m in [blk * BLOCK_M, (blk + 1) * BLOCK_M) of head j, looping over positions
n < prefix_i + min((blk + 1) * BLOCK_M, extend_i) (the last one any of its rows may see) with an
online softmax; blocks past extend_i do no work. Products in q's dtype, accumulation in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Module constant a @triton.jit body may read (globals must be constexpr there).
_LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)


@triton.jit
def _extend_kernel(
    Q,
    K,
    V,
    Out,
    ReqToToken,
    ReqPoolIdx,
    PrefixLens,
    ExtendLens,
    ExtendStart,
    sm_scale,
    stride_qt,
    stride_qh,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_r2t,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    blk = tl.program_id(2)
    kv_head = head // GROUP

    prefix = tl.load(PrefixLens + req).to(tl.int32)
    ext_len = tl.load(ExtendLens + req).to(tl.int32)
    q_start = tl.load(ExtendStart + req).to(tl.int64)
    row = tl.load(ReqPoolIdx + req).to(tl.int64)

    offs_m = blk * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < ext_len
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    # Positions this block's rows may see end at prefix + (last row + 1); a block wholly past
    # ext_len (the grid is sized by the longest request) loops over nothing.
    kv_end = tl.where(blk * BLOCK_M < ext_len, prefix + tl.minimum((blk + 1) * BLOCK_M, ext_len), 0)

    q_rows = q_start + offs_m.to(tl.int64)
    q = tl.load(
        Q + q_rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
        mask=mask_m[:, None] & mask_d[None, :],
        other=0.0,
    )
    # Scores are kept in base 2: exp(x * sm_scale) == exp2(x * sm_scale * log2(e)).
    qk_scale = sm_scale * _LOG2E
    # Absolute position of each query row; key n is visible to row m iff n <= prefix + m.
    q_pos = prefix + offs_m

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for n0 in range(0, kv_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < kv_end
        slots = tl.load(ReqToToken + row * stride_r2t + offs_n, mask=mask_n, other=0).to(tl.int64)
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(K + slots[:, None] * stride_kn + kv_head * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * qk_scale
        s = tl.where((offs_n[None, :] <= q_pos[:, None]) & mask_n[None, :], s, float("-inf"))
        # Position 0 is visible to every row and lies in the first block, so m_new is finite
        # from the first iteration on (rows past ext_len included; they are never stored).
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + slots[:, None] * stride_vn + kv_head * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
        m_i = m_new

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_safe[:, None]
    tl.store(
        Out + q_rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
        out.to(Out.dtype.element_ty),
        mask=mask_m[:, None] & mask_d[None, :],
    )


def extend_attention_fwd(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    out: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_seq_lens: torch.Tensor,
    extend_start_loc: torch.Tensor,
    max_extend_len: int,
    sm_scale: float,
    *,
    block_m: int = 64,
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
) -> None:
    """Write the causal extend attention of packed q [T, Hq, D] into out [T, Hq, D].

    k_buf / v_buf: [slots, Hkv, D] pool buffers already holding every position of every
    request (prefix and new tokens). req_pool_indices, prefix_lens, extend_seq_lens,
    extend_start_loc: [num_reqs] int32 or int64 on q's device; extend_start_loc[i] is the first
    packed row of request i. max_extend_len >= max(extend_seq_lens) sizes the grid. Rows of
    `out` outside every request's range are not written. The last dim of q, out, k_buf, v_buf
    and req_to_token must be contiguous (stride 1).
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_buf.shape[1]
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    num_reqs = req_pool_indices.shape[0]
    if num_reqs == 0 or max_extend_len <= 0:
        return
    grid = (num_reqs, num_heads, triton.cdiv(max_extend_len, block_m))
    _extend_kernel[grid](
        q,
        k_buf,
        v_buf,
        out,
        req_to_token,
        req_pool_indices,
        prefix_lens,
        extend_seq_lens,
        extend_start_loc,
        sm_scale,
        q.stride(0),
        q.stride(1),
        k_buf.stride(0),
        k_buf.stride(1),
        v_buf.stride(0),
        v_buf.stride(1),
        out.stride(0),
        out.stride(1),
        req_to_token.stride(0),
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps,
        num_stages=num_stages,
    )
