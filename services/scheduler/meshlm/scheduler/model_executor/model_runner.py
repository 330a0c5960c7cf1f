"""ModelRunner: owns the model weights, the KV pools and the attention backend; runs forwards.

Sizing (done once at start-up):
    max_total_num_tokens = --max-total-tokens, or KV budget // bytes per token, where the budget
    is --kv-cache-memory-gb (CPU default 2 GiB) or, on CUDA, mem_fraction_static of the free
    memory left after loading the weights. With tensor parallelism the budget is per rank
    (a token's bytes count this rank's KV heads) and every rank takes the smallest rank's
    size, so all pools are equal.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter

import torch

from meshlm.scheduler.attention import create_backend
from meshlm.scheduler.attention.cpu_kernel import storable
from meshlm.scheduler.config import SchedulerConfig
from meshlm.scheduler.distributed import SINGLE, TpGroup
from meshlm.scheduler.kernels.cpu_features import cpu_has_native_bf16
from meshlm.scheduler.kernels.cpu_ops import CpuOps, cpu_ops_or_none
from meshlm.scheduler.kernels.gemm_amx import AMX_GEMM_MAX_ROWS, AmxGemmBf16, gemm_amx_or_none
from meshlm.scheduler.kernels.gemm_bf16 import PanelGemmBf16, gemm_bf16_or_none
from meshlm.scheduler.kernels.gemv import GemvOps, gemv_ops_or_none
from meshlm.scheduler.kernels.gemv_bf16 import BlockGemvBf16, gemv_bf16_or_none
from meshlm.scheduler.layers.cpu_gemm import BF16_GEMV_MAX_ROWS, PackedLinear, PackPlan, prepack_supported
from meshlm.scheduler.layers.linear import ColumnParallelLinear, RowParallelLinear
from meshlm.scheduler.layers.logits_processor import LogitsProcessorOutput
from meshlm.scheduler.layers.prompt_gemm import PromptGemmChoice, prompt_gemm_cache_dir
from meshlm.scheduler.mem_cache.allocator import TokenToKVPoolAllocator
from meshlm.scheduler.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from meshlm.scheduler.model_config import ModelConfig, parse_dtype
from meshlm.scheduler.model_executor.cpu_graph_runner import CpuGraphRunner
from meshlm.scheduler.model_executor.cuda_graph_runner import (
    DEFAULT_CUDA_GRAPH_MAX_BS,
    CudaGraphRunner,
    capture_batch_sizes,
)
from meshlm.scheduler.model_executor.forward_batch_info import ForwardBatch
from meshlm.scheduler.model_loader.weight_utils import iterate_weights
from meshlm.scheduler.models import get_model_class

logger = logging.getLogger(__name__)

CPU_DEFAULT_KV_GB = 2.0
DEFAULT_MAX_RUNNING = 256
EMBEDDING_MAX_TOTAL_TOKENS = 65536


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(
    name: str, model: ModelConfig, device: torch.device, flags: frozenset[str] | None = None
) -> torch.dtype:
    """auto: on CPU bfloat16 where the CPU has native bf16 math (avx512_bf16 or amx_bf16),
    float32 elsewhere; on CUDA the checkpoint's dtype (bfloat16 when it names none)."""
    if name != "auto":
        return parse_dtype(name)
    if device.type == "cpu":
        return torch.bfloat16 if cpu_has_native_bf16(flags) else torch.float32
    return parse_dtype(str(model.hf.get("torch_dtype") or model.hf.get("dtype") or "bfloat16"))


