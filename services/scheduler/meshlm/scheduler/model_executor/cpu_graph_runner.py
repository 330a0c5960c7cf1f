"""CpuGraphRunner: a Llama-family decode forward on CPU as one C call (the CPU's CUDA graph).

On CPU every op of a decode layer is already one of our C kernels; what is left between them is
Python: ~270 module calls, checks, allocations and ctypes conversions a step, 5-8 ms on two
cores, a fifth of a step at batch 16. This runner lays the decoder layers' calls out once over
fixed buffers (kernels/decode_plan.py) and makes them all in one ctypes call per step.

Buffers (`max_rows` rows each, allocated once; the plan points at rows 0..B-1 for a batch of B):

    x        [M, H]              the residual stream (the embeddings, then every layer's sum)
    normed   [M, H]              RMSNorm's output, the input of qkv and gate_up
    qkv      [M, (Hq + 2Hkv) D]  [q | k | v], rotated in place; k and v are stored to the pool
    attn     [M, Hq D]           attention's output
    h        [M, H]              o_proj's and down_proj's output
    gate_up  [M, 2I], act [M, I]
    positions, req_rows, lens, loc   [M] int64: the step's RoPE positions, req_to_token rows,
                                     visible lengths and new KV slots

A layer is: norm(h + x -> x; layer 0: norm(x)) -> normed, qkv, RoPE, attention (stores k, v),
o_proj -> h, norm(h + x -> x) -> normed, gate_up, SiLU*mul -> act, down_proj -> h. The
embedding lookup, the final norm and the LM head stay in Python (once a step). The kernels and
their order are those of the eager forward, so the logits are the same bit for bit.

The buffers have the model's dtype. The plan is used only where every such call has a C kernel:
a float32 or bf16 model on CPU with the fused ops, tp_size 1, the CPU attention backend over a
pool of the model's dtype (or a bf16 pool under a float32 model: --kv-cache-dtype bfloat16),
linears without a row-parallel bias, and batches up to the rows every linear's C kernels cover
(max_rows). In bf16 those are the block GEMV, the AMX GEMM and the
panel GEMM; in float32 the GEMVs and, for a GGUF checkpoint's blocks, the block GEMM up to
GEMM_MAX_ROWS (256) rows (a dense float32 weight: the GEMV's 4 rows; oneDNN, which prompt chunks
and larger batches use, is not C-callable). Anything else runs eagerly.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from meshlm.scheduler.attention.cpu import CpuAttnBackend
from meshlm.scheduler.attention.cpu_kernel import storable
from meshlm.scheduler.kernels import decode_plan as dp
from meshlm.scheduler.kernels.build import KernelUnavailable
from meshlm.scheduler.kernels.gemm_q import GEMM_MAX_ROWS
from meshlm.scheduler.layers.logits_processor import LogitsProcessorOutput
from meshlm.scheduler.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from meshlm.scheduler.models.llama import LlamaDecoderLayer, LlamaForCausalLM

if TYPE_CHECKING:
    from meshlm.scheduler.layers.cpu_gemm import PackedLinear
    from meshlm.scheduler.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class Unsupported(Exception):
    """Why a model or configuration cannot take the plan (logged; the forward stays eager)."""


def linear_ops(p: PackedLinear | None, x: torch.Tensor, y: torch.Tensor) -> tuple[list[dp.Op], int]:
    """The ops of y = p(x) by batch size, as PackedLinear.__call__ picks its kernel, and the
    largest batch they cover (0: none)."""
    if p is None or p.dtype != x.dtype:
        raise Unsupported(f"a linear layer without {x.dtype} packed weights")
    ops: list[dp.Op] = []
    covered = 0
    if x.dtype == torch.float32:
        if p.gemv_ops is not None and p.small is not None and p.gemv_rows > 0:
            ops.append(dp.gemv_op(p.gemv_ops, x, p.small, p.bias, y, p.gemv_rows))
            covered = p.gemv_rows
            if p.gemm_ops is not None and p.blocks is not None and covered < GEMM_MAX_ROWS:
                ops.append(dp.gemm_q_op(p.gemm_ops, x, p.blocks, p.bias, y, covered + 1, GEMM_MAX_ROWS))
                covered = GEMM_MAX_ROWS
        return ops, covered
    if p.gemv_bf16 is not None and p.small is not None and p.gemv_rows > 0:
        ops.append(dp.gemv_bf16_op(p.gemv_bf16, x, p.small, p.bias_f32, y, p.gemv_rows))
        covered = p.gemv_rows
    if p.gemm_amx is not None and p.amx is not None and p.gemm_amx.max_rows > covered:
        ops.append(dp.gemm_amx_op(p.gemm_amx, x, p.amx, p.bias_f32, y, covered + 1, p.gemm_amx.max_rows))
        covered = p.gemm_amx.max_rows
    if p.gemm_bf16 is not None and p.panels is not None:
        ops.append(dp.gemm_panel_op(p.gemm_bf16, x, p.panels, p.bias_f32, y, covered + 1, dp.MAX_ROWS))
        covered = dp.MAX_ROWS
    return ops, covered


class CpuGraphRunner:
    """The decode plan of `runner`'s model for batches of up to max_rows rows (see module doc)."""

    def __init__(self, runner: ModelRunner, max_rows: int) -> None:
        model = runner.model
        if not isinstance(model, LlamaForCausalLM):
            raise Unsupported(f"{type(model).__name__} is not a Llama-family decoder")
        if runner.dtype not in dp.DTYPE_CODES or runner.tp.size != 1:
            raise Unsupported("only float32 and bf16 models with tp_size 1")
        ops = runner.cpu_ops
        backend = runner.attn_backend
        if ops is None:
            raise Unsupported("the fused CPU ops are off")
        if not isinstance(backend, CpuAttnBackend):
            raise Unsupported(f"attention backend {type(backend).__name__}")
        if not storable(runner.dtype, runner.token_to_kv_pool.dtype):
            raise Unsupported(f"a {runner.token_to_kv_pool.dtype} KV pool under a {runner.dtype} model")
        self.runner, self.model, self.ops = runner, model, ops
        self.lib = dp.load_decode_plan_library()
        cfg = runner.model_config
        first = model.model.layers[0]
        assert isinstance(first, LlamaDecoderLayer)
        self.hq, self.hkv, self.d = (
            first.self_attn.num_heads,
            first.self_attn.num_kv_heads,
            first.self_attn.attn.head_dim,
        )
        m, hidden, inter = max_rows, cfg.hidden_size, first.mlp.down_proj.input_size_per_partition
        dt = runner.dtype
        self.x = torch.zeros(m, hidden, dtype=dt)
        self.normed = torch.zeros(m, hidden, dtype=dt)
        self.qkv = torch.zeros(m, (self.hq + 2 * self.hkv) * self.d, dtype=dt)
        self.attn = torch.zeros(m, self.hq * self.d, dtype=dt)
        self.h = torch.zeros(m, hidden, dtype=dt)
        self.gate_up = torch.zeros(m, 2 * inter, dtype=dt)
        self.act = torch.zeros(m, inter, dtype=dt)
        self.positions = torch.zeros(m, dtype=torch.int64)
        self.req_rows = torch.zeros(m, dtype=torch.int64)
        self.lens = torch.ones(m, dtype=torch.int64)
        self.loc = torch.zeros(m, dtype=torch.int64)
        self.max_rows = m
        self.plan = self._build()
        self.num_replays = 0

    def _build(self) -> dp.DecodePlan:
        """The ops of every layer over the buffers; max_rows shrinks to what every linear covers."""
        ops, self.ops_covered = [], self.max_rows
        emb = self.model.model.rotary_emb
        self._tables = (emb.cos_cache, emb.sin_cache)
        runner = self.runner
        backend = runner.attn_backend
        assert isinstance(backend, CpuAttnBackend)
        for i, layer in enumerate(self.model.model.layers):
            assert isinstance(layer, LlamaDecoderLayer)
            sa, mlp = layer.self_attn, layer.mlp
            if sa.o_proj.bias is not None or mlp.down_proj.bias is not None:
                raise Unsupported("a row-parallel linear with a bias")
            norm = layer.input_layernorm
            if i == 0:
                ops.append(dp.add_rmsnorm_op(self.ops, self.x, None, norm.weight, self.normed, norm.eps))
            else:
                ops.append(dp.add_rmsnorm_op(self.ops, self.h, self.x, norm.weight, self.normed, norm.eps))
            ops += self._linear(sa.qkv_proj.packed, self.normed, self.qkv)
            ops.append(dp.rope_op(self.ops, self.qkv, self.hq, self.hkv, self.d, self.positions, *self._tables))
            k_buf, v_buf = runner.token_to_kv_pool.get_kv_buffer(sa.attn.layer_id)
            table = runner.req_to_token_pool.req_to_token
            args = dp.AttnArgs(k_buf, v_buf, table, self.req_rows, self.lens, self.loc, sa.attn.scaling)
            ops.append(dp.decode_attn_op(backend.kernel, self.qkv, self.hq, self.hkv, self.d, args, self.attn))
            ops += self._linear(sa.o_proj.packed, self.attn, self.h)
            post = layer.post_attention_layernorm
            ops.append(dp.add_rmsnorm_op(self.ops, self.h, self.x, post.weight, self.normed, post.eps))
            ops += self._linear(mlp.gate_up_proj.packed, self.normed, self.gate_up)
            ops.append(dp.silu_mul_op(self.ops, self.gate_up, self.act))
            ops += self._linear(mlp.down_proj.packed, self.act, self.h)
        if self.ops_covered < 1:
            raise Unsupported("no batch size has C kernels for every linear")
        self.max_rows = min(self.max_rows, self.ops_covered)
        keep = [self.x, self.normed, self.qkv, self.attn, self.h, self.gate_up, self.act]
        keep += [self.positions, self.req_rows, self.lens, self.loc, *self._tables]
        return dp.DecodePlan(self.lib, ops, keep)

    def _linear(self, p: PackedLinear | None, x: torch.Tensor, y: torch.Tensor) -> list[dp.Op]:
        ops, covered = linear_ops(p, x, y)
        self.ops_covered = min(self.ops_covered, covered)
        return ops

    @classmethod
    def create(cls, runner: ModelRunner, max_rows: int) -> CpuGraphRunner | None:
        """The runner, or None (logged) where the model or configuration cannot take a plan."""
        try:
            graph = cls(runner, max_rows)
        except (Unsupported, KernelUnavailable) as e:
            logger.info("CPU decode plan off: %s", e)
            return None
        logger.info(
            "CPU decode plan: %d kernel calls a step in one C call, for decode batches of up to %d rows",
            len(graph.plan.ops),
            graph.max_rows,
        )
        return graph

    def can_run(self, fb: ForwardBatch) -> bool:
        return (
            fb.forward_mode is ForwardMode.DECODE
            and 0 < fb.batch_size <= self.max_rows
            and fb.num_tokens == fb.batch_size
            and fb.out_cache_loc is not None
        )

    def replay(self, fb: ForwardBatch) -> LogitsProcessorOutput:
        """Logits [B, V] of decode batch fb (can_run(fb) must hold)."""
        b = fb.batch_size
        assert fb.out_cache_loc is not None
        model = self.model.model
        model.rotary_emb._ensure(fb.positions)  # a longer position regrows the tables: rebuild
        if model.rotary_emb.cos_cache is not self._tables[0]:
            self.plan = self._build()
        with torch.inference_mode():
            torch.index_select(model.embed_tokens.weight, 0, fb.input_ids, out=self.x[:b])
            self.positions[:b].copy_(fb.positions)
            self.req_rows[:b].copy_(fb.req_pool_indices)
            self.lens[:b].copy_(fb.seq_lens)
            self.loc[:b].copy_(fb.out_cache_loc)
            self.plan.run(b)
            hidden, _ = model.norm(self.h[:b], self.x[:b])
            out = self.model.logits_processor(hidden, self.model.lm_head.weight, fb)
        self.num_replays += 1
        assert isinstance(out, LogitsProcessorOutput)
        return out
