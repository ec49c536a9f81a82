"""The simulated engine's wire: every simulated process's mailboxes and the meetings of its collectives.

A simulation (`fast.comm.scheduler.Simulation`) of a run holds one `Wire`: the mailboxes (group, receiver, tag) ->
messages not yet taken, each deliverable at the time the emulated link model gives it (`Network`), the meetings
of the groups' collectives, which processes are gone, and what the links cost. `fast.emulation.simulated_comm`
is the `Comm` every simulated process moves its tensors through over it.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import math
import resource
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch

from fast.comm.scheduler import Simulation, current_task, simulation
from fast.emulation.links import EmulatedLink, LinkTable
from fast.emulation.network import Network


@dataclass
class Message:
    src: int
    tag: int
    payload: torch.Tensor | None  # None: lost on its link
    length: int
    deliver_at: float
    order: int
    measurement: bool


@dataclass
class Meeting:
    """One collective of a group: what each member brought, and, once all have, the result and its time."""

    members: list[int]
    brought: dict[int, Any]
    result: Any = None
    done_at: float | None = None
    waiting: list[Any] | None = None
    member_set: set[int] = field(init=False)  # (who is gone among them: a look at the few gone, not at every member)

    def __post_init__(self) -> None:
        self.member_set = set(self.members)


class _Box:
    """A receiver's messages on one tag: each sender's in the order they were sent (a link keeps its messages in
    order), and a heap of each sender's first one by (arrival, order), so that a receive from anyone finds the
    earliest in a look, where a look at every sender's would cost a server of a thousand senders a thousand."""

    def __init__(self) -> None:
        self.queues: dict[int, collections.deque[Message]] = {}
        self.heads: list[tuple[float, int, int]] = []  # (deliver_at, order, src); an entry whose message is gone is
        # dropped when it comes to the top

    def put(self, message: Message) -> None:
        queue = self.queues.setdefault(message.src, collections.deque())
        queue.append(message)
        if len(queue) == 1:
            heapq.heappush(self.heads, (message.deliver_at, message.order, message.src))

    def first(self, src: int | None) -> Message | None:
        """`src`'s first message, or (None) the earliest of every sender's first."""
        if src is not None:
            queue = self.queues.get(src)
            return queue[0] if queue else None
        while self.heads:
            _, order, sender = self.heads[0]
            queue = self.queues.get(sender)
            if queue and queue[0].order == order:
                return queue[0]
            heapq.heappop(self.heads)
        return None

    def take(self, message: Message) -> None:
        """Take `message`, its sender's first."""
        queue = self.queues[message.src]
        queue.popleft()
        if queue:
            heapq.heappush(self.heads, (queue[0].deliver_at, queue[0].order, message.src))
        else:
            del self.queues[message.src]


