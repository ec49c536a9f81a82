"""Asynchronous members of a live run: `run.membership = "live"` with a strategy whose workers never step together and
`joins_alone` (async-ps); a part of fast.runtime.job.Job.

Such workers take no membership rounds. Each holds a line of its own to the servers (fast.comm.lines), formed
when it starts under a store prefix of its member id; the servers stay outside the membership, are launched with
the run, and their death ends it. A worker joins by forming its line and pulling the weights from the servers,
the live state, so no other worker waits for it; a founder's first pull is the run's start. Batches come from the
run's work queue, an atomic counter in the store through each epoch's order: no sample is taken twice, none is
lost but the batch a dying worker held, and uneven workers balance themselves. A worker that leaves or dies fails
its own line only. The members meet once, at the end, through the store: the lowest live member (worker 0 while it
lives: `Job.is_main`) ends the run (run.max_time, the data, `fast stop`), the others stop before their next batch,
hand their last gradients in, take the final weights, and leave their figures in the store for its summary. Any
worker may die; only the servers' start is worker 0's (the layout and the first weights, on its line).
"""

from __future__ import annotations

import json
import math
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from fast.comm import ByteCounter, Comm, timing
from fast.comm.lines import form_line
from fast.runtime.ending import write_outputs
from fast.runtime.live import fingerprint
from fast.runtime.membership import (
    FORM_S,
    HEARTBEAT_S,
    POLL_S,
    PREFIX,
    SILENT_S,
    SLOT_S,
    Access,
    Member,
    RunEnded,
    beat_time,
    connect,
    read_key,
)

QUEUE = "queue"  # the work queue: batches taken so far, over every epoch


def _line_store(access: Access, member: int, connect_s: float) -> Any:
    """The store `member`'s line forms on: a connection of its own (a store's client is not shared between
    threads, and gloo may use it after the line has formed), whose waits for the other side give up after
    `connect_s`."""
    return connect(access, connect_s).for_group(PREFIX + f"line/{member}/")


class ServerLines:
    """A server's lines to the workers, formed in the order the workers announce them (every server in the same
    order, so that a line waits for no other), in a thread of its own while the server serves the others."""

    def __init__(self, access: Access, server: int, servers: int, device: torch.device, deadline_s: float) -> None:
        self.access, self.store = access, connect(access, deadline_s)
        self.server, self.servers, self.device, self.deadline_s = server, servers, device, deadline_s
        self.counter = ByteCounter()
        self.lines: dict[int, Comm] = {}
        self.given_up: list[int] = []  # announced, but gone before their line formed
        self._closed = False
        self._follower: Callable[[int, Comm], None] | None = None
        self._changed = threading.Condition()
        timing.Thread(self._watch, "fast-lines").start()  # (its readers' threads see this process's timeline)

    def _watch(self) -> None:
        formed, unwritten_since = 0, None
        while True:
            try:
                announced = int(self.store.add(PREFIX + "lines", 0))
                if formed < announced:
                    said = read_key(self.store, f"announced/{formed + 1}")
                    if said is None:  # counted, not written yet; skipped if its worker died between the two
                        unwritten_since = unwritten_since or time.monotonic()
                        if time.monotonic() - unwritten_since < SLOT_S:
                            time.sleep(POLL_S)
                            continue
                    formed, unwritten_since = formed + 1, None
                    if said is not None and said.isdigit() and len(said) < 10:
                        self._form(int(said))
                elif read_key(self.store, "ending") is not None or read_key(self.store, "ended") is not None:
                    with self._changed:
                        self._closed = True
                        self._changed.notify_all()
                    return
                else:
                    time.sleep(POLL_S * 5)
            except RuntimeError:  # the store is gone with the run
                with self._changed:
                    self._closed = True
                    self._changed.notify_all()
                return

    def _form(self, member: int) -> None:
        try:
            comm = form_line(_line_store(self.access, member, FORM_S), f"line{member}", 1 + self.server,
                             1 + self.servers, self.device, FORM_S, self.counter)  # fmt: skip
        except RuntimeError:  # the worker went before its line formed
            with self._changed:
                self.given_up.append(member)
                self._changed.notify_all()
            return
        with self._changed:
            self.lines[member] = comm
            follower = self._follower
            self._changed.notify_all()
        if follower is not None:
            follower(member, comm)

    def line(self, member: int) -> Comm:
        """`member`'s line, once formed (worker 0's comes first: the layout and the first weights come on it)."""
        with self._changed:
            while member not in self.lines:
                if member in self.given_up or self._closed:
                    raise RunEnded(f"worker {member} never formed its line to the servers")
                self._changed.wait(POLL_S)
            return self.lines[member]

    def follow(self, add: Callable[[int, Comm], None]) -> list[int]:
        """From now on, each new line goes to `add(member, comm)`; returns the members whose lines formed so far."""
        with self._changed:
            self._follower = add
            return list(self.lines)

    def closed(self) -> bool:
        """Whether no more lines will come: the run is ending, and every line announced has formed or failed."""
        with self._changed:
            return self._closed


