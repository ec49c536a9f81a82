"""A server's or master's checkpoints without stopping anyone: a snapshot per checkpoint step, cut by markers.

A Chandy-Lamport snapshot over the channels from the senders (workers, or ea-wild's group leaders) to one
process that holds state (an async-ps server's shard, an EASGD master's center). After its checkpoint of step N
a sender sends a marker for N on the channel its exchanges travel, so everything before the marker belongs to
its steps <= N. The first marker for N makes a copy of the live state; an exchange from a sender that has not
marked N yet goes into the live state and that copy, one from a sender that has goes into the live state only.
Once every sender still sending (not dead, not done) has marked N, the copy holds exactly every sender's
exchanges of its first N steps, and is handed over to be saved. Several snapshots may be under way at once (a
sender a whole interval ahead of another).

A state is any object with `copy()`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Generic, Protocol, TypeVar

from fast.comm import timing


class Copyable(Protocol):
    def copy(self) -> Copyable: ...


State = TypeVar("State", bound=Copyable)


class Snapshots(Generic[State]):
    """The snapshots of the checkpoint steps under way: which states an exchange from a sender goes into, and
    which snapshots are complete.

    Thread-safe. Exchanges may be applied from several threads at once (`applying`: ea-wild's handlers race on
    the live center, as they always have); taking a copy, or handing over a complete snapshot, waits until no
    exchange is being applied and holds new ones off meanwhile, so a copy never holds part of an update. Neither
    `mark` nor `save_complete` may be called inside `applying`."""

    def __init__(self, live: State, senders: int, committed: int = 0) -> None:
        self.live = live
        self.pending: dict[int, State] = {}  # step -> the snapshot of that step's cut, being completed
        self.marked = [committed] * senders  # each sender's last checkpoint marker
        self.committed = committed  # the step of the last complete snapshot
        self._lock = timing.Condition()
        self._applying = 0  # exchanges being applied now
        self._holding = 0  # copies and hand-overs waiting for those to end (new exchanges wait for them)
        self._saving = timing.Lock()  # complete snapshots are written one at a time, oldest first

    @contextmanager
    def applying(self, sender: int) -> Iterator[list[State]]:
        """The states an exchange from `sender` goes into: the live one and every snapshot of a step it has not
        marked yet; apply it to each inside the context."""
        with self._lock:
            while self._holding:
                self._lock.wait()
            self._applying += 1
            states = [self.live, *(state for step, state in self.pending.items() if self.marked[sender] < step)]
        try:
            yield states
        finally:
            with self._lock:
                self._applying -= 1
                self._lock.notify_all()

    @contextmanager
    def _quiet(self) -> Iterator[None]:
        """Hold the lock while no exchange is being applied."""
        with self._lock:
            self._holding += 1
            try:
                while self._applying:
                    self._lock.wait()
                yield
            finally:
                self._holding -= 1
                self._lock.notify_all()

    def mark(self, sender: int, step: int) -> None:
        """`sender` has sent every exchange of its first `step` steps: its checkpoint marker for `step`."""
        with self._quiet():
            self.marked[sender] = max(self.marked[sender], step)
            if step > self.committed and step not in self.pending:  # the first marker of this step
                self.pending[step] = self.live.copy()

    def save_complete(self, gone: set[int], save: Callable[[int, State], None]) -> list[int]:
        """Hand every snapshot that every sender not in `gone` (dead, or done: it sends nothing more) has marked
        to `save(step, state)`, oldest first, and forget it; returns their steps."""
        with self._saving:
            complete = []
            with self._quiet():
                for step in sorted(self.pending):
                    if any(marked < step for sender, marked in enumerate(self.marked) if sender not in gone):
                        break
                    complete.append((step, self.pending.pop(step)))
                    self.committed = step
            for step, state in complete:
                save(step, state)
        return [step for step, _ in complete]
