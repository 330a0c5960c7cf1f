"""CudaGraphRunner: decode forwards replayed from CUDA graphs captured at start-up.

A decode step of a small model on a GPU is mostly kernel launches (30 layers x ~15 kernels, each a
few microseconds of Python and driver work); a CUDA graph replays all of them in one launch. The
graphs are captured once per batch size in `capture_batch_sizes` and a batch of B rows runs in the
graph of the smallest captured size P >= B.

Static buffers (`max_bs` rows each, allocated once; graphs read nothing else but the weights, the
KV pools and ReqToTokenPool.req_to_token):

    input_ids, positions, out_cache_loc, seq_lens, req_pool_indices

Replay copies the batch's B rows into rows 0..B-1 and sets the padding rows B..P-1 to a dummy
request: input id 0, position 0, seq_len 1, req_pool_index 0 and out_cache_loc 0 -- slot 0 is
the pools' padding slot (no real token lives there), so the padding rows' KV writes are harmless
and their reads (row 0 of req_to_token holds valid slot numbers: the table is zero-initialised and
only ever holds slots) stay in bounds. Rows B..P-1 of the output are dropped.

Invariants:
  * Only DECODE batches with B <= max_bs whose sequences fit the RoPE table run here; the
    attention backend must be graph-safe (its decode metadata refers to fb.seq_lens and
    fb.req_pool_indices as given and to scratch reserved up front; it reads no host-side lists).
  * The returned logits are a view into the graph's output buffer, valid until the next replay.
"""

from __future__ import annotations

import bisect
import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from meshlm.scheduler.layers.logits_processor import LogitsProcessorOutput
from meshlm.scheduler.model_executor.forward_batch_info import ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from meshlm.scheduler.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)

DEFAULT_CUDA_GRAPH_MAX_BS = 160


