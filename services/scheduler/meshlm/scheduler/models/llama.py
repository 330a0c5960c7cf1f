"""Llama family (Llama 2/3, SmolLM2, Mistral-style configs): RoPE, GQA, RMSNorm, SwiGLU.

Weights load from HF checkpoints; q/k/v and gate/up are stored merged, so load_weights maps
each checkpoint name onto (merged parameter, shard id).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from meshlm.scheduler.distributed import SINGLE, TpGroup
from meshlm.scheduler.kernels.cpu_ops import CpuOps
from meshlm.scheduler.layers.activation import SiluAndMul
from meshlm.scheduler.layers.layernorm import RMSNorm
from meshlm.scheduler.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from meshlm.scheduler.layers.logits_processor import LogitsProcessor, LogitsProcessorOutput
from meshlm.scheduler.layers.pooler import LastTokenPooler
from meshlm.scheduler.layers.radix_attention import RadixAttention
from meshlm.scheduler.layers.rotary import RopeBatch, RotaryEmbedding
from meshlm.scheduler.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from meshlm.scheduler.model_config import ModelConfig
from meshlm.scheduler.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from meshlm.scheduler.model_loader.weight_utils import default_weight_loader

# checkpoint name fragment -> (merged parameter fragment, shard id)
_STACKED = (
    ("q_proj", "qkv_proj", "q"),
    ("k_proj", "qkv_proj", "k"),
    ("v_proj", "qkv_proj", "v"),
    ("gate_proj", "gate_up_proj", 0),
    ("up_proj", "gate_up_proj", 1),
)


def _rope_scaling(hf: dict) -> dict | None:
    """rope_scaling (transformers 4) or a non-default rope_parameters (transformers 5)."""
    scaling = hf.get("rope_scaling") or hf.get("rope_parameters")
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) != "default":
        return scaling
    return None


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TpGroup, dtype: torch.dtype) -> None:
        super().__init__()
        inter = cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [inter, inter], tp=tp, params_dtype=dtype)
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, tp=tp, params_dtype=dtype)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TpGroup, dtype: torch.dtype, bias: bool) -> None:
        super().__init__()
        d = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, d, cfg.num_attention_heads, cfg.num_key_value_heads, bias=bias, tp=tp, params_dtype=dtype
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * d, cfg.hidden_size, tp=tp, params_dtype=dtype)
        self.attn = RadixAttention(self.num_heads, d, d**-0.5, self.num_kv_heads, layer_id)

    def forward(self, rope: RopeBatch, x: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        q, k, v = rope.rotate_qkv(self.qkv_proj(x), self.num_heads, self.num_kv_heads, self.attn.head_dim)
        return self.o_proj(self.attn(q, k, v, fb))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TpGroup, dtype: torch.dtype, bias: bool) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_id, tp, dtype, bias)
        self.mlp = LlamaMLP(cfg, tp, dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(
        self, rope: RopeBatch, x: torch.Tensor, fb: ForwardBatch, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(rope, x, fb)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TpGroup, dtype: torch.dtype, bias: bool) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp, dtype)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, tp, dtype, bias) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        # One RoPE table for all layers, looked up once per forward.
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.context_len, cfg.rope_theta, _rope_scaling(cfg.hf))
        self.cpu_ops: CpuOps | None = None  # fused RoPE on CPU (set by ModelRunner)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        rope = self.rotary_emb.batch(positions, x.dtype, self.cpu_ops)
        for layer in self.layers:
            x, residual = layer(rope, x, fb, residual)
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    """forward() returns next-token logits; pooled embeddings when fb is an EMBED batch."""

    attention_bias = False

    def __init__(self, cfg: ModelConfig, tp: TpGroup = SINGLE, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, tp, dtype, cfg.attention_bias or self.attention_bias)
        self.lm_head = (
            self.model.embed_tokens
            if cfg.tie_word_embeddings
            else ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp, dtype)
        )
        self.logits_processor = LogitsProcessor(cfg.vocab_size, tp)
        self.pooler = LastTokenPooler(normalize=True)

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch
    ) -> LogitsProcessorOutput | torch.Tensor:
        hidden = self.model(input_ids, positions, fb)
        if fb.forward_mode is ForwardMode.EMBED:
            return self.pooler(hidden, fb)
        return self.logits_processor(hidden, self.lm_head.weight, fb)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            for frag, merged, shard in _STACKED:
                if frag in name:
                    target = name.replace(frag, merged)
                    if target not in params:
                        break
                    owner = self.get_submodule(target.rsplit(".", 1)[0])
                    owner.weight_loader(params[target], tensor, shard)  # type: ignore[operator]
                    loaded.add(target)
                    break
            else:
                if name not in params:
                    continue  # e.g. attention bias buffers some checkpoints carry
                owner = self.get_submodule(name.rsplit(".", 1)[0])
                loader = getattr(owner, "weight_loader", None)
                if loader is not None:
                    loader(params[name], tensor)
                else:
                    default_weight_loader(params[name], tensor, name=name)
                loaded.add(name)
        missing = set(params) - loaded
        if missing:
            raise ValueError(f"checkpoint is missing weights: {sorted(missing)[:8]}")
