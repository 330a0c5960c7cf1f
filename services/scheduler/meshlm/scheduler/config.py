"""SchedulerConfig: the engine's flags (SGLang's ServerArgs subset), frozen after parsing."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from meshlm.common.flags import Flag, add_config_flags

POLICIES = ("fcfs", "lpm")
DISAGGREGATION_MODES = ("null", "prefill", "decode")
ATTENTION_BACKENDS = ("auto", "torch_native", "cpu", "triton")  # meshlm.scheduler.attention.BACKENDS
FUSED_OPS = ("auto", "torch")
PROMPT_GEMMS = ("auto", "onednn", "mkl")  # layers/prompt_gemm.py
KV_CACHE_DTYPES = ("auto", "bfloat16")
GRAMMAR_BACKENDS = ("xgrammar", "llguidance", "none")  # meshlm.scheduler.constrained.backends


@dataclass(frozen=True)
class SchedulerConfig:
    """Every field is a CLI flag (`--model-path` style, underscores become dashes; the
    scheduler service also reads each from MESHLM_SCHEDULER_<FIELD>).

    Sizes left as None are derived at start-up from the model and the memory budget.
    """

    model_path: str | None = None  # HF dir or .gguf; None = the packaged SmolLM2-135M-Instruct
    tokenizer_path: str | None = None  # defaults to model_path
    dtype: str = "auto"  # auto = bfloat16 on a CPU with native bf16, else float32; CUDA: the checkpoint's
    device: str = "auto"  # auto = cuda if available else cpu
    context_length: int | None = None
    page_size: int = 1
    max_total_tokens: int | None = None  # KV pool size in tokens
    kv_cache_memory_gb: float | None = None  # KV budget; CPU default 2 GiB
    kv_cache_dtype: str = "auto"  # auto = the model's dtype; bfloat16 = a bf16 pool under a float32 model (CPU)
    mem_fraction_static: float = 0.85  # CUDA: share of free memory for weights + KV
    max_running_requests: int | None = None
    max_prefill_tokens: int = 16384
    chunked_prefill_size: int = 2048  # -1 disables chunking (vLLM's CPU default token budget)
    prefill_chunk_per_req: int = 64  # chunk <= this x (running + waiting) requests (0: off)
    enable_mixed_chunk: bool = True  # decode tokens of running requests ride in prefill batches
    schedule_policy: str = "fcfs"
    schedule_conservativeness: float = 1.0
    disable_radix_cache: bool = False
    stream_interval: int = 1
    decode_log_interval: int = 40  # a "Decode batch." log line every N decode steps (0: none)
    max_queued_requests: int | None = None
    attention_backend: str = "auto"
    cuda_graph_max_bs: int | None = None  # CUDA: decode graphs up to this batch (None = 160, capped)
    disable_cuda_graph: bool = False
    disable_cpu_graph: bool = False  # CPU: decode layers through Python instead of one C plan
    fused_ops: str = "auto"  # auto = CPU: prepacked oneDNN linears + fused C elementwise; torch = eager
    cpu_prompt_gemm: str = "auto"  # float32 prompt-chunk linears: auto (timed per shape) | onednn | mkl
    random_seed: int | None = None
    tp_size: int = 1
    disaggregation_mode: str = "null"  # null = unified; prefill / decode = PD roles
    grammar_backend: str = "xgrammar"  # structured output: xgrammar | llguidance | none
    constrained_json_disable_any_whitespace: bool = False  # compact JSON under json_schema
    constrained_json_max_whitespace: int = 2  # longest whitespace run a JSON grammar allows
    load_progress: bool = True

    def __post_init__(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(msg)

        need(self.page_size >= 1, f"page_size must be >= 1, got {self.page_size}")
        need(
            self.schedule_policy in POLICIES, f"schedule_policy must be one of {POLICIES}, got {self.schedule_policy!r}"
        )
        need(
            self.chunked_prefill_size == -1 or self.chunked_prefill_size >= self.page_size,
            f"chunked_prefill_size must be -1 or >= page_size ({self.page_size}), got {self.chunked_prefill_size}",
        )
        need(
            self.prefill_chunk_per_req >= 0,
            f"prefill_chunk_per_req must be >= 0, got {self.prefill_chunk_per_req}",
        )
        need(self.max_prefill_tokens >= 1, f"max_prefill_tokens must be >= 1, got {self.max_prefill_tokens}")
        need(self.stream_interval >= 1, f"stream_interval must be >= 1, got {self.stream_interval}")
        need(self.decode_log_interval >= 0, f"decode_log_interval must be >= 0, got {self.decode_log_interval}")
        need(self.schedule_conservativeness > 0, "schedule_conservativeness must be > 0")
        need(self.tp_size >= 1, f"tp_size must be >= 1, got {self.tp_size}")
        need(
            self.disaggregation_mode in DISAGGREGATION_MODES,
            f"disaggregation_mode must be one of {DISAGGREGATION_MODES}, got {self.disaggregation_mode!r}",
        )
        need(
            self.disaggregation_mode == "null" or self.tp_size == 1,
            f"disaggregation_mode {self.disaggregation_mode!r} needs tp_size 1 (KV handover of TP shards "
            f"is not implemented), got tp_size {self.tp_size}",
        )
        need(
            self.attention_backend in ATTENTION_BACKENDS,
            f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}",
        )
        need(
            self.cuda_graph_max_bs is None or self.cuda_graph_max_bs >= 1,
            f"cuda_graph_max_bs must be >= 1, got {self.cuda_graph_max_bs}",
        )
        need(self.fused_ops in FUSED_OPS, f"fused_ops must be one of {FUSED_OPS}, got {self.fused_ops!r}")
        need(
            self.cpu_prompt_gemm in PROMPT_GEMMS,
            f"cpu_prompt_gemm must be one of {PROMPT_GEMMS}, got {self.cpu_prompt_gemm!r}",
        )
        need(
            self.kv_cache_dtype in KV_CACHE_DTYPES,
            f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}",
        )
        need(
            self.grammar_backend in GRAMMAR_BACKENDS,
            f"grammar_backend must be one of {GRAMMAR_BACKENDS}, got {self.grammar_backend!r}",
        )
        need(
            self.constrained_json_max_whitespace >= 1,
            f"constrained_json_max_whitespace must be >= 1, got {self.constrained_json_max_whitespace}",
        )
        if self.max_total_tokens is not None:
            need(self.max_total_tokens >= 16, f"max_total_tokens must be >= 16, got {self.max_total_tokens}")
        if self.max_running_requests is not None:
            need(self.max_running_requests >= 1, "max_running_requests must be >= 1")

    def replace(self, **changes: Any) -> SchedulerConfig:
        return dataclasses.replace(self, **changes)

    # ---- CLI ------------------------------------------------------------------------------
    @staticmethod
    def add_cli_args(
        parser: argparse.ArgumentParser,
        env_prefix: str | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        """Add one flag per field (meshlm.common.flags: bools are --x / --no-x); with env_prefix
        each defaults to its <env_prefix><FIELD> environment variable when set."""
        helps = {
            "model_path": "HF-format model directory or .gguf file; unset = the packaged SmolLM2-135M-Instruct",
            "tokenizer_path": "tokenizer directory; unset = the model's",
            "dtype": (
                "auto | float32 | bfloat16 | float16; auto = bfloat16 on a CPU with native bf16 "
                "(avx512_bf16 or amx_bf16), float32 on other CPUs, the checkpoint's dtype on CUDA"
            ),
            "device": "auto | cpu | cuda",
            "context_length": "override the model's context length",
            "page_size": "tokens per KV page",
            "max_total_tokens": "KV pool size in tokens; unset = from the memory budget",
            "kv_cache_memory_gb": "KV budget in GiB; unset = 2 on CPU",
            "kv_cache_dtype": (
                "auto | bfloat16; auto = the model's dtype; bfloat16 under a float32 model (CPU) "
                "stores K and V rounded to bf16: twice the tokens in the same KV budget and half "
                "the bytes a decode step reads, at bf16's precision in attention (as SGLang's and "
                "vLLM's --kv-cache-dtype)"
            ),
            "mem_fraction_static": "CUDA: fraction of free GPU memory for weights + KV",
            "max_running_requests": "most requests decoding at once",
            "max_prefill_tokens": "token budget of one prefill batch",
            "chunked_prefill_size": "tokens per prefill chunk (-1 disables chunking)",
            "prefill_chunk_per_req": (
                "while requests are decoding, a prefill chunk holds at most this many prompt tokens "
                "per request running or waiting (never fewer than 256, never more than "
                "--chunked-prefill-size): a few arrivals beside a decoding batch prefill in small "
                "chunks and reach their first tokens sooner, a burst of arrivals in large ones; "
                "0 = always --chunked-prefill-size"
            ),
            "enable_mixed_chunk": (
                "run the running requests' decode step inside each prefill batch (SGLang's mixed "
                "chunk; on by default, as vLLM always mixes): decoding never pauses while prompts "
                "prefill; --no-enable-mixed-chunk runs them as separate steps"
            ),
            "schedule_policy": f"waiting-queue order: {' | '.join(POLICIES)}",
            "schedule_conservativeness": "scales the reserve kept for future decode tokens",
            "disable_radix_cache": "do not reuse KV of shared prefixes",
            "stream_interval": "emit streamed outputs every N tokens",
            "decode_log_interval": (
                "log a 'Decode batch.' line (running requests, KV usage, generation throughput, "
                "forward ms) every N decode steps; every prefill batch gets a 'Prefill batch.' "
                "line (SGLang's format plus the forward's ms); 0 = no decode lines"
            ),
            "max_queued_requests": "reject new requests when this many wait (RESOURCE_EXHAUSTED)",
            "attention_backend": (
                "attention implementation: auto (CPU: the fused C decode kernel when a C compiler "
                "can build it, else torch_native; CUDA: triton when triton imports, else "
                "torch_native) | torch_native | cpu | triton (paged Triton kernels, CUDA)"
            ),
            "cuda_graph_max_bs": (
                "CUDA: capture decode forwards as CUDA graphs for batch sizes up to this (default "
                "160, at most max_running_requests); larger batches run eagerly"
            ),
            "disable_cuda_graph": "CUDA: run every decode forward eagerly (no graph capture)",
            "disable_cpu_graph": (
                "CPU: call the decoder layers' C kernels from Python one by one instead of the "
                "decode plan (one C call a step for a float32 or bf16 Llama-family model)"
            ),
            "fused_ops": (
                "CPU model kernels: auto (linear weights prepacked for oneDNN; when a C compiler "
                "can build them, fused C kernels for RMSNorm + residual, RoPE and SiLU*mul and, in "
                "float32, a GEMV for batches of 1-4 rows over a second copy of each weight: a GGUF "
                "model's own Q4_1 / Q8_0 blocks where they hold it exactly, else dense) | torch "
                "(F.linear and eager torch ops)"
            ),
            "cpu_prompt_gemm": (
                "CPU, float32: the library multiplying prompt chunks by each linear weight: auto (oneDNN "
                "unless MKL over the transposed weight is >= 5%% faster for the shape, timed once at "
                "start-up and remembered in the kernel cache) | onednn | mkl"
            ),
            "random_seed": (
                "seed of the global sampler RNG (with tp_size > 1 and none given, rank 0 picks one for every rank)"
            ),
            "tp_size": "tensor-parallel size (ranks in this scheduler's pod)",
            "disaggregation_mode": (
                "prefill/decode disaggregation role: null (prefill and decode here) | prefill "
                "(compute prompts, hand KV + first token to a decode scheduler) | decode"
            ),
            "grammar_backend": (
                "structured output (sampling_params json_schema / regex / ebnf, response_format): "
                "xgrammar (default) | llguidance | none (constrained requests are refused)"
            ),
            "constrained_json_disable_any_whitespace": (
                "json_schema grammars allow no free whitespace: compact JSON (SGLang's flag)"
            ),
            "constrained_json_max_whitespace": (
                "the longest run of whitespace a json_schema grammar allows between two JSON "
                "tokens (keeps a small model from emitting newlines until max_new_tokens)"
            ),
            "load_progress": "show a progress bar while loading weights",
        }
        flags = {name: Flag(text, aliases=("--model",) if name == "model_path" else ()) for name, text in helps.items()}
        group = parser.add_argument_group("engine")
        add_config_flags(group, SchedulerConfig, flags, env_prefix=env_prefix, environ=environ)

    @staticmethod
    def from_cli_args(ns: argparse.Namespace) -> SchedulerConfig:
        return SchedulerConfig(**{f.name: getattr(ns, f.name) for f in fields(SchedulerConfig)})
