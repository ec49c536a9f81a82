"""Time a thread spends waiting on communication, so that a step's own work can be told from its waits."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from fast.comm import timeline, timing

_local = threading.local()
_in_waits = 0  # threads of this process inside `waiting()` now
_count_lock = threading.Lock()


def waiting_now() -> bool:
    """Whether a thread of this process is waiting on communication now (else it computes, or idles)."""
    return _in_waits > 0


def _count(change: int) -> None:
    global _in_waits
    with _count_lock:
        _in_waits += change


def waited_s() -> float:
    """Seconds this thread has spent inside `waiting()` so far."""
    return getattr(_local, "seconds", 0.0)


@contextmanager
def waiting() -> Iterator[None]:
    """Time inside counts as this thread waiting on communication; nested waits count once."""
    depth = getattr(_local, "depth", 0)
    _local.depth = depth + 1
    started = timing.now()
    if depth == 0:
        _count(1)
    try:
        if depth:
            yield
        else:
            with timeline.span("wait", "wait"):
                yield
    finally:
        _local.depth = depth
        if depth == 0:
            _count(-1)
            _local.seconds = waited_s() + timing.now() - started
