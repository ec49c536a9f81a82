"""Byte accounting: every payload that crosses `comm` is counted here, per peer, in both directions."""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager


class ByteCounter:
    """Bytes sent to and received from each peer, plus what the same messages would weigh as dense fp32.

    Shared by every channel of one worker (the main group and background threads), so it is thread-safe.
    Traffic inside `unmetered()` (measurement only, e.g. replica divergence) is not counted. Traffic inside
    `dense_equivalent(n)` (a compressed exchange) counts its real bytes in `sent` and `n`, the bytes of the
    same messages as dense fp32, in `sent_uncompressed`; any other send counts the same in both.
    Both contexts are per thread; `context()` and `entered()` carry them to a thread working for the caller.
    """

    def __init__(self) -> None:
        self.sent: dict[int, int] = defaultdict(int)
        self.received: dict[int, int] = defaultdict(int)
        self.sent_uncompressed = 0
        self.sent_unmetered = 0  # what `unmetered()` left out of the count, so that the wire's total can be matched
        self._lock = threading.Lock()
        self._local = threading.local()

    @property
    def metered(self) -> bool:
        return getattr(self._local, "depth", 0) == 0

    @contextmanager
    def unmetered(self) -> Iterator[None]:
        self._local.depth = getattr(self._local, "depth", 0) + 1
        try:
            yield
        finally:
            self._local.depth -= 1

    @contextmanager
    def dense_equivalent(self, nbytes: int) -> Iterator[None]:
        """The sends inside stand for `nbytes` of dense fp32 messages in `sent_uncompressed`."""
        if self.metered:
            with self._lock:
                self.sent_uncompressed += int(nbytes)
        self._local.compressed = getattr(self._local, "compressed", 0) + 1
        try:
            yield
        finally:
            self._local.compressed -= 1

    def context(self) -> tuple[int, int]:
        """This thread's accounting context (unmetered, compressed), for `entered` in another thread."""
        return getattr(self._local, "depth", 0), getattr(self._local, "compressed", 0)

    @contextmanager
    def entered(self, context: tuple[int, int]) -> Iterator[None]:
        """Count this thread's traffic as the thread that took `context` would (emulated collectives)."""
        saved = self.context()
        self._local.depth, self._local.compressed = context
        try:
            yield
        finally:
            self._local.depth, self._local.compressed = saved

    def add_sent(self, peer: int, nbytes: int, uncompressed: int | None = None) -> None:
        """Count `nbytes` sent to `peer`; `uncompressed` (default: nbytes, or 0 inside `dense_equivalent`)
        is what the message would have been as dense fp32."""
        if nbytes <= 0:
            return
        if not self.metered:
            with self._lock:
                self.sent_unmetered += int(nbytes)
            return
        if uncompressed is None:
            uncompressed = 0 if getattr(self._local, "compressed", 0) else nbytes
        with self._lock:
            self.sent[peer] += int(nbytes)
            self.sent_uncompressed += int(uncompressed)

    def add_received(self, peer: int, nbytes: int) -> None:
        if not self.metered or nbytes <= 0:
            return
        with self._lock:
            self.received[peer] += int(nbytes)

    @property
    def bytes_sent(self) -> int:
        return sum(self.sent.values())

    @property
    def bytes_received(self) -> int:
        return sum(self.received.values())

    def snapshot(self) -> dict[str, object]:
        with self._lock:
            return {
                "bytes_sent": sum(self.sent.values()),
                "bytes_received": sum(self.received.values()),
                "bytes_sent_uncompressed": self.sent_uncompressed,
                "bytes_sent_unmetered": self.sent_unmetered,
                "sent_per_peer": {str(k): v for k, v in sorted(self.sent.items())},
                "received_per_peer": {str(k): v for k, v in sorted(self.received.items())},
            }
