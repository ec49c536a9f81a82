"""A worker that is a sharded replica (`run.shards = K` > 1, fast.shards): the job's part for it (a part of
fast.runtime.job.Job).

The run's W×K worker processes are W replicas of K consecutive ranks. At init each forms its two groups: its
replica's K processes (FSDP2's mesh) and shard k of every replica, which is its strategy's `comm`. `prepare` shards
the user's model over its replica (fast.shards.ShardedReplica) and sets the strategy up on the local shards
(`replica.view`); the step driver bridges their gradients (fast.runtime.steps). Everything else is the job's as it is,
but for:

- data: cut by replica, each shard taking its slice of its replica's batch (fast.runtime.loader);
- evaluation: the sharded model, every shard of the first replica together (a live run's lowest live one), holding
  the reported weights (the strategy's replica, or its average or θ, copied into the local shards for the evaluation
  and put back after); the metrics go to every process. A whole-replica divergence (`replica.divergence`);
- model.pt: the reported model gathered whole by replica 0's shards, on rank 0, loading into the user's class (its
  buffers, BatchNorm's statistics, are shard 0's: each shard keeps its own, as DDP's processes do without a buffer
  broadcast);
- checkpoints: a folder per replica and step through DCP (fast.shards.checkpoint): the model, the optimizer and the
  strategy's vectors reshard, so a checkpoint resumes bit for bit at the same K, and at another (K = 1 included).

Live membership (`run.membership = "live"`, fast.runtime.live): the members are the replicas' processes, K
consecutive ids to a replica, which joins and leaves whole (fast.runtime.membership; its launcher stops a replica's
other processes when one dies). Each generation re-forms the world, which aborts every process group of the process,
the replica's own included; the replica's K processes are the same ones at the same shard indices, so its groups are
made again over the new world (`_reform_shard_groups`) and the sharded model is moved onto the new shard group as it
is (fast.shards.rebind: FSDP2's mesh and its mesh infos point at the new group; no local value, and no optimizer
state, moves). A joiner heals shard for shard, over the replica groups: shard k of the joiner gets shard k's local
state from shard k of a live replica. The first replica of a generation does worker 0's duties (its shard 0 is the
generation's first member, `Job.is_main`; its other shards take part in the evaluation and in gathering model.pt).
After a step's exchange the replica's shards meet at a barrier (`replica.settle`): a shard whose exchange failed
leaves it broken, so a step is discarded by all of a replica's shards or by none.

On the CPU a sharded process has glibc return freed blocks of 1 MB or more to the system: FSDP2 gathers each block
into new memory at every forward and backward, and glibc's own threshold keeps what it frees in the heap
(bench/shards_memory.py: the peak of K = 2 is 0.58x that of K = 1 with it, 1.22x without).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fast.errors import ConfigError
from fast.runtime.checkpoints import KEEP
from fast.shards import Groups, ShardedReplica, form_groups, strategy_state
from fast.shards import checkpoint as replica_checkpoint

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)
RETURNED_BYTES = 1 << 20  # freed blocks of this size or more go back to the system


def _return_freed_blocks() -> None:
    """glibc hands freed blocks of RETURNED_BYTES or more back to the system (nothing where libc is another)."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, RETURNED_BYTES)
    except (OSError, AttributeError):
        pass


