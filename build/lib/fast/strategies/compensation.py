"""Asynchrony-aware momentum: an optimizer's explicit momentum lowered by the implicit momentum of staleness.

Mitliagkas et al. 2016 ("Asynchrony begets momentum") show that updates applied late act as momentum: with M
asynchronous workers, whose updates are M − 1 steps stale on average, the implicit momentum is 1 − 1/M; in terms
of the mean staleness τ̄, μ_τ = τ̄ / (1 + τ̄). Momentum μ multiplies the long-run effect of a step by 1 / (1 − μ),
and the two compose, so the explicit momentum that keeps the run's configured μ* is

    μ = 1 − (1 − μ*) (1 + τ̄),   at least 0,

with τ̄ the mean staleness of the last `WINDOW` updates the strategy measured. Adam's β₁ is treated as momentum.
The strategies whose updates arrive stale offer it as `[strategy] momentum_compensation = true`
(`fast.strategies.base.CompensationOptions`).
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import Field

from fast.strategies.context import StrategyOptions

WINDOW = 64  # recent updates whose staleness sets the compensation


def compensated(target: float, mean_staleness: float) -> float:
    """The explicit momentum that, with the implicit momentum of `mean_staleness`, makes `target`."""
    return max(0.0, 1.0 - (1.0 - target) * (1.0 + max(0.0, mean_staleness)))


class MomentumCompensation:
    """Sets the momentum of an optimizer's parameter groups from the staleness measured so far."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.targets = [self._momentum(group) for group in optimizer.param_groups]
        self.mean_staleness = 0.0

    @staticmethod
    def _momentum(group: dict[str, Any]) -> float:
        return float(group["betas"][0]) if "betas" in group else float(group.get("momentum", 0.0))

    def update(self, staleness: list[int]) -> None:
        """Before an optimizer step: the explicit momentum for the recent updates' mean staleness."""
        recent = staleness[-WINDOW:]
        self.mean_staleness = sum(recent) / len(recent) if recent else 0.0
        for group, target in zip(self.optimizer.param_groups, self.targets, strict=True):
            value = compensated(target, self.mean_staleness)
            if "betas" in group:
                group["betas"] = (value, *tuple(group["betas"])[1:])
            elif "momentum" in group:
                group["momentum"] = value

    def figures(self) -> dict[str, float]:
        explicit = self._momentum(self.optimizer.param_groups[0])
        return {"explicit_momentum": round(explicit, 4), "compensated_staleness": round(self.mean_staleness, 3)}


class CompensationOptions(StrategyOptions):
    """For the strategies whose updates arrive stale (fast.strategies.compensation)."""

    momentum_compensation: bool = Field(
        False, description="lower explicit momentum by the implicit momentum of the staleness measured"
    )
