"""Where a worker's time goes: spans of compute, strategy work (encode, send, apply) and waits on communication.

Each span is timed exclusively (a wait inside a strategy hook counts as waiting, not as the hook's own work),
and the training thread's exclusive seconds add up by category: `compute` (forward, backward, the optimizer, an
emulated machine's slowdown), `communicate` (the strategy's own work on messages: encoding, copies, applying what
arrived) and `wait` (blocked on a collective or a message). The summary's shares split the blocked time once every
process's is known (fast.comm.arrivals): until the last peer issued the collective, or the sender its message, it
is waiting for peers (`wait`: a straggler, a barrier, an evaluation); the rest, blocked on the transfer itself, is
communication (`communicate`); what no category holds (data, records) is `other`. With `[run] trace = true` every
span of every thread is also kept and written as a Chrome trace (one process per worker, one track per thread)
that Perfetto and chrome://tracing load, each wait holding its part spent "waiting for peers".
"""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any

from fast.comm import timing
from fast.comm.arrivals import Arrivals, Ticket

CATEGORIES = ("compute", "communicate", "wait")
_local = threading.local()


class _Frame:
    __slots__ = ("name", "category", "start", "resumed", "own", "timeline")

    def __init__(self, name: str, category: str, now: float, timeline: Timeline) -> None:
        self.name, self.category, self.timeline = name, category, timeline
        self.start, self.resumed, self.own = now, now, 0.0


class Timeline:
    """One process's spans: exclusive seconds per category on the training thread, and the events if kept."""

    def __init__(self, rank: int, keep_events: bool) -> None:
        self.rank, self.keep_events = rank, keep_events
        self.origin = timing.now()
        self.unix_origin = timing.wall()
        self.training_thread = threading.get_ident()
        self.seconds = dict.fromkeys(CATEGORIES, 0.0)
        self.events: list[dict[str, Any]] = []
        self.threads: dict[int, str] = {}
        self.lock = threading.Lock()
        self.counting = False  # the shares count training time only (`count_from_now` .. `stop_counting`)
        self.pauses = 0
        self.arrivals = Arrivals()  # to split the waits into waiting for peers and communication

    def count_from_now(self) -> None:
        self.seconds = dict.fromkeys(CATEGORIES, 0.0)
        self.counting = True

    def stop_counting(self) -> None:
        self.counting = False

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Spans that end inside are not training time (evaluation, measurements)."""
        self.pauses += 1
        try:
            yield
        finally:
            self.pauses -= 1

    def record(self, name: str, category: str, start: float, end: float, own: float) -> None:
        thread = threading.get_ident()
        if thread == self.training_thread and self.counting and not self.pauses:
            self.seconds[category] += own
        if self.keep_events:
            with self.lock:
                self.threads.setdefault(thread, threading.current_thread().name)
                unix_start = self.unix_origin + (start - self.origin)  # one clock for every process of the host
                self.events.append({"name": name, "cat": category, "ph": "X", "pid": self.rank, "tid": thread,
                                    "ts": unix_start * 1e6, "dur": (end - start) * 1e6})  # fmt: skip

    def chrome_events(self, role: str) -> list[dict[str, Any]]:
        """The kept events, with the names of this process (`role`) and of its threads."""
        names = [
            {"name": "process_name", "ph": "M", "pid": self.rank, "args": {"name": role}},
            {"name": "process_sort_index", "ph": "M", "pid": self.rank, "args": {"sort_index": self.rank}},
        ]
        names += [{"name": "thread_name", "ph": "M", "pid": self.rank, "tid": tid, "args": {"name": name}}
                  for tid, name in self.threads.items()]  # fmt: skip
        with self.lock:
            return names + list(self.events)


_timeline: ContextVar[Timeline | None] = ContextVar("timeline", default=None)  # the worker's (one per simulated one)


def start(rank: int, keep_events: bool) -> Timeline:
    """Time this worker's spans from now on."""
    timeline = Timeline(rank, keep_events)
    _timeline.set(timeline)
    return timeline


def stop() -> None:
    _timeline.set(None)


def ticket(channel: str, issue: bool) -> Ticket | None:
    """The next operation's ticket on `channel` (fast.comm.arrivals); `issue`: this process issues it."""
    timeline = _timeline.get()
    return timeline.arrivals.take(channel, issue) if timeline is not None else None


def waited(ticket: Ticket | None, start: float, end: float) -> None:
    """This thread waited on `ticket`'s operation from `start` to `end` (wall clock): kept if it is the training
    thread's, in training time."""
    timeline = _timeline.get()
    if ticket is None or timeline is None or not timeline.counting or timeline.pauses:
        return
    if threading.get_ident() == timeline.training_thread:
        timeline.arrivals.waited(ticket, start, end)


def open_span(name: str, category: str) -> None:
    """Start a span on this thread (for work that begins and ends in different callbacks: `close_span` ends it)."""
    timeline = _timeline.get()
    if timeline is None:
        return
    stack: list[_Frame] = _local.__dict__.setdefault("stack", [])
    now = timing.now()
    if stack:
        stack[-1].own += now - stack[-1].resumed
    stack.append(_Frame(name, category, now, timeline))


def close_span() -> None:
    """End this thread's innermost span."""
    stack: list[_Frame] = _local.__dict__.get("stack", [])
    if not stack:
        return
    end = timing.now()
    frame = stack.pop()
    frame.own += end - frame.resumed
    if stack:
        stack[-1].resumed = end
    frame.timeline.record(frame.name, frame.category, frame.start, end, frame.own)


@contextmanager
def span(name: str, category: str) -> Iterator[None]:
    """Time the block as `name` in `category` (its nested spans' time is theirs)."""
    if _timeline.get() is None:
        yield
        return
    open_span(name, category)
    try:
        yield
    finally:
        close_span()


def timed(name: str, category: str = "communicate") -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A decorator: every call of the function is a span."""

    def wrap(function: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(function)
        def timed_call(*args: Any, **kwargs: Any) -> Any:
            with span(name, category):
                return function(*args, **kwargs)

        return timed_call

    return wrap


def shares(seconds: dict[str, float], wall_s: float, peers_fraction: float | None) -> dict[str, float]:
    """Each category's share of `wall_s`, and the rest (data loading, the user's own code, records) as `other`. The
    time blocked on communication splits: `peers_fraction` of it (fast.comm.arrivals; None: no wait was matched)
    waiting for peers (`wait`), the rest blocked on the transfers themselves, which is communication."""
    if wall_s <= 0:
        return {}
    blocked, peers = seconds.get("wait", 0.0), peers_fraction or 0.0
    split = {"compute": seconds.get("compute", 0.0), "communicate": seconds.get("communicate", 0.0)
             + (1 - peers) * blocked, "wait": peers * blocked}  # fmt: skip
    found = {category: round(min(1.0, split[category] / wall_s), 4) for category in CATEGORIES}
    return {**found, "other": round(max(0.0, 1.0 - sum(found.values())), 4)}


def chrome_trace(parts: list[Path]) -> str:
    """One trace (JSON) of the processes' parts (each a JSON list of events), its clock starting at the first."""
    events: list[dict[str, Any]] = []
    for part in parts:
        events += json.loads(part.read_text())
    origin = min((e["ts"] for e in events if "ts" in e), default=0.0)
    for event in events:
        if "ts" in event:
            event["ts"] = round(event["ts"] - origin, 3)
            event["dur"] = round(event["dur"], 3)
    return json.dumps({"traceEvents": events, "displayTimeUnit": "ms"})
