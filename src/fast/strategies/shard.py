"""A parameter server's shard of the weights: its state, the updates it applies (with their staleness, optionally
scaled by it or delay-compensated), and the copy a checkpoint snapshot takes."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from fast.strategies.compensation import MomentumCompensation


def shard_bounds(numel: int, shards: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) ranges that split `numel` elements into `shards` near-equal parts."""
    cuts = [round(i * numel / shards) for i in range(shards + 1)]
    return list(zip(cuts[:-1], cuts[1:], strict=True))


def compensated_gradient(
    gradient: torch.Tensor,
    weights: torch.Tensor,
    backup: torch.Tensor | None,
    *,
    staleness: int,
    staleness_lr: bool,
    dc_lambda: float,
) -> torch.Tensor:
    """The gradient a server applies: delay-compensated (DC-ASGD) against the weights the worker pulled,
    then divided by its staleness when `staleness_lr` (a staleness of 0 or 1 leaves it as it is)."""
    g = gradient.clone()
    if dc_lambda > 0:
        g += dc_lambda * gradient * gradient * (weights - backup)
    if staleness_lr and staleness > 1:
        g /= staleness
    return g


class ShardState:
    """What a server's updates depend on: its shard of the weights, its optimizer, how many updates it has
    applied (from each worker), the version each worker last pulled and (DC-ASGD) the weights it pulled.
    This is what a server checkpoints. `options` are async-ps's (server_momentum, staleness_lr,
    delay_compensation, momentum_compensation); under momentum_compensation the servers aim at the run's own
    `momentum`, lowered by the implicit momentum of the staleness they measure."""

    def __init__(self, shard: torch.Tensor, options: Any, lr: float, weight_decay: float, workers: int,
                 momentum: float = 0.0):  # fmt: skip
        self.options, self.lr, self.weight_decay, self.workers = options, lr, weight_decay, workers
        self.momentum = momentum
        self.shard = nn.Parameter(shard)
        compensating = getattr(options, "momentum_compensation", False)
        target = momentum if compensating else options.server_momentum
        self.optimizer = torch.optim.SGD([self.shard], lr=lr, momentum=target, weight_decay=weight_decay)
        self.compensation = MomentumCompensation(self.optimizer) if compensating else None
        self.version = 0  # updates applied to this shard
        self.pulled_version = dict.fromkeys(range(workers), 0)
        self.updates_from = dict.fromkeys(range(workers), 0)
        dc = options.delay_compensation > 0
        self.backup = {w: shard.detach().clone() for w in range(workers)} if dc else {}
        self.staleness: list[int] = []
        self.lost_pushes = 0  # pushes lost on a lossy link: updates not applied
        self.lost_pulls = 0  # answers to pulls lost on a lossy link, as the workers report them
        self.pulls = 0  # pulls answered (whether or not the answer arrived)

    def apply(self, worker: int, gradient: torch.Tensor) -> None:
        """One update from a worker's pushed gradient, with its staleness recorded."""
        staleness = self.version - self.pulled_version[worker]
        self.staleness.append(staleness)
        self.shard.grad = compensated_gradient(
            gradient,
            self.shard.detach(),
            self.backup.get(worker),
            staleness=staleness,
            staleness_lr=self.options.staleness_lr,
            dc_lambda=self.options.delay_compensation,
        )
        if self.compensation is not None:
            self.compensation.update(self.staleness)
        self.optimizer.step()
        self.shard.grad = None
        self.version += 1
        self.updates_from[worker] += 1

    def admit(self, worker: int) -> None:
        """A worker that joined a live run (its first pull sets its version)."""
        self.pulled_version.setdefault(worker, self.version)
        self.updates_from.setdefault(worker, 0)
        if self.options.delay_compensation > 0:
            self.backup.setdefault(worker, self.shard.detach().clone())

    def skip(self) -> None:
        """A pushed gradient was lost on its link: no update."""
        self.lost_pushes += 1

    def pulled(self, worker: int, weights: torch.Tensor) -> None:
        """`worker` was sent `weights` (the live shard) at this state's current version."""
        self.pulls += 1
        self.pulled_version[worker] = self.version
        if worker in self.backup:
            self.backup[worker].copy_(weights)

    def figures(self) -> torch.Tensor:
        """pushes, lost pushes, pulls and lost pulls, in that order."""
        return torch.tensor([self.version + self.lost_pushes, self.lost_pushes, self.pulls, self.lost_pulls])

    def figures_for_summary(self) -> dict[str, Any]:
        compensation = self.compensation.figures() if self.compensation is not None else {}
        return {"server_updates": self.version, **compensation}

    def state_dict(self) -> dict[str, Any]:
        return {
            "shard": self.shard.detach().clone(),
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),
            "version": self.version,
            "pulled_version": dict(self.pulled_version),
            "updates_from": dict(self.updates_from),
            "backup": {w: b.clone() for w, b in self.backup.items()},
            "staleness": torch.tensor(self.staleness, dtype=torch.int64),
            "lost_pushes": self.lost_pushes,
            "lost_pulls": self.lost_pulls,
            "pulls": self.pulls,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            self.shard.copy_(state["shard"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.version = int(state["version"])
        self.pulled_version = {int(w): int(v) for w, v in state["pulled_version"].items()}
        self.updates_from = {int(w): int(v) for w, v in state["updates_from"].items()}
        for w, b in state["backup"].items():
            self.backup[int(w)].copy_(b)
        self.staleness[:] = state["staleness"].tolist()
        self.lost_pushes, self.pulls = int(state.get("lost_pushes", 0)), int(state.get("pulls", 0))
        self.lost_pulls = int(state.get("lost_pulls", 0))

    def copy(self) -> ShardState:
        twin = ShardState(self.shard.detach().clone(), self.options, self.lr, self.weight_decay, self.workers,
                          self.momentum)  # fmt: skip
        twin.load_state_dict(self.state_dict())
        return twin