class Sharded:
    """A sharded replica's process: its groups, its model's shards, evaluations, model.pt and checkpoints."""

    def _form_shard_groups(self) -> None:
        """Collective over the workers' group (`run.shards` > 1): this worker's two groups. Every process of the
        run knows its replica and its shard (unsharded, a worker is its own replica: shard 0 of it). A live run's
        ids come K to a replica (fast.runtime.membership), so the same rule holds there, and its groups are formed
        with each generation (`_reform_shard_groups`)."""
        k = self.shards
        self.replica_index, self.shard_index = (self.rank // k, self.rank % k) if self.is_worker else (0, 0)
        self.sharded: ShardedReplica | None = None
        if getattr(self, "groups", None) is not None:  # (a live run's, formed with its first generation)
            return
        self.groups: Groups | None = None
        if k > 1 and self.is_worker:
            self.groups = form_groups(self.comm, k)
            if self.device.type == "cpu" and not self.simulated:
                _return_freed_blocks()

    def _reform_shard_groups(self) -> None:
        """A live run's new generation (collective over its world): the replica's groups made again over it, and the
        sharded model, once there is one, moved onto them (fast.shards.rebind)."""
        groups = form_groups(self.world, self.shards)
        if getattr(self, "sharded", None) is not None:
            self.sharded.regroup(groups)
        self.groups = groups

    @property
    def _first_replica(self) -> bool:
        """Whether this process is in the first replica of the workers' group (in a live run, the current
        generation's: the lowest live replica, which does worker 0's duties)."""
        return self.groups.replica == 0

    def _shard(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> nn.Module:
        """Shard `model` over this worker's replica (in place; `optimizer` moved onto its shards), and return what
        the strategy runs on: the local shards as an ordinary module; an unsharded worker's model itself."""
        if self.groups is None:
            return model
        self.sharded = ShardedReplica(self.comm, self.shards, model, optimizer, groups=self.groups)
        return self.sharded.view

    # -- evaluation ------------------------------------------------------------------------------------------------
    def _sharded_metrics(self, fn: Callable[[nn.Module], Any], model: nn.Module, during_run: bool) -> dict[str, float]:
        """`fn` of the sharded model holding `model` (the strategy's replica, or a copy of it), on every shard of
        replica 0 together (a forward is collective inside a replica); {} on the others."""
        if not self._first_replica:
            return {}
        with self.sharded.holding(model) as sharded:
            return self._metrics_of(fn, sharded, during_run=during_run)

    def _divergence(self) -> float:
        """The replicas' divergence (collective): whole replicas', from each shard's part."""
        if self.sharded is None:
            return self.strategy.divergence()
        return self.sharded.divergence(self.strategy.flat_parameters())

    def _whole_model(self, model: nn.Module) -> nn.Module | None:
        """`model` (the strategy's replica, or a copy of it) gathered whole in the user's class: on each replica's
        shard 0, None on its other shards (collective inside every replica)."""
        state = self.sharded.whole_state_dict(local=None if model is self.sharded.view else model.state_dict())
        return self.sharded.whole_model(state) if self.shard_index == 0 else None

    def _whole_state(self, model: nn.Module | None) -> dict[str, torch.Tensor] | None:
        """The reported `model` (the strategy's replica, or a copy of it) gathered whole by replica 0's shards: its
        state on rank 0 (model.pt), None elsewhere."""
        if model is None or not self._first_replica:
            return None
        state = self.sharded.whole_state_dict(local=None if model is self.sharded.view else model.state_dict())
        return state if self.shard_index == 0 else None

    # -- checkpoints -----------------------------------------------------------------------------------------------
    def _local_numel(self) -> int:
        """The elements of this process's parameters (a sharded replica's: its local shards')."""
        return sum(p.numel() for p in (self.sharded.view if self.sharded is not None else self.model).parameters())

    def _save_replica_checkpoint(self, state: dict[str, Any]) -> None:
        """This shard's part of its replica's checkpoint of this step: the model and the optimizer through DCP, with
        the strategy's vectors laid out like the parameters (fast.shards.strategy_state), and `state`'s rest in its
        own file; shard 0 then deletes the replica's checkpoints older than its newest KEEP."""
        skeleton, flats = strategy_state.split(state["strategy"], self._local_numel())
        kinds = {name: str(vector.dtype).removeprefix("torch.") for name, vector in flats.items()}
        extra = {**state, "strategy": skeleton, "shards": self.shards, "flat": kinds}
        self.sharded.save(replica_checkpoint.replica_folder(self.run_dir, self.replica_index, self.step), extra, flats)
        if self.shard_index == 0:
            older = replica_checkpoint.saved_steps(self.run_dir, self.replica_index)[:-KEEP]
            replica_checkpoint.remove(self.run_dir, self.replica_index, older)

    def _load_replica_checkpoint(self, folder: Path) -> dict[str, Any]:
        """This process's state from its replica's checkpoint in `folder` (written at any K): the model and the
        optimizer loaded (resharded where K differs, or into an unsharded worker's model), and the rest returned as
        a worker's checkpoint holds it. ConfigError where K differs and the strategy's state does not reshard."""
        mine = replica_checkpoint.read_extra(folder, self.shard_index)
        numel = self._local_numel()
        flats = {name: torch.zeros(numel, dtype=getattr(torch, kind)) for name, kind in mine["flat"].items()}
        if self.sharded is not None:
            extra = self.sharded.load(folder, flat=flats)
        else:
            extra = replica_checkpoint.load(folder, self.model, self.optimizer, flat=flats)
        saved = int(extra["shards"])
        laid_by_shard = strategy_state.by_shard(extra["strategy"])
        if saved != self.shards and laid_by_shard:
            raise ConfigError(f"resuming at run.shards = {self.shards} from checkpoints of {saved} shards: strategy "
                              f"{self.parts.options.name!r} keeps {laid_by_shard[0]} laid out by shard, which does "
                              f"not reshard: resume at run.shards = {saved}")  # fmt: skip
        return {**extra, "strategy": strategy_state.join(extra["strategy"], flats)}
