"""Time a thread spends waiting on communication, so that a step's own work can be told from its waits."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from fast.comm import timeline

_local = threading.local()


def waited_s() -> float:
    """Seconds this thread has spent inside `waiting()` so far."""
    return getattr(_local, "seconds", 0.0)


@contextmanager
def waiting() -> Iterator[None]:
    """Time inside counts as this thread waiting on communication; nested waits count once."""
    depth = getattr(_local, "depth", 0)
    _local.depth = depth + 1
    started = time.perf_counter()
    try:
        if depth:
            yield
        else:
            with timeline.span("wait", "wait"):
                yield
    finally:
        _local.depth = depth
        if depth == 0:
            _local.seconds = waited_s() + time.perf_counter() - started
