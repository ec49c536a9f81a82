"""`diloco`: DiLoCo (Douillard et al. 2023), local SGD with an inner and an outer optimizer.

Every worker starts a round from the shared weights θ and runs `period` steps of its own torch.optim
optimizer (the *inner* optimizer: AdamW in the paper, any optimizer here; its state stays local and lives
across rounds). Then the pseudo-gradient Δ = θ − θ_local is averaged over the workers and given to the
*outer* optimizer, SGD with Nesterov momentum (`outer_lr` 0.7, `outer_momentum` 0.9 as in the paper), which
updates θ; every replica starts the next round from the new θ. So the run's `[optimizer]` table configures
the inner optimizer only, and the outer optimizer's state (its momentum) is part of this strategy's state.
Floating-point buffers (BatchNorm statistics) are not parameters: they are simply averaged each round.
The reported model is θ; a last round at the end of the run folds in any steps after the last full round.
With a `[codec]`, the pseudo-gradients are averaged through it (with its error feedback, per worker:
`fast.exchange.allreduce`); every worker decodes the same mean, so θ stays the same everywhere.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from pydantic import Field
from torch import nn

from fast.strategies.flat import FlatState
from fast.strategies.periodic import PeriodicAveraging, WarmupOptions


class DiLoCoOptions(WarmupOptions):
    period: int = Field(16, ge=1, description="inner steps per round (H in the paper)")
    outer_lr: float = Field(0.7, gt=0, description="learning rate of the outer optimizer")
    outer_momentum: float = Field(0.9, ge=0, lt=1, description="momentum of the outer optimizer")
    outer_nesterov: bool = Field(True, description="Nesterov momentum in the outer optimizer")


class DiLoCo(PeriodicAveraging):
    name = "diloco"
    Options = DiLoCoOptions
    catch_up_copies = 2.0  # θ and the outer momentum

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().setup(model, optimizer)
        self.params = FlatState.of_parameters(model)
        self.buffers = FlatState.of_buffers(model)
        self.theta = self.params.read().clone()  # the shared weights every round starts from
        o = self.options
        self.outer = torch.optim.SGD(
            [self.theta],
            lr=o.outer_lr,
            momentum=o.outer_momentum,
            nesterov=o.outer_nesterov and o.outer_momentum > 0,
        )
        self.rounds = 0
        self.last_round_step = -1

    def after_optimizer_step(self, step: int) -> None:
        self.last_step = step
        if self.local_steps(step) == 0:  # the warm-up's last step: the replicas agree, and θ starts from them
            self.theta.copy_(self.params.read())
        elif self.local_steps(step) > 0 and self.local_steps(step) % self.options.period == 0:
            self.outer_step()

    @torch.no_grad()
    def outer_step(self) -> None:
        """Average the pseudo-gradients, step the outer optimizer, and restart every replica from θ."""
        pseudo_gradient = self.theta - self.params.read()
        if self.compressed is not None:
            self.mean(pseudo_gradient, "pseudo_gradient", [t.shape for t in self.params.tensors])
        elif not self.mean_of_movers(pseudo_gradient):
            return  # every worker's loop has ended: θ stays as it is (its momentum would still move it)
        self.theta.grad = pseudo_gradient
        self.outer.step()
        self.theta.grad = None
        self.params.write(self.theta)
        if self.buffers.numel:
            buffers = self.buffers.read()
            self.comm.all_reduce(buffers, op="mean")
            self.buffers.write(buffers)
        self.rounds += 1
        self.last_round_step = self.last_step

    def end_of_run(self) -> None:
        if not self.warming_up(self.last_step) and self.last_round_step != self.last_step:
            if self.compressed is not None or self.round_owed(self.last_round_step):
                self.outer_step()

    def final_model(self, choice: str | None = None) -> nn.Module:
        """θ, which every worker holds (no communication); "best" and "worker:K" pick a local replica."""
        if (choice or self.options.final_model) != "average":
            return super().final_model(choice)
        model = copy.deepcopy(self.model)
        FlatState.of_parameters(model).write(self.theta)
        return model

    def state_dict(self) -> dict[str, Any]:
        """θ, the outer optimizer's state (momentum), the round counters and the codec's error feedback; each
        worker's replica and inner optimizer are in its own checkpoint."""
        state = {
            "theta": self.theta.clone(),
            "outer": self.outer.state_dict(),
            "rounds": self.rounds,
            "last_step": self.last_step,
            "last_round_step": self.last_round_step,
        }
        if self.compressed is not None:
            state["codec"] = self.compressed.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            self.theta.copy_(state["theta"])
        self.outer.load_state_dict(state["outer"])
        self.rounds = int(state.get("rounds", 0))
        self.last_step = int(state.get("last_step", -1))
        self.last_round_step = int(state.get("last_round_step", -1))
        if self.compressed is not None and "codec" in state:
            self.compressed.load_state_dict(state["codec"])

    def summary(self) -> dict[str, Any]:
        reported = "theta" if self.options.final_model == "average" else self.options.final_model
        return {"outer_rounds": self.rounds, "final_model": reported}
