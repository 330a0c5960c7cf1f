"""Qwen2 family: the Llama architecture with a bias on the q/k/v projections."""

from __future__ import annotations

from meshlm.scheduler.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    attention_bias = True
