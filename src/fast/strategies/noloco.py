"""`noloco`: NoLoCo (Kolehmainen et al. 2025), DiLoCo's rounds with no all-reduce: one random peer a round.

Each worker keeps outer weights φ and an outer momentum m of its own. It runs `period` (H) steps of its inner
optimizer from φ; then the workers are paired by a random perfect matching, the same on every worker (seeded by
the run's seed and the round; fast.topology.schedules.RandomMatchings), and each pair swaps φ and the progress
θ − φ. With φ̄ and ḡ the pair's means of φ and of θ − φ:

    m ← μ·m + a·ḡ − a·(φ − φ̄)        φ ← φ + m        θ ← φ

(`outer_momentum` μ, `outer_lr` a: the step along the pair's progress and the pull towards the pair's φ, one
coefficient for both as in the reference code). No collective: a round costs each worker one message of
2 × the model to its partner. With an odd number of workers one sits each round out (ḡ = its own progress,
φ̄ = its φ). The replicas differ; the reported model is their average (`final_model`).

A worker that dies is noticed by each partner it is drawn with, when their exchange fails (the connection
closes, or the deadline passes): that partner takes the round alone, and every later round drawn with the dead
one. The matchings are drawn over every worker, dead or not, so that the survivors never need to agree on who
is gone to agree on who pairs with whom.
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import Field
from torch import nn

from fast.comm.patience import PatientGroup
from fast.exchange.neighbours import NeighbourRound
from fast.perfmodel import Link, StepCost
from fast.perfmodel.step import count
from fast.strategies.base import Strategy, StrategyOptions
from fast.strategies.flat import FlatState
from fast.topology.schedules import RandomMatchings


class NoLoCoOptions(StrategyOptions):
    period: int = Field(16, ge=1, description="inner steps per round (H)")
    outer_lr: float = Field(0.7, gt=0, description="the outer step along the pair's progress and towards its φ (a)")
    outer_momentum: float = Field(0.5, ge=0, lt=1, description="the outer momentum (μ)")


def noloco_step(phi: torch.Tensor, moved: torch.Tensor, momentum: torch.Tensor, partner: tuple[torch.Tensor,
                torch.Tensor] | None, lr: float, mu: float) -> torch.Tensor:  # fmt: skip
    """One worker's outer step, in place on `phi` and `momentum` (returned: the new φ). `moved` = θ − φ;
    `partner`: its (φ, θ − φ), or None for a round alone."""
    phi_mean, moved_mean = (phi, moved) if partner is None else ((phi + partner[0]) / 2, (moved + partner[1]) / 2)
    momentum.mul_(mu).add_(moved_mean, alpha=lr).sub_(phi - phi_mean, alpha=lr)
    return phi.add_(momentum)


class NoLoCo(Strategy):
    name = "noloco"
    Options = NoLoCoOptions
    tags = (0,)
    replicas_differ = True
    survives_failures = True
    takes_shards = False
    shards_why = (
        "it survives a lost worker, and a sharded replica cannot lose a process: FSDP2's collectives inside "
        "it need every shard"
    )
    cost_options = frozenset({"period"})

    @classmethod
    def cost(cls, n: float, workers: int, link: Link, compute_s: float, options: dict[str, Any]) -> StepCost:
        """Every H steps one message of φ and θ − φ each way with one partner (one NIC, full duplex)."""
        period = count(options, "period", None, low=1)
        if workers == 1:
            return StepCost(compute_s, compute_s, 0.0, 0.0)
        seconds = link.message_time(2 * n)
        return StepCost(compute_s + seconds / period, compute_s, seconds / period, 2 * n / period)

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().setup(model, optimizer)
        self.params = FlatState.of_parameters(model)
        self.phi = self.params.read().clone()
        self.momentum = torch.zeros_like(self.phi)
        self.matchings = RandomMatchings(self.comm.size, self.ctx.config.run.seed)
        self.patient = PatientGroup(self.comm)
        self.rounds = self.alone = 0
        self.last_step = -1

    def gradients_stay_local(self, step: int) -> bool:
        return True

    def after_optimizer_step(self, step: int) -> None:
        self.last_step = step
        if (step + 1) % self.options.period == 0:
            self.outer_step()

    @torch.no_grad()
    def outer_step(self) -> None:
        """Swap φ and θ − φ with this round's partner (if it has one, alive), step φ, restart θ from it."""
        me, ranks = self.comm.index(), self.comm.ranks
        moved = self.params.read().sub_(self.phi)
        partner = self.matchings.partner(me, self.rounds)
        theirs = None
        if partner is not None and ranks[partner] not in self.dead:
            message = torch.cat([self.phi, moved])
            arrived, _, gone = NeighbourRound(self.patient, message, [ranks[partner]], [ranks[partner]]).finish()
            for peer, how in gone.items():
                self.lost(peer, self.last_step, how)
            if ranks[partner] in arrived:
                theirs = arrived[ranks[partner]].tensor_split(2)
        self.alone += theirs is None
        o = self.options
        self.params.write(noloco_step(self.phi, moved, self.momentum, theirs, o.outer_lr, o.outer_momentum))
        self.rounds += 1

    def state_dict(self) -> dict[str, Any]:
        return {"phi": self.phi.clone(), "momentum": self.momentum.clone(), "rounds": self.rounds}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.phi.copy_(state["phi"])
        self.momentum.copy_(state["momentum"])
        self.rounds = int(state["rounds"])

    def summary(self) -> dict[str, Any]:
        return {"outer_rounds": self.rounds, "rounds_alone": self.alone}
