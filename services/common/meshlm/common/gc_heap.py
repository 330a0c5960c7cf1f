"""The start-up heap out of the cyclic garbage collector's way.

A service imports and builds most of what it will ever hold before it serves: modules, the
FastAPI app and its schemas, protobuf descriptors, the tokenizer, the model's Python objects.
Left where they are, that heap reaches the oldest generation and every full collection walks it
again (a full collection follows every ~100 young ones, which a relay's per-token garbage
triggers every few milliseconds). Moving it to the permanent generation once, as servers
written in Python commonly do (gc.freeze), leaves the collector the objects made while serving.
"""

from __future__ import annotations

import gc
import logging

logger = logging.getLogger(__name__)


def freeze_startup_heap() -> int:
    """Collect once (nothing unreachable is frozen), then move every object alive now into the
    permanent generation, which collections skip. Call once per process, when it starts to
    serve; returns how many objects the permanent generation holds."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.info("start-up heap frozen: %d objects left out of garbage collection", frozen)
    return frozen
