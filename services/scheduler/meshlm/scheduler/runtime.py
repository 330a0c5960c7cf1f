"""SchedulerRuntime: the scheduler loop and what it needs, started the same way by the
in-process Engine and by the gRPC scheduler service.

It resolves the model, reads its config, loads the tokenizer (both without transformers),
builds the SchedulerPort (queue in, the caller's callbacks out) and the Scheduler (which loads
the weights), and runs `event_loop_normal` in a daemon thread. A loop crash is logged and
reported to `on_crash`.

The Scheduler is built in the thread that later runs its loop ("scheduler-loop"), so every
parallel torch / oneDNN / C-kernel region of this process starts from one thread. libgomp keeps
one worker team per thread that opens a parallel region, and once the process holds more of its
threads than there are CPUs it stops its workers from spinning between regions: a model loaded
in one thread and run in another then wakes its workers through the OS at each of the hundreds
of regions a decode step opens (a batch-1 step of SmolLM2-135M on 2 cores: 22.5 ms when loading
and stepping share a thread, 38 ms when they do not).

With --tp-size N > 1 this process is rank 0 of the tensor-parallel group: it checks that the
model shards N ways, picks the sampler seed when none is given (every rank seeds its RNG with
it), spawns ranks 1..N-1 (distributed/launch.py), each running `follower_rank` (the same
Scheduler on its shard, outputs discarded), and builds its own Scheduler on shard 0. stop()
ends every rank: the loop's last broadcast tells the others to stop, then they are reaped.
"""

from __future__ import annotations

import functools
import logging
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from meshlm.scheduler.config import SchedulerConfig
from meshlm.scheduler.distributed import TpGroup
from meshlm.scheduler.distributed.launch import TpRanks, start_tp_group
from meshlm.scheduler.managers.port import OutputCallback, SchedulerPort
from meshlm.scheduler.managers.scheduler import Scheduler
from meshlm.scheduler.model_config import ModelConfig
from meshlm.scheduler.model_executor.model_runner import resolve_device
from meshlm.scheduler.model_loader import resolve_model_path
from meshlm.scheduler.model_loader.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

CrashCallback = Callable[[BaseException], None]


def load_model_facts(config: SchedulerConfig) -> tuple[SchedulerConfig, ModelConfig, Any]:
    """(config with the resolved model path, the model's ModelConfig, its tokenizer); raises
    ValueError naming tp_size when the model cannot be sharded tp_size ways. Reads JSON files
    only (config.json with plain json, the tokenizer with `tokenizers`): no transformers import
    (model_loader/tokenizer.py)."""
    t0 = time.perf_counter()
    path = resolve_model_path(config.model_path)
    model_config = ModelConfig.from_path(path, config.context_length)
    model_config.verify_tp_size(config.tp_size)
    tokenizer = load_tokenizer(config.tokenizer_path or path)
    logger.info("model facts (config, tokenizer) of %s in %.2fs", path, time.perf_counter() - t0)
    return config.replace(model_path=str(path)), model_config, tokenizer


def _discard(msg: Any) -> None:
    """Output callback of ranks > 0: rank 0 alone answers."""


def follower_rank(
    config: SchedulerConfig, tp: TpGroup, cpu_group: torch.distributed.ProcessGroup
) -> Callable[[], None]:
    """Start-up of TP rank tp.rank > 0 (in its own process): the Scheduler on its shard, with
    a port that discards outputs; returns the loop, which takes its inputs from rank 0."""
    config, model_config, tokenizer = load_model_facts(config)
    port = SchedulerPort(_discard, _discard)
    return Scheduler(config, model_config, tokenizer, port, tp, cpu_group).event_loop_normal


class SchedulerRuntime:
    """Construction returns once the Scheduler is built (or raises what building it raised);
    start() then lets the same thread run the loop."""

    def __init__(self, config: SchedulerConfig, on_output: OutputCallback, on_control: OutputCallback) -> None:
        self.config, self.model_config, self.tokenizer = load_model_facts(config)
        self.port = SchedulerPort(on_output, on_control)
        self.tp_ranks: TpRanks | None = None
        self.scheduler: Scheduler
        self._on_crash: CrashCallback | None = None
        self.crashed: BaseException | None = None
        self._started = False
        self._built = threading.Event()
        self._go = threading.Event()
        self._build_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="scheduler-loop", daemon=True)
        self._thread.start()
        self._built.wait()
        if self._build_error is not None:
            self._thread.join()
            raise self._build_error

    def _build(self) -> None:
        if self.config.tp_size == 1:
            self.scheduler = Scheduler(self.config, self.model_config, self.tokenizer, self.port)
            return
        if self.config.random_seed is None:
            self.config = self.config.replace(random_seed=secrets.randbelow(1 << 31))
        self.tp_ranks, self.scheduler = start_tp_group(
            self.config.tp_size,
            resolve_device(self.config.device),
            functools.partial(follower_rank, self.config.replace(load_progress=False)),
            lambda tp, cpu_group: Scheduler(self.config, self.model_config, self.tokenizer, self.port, tp, cpu_group),
        )

    def start(self, on_crash: CrashCallback | None = None) -> None:
        """Let the loop run (in the thread that built the Scheduler)."""
        self._on_crash = on_crash
        self._started = True
        self._go.set()

    def _run(self) -> None:
        try:
            self._build()
        except BaseException as e:  # handed to the constructor, which raises it
            self._build_error = e
            self._built.set()
            return
        self._built.set()
        self._go.wait()
        try:
            self.scheduler.event_loop_normal()
        except BaseException as e:  # a loop crash must fail every waiter, never hang them
            logger.exception("scheduler loop crashed")
            self.crashed = e
            if self.tp_ranks is not None:
                self.tp_ranks.terminate()  # they wait for a broadcast that will not come
            if self._on_crash is not None:
                self._on_crash(e)
            raise

    def is_alive(self) -> bool:
        """Whether the loop was started and is still running."""
        return self._started and self._thread.is_alive()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the loop after its current step and wait for the thread; with TP, then wait
        for the other ranks to exit (killing any left after `timeout`) and leave the group. A
        loop never started runs one iteration, which sees the stop (with TP it broadcasts it)."""
        self.scheduler.stop()
        self._go.set()
        self._thread.join(timeout=timeout)
        if self.tp_ranks is not None:
            self.tp_ranks.join(timeout)
