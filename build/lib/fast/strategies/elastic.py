"""The center of elastic averaging: how a strategy reports it, and how a server keeps it (asynchronous EASGD's
master, EA-wild's) with each update's staleness."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from fast.strategies.flat import FlatState


def center_model(model: nn.Module, center: torch.Tensor) -> nn.Module:
    """A copy of `model` holding the center."""
    copied = copy.deepcopy(model)
    FlatState.of_model(copied).write(center)
    return copied


class ReportsCenter:
    """A mixin for the EASGD strategies: the center is the model evaluated during training, and the final model
    unless `final_model` picks a replica ("best", "worker:K")."""

    center: torch.Tensor
    model: nn.Module
    options: Any

    def final_model(self, choice: str | None = None) -> nn.Module:
        if (choice or self.options.final_model) != "average":
            return super().final_model(choice)  # type: ignore[misc]
        return self.eval_model()

    def eval_model(self) -> nn.Module:
        return center_model(self.model, self.center)


class CenterState:
    """What a master's center depends on, and what it checkpoints: the center, the updates it has had from each
    sender (an easgd worker, an ea-wild group), the updates in all that each sender knew of at its last exchange,
    and the staleness of every update."""

    def __init__(self, center: torch.Tensor, senders: int) -> None:
        self.center = center
        self.updates = [0] * senders  # one slot per sender: ea-wild's handler threads count without a lock
        self.seen = [0] * senders
        self.staleness: list[int] = []

    def total(self) -> int:
        """The updates the center has had."""
        return sum(self.updates)

    @torch.no_grad()
    def apply(self, sender: int, weights: torch.Tensor, alpha: float) -> None:
        """One elastic update from `sender`, w̃ ← w̃ + α(w − w̃), in place and without a lock (ea-wild's handlers
        race on the live center), with its staleness: the updates from the others since the sender's previous
        exchange."""
        self.staleness.append(self.total() - self.seen[sender])
        self.center.lerp_(weights, alpha)
        self.updates[sender] += 1
        self.seen[sender] = self.total()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {
            "center": self.center.clone(),
            "updates": torch.tensor(self.updates, dtype=torch.int64),
            "seen": torch.tensor(self.seen, dtype=torch.int64),
            "staleness": torch.tensor(self.staleness, dtype=torch.int64),
        }

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """In place: the center tensor and the lists stay the objects the strategy holds."""
        self.center.copy_(state["center"])
        self.updates[:] = [int(n) for n in state["updates"].tolist()]
        self.seen[:] = [int(n) for n in state["seen"].tolist()]
        self.staleness[:] = [int(n) for n in state["staleness"].tolist()]

    def copy(self) -> CenterState:
        twin = CenterState(torch.empty_like(self.center), len(self.updates))
        twin.load_state_dict(self.state_dict())
        return twin
