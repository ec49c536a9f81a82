"""A channel whose waits give up at the run's deadline without letting gloo time out (which would break it).

A gloo operation that passes its own deadline closes every connection of its group in this process, so that
all its other peers would take this process for dead; and a gloo send or receive cannot be polled (it
completes only inside `wait`). So on a `PatientGroup` gloo never times out: a daemon thread waits on each
operation and the caller gives up at the run's deadline with CommTimeout, leaving the operation pending.
`probe` finds a dead peer without waiting: a send to a process that is gone fails at once (its connection is
closed), while one to a live process stays pending, unread.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from typing import Any

import torch

from fast.comm import tags, timeline, timing
from fast.comm.comm import RECV_BYTES, Comm, Handle, check_length
from fast.comm.waiting import waiting
from fast.errors import CommError, CommTimeout

PROBE_TAG = tags.PROBE  # nobody receives on it: a probe stays pending at a live peer
IDLE_DEADLINE_S = 7 * 24 * 3600.0  # gloo's own deadline on these channels: never reached


def probe_period(deadline_s: float) -> float:
    """How often a silent peer is probed: often enough to notice a death well within the deadline."""
    return min(0.5, deadline_s / 4)


def probe(comm: Comm, peer: int, pending: list[Handle]) -> str | None:
    """Why `peer` is gone (a send to it fails at once: its connection is closed), or None if it may be alive.
    Never waits: the send stays pending, unread, at a live peer; it is kept in `pending` for as long as `comm`
    lives. Unmetered: not training traffic."""
    try:
        with comm.unmetered():
            pending.append(comm.isend(torch.zeros(1), peer, tag=PROBE_TAG))
    except CommError as e:
        return str(e)
    return None


class _Waiter:
    """Daemon threads that wait on operations for callers that give up at their own deadline (a stuck wait
    keeps its thread; a daemon thread does not keep the process from exiting)."""

    def __init__(self) -> None:
        self._jobs = timing.Queue()
        self._lock = threading.Lock()
        self._free = 0  # threads minus jobs not finished yet

    def submit(self, job: Callable[[], Any]) -> Any:
        future = timing.Future()
        with self._lock:
            if self._free == 0:
                timing.Thread(self._loop, "fast-waiter").start()
                self._free += 1
            self._free -= 1
        self._jobs.put((job, future))
        return future

    def _loop(self) -> None:
        while True:
            job, future = self._jobs.get()
            try:
                future.set_result(job())
            except BaseException as e:  # handed to the caller by future.result()
                future.set_exception(e)
            # the exception's traceback holds this frame: a future (and the tensor of its operation) left here would
            # form a cycle, and torch aborts the process when the garbage collector clears a tensor that gloo holds
            job = future = None
            with self._lock:
                self._free += 1


class PatientGroup:
    """A strategy's own group over `comm`'s ranks (collective to create) whose waits give up at the run's
    deadline with CommTimeout, leaving the operation pending, instead of letting gloo time out."""

    def __init__(self, comm: Comm) -> None:
        self.deadline_s = comm.deadline_s
        self.comm = copy.copy(comm.separate_group())
        self.comm.deadline_s = IDLE_DEADLINE_S
        self.probes: list[Handle] = []  # sends nobody receives, kept as long as the channel

    def wait(self, handle: Handle, deadline_s: float | None = None) -> Any:
        """Wait for an operation of this channel (posted with `self.comm`) for at most the deadline."""
        deadline_s = self.deadline_s if deadline_s is None else deadline_s
        if timing.simulated():  # a simulated wait that gives up breaks nothing: no waiter thread needed
            return handle.wait(deadline_s)
        counting = self.comm.counter.context()

        def job() -> Any:
            with self.comm.counter.entered(counting):
                return handle.wait()

        future = timing.shared("waiter", _Waiter).submit(job)
        interrupted = self.comm.interrupted
        end = timing.now() + deadline_s
        try:
            with waiting():
                started = timing.wall()  # (inside the trace's wait span, as the end is)
                while True:  # (a live membership: in slices, to give up as soon as the membership changes)
                    try:
                        slice_s = deadline_s if interrupted is None else min(0.25, max(0.0, end - timing.now()))
                        result = future.result(slice_s)
                        timeline.waited(handle.ticket, started, timing.wall())  # (the waiter's thread is not ours)
                        return result
                    except timing.FutureTimeout:
                        if interrupted is not None and timing.now() < end:
                            reason = interrupted()
                            if reason is None:
                                continue
                            raise CommError(f"{handle.op} with {handle.peer} given up: {reason}") from None
                        raise CommTimeout(
                            f"{handle.op} with {handle.peer} did not complete within {deadline_s:g}s: the peer is "
                            "gone or stuck (raise run.deadline_s if it is only slow)"
                        ) from None
        finally:
            # an error the future re-raises holds this frame in its traceback: the future, holding the error, would
            # close a cycle, and torch aborts the process when the garbage collector clears a tensor gloo still holds
            future = job = None  # noqa: F841

    def send(self, tensor: torch.Tensor, peer: int, tag: int, droppable: bool = False,
             deadline_s: float | None = None) -> None:  # fmt: skip
        self.wait(self.comm.isend(tensor, peer, tag=tag, droppable=droppable), deadline_s)

    def recv(self, tensor: torch.Tensor, peer: int, tag: int, deadline_s: float | None = None) -> torch.Tensor:
        return self.wait(self.comm.irecv(tensor, peer, tag=tag), deadline_s)

    def send_bytes(self, payload: torch.Tensor, peer: int, tag: int, deadline_s: float | None = None) -> None:
        """A variable-length uint8 payload: its length, then its bytes (as `Comm.send_bytes`)."""
        self.send(torch.tensor([payload.numel()], dtype=torch.int64), peer, tag, deadline_s=deadline_s)
        if payload.numel():
            self.send(payload.contiguous(), peer, tag, deadline_s=deadline_s)

    def recv_bytes(self, peer: int, tag: int, deadline_s: float | None = None, limit: int = RECV_BYTES) -> torch.Tensor:
        """A payload `send_bytes` sent, of at most `limit` bytes (as `Comm.recv_bytes`)."""
        length = self.recv(torch.zeros(1, dtype=torch.int64), peer, tag, deadline_s)
        n = int(length.item())
        check_length(peer, n, limit)
        return self.recv(torch.empty(n, dtype=torch.uint8), peer, tag, deadline_s) if n else torch.empty(0)

    def probe(self, peer: int) -> str | None:
        """Why `peer` is gone (its connection is closed), or None if it may be alive; never waits."""
        return probe(self.comm, peer, self.probes)

    def unmetered(self) -> Any:
        return self.comm.unmetered()


def wait_for_senders(
    changed: Any,
    missing: Callable[[], list[int]],
    heard: dict[int, float],
    probe_sender: Callable[[int], str | None],
    found_dead: Callable[[int, str], None],
    deadline_s: float,
    check: Callable[[], None] = lambda: None,
) -> None:
    """Wait until `missing()` (the senders still awaited) is empty; `changed` is notified whenever a sender is heard
    from (`heard`: when, timing.now()). A sender awaited and silent for a while is probed: one whose connection
    is closed, or that stays silent past the deadline (from its last word or from this call, whichever is later),
    goes to `found_dead`, which must drop it from `missing()`. `check()` raises what went wrong elsewhere."""
    start, period = timing.now(), probe_period(deadline_s)
    probed: dict[int, float] = {}
    with waiting(), changed:
        while True:
            check()
            waiting_for = missing()
            if not waiting_for:
                return
            now = timing.now()
            for sender in waiting_for:
                silent = now - max(start, heard.get(sender, start))
                if silent < period or now - probed.get(sender, start) < period:
                    continue
                probed[sender] = now
                why = probe_sender(sender)
                if why is None and silent > deadline_s:
                    why = f"silent for {silent:.1f}s while this process waited for it"
                if why is not None:
                    found_dead(sender, why)
            changed.wait(period)
