"""Training time from the common start barrier, with evaluation (and other measurement) left out."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import contextmanager

from fast.comm import timing
from fast.comm.timeline import Timeline


class Clock:
    def __init__(self, offset: float = 0.0, timeline: Timeline | None = None) -> None:
        self.start = timing.now() - offset
        self.paused = 0.0
        self.timeline = timeline  # its shares count training time only, as this clock does

    def now(self) -> float:
        return timing.now() - self.start - self.paused

    @contextmanager
    def pause(self) -> Iterator[None]:
        """Time spent inside is not training time."""
        started = timing.now()
        try:
            with self.timeline.paused() if self.timeline is not None else contextlib.nullcontext():
                yield
        finally:
            self.paused += timing.now() - started
