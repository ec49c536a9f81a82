"""Where each process of a sharded run stands: W replicas of K shards, and the two groups every process belongs to.

With `run.shards = K` a run has W×K processes; the process at position `i` of the workers' group is shard `i % K` of
replica `i // K`. The K shards of a replica are consecutive ranks, which launchers place on one machine: they talk at
every block's all-gather and reduce-scatter. Two partitions of the ranks follow (HSDP's two mesh dimensions):

- the shard groups ("shard"), one per replica, its K ranks: FSDP2's mesh, over which the replica's parameters,
  gradients and optimizer state are sharded;
- the replica groups ("replicate"), one per shard index k, the W ranks that hold shard k: the group FAST's strategies
  run on, shard k of every replica with shard k of the others.

A strategy may make groups of its own from its replica group (a background channel, sync's hierarchy); a process
group is made by every process of the run together, in the same order, so the replica group's `Comm` makes each of
them for every shard index at once, shard k of every replica calling with its own ranks (`ReplicateComm`): the shards
of a replica run the same code at the same step, so their calls line up.

Traffic inside a replica is FSDP2's own and is not FAST's to count: the shard group's `Comm` has a byte counter of its
own, and what a run reports is what crosses between replicas, as it is for unsharded workers. Under emulated links
([network], fast.emulation) the same line holds: the replica groups' traffic crosses them (`EmulatedReplicateComm`, on
the links between replicas: fast.emulation.links.ReplicaLinks), the shard group's is native, at full speed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from fast.comm import ByteCounter, Comm
from fast.emulation.network import EmulatedComm
from fast.errors import ConfigError


@dataclass(frozen=True)
class Layout:
    """W replicas (`replicas`) of K shards (`shards`) over the ranks `ranks` (the workers' group, in order)."""

    ranks: tuple[int, ...]
    shards: int

    @classmethod
    def of(cls, ranks: list[int] | tuple[int, ...], shards: int) -> Layout:
        """The layout of `shards` per replica over `ranks`; ConfigError when they do not divide into replicas."""
        if shards < 1:
            raise ConfigError(f"run.shards = {shards}: a replica needs at least one process; set run.shards >= 1")
        if len(ranks) % shards:
            raise ConfigError(f"{len(ranks)} processes do not make replicas of run.shards = {shards} each: start "
                              f"workers × shards processes (e.g. {shards * max(1, len(ranks) // shards)})")  # fmt: skip
        return cls(tuple(ranks), shards)

    @property
    def replicas(self) -> int:
        return len(self.ranks) // self.shards

    def replica_of(self, rank: int) -> int:
        return self.ranks.index(rank) // self.shards

    def shard_of(self, rank: int) -> int:
        return self.ranks.index(rank) % self.shards

    def shard_groups(self) -> list[list[int]]:
        """One per replica: its K ranks (FSDP2's mesh)."""
        k = self.shards
        return [list(self.ranks[r * k : (r + 1) * k]) for r in range(self.replicas)]

    def replica_groups(self) -> list[list[int]]:
        """One per shard index k: the ranks of shard k in every replica (the strategies' group)."""
        return [list(self.ranks[k :: self.shards]) for k in range(self.shards)]

    def counterparts(self, ranks: list[int]) -> list[list[int]]:
        """For ranks of one shard index (some of a replica group's), the same replicas' ranks at every shard index."""
        return [[self.ranks[self.replica_of(r) * self.shards + k] for r in ranks] for k in range(self.shards)]


class ReplicateComm(Comm):
    """A replica group's `Comm`: a group made from it (`subgroups`, `separate_group`) is made for every shard index
    at once (see the module), and is of this kind too."""

    def __init__(self, layout: Layout, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.layout = layout

    @staticmethod
    def wrapping(comm: Comm, layout: Layout) -> ReplicateComm:
        """`comm`'s group, as a replica group's Comm (an emulated one's on the same emulated network)."""
        emulated = {"network": comm.network} if isinstance(comm, EmulatedComm) else {}
        kind = EmulatedReplicateComm if emulated else ReplicateComm
        made = kind(layout, group=comm.group, deadline_s=comm.deadline_s, device=comm.device, counter=comm.counter,
                    ranks=comm.ranks, rank=comm.rank, world_size=comm.world_size, piece_bytes=comm.piece_bytes,
                    **emulated)  # fmt: skip
        made.interrupted, made.connect_s, made.busy, made.key = comm.interrupted, comm.connect_s, comm.busy, comm.key
        return made

    def _connect_group(self, ranks: list[int], backend: str, connect_s: float | None) -> Any:
        mine = None
        for theirs in self.layout.counterparts(ranks):  # (every process makes every shard index's, in order)
            group = super()._connect_group(theirs, backend, connect_s)
            mine = group if theirs == list(ranks) else mine
        return mine

    def _derived(self, *, group: Any, ranks: list[int], device: torch.device | str) -> Comm:
        return self.wrapping(super()._derived(group=group, ranks=ranks, device=device), self.layout)


class EmulatedReplicateComm(ReplicateComm, EmulatedComm):
    """A replica group's `Comm` whose traffic crosses the emulated links between replicas (fast.emulation.network)."""


def native(comm: Comm) -> Comm:
    """`comm`'s group as a plain `Comm` (with a byte counter of its own): a replica's traffic inside it crosses no
    emulated link."""
    plain = Comm(group=comm.group, deadline_s=comm.deadline_s, device=comm.device, counter=ByteCounter(),
                 ranks=comm.ranks, rank=comm.rank, world_size=comm.world_size,
                 piece_bytes=comm.piece_bytes)  # fmt: skip
    plain.interrupted, plain.connect_s, plain.busy, plain.key = comm.interrupted, comm.connect_s, comm.busy, comm.key
    return plain


@dataclass
class Groups:
    """This process's two groups: `replicate` (shard k of every replica: the strategies' `Comm`), `shard` (the K
    shards of its replica, with a byte counter of its own) and `mesh`, FSDP2's device mesh over `shard`."""

    layout: Layout
    replicate: Comm
    shard: Comm
    mesh: DeviceMesh

    @property
    def replica(self) -> int:
        return self.layout.replica_of(self.shard.rank)

    @property
    def shard_index(self) -> int:
        return self.layout.shard_of(self.shard.rank)


def form_groups(comm: Comm, shards: int) -> Groups:
    """This process's groups in a run of `shards` per replica over `comm` (the workers' group). Collective: every
    member of `comm` calls it, in the same order relative to its other group-making calls."""
    layout = Layout.of(comm.ranks, shards)
    shard = comm.subgroups(layout.shard_groups())
    replicas = comm.subgroups(layout.replica_groups())
    assert shard is not None and replicas is not None  # every rank of `comm` is in one group of each partition
    replicate = ReplicateComm.wrapping(replicas, layout)
    shard = native(shard)  # FSDP2's traffic inside the replica is not between replicas, nor on their links
    mesh = DeviceMesh.from_group(shard.group, comm.device.type, mesh_dim_names=("shard",))
    return Groups(layout, replicate, shard, mesh)
