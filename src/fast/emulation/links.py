"""The links of an emulated deployment: latency, bandwidth, jitter and loss per pair of ranks, and outages.

A `LinkTable` answers, for a message from one global rank to another, which `EmulatedLink` it travels on
and whether that link is down at a given time. It knows nothing about configs: `fast.emulation.deployment` builds
it from the `[network]` and `[faults]` tables. A sharded run's processes see its table through `ReplicaLinks`, which
names replicas where the table names workers.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class EmulatedLink:
    """One direction of a link: `latency_s` per message, `bandwidth_Bps` bytes per second, `jitter_s` (each
    message's latency varies uniformly within ± jitter) and `loss` (the probability that a droppable
    message is lost)."""

    latency_s: float
    bandwidth_Bps: float
    jitter_s: float = 0.0
    loss: float = 0.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.latency_s) and self.latency_s >= 0):
            raise ValueError(f"link latency must be >= 0 s, got {self.latency_s}")
        if not self.bandwidth_Bps > 0:  # math.inf: an ideal link (simulations without [network])
            raise ValueError(f"link bandwidth must be > 0 B/s, got {self.bandwidth_Bps}")
        if not (math.isfinite(self.jitter_s) and self.jitter_s >= 0):
            raise ValueError(f"link jitter must be >= 0 s, got {self.jitter_s}")
        if not 0 <= self.loss < 1:
            raise ValueError(f"link loss must be a probability in [0, 1), got {self.loss}")

    def transfer_s(self, nbytes: int) -> float:
        """Seconds the sender's NIC is busy putting `nbytes` on this link."""
        return nbytes / self.bandwidth_Bps

    def describe(self) -> dict[str, float]:
        return {
            "latency_s": self.latency_s,
            "bandwidth_Bps": self.bandwidth_Bps,
            "jitter_s": self.jitter_s,
            "loss": self.loss,
        }


@dataclass(frozen=True)
class Outage:
    """The link between ranks `a` and `b` is down (both directions) from `start_s` to `end_s`, in seconds
    from the common start of training."""

    a: int
    b: int
    start_s: float
    end_s: float

    def covers(self, src: int, dst: int, t: float) -> bool:
        return {src, dst} == {self.a, self.b} and self.start_s <= t < self.end_s


@dataclass
class LinkTable:
    """Every directed link among `size` ranks: `default` unless a (src, dst) entry in `links` overrides it."""

    size: int
    default: EmulatedLink
    links: dict[tuple[int, int], EmulatedLink] = field(default_factory=dict)
    outages: list[Outage] = field(default_factory=list)

    def link(self, src: int, dst: int) -> EmulatedLink:
        return self.links.get((src, dst), self.default)

    def among(self, ranks: Iterable[int]) -> list[EmulatedLink]:
        """The distinct links between any two of `ranks` (each ordered pair's): the table's own entries between two of
        them, and `default` where some pair has none. Linear in the ranks and the entries, where every pair would be
        quadratic (a million pairs at 1,024 workers)."""
        members = set(ranks)
        own = [link for (a, b), link in self.links.items() if a != b and a in members and b in members]
        pairs = len(members) * (len(members) - 1)
        return list(dict.fromkeys([*own, *([self.default] if len(own) < pairs else [])]))

    def up_again_at(self, src: int, dst: int, t: float) -> float:
        """`t` if the link is up at time `t`, else the first time from which it is up again."""
        moved = True
        while moved:
            moved = False
            for outage in self.outages:
                if outage.covers(src, dst, t):
                    t, moved = outage.end_s, True
        return t

    def describe(self) -> dict[str, object]:
        """The resolved links, for summary.json: the default, each link that differs, and the outages."""
        return {
            "ranks": self.size,
            "default": self.default.describe(),
            "links": [
                {"src": src, "dst": dst, **link.describe()}
                for (src, dst), link in sorted(self.links.items())
                if link != self.default
            ],
            "outages": [{"a": o.a, "b": o.b, "start_s": o.start_s, "end_s": o.end_s} for o in self.outages],
        }


def named_as(process: int, shards: int, worker_processes: int) -> int:
    """The rank a [network], [compute] or [faults] table knows process `process` by, of `worker_processes` worker
    processes, `shards` to a replica: its replica, or a server's rank, after the replicas' (itself when unsharded)."""
    if process < worker_processes:
        return process // shards
    return process - worker_processes + worker_processes // shards


IDEAL = EmulatedLink(latency_s=0.0, bandwidth_Bps=math.inf)  # no time at all: traffic inside a sharded replica


@dataclass(frozen=True)
class ReplicaLinks:
    """The links among the processes of a sharded run (`run.shards` = K > 1), from `table`, whose ranks are its
    workers (replicas) and then its servers. Of the `worker_processes` (W×K) ranks, process p is shard p % K of
    replica p // K; a server's rank comes after them (process W·K + j is the table's W + j).

    - Inside a replica: `IDEAL`, no emulated time. (FSDP2's all-gathers and reduce-scatters run on the replica's own
      group, which no emulated link carries; this is what the rest of a replica's traffic on emulated groups takes.)
    - Between two replicas: their link in `table`, shared by the K shard pairs that use it as K lanes: each lane has
      the link's latency, jitter and loss and 1/K of its bandwidth. The shards of a replica exchange their 1/K of the
      model at once, so a replica's exchange over a link takes what a whole worker's takes over the same link.
    - Outages: the table's, between replicas.
    """

    table: LinkTable
    shards: int
    worker_processes: int

    def named(self, process: int) -> int:
        """The rank `table` knows process `process` by: its replica, or a server's rank."""
        return named_as(process, self.shards, self.worker_processes)

    def link(self, src: int, dst: int) -> EmulatedLink:
        a, b = self.named(src), self.named(dst)
        if a == b:
            return IDEAL
        link = self.table.link(a, b)
        lanes = self.shards if max(src, dst) < self.worker_processes else 1  # (a server's lines are its own)
        return replace(link, bandwidth_Bps=link.bandwidth_Bps / lanes)

    def up_again_at(self, src: int, dst: int, t: float) -> float:
        a, b = self.named(src), self.named(dst)
        return t if a == b else self.table.up_again_at(a, b, t)