class Wire:
    """The run's mailboxes, (group, receiver, tag) -> messages not yet taken (`_Box`), and the tasks waiting on
    them, by (group, receiver, sender), None for anyone: a message wakes only those that may take it."""

    def __init__(self, sim: Simulation, world_size: int, links: LinkTable, seed: int) -> None:
        self.sim, self.world_size, self.links, self.seed = sim, world_size, links, seed
        self.boxes: dict[tuple[int, int, int], _Box] = defaultdict(_Box)  # (group, receiver, tag) -> its messages
        self.waiters: dict[tuple[int, int, int | None], list[Any]] = defaultdict(list)
        self.gone: dict[int, str] = {}
        self.groups: dict[tuple[Any, ...], int] = {}
        self.meetings: dict[tuple[int, int], Meeting] = {}
        self.busy_until: dict[int, float] = defaultdict(float)  # a group's collectives run one after another
        self._links_of: dict[tuple[int, ...], list[EmulatedLink]] = {}  # a group's distinct links (tree_round_s)
        self.networks = [Network(links, rank, seed) for rank in range(world_size)]
        for network in self.networks:
            network.start_clock(0.0)  # virtual time; the machines move it to the start of training
        self._order = itertools.count()
        self.host_started, self.cpu_started = time.perf_counter(), time.process_time()
        self.workers = world_size  # the workers the run starts with (servers apart): set by the launcher
        self._began: set[int] = set()  # the founding workers that have begun a step
        self.setup_host_s: float | None = None  # until every founding worker had begun its first step
        self.training_host_s: float | None = None  # until worker 0 was done training
        self.setup_cpu_s: float | None = None  # the process's CPU seconds, likewise (a loaded host's wall time is not
        self.training_cpu_s: float | None = None  # the run's own)
        self.host_step_s: list[float] = []  # run.step_time = "auto": the first steps, timed on the host
        self.host_request_s: list[float] = []  # run.server_time = "auto": the servers' first requests, likewise

    def add(self, rank: int) -> None:
        """A process that joins the run (live membership) gets its place on the wire."""
        while len(self.networks) <= rank:
            network = Network(self.links, len(self.networks), self.seed)
            network.start_clock(0.0)
            self.networks.append(network)
        self.world_size = len(self.networks)

    def step_begins(self, rank: int) -> None:
        """Worker `rank` begins a step: the set-up is over once every founding worker has."""
        if self.setup_host_s is None and rank < self.workers:
            self._began.add(rank)
            if len(self._began) == self.workers:
                self.setup_host_s = round(time.perf_counter() - self.host_started, 3)
                self.setup_cpu_s = round(time.process_time() - self.cpu_started, 3)

    def group(self, key: tuple[Any, ...]) -> int:
        """The number of the group every member names by `key` (members create their groups in the same order)."""
        return self.groups.setdefault(key, len(self.groups))

    def post(self, group: int, dst: int, message: Message) -> None:
        message.order = next(self._order)
        self.boxes[(group, dst, message.tag)].put(message)
        for waiting_on in (message.src, None):
            for task in self.waiters.get((group, dst, waiting_on), ()):
                self.sim.wake(task, message.deliver_at)

    def take(self, group: int, dst: int, src: int | None, tag: int) -> Message | None:
        """The message on `tag` from `src` (or anyone) that is in, the earliest first; None if none is."""
        box = self.boxes.get((group, dst, tag))
        message = box.first(src) if box is not None else None
        if message is None or message.deliver_at > self.sim.now:
            return None
        box.take(message)  # type: ignore[union-attr]
        return message

    def next_at(self, group: int, dst: int, src: int | None, tag: int) -> float | None:
        box = self.boxes.get((group, dst, tag))
        message = box.first(src) if box is not None else None
        return message.deliver_at if message is not None else None

    def leave(self, rank: int, why: str) -> None:
        """`rank` is gone: whoever waits on a message from it, or in a collective with it, learns so now; the
        messages on their way to it are dropped (a joiner's state, say: they would stay to the end of the run)."""
        self.gone[rank] = why
        for box in [box for box in self.boxes if box[1] == rank]:
            del self.boxes[box]
        for tasks in self.waiters.values():
            for task in tasks:
                self.sim.wake(task)
        for meeting in self.meetings.values():
            for task in meeting.waiting or []:
                self.sim.wake(task)

    def hop_s(self, ranks: list[int], nbytes: float) -> float:
        """One round of a ring over `ranks` carrying `nbytes` per message: its slowest hop."""
        n = len(ranks)
        return max(self._message_s(ranks[i], ranks[(i + 1) % n], nbytes) for i in range(n))

    def tree_round_s(self, ranks: list[int], nbytes: float) -> float:
        """One round of a tree over `ranks`: the slowest link of the group."""
        if len(ranks) < 2:
            return 0.0
        return max(link.latency_s + link.transfer_s(int(nbytes)) for link in self._group_links(ranks))

    def _group_links(self, ranks: list[int]) -> list[EmulatedLink]:
        """The distinct links among `ranks` (LinkTable.among), kept by group."""
        key = tuple(ranks)
        found = self._links_of.get(key)
        if found is None:
            found = self._links_of[key] = self.links.among(ranks)
        return found

    def _message_s(self, src: int, dst: int, nbytes: float) -> float:
        link = self.links.link(src, dst)
        return link.latency_s + link.transfer_s(int(nbytes))


def ideal_links(size: int) -> LinkTable:
    """Links that take no time: a simulation without [network] charges compute only."""
    return LinkTable(size=size, default=EmulatedLink(latency_s=0.0, bandwidth_Bps=math.inf))


def place() -> tuple[int, int] | None:
    """(rank, world size) of the calling simulated process, or None in a real one."""
    task, sim = current_task(), simulation()
    if task is None or sim is None or task.rank is None:
        return None
    return task.rank, sim.shared["wire"].world_size


def wire() -> Wire:
    """The wire of the calling task's simulation."""
    sim = simulation()
    assert sim is not None
    return sim.shared["wire"]


def training_ends() -> None:
    """Worker 0 is done training (what follows is the end: final model, evaluations, outputs)."""
    the_wire = wire()
    if the_wire.training_host_s is None:
        the_wire.training_host_s = round(time.perf_counter() - the_wire.host_started, 3)
        the_wire.training_cpu_s = round(time.process_time() - the_wire.cpu_started, 3)


def host_figures() -> dict[str, Any]:
    """What the simulation cost the host so far: its seconds (all, until every worker had begun its first step, and
    until worker 0 was done training), the process's CPU seconds likewise (all its threads', torch's included), its
    peak memory, and the compute time a step was charged (as `run.step_time` would fix it)."""
    the_wire = wire()
    timed = the_wire.host_step_s
    return {
        "engine": "simulated",
        "host_s": round(time.perf_counter() - the_wire.host_started, 3),
        "setup_host_s": the_wire.setup_host_s,
        "training_host_s": the_wire.training_host_s,
        "cpu_s": round(time.process_time() - the_wire.cpu_started, 3),
        "setup_cpu_s": the_wire.setup_cpu_s,
        "training_cpu_s": the_wire.training_cpu_s,
        "peak_memory_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "step_time_s": statistics.median(timed) if timed else None,
    }


def start(sim: Simulation, world_size: int, links: LinkTable, seed: int) -> Wire:
    """Lay the wire of a simulated run of `world_size` processes."""
    the_wire = Wire(sim, world_size, links, seed)
    sim.shared["wire"] = the_wire
    return the_wire
