"""SchedulerRuntime: the scheduler loop and what it needs, started the same way by the
in-process Engine and by the gRPC scheduler service.

It resolves the model, reads its config, loads the tokenizer, builds the SchedulerPort (queue
in, the caller's callbacks out) and the Scheduler (which loads the weights), and runs
`event_loop_normal` in a daemon thread. A loop crash is logged and reported to `on_crash`.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Optional

from meshlm.scheduler.config import SchedulerConfig
from meshlm.scheduler.managers.port import OutputCallback, SchedulerPort
from meshlm.scheduler.managers.scheduler import Scheduler
from meshlm.scheduler.model_config import ModelConfig
from meshlm.scheduler.model_loader import resolve_model_path

logger = logging.getLogger(__name__)

CrashCallback = Callable[[BaseException], None]


class SchedulerRuntime:
    def __init__(self, config: SchedulerConfig, on_output: OutputCallback, on_control: OutputCallback) -> None:
        path = resolve_model_path(config.model_path)
        self.model_config = ModelConfig.from_path(path, config.context_length)
        from transformers import AutoTokenizer

        self.tokenizer: Any = AutoTokenizer.from_pretrained(str(config.tokenizer_path or path))
        self.config = config.replace(model_path=str(path))
        self.port = SchedulerPort(on_output, on_control)
        self.scheduler = Scheduler(self.config, self.model_config, self.tokenizer, self.port)
        self._thread: Optional[threading.Thread] = None
        self._on_crash: Optional[CrashCallback] = None
        self.crashed: Optional[BaseException] = None

    def start(self, on_crash: Optional[CrashCallback] = None) -> None:
        """Run the loop in a daemon thread ("scheduler-loop")."""
        self._on_crash = on_crash
        self._thread = threading.Thread(target=self._run, name="scheduler-loop", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self.scheduler.event_loop_normal()
        except BaseException as e:  # a loop crash must fail every waiter, never hang them
            logger.exception("scheduler loop crashed")
            self.crashed = e
            if self._on_crash is not None:
                self._on_crash(e)
            raise

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the loop after its current step and wait for the thread."""
        self.scheduler.stop()
        if self._thread is not None:
            self._thread.join(timeout=timeout)
