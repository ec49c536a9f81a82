"""Training time from the common start barrier, with evaluation (and other measurement) left out."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager


class Clock:
    def __init__(self, offset: float = 0.0) -> None:
        self.start = time.perf_counter() - offset
        self.paused = 0.0

    def now(self) -> float:
        return time.perf_counter() - self.start - self.paused

    @contextmanager
    def pause(self) -> Iterator[None]:
        """Time spent inside is not training time."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.paused += time.perf_counter() - started
