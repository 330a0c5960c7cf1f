"""freeze_startup_heap: what is alive at start-up leaves the collector's generations (a full
collection then walks only what was made since), and garbage made before it is collected first,
not frozen. Runs in a subprocess: a frozen heap would outlive the test in this one."""

from __future__ import annotations

import subprocess
import sys

PROBE = r"""
import gc, weakref
from meshlm.common.gc_heap import freeze_startup_heap

class Node:
    pass

kept = [Node() for _ in range(1000)]
cycle = Node(); cycle.self = cycle
gone = weakref.ref(cycle)
del cycle
before = len(gc.get_objects())
frozen = freeze_startup_heap()
assert gone() is None, "unreachable garbage was frozen instead of collected"
assert frozen >= 1000 and frozen == gc.get_freeze_count(), frozen
after = len(gc.get_objects())  # the generations' objects: what a full collection walks
assert after < before / 10, (before, after)
new = [Node() for _ in range(10)]
assert all(gc.is_tracked(n) for n in new) and len(gc.get_objects()) >= after + 10
print("ok", before, after, frozen)
"""


def test_the_start_up_heap_is_frozen_and_its_garbage_collected_first() -> None:
    result = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ok")