class Detached:
    """The asynchronous members' part of a Job (only in a live run whose strategy `joins_alone`)."""

    def _start_detached(self) -> None:
        """A server: its lines, worker 0's first. A worker: its member (a joiner waits to be in a generation), then
        its line to the servers."""
        access, deadline_s = Access.from_environment(), self.config.run.deadline_s
        servers = self.world_size - self.workers
        self.membership: list[dict[str, Any]] = []
        self.data_epoch, self.data_cursor, self._claimed = 0, 0, None
        if self.is_server:
            self.server_lines = ServerLines(access, self.rank - self.workers, servers, self.device, deadline_s)
            self.world = self.comm = self.server_lines.line(0)
            return
        self.member = Member(access, self.rank, deadline_s)
        self.member.report(self._reported_figures)
        self.joining = os.environ.get("FAST_JOINING") == "1"
        self.generation = self.member.generation(0)
        if self.joining:
            self.member.ready()
            self.generation = self.member.wait_for(-1, including=self.rank)
        store = connect(access, deadline_s)
        if read_key(store, "ending") is not None:
            raise RunEnded("the run ended before this worker could take part")
        number = int(store.add(PREFIX + "lines", 1))
        store.set(PREFIX + f"announced/{number}", str(self.rank))
        try:
            self.world = self.comm = form_line(_line_store(access, self.rank, deadline_s), f"line{self.rank}", 0,
                                               1 + servers, self.device, deadline_s, ByteCounter())  # fmt: skip
        except RuntimeError as e:
            raise RunEnded(f"the servers did not form this worker's line: {str(e).splitlines()[0]}") from None
        self.run_store = store  # the work queue, the members' figures at the end
        signal.signal(signal.SIGTERM, self._leave_on_sigterm)

    def _catch_up(self) -> None:
        """The weights from the servers: a founder's start (not metered, as a start's broadcast), a joiner's
        catch-up (metered: the traffic churn costs)."""
        started, before = timing.now(), self.world.counter.bytes_received
        position = int(self.run_store.add(PREFIX + QUEUE, 0))
        if self.joining:
            # the run's time goes on from its start, not from this joiner's (churn that replaces every founder does
            # not push run.max_time back)
            now = time.time()
            self._run_time_offset = max(0.0, now - beat_time(read_key(self.run_store, "started"), now))
            self.strategy.catch_up()
            self.records.add({"worker": self.rank, "kind": "healed", "step": self.step, "from": "servers",
                              "generation": self.generation.number, "batch": position, "time_s": 0.0,
                              "catch_up_bytes": self.world.counter.bytes_received - before,
                              "catch_up_s": round(timing.now() - started, 4),
                              "fingerprint": fingerprint({"model": self.model.state_dict()})})  # fmt: skip
            return
        with self.world.unmetered():
            self.strategy.catch_up()
        if self.is_main:
            self.member.started()

    # -- the work queue ----------------------------------------------------------------------------------------
    def _take_batch(self, per_epoch: int) -> tuple[int, int] | None:
        """The next batch of the run's work queue as (epoch, index in it); None once this worker stops (the lowest
        live member ended the run, `fast stop`, or the planned epochs are taken)."""
        if self.member.ending_seen() or self.member.stopping():
            self._stopping = True
        if self.stopped:
            return None
        if self._claimed is None:
            self._claimed = int(self.run_store.add(PREFIX + QUEUE, 1)) - 1
        epochs = self.planned_epochs if self.planned_epochs is not None else self.config.run.epochs
        batches = epochs * per_epoch
        if self.config.run.max_samples is not None:
            batches = min(batches, math.ceil(self.config.run.max_samples / self.batch_size))
        if self._claimed >= batches:
            self._stopping = True
            return None
        return divmod(self._claimed, per_epoch)

    def _batch_taken(self) -> None:
        self._claimed = None

    # -- the end ---------------------------------------------------------------------------------------------------
    def _gather_through_store(self, final: Callable[[], Any] | None = None) -> dict[str, Any] | None:
        """Each worker leaves its figures in the store and waits until the outputs are written. The lowest live
        member (worker 0, unless it is gone: then the next) evaluates with `final`, takes every member's figures
        that is still in the run (waiting while its heartbeat goes on), the departed ones' records and the servers'
        figures, and writes the outputs; should it go before it has, the next lowest does."""
        if self.is_server:
            own = self._own_figures()
            self.server_lines.store.set(PREFIX + f"server-end/{self.rank}", json.dumps(own))
            return None
        if not self.is_main:
            self.run_store.set(PREFIX + f"end/{self.rank}", json.dumps(self._own_figures()))
            while not self.is_main:  # (until the outputs are written, or the member that writes them is gone)
                if read_key(self.run_store, "written") is not None:
                    return None
                time.sleep(HEARTBEAT_S)
        model = final() if final is not None else None
        own = self._own_figures()
        everyone = [own, *self._figures_of_members(), *self._figures_of_servers()]
        self.workers = len([p for p in everyone if not p["server"]])
        self.membership = self._membership_record(everyone)
        departed = self._departed_records(everyone)
        self._add_evaluations([r for r in departed if r.get("kind") == "eval"])
        summary = write_outputs(self.run_dir, [*everyone, {"records": departed}], model, self._summarize(everyone))
        self.member.wrote()
        return summary

    def _lowest_live(self) -> int:
        """The member that does worker 0's duties (`Job.is_main`): the lowest of the newest generation not gone.
        (While the run ends a generation only loses members that die: one that dies is seen gone by its silence
        meanwhile.)"""
        for member in self.member.generation(self.member.newest()).members:
            if member == self.rank or not self._gone(member):
                return member
        return self.rank

    def _gone(self, member: int) -> bool:
        """Whether `member` has left, or its heartbeat is silent (for SILENT_S, or never began)."""
        beat = read_key(self.run_store, f"heartbeat/{member}")
        left = read_key(self.run_store, f"leave/{member}") is not None
        return left or beat is None or time.time() - beat_time(beat, time.time()) > SILENT_S

    def _close_lines(self) -> None:
        lines = self.server_lines.lines.values() if self.is_server else [self.world]
        for line in lines:
            line.close()

    def _figures_of_members(self) -> list[dict[str, Any]]:
        store, found = self.run_store, []
        newest = self.member.generation(self.member.newest())
        for member in newest.members:
            if member == self.rank:
                continue
            while (figures := read_key(store, f"end/{member}")) is None:
                if self._gone(member):
                    break  # its figures with it
                time.sleep(POLL_S)
            if figures is not None:
                found.append(json.loads(figures))
        return found

    def _figures_of_servers(self) -> list[dict[str, Any]]:
        patience_s = 3 * self.config.run.deadline_s
        found, deadline = [], time.monotonic() + patience_s
        for rank in range(self.config.run.workers, self.world_size):
            while (figures := read_key(self.run_store, f"server-end/{rank}")) is None:
                if time.monotonic() > deadline:
                    raise RunEnded(f"server {rank} did not hand in its figures within {patience_s:g}s")
                time.sleep(POLL_S)
            found.append(json.loads(figures))
        return found

    def _membership_record(self, everyone: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Each generation the coordinator published: who was in, who left and joined, each joiner's catch-up from
        the servers (its bytes and seconds) and the batch of the work queue it started at."""
        healed = {r["worker"]: r for p in everyone for r in p["records"] if r.get("kind") == "healed"}
        start = self.member.generation(0).unix_time
        events = []
        for number in range(self.member.newest() + 1):
            generation = self.member.generation(number)
            catch_ups = [healed[m] for m in generation.joined if m in healed]
            events.append({
                "generation": number,
                "step": None,
                "batch": min((r["batch"] for r in catch_ups), default=None),
                "unix_time": generation.unix_time,
                "time_s": round(generation.unix_time - start, 3),
                "members": generation.members,
                "joined": generation.joined,
                "left": generation.left,
                "healed": [r["worker"] for r in catch_ups],
                "healed_from": ["servers"] * len(catch_ups),
                "catch_up_bytes": sum(r["catch_up_bytes"] for r in catch_ups),
                "catch_up_s": round(sum(r["catch_up_s"] for r in catch_ups), 4),
            })  # fmt: skip
        return events
