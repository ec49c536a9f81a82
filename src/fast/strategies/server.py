"""The server protocol: what the strategies with server processes (async-ps, asynchronous EASGD, EA-wild) share.

A server holds state the workers exchange with (a shard of the weights, a center). Its loop (`ServerLoop`)
reads requests in background threads, one per *line*: one line that every worker sends on, whose requests are
answered one at a time in arrival order, or a line per sender when their requests are to be applied
concurrently (EA-wild's lock-free center). Each strategy reads its own wire format (`read`) into a `Request`:

- work (an exchange, a push, a pull): answered by the strategy (`ServerStrategy.answer`), which applies it to
  the live state and to every snapshot under way that the sender has not marked yet (`fast.strategies.snapshots`);
- a marker: the sender's checkpoint marker for a step; the snapshot of that step is written once complete;
- done: the sender sends no more.

A sender silent for a while is probed: one whose connection is closed, or that stays silent past the deadline,
is recorded as lost and holds no snapshot back; one only slow that speaks again is taken back. The loop ends
when every sender is done or lost; then every live sender that said done gets its farewell (the final state).
A server's death stays fatal: worker 0 ends the run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from fast.comm import Comm, Handle, timing
from fast.comm.patience import probe, wait_for_senders
from fast.errors import CommError
from fast.strategies.base import ModelLayout, Strategy
from fast.strategies.snapshots import Snapshots

WORK, MARKER, DONE = "work", "marker", "done"


@dataclass
class Request:
    sender: int
    kind: str  # WORK, MARKER or DONE
    step: int = 0  # the steps the sender had done (a marker's: its checkpoint's step)
    data: Any = None  # what the strategy read with it (a header, a gradient, weights)


@dataclass
class Line:
    """Where requests come from: `comm`, from `peer` (or from whichever sender comes first when None), read by
    `read(comm, peer) -> Request`."""

    comm: Comm
    peer: int | None
    read: Callable[[Comm, int | None], Request]


class ServerLoop:
    def __init__(self, server: ServerStrategy, senders: list[int], lines: list[Line],
                 more_may_come: Callable[[], bool] = lambda: False) -> None:  # fmt: skip
        self.server, self.senders, self.lines = server, list(senders), lines
        self.more_may_come = more_may_come  # a live run's: senders may still join (`add`)
        self.done: set[int] = set()
        self.heard: dict[int, float] = {}
        self.changed = timing.Condition()
        self.error: BaseException | None = None
        self.pending: list[Handle] = []  # probes nobody receives, kept to the end
        self.running = False

    def run(self) -> set[int]:
        """Serve until every sender is done or lost (and no more may come); returns the live senders that said
        done."""
        with self.changed:
            self.running = True
            for line in self.lines:
                timing.Thread(self._read, "fast-server", args=(line,)).start()
        while True:
            self._wait()
            if not self.more_may_come():
                break
            with self.changed:
                self.changed.wait(0.1)
        self.server.save_snapshots(self.done)
        return self.done - self.server.dead

    def add(self, sender: int, line: Line) -> None:
        """A sender that joined the run, on a line of its own."""
        with self.changed:
            self.senders.append(sender)
            self.lines.append(line)
            if self.running:
                timing.Thread(self._read, "fast-server", args=(line,)).start()
            self.changed.notify_all()

    def _read(self, line: Line) -> None:
        try:
            while not self._over(line.peer):
                try:
                    request = line.read(line.comm, line.peer)
                except CommError as e:
                    if self._over(line.peer):  # (its line closed at the end)
                        return
                    if line.peer is None:
                        raise
                    self._lost(line.peer, str(e))
                    return
                self._handle(request)
        except BaseException as e:  # handed to the serving thread
            with self.changed:
                self.error = e
                self.changed.notify_all()

    def _over(self, peer: int | None) -> bool:
        """Whether a line's reading is over: its sender's (one sender's line), or every sender's."""
        with self.changed:
            senders = self.senders if peer is None else [peer]
            return all(s in self.done or s in self.server.dead for s in senders)

    def _handle(self, request: Request) -> None:
        sender = request.sender
        self.server.taken_back(sender)
        with self.changed:
            self.heard[sender] = timing.now()
        if request.kind == MARKER:
            self.server.snapshots.mark(self.server.sender_index(sender), request.step)
        elif request.kind == DONE:
            with self.changed:
                self.done.add(sender)
            self.server.finished(request)
        else:
            try:
                with self.server.ctx.serving():
                    self.server.answer(request)
            except CommError as e:
                self._lost(sender, str(e))
        self.server.save_snapshots(self.done)
        if request.kind == DONE:  # what the serving thread waits for (a request answered changes none of it: waking
            with self.changed:  # it at each would cost it a look at every sender, a thousand of them, each time)
                self.changed.notify_all()

    def _lost(self, sender: int, how: str) -> None:
        self.server.lost(sender, self.server.last_step(sender), how)
        self.server.save_snapshots(self.done)
        with self.changed:
            self.changed.notify_all()

    def _wait(self) -> None:
        """Until every sender is done or lost, probing the silent ones (a receive cannot be used for that: gloo is
        unusable after a missed deadline)."""

        def check() -> None:
            if self.error is not None:
                raise self.error

        def missing() -> list[int]:
            return [s for s in self.senders if s not in self.done and s not in self.server.dead]

        def probe_sender(sender: int) -> str | None:
            return probe(*self.server.line_to(sender), self.pending)

        def found_dead(sender: int, why: str) -> None:
            self._lost(sender, f"probed after silence: {why}")

        deadline_s = self.server.world.deadline_s  # the run's (a line may never time gloo out)
        wait_for_senders(self.changed, missing, self.heard, probe_sender, found_dead, deadline_s, check)


class ServerStrategy(Strategy):
    """A strategy with server processes; subclasses give the server side `open`, `lines`, `read`, `answer`,
    `farewell` (and `finished`, `last_step` where they need them) and their workers' side as usual."""

    collective_eval = False
    stops_alone = True
    survives_failures = True
    takes_shards = False
    shards_why = (
        "its servers hold whole-model state that every worker pushes to and pulls from; servers are not sharded"
    )
    server_checkpoints = True  # the servers' snapshots
    state_key: ClassVar[str] = "state"  # the name of the server's state in its checkpoint

    def __init__(self, options: Any, ctx: Any) -> None:
        super().__init__(options, ctx)
        self.failure_lock = timing.Lock()  # deaths are recorded from several threads (a server's lines)

    @classmethod
    def server_count(cls, options: Any, workers: int) -> int:
        return 1

    # -- the server's side --------------------------------------------------------------------------------------
    @property
    def on_server(self) -> bool:
        """Whether this process is one of the servers (it has set its live state up)."""
        return "live" in self.__dict__

    def setup_server(self, layout: ModelLayout) -> None:
        self.live = self.open(layout)
        self.staleness = self.live.staleness
        self.snapshots = Snapshots(self.live, len(self.senders()))

    def serve(self) -> None:
        lines = self.ctx.lines
        if lines is None:
            loop = ServerLoop(self, self.senders(), self.lines())
        else:  # a live run's workers, each on a line of its own, as they come (fast.runtime.detached)
            loop = ServerLoop(self, [], [], more_may_come=lambda: not lines.closed())
            for member in lines.follow(lambda member, comm: loop.add(member, self.line_of(member))):
                loop.add(member, self.line_of(member))
        for sender in sorted(loop.run()):
            try:
                self.farewell(sender)
            except CommError as e:
                self.lost(sender, self.last_step(sender), f"did not take its farewell: {e}")

    def open(self, layout: ModelLayout) -> Any:
        """The live state (with `copy`, `state_dict`, `load_state_dict` and a `staleness` list), set up."""
        raise NotImplementedError

    def senders(self) -> list[int]:
        """The ranks that send requests (the workers; EA-wild: the group leaders; a live run's detached
        workers: those whose lines have formed)."""
        if self.ctx.lines is not None:
            return list(self.ctx.lines.lines)
        return list(range(self.ctx.workers))

    def sender_index(self, sender: int) -> int:
        return self._sender_indices()[sender]

    def _sender_indices(self) -> dict[int, int]:
        """Each sender's index in `senders()`, made again when a sender joins (a look-up, where `index` scans a list
        of a thousand senders at every request of a simulated run)."""
        senders = self.senders()  # (senders only join: the same count, the same senders)
        if len(self.__dict__.get("_indices_of", ())) != len(senders):
            self._indices_of = {sender: i for i, sender in enumerate(senders)}
        return self._indices_of

    def lines(self) -> list[Line]:
        raise NotImplementedError

    def line_of(self, member: int) -> Line:
        """The line of a live run's detached worker (fast.runtime.detached), for strategies that `joins_alone`."""
        raise NotImplementedError

    def line_to(self, sender: int) -> tuple[Comm, int]:
        """The Comm a sender's requests come on, and the sender's rank in it (to probe it)."""
        lines = self.lines() if self.ctx.lines is None else [self.line_of(sender)]
        comm = next((line.comm for line in lines if line.peer == sender), lines[0].comm)
        return comm, (0 if self.ctx.lines is not None else sender)

    def answer(self, request: Request) -> None:
        raise NotImplementedError

    def finished(self, request: Request) -> None:
        """A sender said DONE (its request's data may tell more)."""

    def farewell(self, sender: int) -> None:
        """What a live sender that said DONE gets at the end (the final state)."""
        raise NotImplementedError

    def last_step(self, sender: int) -> int:
        """The steps of `sender`'s applied at the server (for the record of its death)."""
        return 0

    def lost(self, peer: int, step: int | None, how: str) -> None:
        with self.failure_lock:
            super().lost(peer, step, how)

    def taken_back(self, sender: int) -> None:
        """A sender taken for dead spoke again: it was only slow."""
        with self.failure_lock:
            if sender in self.dead:
                self.dead.discard(sender)
                self.failures = [f for f in self.failures if f["worker"] != sender]

    def save_snapshots(self, done: set[int]) -> None:
        """Write every snapshot that no live sender still holds back (one done or dead sends no more markers)."""
        with self.failure_lock:
            indices = self._sender_indices()
            gone = {indices[s] for s in set(self.dead) | done if s in indices}
        self.snapshots.save_complete(gone, self._save)

    def _save(self, step: int, state: Any) -> None:
        if self.ctx.save_checkpoint is not None:
            self.ctx.save_checkpoint({"step": step, self.state_key: state.state_dict()})

    def load_server_state(self, state: dict[str, Any]) -> None:
        """A resumed server's own snapshot (its checkpoint file)."""
        self.live.load_state_dict(state[self.state_key])
        self.snapshots = Snapshots(self.live, len(self.senders()), committed=int(state["step"]))

    def summary(self) -> dict[str, Any]:
        return {}


def header(*values: float, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)