def resolve_kv_dtype(name: str, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The KV pool's dtype: the model's (auto), or bf16 (`bfloat16`), which under a model of
    another dtype only the CPU kernels read (ValueError elsewhere; which mix they read is
    cpu_kernel.storable's rule, the one the decode kernel and the decode plan check)."""
    kv = dtype if name == "auto" else parse_dtype(name)
    if kv == dtype:
        return dtype
    if device.type != "cpu" or not storable(dtype, kv):
        raise ValueError(
            f"--kv-cache-dtype {name} under a {str(dtype).removeprefix('torch.')} model on {device.type}: "
            "only a float32 model on CPU can keep a KV pool of another dtype (bfloat16)"
        )
    return kv


def _dtype_reason(name: str, dtype: torch.dtype, device: torch.device) -> str:
    if name != "auto":
        return f"--dtype {name}"
    if device.type != "cpu":
        return "--dtype auto: the checkpoint's dtype"
    if dtype == torch.bfloat16:
        return "--dtype auto: this CPU has native bf16 (avx512_bf16/amx_bf16)"
    return "--dtype auto: this CPU has no native bf16 (avx512_bf16/amx_bf16), so float32"


class ModelRunner:
    def __init__(self, model_config: ModelConfig, config: SchedulerConfig, tp: TpGroup = SINGLE) -> None:
        self.model_config = model_config
        self.config = config
        self.tp = tp
        self.device = resolve_device(config.device)
        if self.device.type == "cuda" and tp.size > 1:
            self.device = torch.device("cuda", tp.rank)  # one pod per TP group: rank r owns GPU r
        self.dtype = resolve_dtype(config.dtype, model_config, self.device)
        self.cpu_ops: CpuOps | None = None  # the fused C ops, on CPU with fused_ops=auto
        logger.info(
            "dtype %s (%s)",
            str(self.dtype).removeprefix("torch."),
            _dtype_reason(config.dtype, self.dtype, self.device),
        )
        if config.random_seed is not None:
            torch.manual_seed(config.random_seed)
        self.gemv_bf16 = self._bf16_block_gemv()
        # A bf16 model whose float32 checkpoint may hold GGUF blocks is loaded in float32, so
        # that prepack finds the blocks in the exact values; the rest is cast afterwards.
        self.load_dtype = torch.float32 if self.gemv_bf16 is not None else self.dtype
        self.load_model()
        self.prepare_cpu_model()
        if self.load_dtype != self.dtype:
            self._cast_parameters(self.dtype)
        self.init_memory_pool()
        self.attn_backend = create_backend(
            config.attention_backend,
            self.device,
            max(1, model_config.num_attention_heads // tp.size),
            model_config.head_dim,
        )
        self.graph_runner: CudaGraphRunner | CpuGraphRunner | None = self.init_cuda_graphs() or self.init_cpu_graph()

    def _bf16_block_gemv(self) -> BlockGemvBf16 | None:
        """The bf16 block GEMV, for a bf16 decoder on CPU (fused_ops=auto) whose checkpoint is
        float32 (a converted GGUF: the only kind whose weights can be blocks); else None."""
        mc = self.model_config
        checkpoint = str(mc.hf.get("torch_dtype") or mc.hf.get("dtype") or "")
        if (
            self.device.type != "cpu"
            or self.dtype != torch.bfloat16
            or self.config.fused_ops != "auto"
            or mc.is_embedding
            or checkpoint != "float32"
            or not prepack_supported()
        ):
            return None
        return gemv_bf16_or_none()

    def _cast_parameters(self, dtype: torch.dtype) -> None:
        """Every floating parameter to `dtype` (buffers such as the RoPE tables stay float32)."""
        for module in self.model.modules():
            for name, p in list(module.named_parameters(recurse=False)):
                if p.is_floating_point() and p.dtype != dtype:
                    setattr(module, name, torch.nn.Parameter(p.data.to(dtype), requires_grad=False))

    def load_model(self) -> None:
        t0 = time.perf_counter()
        cls = get_model_class(self.model_config.architecture)
        with torch.device(self.device):
            if self.model_config.is_embedding:
                self.model = cls(self.model_config.hf, self.load_dtype)
            else:
                self.model = cls(self.model_config, self.tp, self.load_dtype)
        self.model.load_weights(iterate_weights(self.model_config.path, progress=self.config.load_progress))
        self.model.eval()
        logger.info(
            "loaded %s (%s, %s) in %.1fs",
            self.model_config.architecture,
            self.dtype,
            self.device,
            time.perf_counter() - t0,
        )

    def prepare_cpu_model(self) -> None:
        """On CPU with fused_ops=auto: linear weights prepacked for oneDNN, and the fused C ops
        handed to every layer that takes them (modules with a `cpu_ops` attribute: RMSNorm,
        SiluAndMul, the RoPE of LlamaModel). fused_ops=torch keeps plain eager torch."""
        if self.device.type != "cpu" or self.config.fused_ops != "auto":
            return
        bf16 = self.dtype == torch.bfloat16
        gemm_bf16 = gemm_bf16_or_none() if bf16 else None
        gemm_amx = gemm_amx_or_none() if bf16 else None
        self.prepack_linears(gemv_ops_or_none(), self.gemv_bf16, gemm_bf16, gemm_amx)
        ops = cpu_ops_or_none()
        if ops is None:
            return
        self.cpu_ops = ops
        n = 0
        for module in self.model.modules():
            if hasattr(module, "cpu_ops"):
                module.cpu_ops = ops
                n += 1
        logger.info("fused CPU ops (RMSNorm + residual, RoPE, SiLU*mul) in %d modules", n)

    def prepack_linears(
        self,
        gemv_ops: GemvOps | None = None,
        gemv_bf16: BlockGemvBf16 | None = None,
        gemm_bf16: PanelGemmBf16 | None = None,
        gemm_amx: AmxGemmBf16 | None = None,
    ) -> None:
        """Every linear layer's weight (and the LM head) into the layouts its kernels read
        (layers/cpu_gemm.py); layers this torch build cannot pack keep F.linear. With gemv_ops
        (float32), decode batches take our kernels: a weight that is exactly GGUF blocks as those
        blocks (GEMV for a few rows, the block GEMM up to 256), any other a dense copy streamed
        by the GEMV for batches of <= 4 rows. With gemv_bf16 (a bf16 model loaded in float32), a
        weight that is GGUF blocks keeps them for bf16 batches of <= BF16_GEMV_MAX_ROWS rows. With
        gemm_bf16 (AVX512-BF16 without AMX), bf16 weights go to the panel GEMM instead of oneDNN.
        With gemm_amx (AMX), bf16 decode batches go to the AMX GEMM, prompt chunks to oneDNN."""
        if not prepack_supported():
            logger.warning("oneDNN is not available in this torch build; linears use F.linear")
            return
        t0 = time.perf_counter()
        cache = gemv_ops.cache if gemv_ops is not None else None
        before = dataclasses.replace(cache.stats) if cache is not None else None
        packed: list[PackedLinear] = []
        # one self-check per layout, not per weight
        prompt_gemm = PromptGemmChoice(self.config.cpu_prompt_gemm, prompt_gemm_cache_dir())
        plan = PackPlan(self.dtype, gemv_ops, gemv_bf16, gemm_bf16, gemm_amx, prompt_gemm=prompt_gemm)
        for module in self.model.modules():
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and module.prepack(plan):
                assert module.packed is not None
                packed.append(module.packed)
        head = getattr(self.model, "lm_head", None)
        logits = getattr(self.model, "logits_processor", None)
        # the head's prompt calls are a few rows (last tokens only): not worth timing at TUNE_ROWS
        head_plan = dataclasses.replace(plan, prompt_gemm=PromptGemmChoice("onednn"))
        if head is not None and logits is not None and logits.prepack(head.weight, head_plan):
            assert logits.packed_head is not None
            packed.append(logits.packed_head)
        formats = Counter(p.small.format for p in packed if p.small is not None)
        small_mib = sum(p.small.nbytes() + (p.blocks.nbytes() if p.blocks else 0) for p in packed if p.small) / (
            1 << 20
        )
        logger.info(
            "prepacked %d linear weights in %.2fs: %d also as GGUF blocks (GEMV + block GEMM), %d as GGUF "
            "blocks for bf16 batches of <= %d rows, %d for the bf16 panel GEMM, %d for the AMX GEMM (<= %d rows), "
            "%d for oneDNN, %d for MKL over W^T (--cpu-prompt-gemm %s); small-batch GEMV "
            "weights: %s (%.0f MiB with the GEMM panels)",
            len(packed),
            time.perf_counter() - t0,
            sum(p.blocks is not None for p in packed),
            sum(p.gemv_bf16 is not None for p in packed),
            BF16_GEMV_MAX_ROWS,
            sum(p.panels is not None for p in packed),
            sum(p.amx is not None for p in packed),
            AMX_GEMM_MAX_ROWS,
            sum(p.packed is not None for p in packed),
            sum(p.weight_t is not None for p in packed),
            prompt_gemm.mode,
            ", ".join(f"{k} x{v}" for k, v in sorted(formats.items())) or "none",
            small_mib,
        )
        if cache is not None and before is not None:
            st = cache.stats
            logger.info(
                "GEMV blocks: %d weights from the cache (%s), %d recovered in %.2fs and cached",
                st.hits - before.hits,
                cache.root,
                st.stored - before.stored,
                st.recover_s - before.recover_s,
            )

    def _kv_budget_bytes(self) -> int:
        if self.config.kv_cache_memory_gb is not None:
            return int(self.config.kv_cache_memory_gb * (1 << 30))
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            total = torch.cuda.get_device_properties(self.device).total_memory
            weights = total - free
            return max(int(total * self.config.mem_fraction_static) - weights, 1 << 26)
        return int(CPU_DEFAULT_KV_GB * (1 << 30))

    def init_memory_pool(self) -> None:
        t0 = time.perf_counter()
        cfg, mc = self.config, self.model_config
        kv_heads = max(1, mc.num_key_value_heads // self.tp.size)
        layers = 1 if mc.is_embedding else mc.num_hidden_layers
        kv_dtype = resolve_kv_dtype(cfg.kv_cache_dtype, self.dtype, self.device)
        cell = MHATokenToKVPool.cell_size_bytes(kv_heads, mc.head_dim, layers, kv_dtype)
        total = cfg.max_total_tokens or self._kv_budget_bytes() // cell
        if mc.is_embedding and cfg.max_total_tokens is None:
            total = min(total, EMBEDDING_MAX_TOTAL_TOKENS)  # encoders keep no KV between steps
        # Every rank runs the same schedule, so every rank's pool must be the same size: the
        # smallest budget wins (CUDA ranks can see different free memory).
        total = self.tp.min_over_ranks(total, self.device)
        total = total // cfg.page_size * cfg.page_size
        self.max_total_num_tokens = total
        max_running = cfg.max_running_requests or min(DEFAULT_MAX_RUNNING, max(total // 2, 1))
        self.max_running_requests = max_running
        self.req_to_token_pool = ReqToTokenPool(max_running, mc.context_len + 4, self.device)
        self.token_to_kv_pool = MHATokenToKVPool(
            total, cfg.page_size, kv_dtype, kv_heads, mc.head_dim, layers, self.device
        )
        self.token_to_kv_pool_allocator = TokenToKVPoolAllocator(total, cfg.page_size, self.device)
        logger.info(
            "KV pool: %d tokens (%.2f GiB, %s), max_running_requests=%d, page_size=%d, in %.2fs",
            total,
            total * cell / (1 << 30),
            str(kv_dtype).removeprefix("torch."),
            max_running,
            cfg.page_size,
            time.perf_counter() - t0,
        )

    def init_cuda_graphs(self) -> CudaGraphRunner | None:
        """On CUDA, decode graphs for batch sizes up to cuda_graph_max_bs (model_executor/
        cuda_graph_runner.py), unless disabled, or the backend is not graph-safe, or tp_size > 1
        (the all-reduce would have to be captured too). None = every forward runs eagerly."""
        cfg = self.config
        if self.device.type != "cuda" or cfg.disable_cuda_graph or self.model_config.is_embedding:
            return None
        why = ""
        if not self.attn_backend.supports_cuda_graph:
            why = f"attention backend {type(self.attn_backend).__name__} is not graph-safe"
        elif self.tp.size > 1:
            why = "tp_size > 1"
        if why:
            logger.info("CUDA graphs off: %s", why)
            return None
        max_bs = min(cfg.cuda_graph_max_bs or DEFAULT_CUDA_GRAPH_MAX_BS, self.max_running_requests)
        self.attn_backend.reserve_decode_buffers(max_bs)
        return CudaGraphRunner(self, capture_batch_sizes(max_bs)).capture()

    def init_cpu_graph(self) -> CpuGraphRunner | None:
        """On CPU, the decode plan (model_executor/cpu_graph_runner.py: every decoder layer's C
        kernel calls made in one C call) for batches of up to max_running_requests, where the
        model and configuration allow it and disable_cpu_graph is not set."""
        if self.device.type != "cpu" or self.config.disable_cpu_graph or self.model_config.is_embedding:
            return None
        return CpuGraphRunner.create(self, self.max_running_requests)

    def forward(self, fb: ForwardBatch) -> LogitsProcessorOutput | torch.Tensor:
        """Run the model on one batch: logits (generation) or pooled embeddings [B, H]. A decode
        batch that a captured graph covers replays it (its logits live until the next replay)."""
        if self.graph_runner is not None and self.graph_runner.can_run(fb):
            return self.graph_runner.replay(fb)
        fb.req_to_token_pool = self.req_to_token_pool
        fb.token_to_kv_pool = self.token_to_kv_pool
        fb.attn_backend = self.attn_backend
        if not self.model_config.is_embedding:
            self.attn_backend.init_forward_metadata(fb)
        with torch.inference_mode():
            return self.model(fb.input_ids, fb.positions, fb)

    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    def memory_report(self) -> dict[str, float | None]:
        return {"kv_pool_gib": self.token_to_kv_pool.mem_usage_bytes() / (1 << 30)}
