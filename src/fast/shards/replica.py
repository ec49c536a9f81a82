"""One process's part of a sharded replica (`run.shards = K`): what the job holds and calls, in one place.

    job.prepare(model, optimizer)   replica = ShardedReplica(comm, K, model, optimizer): the groups, the model
                                    sharded (or the user's sharded model checked), the optimizer on its shards
    the strategy                    its context's comm is `replica.comm`; its setup takes `replica.view` (the
                                    local shards as an ordinary module) and the user's optimizer
    each step, around after_backward replica.gradients_in() ... strategy.after_backward ... replica.gradients_out();
                                    a device flag every shard of the replica must agree on: replica.any(flag)
    an evaluation                   with replica.holding(strategy's model) as sharded: fn(sharded), every shard of the
                                    replica together; a whole-replica divergence: replica.divergence(flat)
    model.pt, an evaluation alone   replica.whole_state_dict() on shard 0; replica.whole_model() there
    checkpoints                     replica.save(folder, extra, flat) / replica.load(folder, flat) -> extra

The model and the optimizer stay the user's own objects: the loop calls them as before, and the forward and
backward are FSDP2's, collective inside the replica.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fast.comm import Comm
from fast.errors import UsageError
from fast.shards import checkpoint
from fast.shards.layout import Groups, form_groups
from fast.shards.local import LocalShards
from fast.shards.rebind import rebind
from fast.shards.sharding import is_sharded, shard
from fast.shards.whole import Unsharded, gathered_state_dict


class ShardedReplica:
    """This process's groups, the user's model sharded over its replica, and the strategies' view of its shards.
    Collective over `comm` (the workers' group): every member makes its own, in the same order."""

    def __init__(
        self, comm: Comm, shards: int, model: nn.Module, optimizer: torch.optim.Optimizer, groups: Groups | None = None
    ) -> None:
        self.groups: Groups = groups if groups is not None else form_groups(comm, shards)  # (formed already: given)
        # the user's class, without memory, for a whole copy (a model the user sharded has none: it is built anew)
        self.unsharded = None if is_sharded(model) else Unsharded(model)
        self.model = shard(model, self.groups.mesh, optimizer)
        self.optimizer = optimizer
        self.local = LocalShards(self.model)

    @property
    def comm(self) -> Comm:
        """The strategies' group: shard k of every replica."""
        return self.groups.replicate

    @property
    def view(self) -> nn.Module:
        """The local shards as an ordinary module (fast.shards.local): what the strategy is set up with."""
        return self.local.module

    @property
    def shard_index(self) -> int:
        return self.groups.shard_index

    @property
    def replica(self) -> int:
        return self.groups.replica

    def regroup(self, groups: Groups) -> None:
        """Take `groups`, this process's groups re-made over a live run's new generation (the same replica, at the
        same shard index): the model moves onto the new shard group, its mesh and local shards kept
        (fast.shards.rebind)."""
        rebind(self.model, self.groups.mesh, groups.shard.group)
        groups.mesh = self.groups.mesh
        self.groups = groups

    def settle(self) -> None:
        """A barrier of the replica's shards (a live run's, after a step's exchange): a shard whose exchange failed
        leaves it broken, so that its siblings discard the step with it (fast.runtime.live)."""
        self.groups.shard.barrier()

    def gradients_in(self) -> None:
        self.local.gradients_in()

    def gradients_out(self) -> None:
        self.local.gradients_out()

    def any(self, flag: torch.Tensor) -> torch.Tensor:
        """Whether `flag` (a one-element bool tensor on the device) is set on some shard of the replica, as a flag on
        the device (not read): a step is skipped by all of a replica's shards or by none."""
        either = flag.to(torch.float32).reshape(1)
        self.groups.shard.all_reduce(either, op="max")
        return either.reshape(()) > 0

    @contextmanager
    def holding(self, model: nn.Module) -> Iterator[nn.Module]:
        """The sharded model holding the state of `model`, a module like `view` (a strategy's average or θ, copied
        from the view), for a forward of the whole replica (an evaluation: collective inside it); the replica's own
        shards are back afterwards. `view` itself: the sharded model as it is."""
        if model is self.view:
            yield self.model
            return
        mine, theirs = self.view.state_dict(), model.state_dict()  # (the view's share the local shards' memory)
        kept = {name: tensor.clone() for name, tensor in mine.items()}
        with torch.no_grad():
            for name, tensor in mine.items():
                tensor.copy_(theirs[name])
        try:
            yield self.model
        finally:
            with torch.no_grad():
                for name, tensor in mine.items():
                    tensor.copy_(kept[name])

    def divergence(self, flat: torch.Tensor) -> float:
        """Mean over replicas of ||w_r - w̄|| / ||w̄||, of whole replicas, from this shard's part of its replica's
        parameters `flat` (collective over both groups; measurement traffic, not counted)."""
        replicate, shard = self.groups.replicate, self.groups.shard
        with replicate.unmetered(), shard.unmetered(), torch.no_grad():
            mean = flat.clone()
            replicate.all_reduce(mean, op="mean")
            squares = torch.stack([(flat - mean).square().sum(), mean.square().sum()]).float()
            shard.all_reduce(squares)  # the whole replica's sums of squares
            ratio = (squares[0].sqrt() / squares[1].sqrt().clamp_min(1e-12)).reshape(1)
            replicate.all_reduce(ratio, op="mean")
        return float(ratio.item())

    def whole_state_dict(
        self, local: Mapping[str, torch.Tensor] | None = None, everywhere: bool = False
    ) -> dict[str, torch.Tensor]:
        """The whole model's state on shard 0 (fast.shards.whole.gathered_state_dict): collective in the replica."""
        return gathered_state_dict(self.model, local=local, everywhere=everywhere)

    def whole_model(self, state: Mapping[str, torch.Tensor]) -> nn.Module:
        """A model of the user's class holding `state` (a `whole_state_dict`), on this process."""
        if self.unsharded is None:
            raise UsageError("the model came sharded, so FAST holds no unsharded copy of its class: evaluate the "
                             "sharded model on every shard of the replica (a collective evaluation)")  # fmt: skip
        return self.unsharded.build(state, buffers_of=self.model)

    def save(self, folder: Path, extra: dict[str, Any] | None = None,
             flat: Mapping[str, torch.Tensor] | None = None) -> None:  # fmt: skip
        checkpoint.save(folder, self.model, self.optimizer, extra, flat)

    def load(self, folder: Path, flat: Mapping[str, torch.Tensor] | None = None) -> dict[str, Any]:
        return checkpoint.load(folder, self.model, self.optimizer, flat)