def capture_batch_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, 12, 16, 24, then every 8 (every 16 past 64) up to max_bs, and max_bs itself.
    Padding a batch to the next size wastes at most ~20% of a step above 8 rows."""
    sizes = [1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64]
    sizes += list(range(80, max_bs + 1, 16))
    return sorted({s for s in sizes if s <= max_bs} | {max_bs})


class _CudaGraph:
    """A torch.cuda.CUDAGraph of `run`, captured on a side stream into a shared memory pool."""

    def __init__(self, run: Callable[[], torch.Tensor], pool: Any, stream: torch.cuda.Stream) -> None:
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool, stream=stream):
            self.output = run()

    def replay(self) -> None:
        self.graph.replay()


class CudaGraphRunner:
    """Captures the decode forward of `runner` at `batch_sizes` and replays it (see module doc).

    eager=True keeps the whole mechanism but re-runs the forward eagerly instead of capturing a
    graph (any device)."""

    def __init__(self, runner: ModelRunner, batch_sizes: Sequence[int], eager: bool = False) -> None:
        if not batch_sizes:
            raise ValueError("CudaGraphRunner needs at least one batch size")
        self.runner = runner
        self.batch_sizes = sorted(set(batch_sizes))
        self.max_bs = self.batch_sizes[-1]
        self.eager = eager
        self.max_seq_len = runner.model_config.context_len
        device = runner.device
        n = self.max_bs
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.out_cache_loc = torch.zeros(n, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int64, device=device)
        self.req_pool_indices = torch.zeros(n, dtype=torch.int64, device=device)
        self.graphs: dict[int, _CudaGraph] = {}
        self.fbs: dict[int, ForwardBatch] = {}
        self.num_replays = 0  # decode forwards run here
        self.padded_rows = 0  # padding rows they carried

    def can_run(self, fb: ForwardBatch) -> bool:
        return (
            fb.forward_mode is ForwardMode.DECODE
            and fb.batch_size <= self.max_bs
            and bool(fb.seq_lens_cpu)
            and max(fb.seq_lens_cpu) <= self.max_seq_len
        )

    def _static_batch(self, bs: int) -> ForwardBatch:
        r = self.runner
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            batch_size=bs,
            input_ids=self.input_ids[:bs],
            positions=self.positions[:bs],
            seq_lens=self.seq_lens[:bs],
            req_pool_indices=self.req_pool_indices[:bs],
            out_cache_loc=self.out_cache_loc[:bs],
            seq_lens_cpu=[1] * bs,
            extend_seq_lens_cpu=[1] * bs,
            req_to_token_pool=r.req_to_token_pool,
            token_to_kv_pool=r.token_to_kv_pool,
            attn_backend=r.attn_backend,
        )

    def _forward(self, fb: ForwardBatch) -> torch.Tensor:
        with torch.inference_mode():
            out = self.runner.model(fb.input_ids, fb.positions, fb)
        assert isinstance(out, LogitsProcessorOutput)
        return out.next_token_logits

    def capture(self) -> CudaGraphRunner:
        """Capture every batch size, largest first (later graphs reuse the first one's pool)."""
        t0 = time.perf_counter()
        self._reset_padding(0, self.max_bs)
        if self.eager:
            for bs in reversed(self.batch_sizes):
                self.fbs[bs] = self._static_batch(bs)
            return self
        stream = torch.cuda.Stream(self.runner.device)
        pool = torch.cuda.graph_pool_handle()
        before = torch.cuda.mem_get_info(self.runner.device)[0]
        for bs in reversed(self.batch_sizes):
            fb = self._static_batch(bs)
            self.runner.attn_backend.init_forward_metadata(fb)
            self.fbs[bs] = fb
            torch.cuda.synchronize(self.runner.device)
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up: Triton compiles and the allocator settles
                    self._forward(fb)
            torch.cuda.synchronize(self.runner.device)
            self.graphs[bs] = _CudaGraph(functools.partial(self._forward, fb), pool, stream)
        torch.cuda.synchronize(self.runner.device)
        used = (before - torch.cuda.mem_get_info(self.runner.device)[0]) / (1 << 20)
        logger.info(
            "captured %d CUDA graphs (decode batch sizes %d..%d) in %.1fs, %.0f MiB",
            len(self.graphs),
            self.batch_sizes[0],
            self.max_bs,
            time.perf_counter() - t0,
            used,
        )
        return self

    def _reset_padding(self, start: int, end: int) -> None:
        """Rows start..end-1 become the dummy request (see module doc)."""
        if end > start:
            self.input_ids[start:end].zero_()
            self.positions[start:end].zero_()
            self.out_cache_loc[start:end].zero_()
            self.seq_lens[start:end].fill_(1)
            self.req_pool_indices[start:end].zero_()

    def padded_size(self, bs: int) -> int:
        return self.batch_sizes[bisect.bisect_left(self.batch_sizes, bs)]

    def replay(self, fb: ForwardBatch) -> LogitsProcessorOutput:
        """Logits [B, V] of decode batch fb (can_run(fb) must hold)."""
        bs = fb.batch_size
        size = self.padded_size(bs)
        assert fb.out_cache_loc is not None
        self.input_ids[:bs].copy_(fb.input_ids, non_blocking=True)
        self.positions[:bs].copy_(fb.positions, non_blocking=True)
        self.out_cache_loc[:bs].copy_(fb.out_cache_loc, non_blocking=True)
        self.seq_lens[:bs].copy_(fb.seq_lens, non_blocking=True)
        self.req_pool_indices[:bs].copy_(fb.req_pool_indices, non_blocking=True)
        # Rows bs..size-1 may hold a larger earlier batch's requests: make them padding again.
        self._reset_padding(bs, size)
        self.num_replays += 1
        self.padded_rows += size - bs
        if self.eager:
            return LogitsProcessorOutput(self._eager_replay(fb, size)[:bs])
        graph = self.graphs[size]
        graph.replay()
        return LogitsProcessorOutput(graph.output[:bs])

    def _eager_replay(self, fb: ForwardBatch, size: int) -> torch.Tensor:
        static = self.fbs[size]
        static.seq_lens_cpu = list(fb.seq_lens_cpu) + [1] * (size - fb.batch_size)
        static.attn_metadata = None
        self.runner.attn_backend.init_forward_metadata(static)
        return self._forward(static)
