"""Who a wait waited for: when each process issued each collective and each message, so that the time a worker is
blocked on one splits into waiting for its peers and communication, the same way for every strategy and exchange.

A wait on a collective lasts until the last member has issued it, then until the bytes have moved: the part before
the last member's issue is waiting for peers (a straggler, a barrier, a peer still evaluating), the rest is
communication. A receive's wait splits the same way at the time its sender posted the message. Each process
numbers the operations of each channel (a group's collectives; one direction of a pair on one tag), which every
member issues in the same order, and keeps, for a sample of them, when it issued each and, on the training thread,
when its wait on it began and ended. The sample is chosen by number, the same on every member: all of the first
SAMPLED, then every second, every fourth, ..., so that a long run's tables stay small. Worker 0 matches everyone's
tables at the end (`peers_fractions`).
"""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Any

from fast.comm import timing

SAMPLED = 1024

Ticket = tuple[str, int]  # (channel, number)


def sampled(number: int) -> bool:
    """Whether the operation of this number (from 0) on its channel is in the sample."""
    if number < SAMPLED:
        return True
    return number % (1 << (number // SAMPLED).bit_length()) == 0


class Arrivals:
    """One process's numbers, sampled issue times and training-thread waits (kept by its timeline)."""

    def __init__(self) -> None:
        self.numbers: dict[str, int] = defaultdict(int)
        self.issued: dict[str, dict[int, float]] = defaultdict(dict)
        self.waits: list[tuple[str, int, float, float]] = []
        self._lock = threading.Lock()

    def take(self, channel: str, issue: bool) -> Ticket | None:
        """The next number of `channel`, and its ticket if sampled; `issue`: this process issues it (a collective,
        or a message it sends), so its time is kept."""
        with self._lock:
            number = self.numbers[channel]
            self.numbers[channel] = number + 1
        if not sampled(number):
            return None
        if issue:
            self.issued[channel][number] = timing.wall()
        return channel, number

    def waited(self, ticket: Ticket, start: float, end: float) -> None:
        """The training thread waited on `ticket`'s operation from `start` to `end` (wall clock)."""
        self.waits.append((ticket[0], ticket[1], start, end))

    def table(self) -> dict[str, Any]:
        """What worker 0 matches at the end (JSON)."""
        issued = {channel: {str(n): t for n, t in times.items()} for channel, times in self.issued.items()}
        return {"issued": issued, "waits": [list(wait) for wait in self.waits]}


def peers_fractions(tables: list[dict[str, Any] | None]) -> tuple[list[float | None], list[list[tuple[float, float]]]]:
    """Each process's share of its sampled waits spent waiting for peers (None: no wait matched), and those parts
    of its waits as (start, end) on the wall clock (for the trace)."""
    last: dict[tuple[str, int], float] = {}
    for table in tables:
        for channel, times in (table or {}).get("issued", {}).items():
            for number, t in times.items():
                key = (channel, int(number))
                last[key] = max(t, last.get(key, t))
    fractions: list[float | None] = []
    spans: list[list[tuple[float, float]]] = []
    for table in tables:
        waited = peers = 0.0
        mine: list[tuple[float, float]] = []
        for channel, number, start, end in (table or {}).get("waits", []):
            arrived = last.get((channel, int(number)))
            if arrived is None or end <= start:
                continue
            waited += end - start
            until = min(max(arrived, start), end)
            peers += until - start
            if until > start:
                mine.append((start, until))
        fractions.append(peers / waited if waited > 0 else None)
        spans.append(mine)
    return fractions, spans
