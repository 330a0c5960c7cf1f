"""GrammarCompilePool: grammars compile off the scheduler loop, once per key.

A pool of compile threads and a cache of compiled grammars by GrammarKey (kind, text), in
least-recently-used order and bounded by `cache_size` entries (only finished entries are
dropped). `get(key)` never blocks: it returns the key's Future (cached, in flight, or just
submitted), which resolves to the compiled template (a BaseGrammarObject) or raises
InvalidGrammarError; failures are cached as well, so a bad schema sent again fails at once.

The backend itself (an xgrammar / llguidance tokenizer vocabulary: about a second) is built on
a compile thread as soon as the pool starts, so neither the loop nor the start-up waits for it.
Every finished compile calls `on_done` (the loop's wake-up) and `on_compiled(seconds)` (the
grammar_compilation_time_seconds histogram) when set. Thread-safe.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from meshlm.scheduler.constrained.base_grammar_backend import BaseGrammarBackend, BaseGrammarObject, GrammarKey


class GrammarCompilePool:
    def __init__(
        self,
        make_backend: Callable[[], BaseGrammarBackend],
        threads: int,
        cache_size: int,
        on_done: Callable[[], None] | None = None,
    ) -> None:
        self._executor = ThreadPoolExecutor(max_workers=max(threads, 1), thread_name_prefix="grammar-compile")
        self._backend: Future[BaseGrammarBackend] = self._executor.submit(make_backend)
        self._cache: OrderedDict[GrammarKey, Future[BaseGrammarObject]] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._on_done = on_done
        self.on_compiled: Callable[[float], None] | None = None
        self.cache_hits = 0
        self.compiles = 0

    def get(self, key: GrammarKey) -> Future[BaseGrammarObject]:
        """The Future of key's compiled grammar (cached, in flight or just submitted)."""
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:
                self._cache.move_to_end(key)
                self.cache_hits += 1
                return fut
            self.compiles += 1
            fut = self._executor.submit(self._compile, key)
            self._cache[key] = fut
            self._evict()
        if self._on_done is not None:
            wake = self._on_done
            fut.add_done_callback(lambda _f: wake())
        return fut

    def _evict(self) -> None:
        excess = len(self._cache) - self._cache_size
        for old in [k for k, f in self._cache.items() if f.done()][: max(excess, 0)]:
            del self._cache[old]

    def _compile(self, key: GrammarKey) -> BaseGrammarObject:
        backend = self._backend.result()
        t0 = time.perf_counter()
        try:
            return backend.compile(key)
        finally:
            if self.on_compiled is not None:
                self.on_compiled(time.perf_counter() - t0)

    def backend(self, timeout: float | None = None) -> BaseGrammarBackend:
        """The backend, once built (raises what building it raised)."""
        return self._backend.result(timeout)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
