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

`eager = true` (Kale et al. 2025, eager updates): a round's all-reduce runs behind the next round's inner steps,
one outer step late, so that the outer step never waits for it. Worker m's outer step at round t takes
Δ̄⁽ᵗ⁻¹⁾ + (Δ_m⁽ᵗ⁾ − Δ_m⁽ᵗ⁻¹⁾) / M: the mean that has just arrived, in which its own pseudo-gradient stands
replaced by the one it has now (the others' are a round old). The workers' θ then differ by their own terms;
at the end the last mean lands, each worker steps θ by the others' share of it (no outer step took that
share) and the workers take the mean of their θ (one more all-reduce). An evaluation during the run
evaluates the mean of the workers' θ (measurement traffic, not counted).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from typing import Any

import torch
from pydantic import Field
from torch import nn

from fast.config import Config
from fast.errors import ConfigError
from fast.exchange.allreduce import Contributors, divide
from fast.strategies.flat import FlatState
from fast.strategies.periodic import PeriodicAveraging, WarmupOptions, once


class DiLoCoOptions(WarmupOptions):
    period: int = Field(16, ge=1, description="inner steps per round (H in the paper)")
    outer_lr: float = Field(0.7, gt=0, description="learning rate of the outer optimizer")
    outer_momentum: float = Field(0.9, ge=0, lt=1, description="momentum of the outer optimizer")
    outer_nesterov: bool = Field(True, description="Nesterov momentum in the outer optimizer")
    eager: bool = Field(False, description="the all-reduce overlaps the next round; the own pseudo-gradient stands in")


class DiLoCo(PeriodicAveraging):
    name = "diloco"
    Options = DiLoCoOptions
    catch_up_copies = 2.0  # θ and the outer momentum
    background_heal = True  # (θ and its momentum from the round's start, then the round's mean as every worker)
    cost_options = PeriodicAveraging.cost_options | {"eager"}

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().setup(model, optimizer)
        self.params = FlatState.of_parameters(model)
        self.buffers = FlatState.of_buffers(model)
        self.theta = self.params.read().clone()  # the shared weights every round starts from
        self.outer = self.outer_optimizer(self.theta)
        self.rounds = 0
        self.last_round_step = -1
        if self.eager:
            self.channel = self.comm.separate_group() if self.compressed is None else None
            self.landing: Callable[[], torch.Tensor | None] | None = None  # the last round's mean, on its way
            self.mine_before = torch.zeros_like(self.theta)  # this worker's pseudo-gradient of the last round

    @classmethod
    def check(cls, options: DiLoCoOptions, config: Config) -> None:
        if getattr(options, "eager", False) and config.run.live:
            raise ConfigError("`strategy.eager` with run.membership = 'live': eager workers' θ differ, a joiner has "
                              "no one θ to take; set strategy.eager = false")  # fmt: skip

    @property
    def eager(self) -> bool:
        return bool(getattr(self.options, "eager", False))  # (a variant's options may not have it)

    def in_background(self) -> bool:
        return self.eager

    def outer_optimizer(self, theta: torch.Tensor) -> torch.optim.Optimizer:
        return outer_sgd([theta], self.options)

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
        if self.eager:
            pseudo_gradient = self._eager(pseudo_gradient)
        elif self.compressed is not None:
            self.mean(pseudo_gradient, "pseudo_gradient", [t.shape for t in self.params.tensors])
        elif not self.mean_of_movers(pseudo_gradient):
            return  # every worker's loop has ended: θ stays as it is (its momentum would still move it)
        self._step_theta(pseudo_gradient)
        if self.buffers.numel:
            buffers = self.buffers.read()
            self.comm.all_reduce(buffers, op="mean")
            self.buffers.write(buffers)
        self.rounds += 1
        self.last_round_step = self.last_step

    def _step_theta(self, outer_gradient: torch.Tensor) -> None:
        """The outer optimizer's step on θ, and every replica restarts from θ."""
        self.theta.grad = outer_gradient
        self.outer.step()
        self.theta.grad = None
        self.params.write(self.theta)

    @torch.no_grad()
    def replay_round(self, mean: torch.Tensor, step: int) -> None:
        """The round's mean is the pseudo-gradient every worker's outer step took (the floating-point buffers, which
        are averaged apart, stay as the state has them)."""
        self._step_theta(mean)
        self.rounds += 1
        self.last_step = self.last_round_step = step

    def _eager(self, mine: torch.Tensor) -> torch.Tensor:
        """Send this round's pseudo-gradient on its way; the outer gradient from the last round's mean."""
        shapes = [t.shape for t in self.params.tensors]
        summed = mine.clone()
        if self.compressed is not None:
            pending = self.compressed.start(summed, "pseudo_gradient", shapes=shapes)
            contributors: Callable[[], Contributors] = pending.wait
        else:
            handle = self.channel.all_reduce(summed, async_op=True)

            def contributors() -> int:
                handle.wait()
                return self.comm.size

        before = self.landing() if self.landing is not None else torch.zeros_like(mine)
        self.landing = once(lambda: divide(summed, contributors()))
        gradient = eager_outer_gradient(before, mine, self.mine_before, self.comm.size)
        self.mine_before = mine
        return gradient

    @torch.no_grad()
    def _agree(self, metered: bool) -> torch.Tensor:
        """The mean of the workers' θ (eager: each worker's differs by its own terms)."""
        theta = self.theta.clone()
        with contextlib.nullcontext() if metered else self.comm.unmetered():
            self.comm.all_reduce(theta, op="mean")
        return theta

    def end_of_run(self) -> None:
        if not self.warming_up(self.last_step) and self.last_round_step != self.last_step:
            if self.compressed is not None or self.eager or self.round_owed(self.last_round_step):
                self.outer_step()
        if self.eager and self.landing is not None:
            last_mean = self.landing()
            self.landing = None
            with torch.no_grad():  # the others' share of the last round, which no outer step took, then one θ
                self.theta.sub_(eager_rest(last_mean, self.mine_before, self.comm.size), alpha=self.options.outer_lr)
                self.theta.copy_(self._agree(metered=True))
                self.params.write(self.theta)
            if self.compressed is not None:
                self.compressed.close()

    def final_model(self, choice: str | None = None) -> nn.Module:
        """θ, which every worker holds (no communication); "best" and "worker:K" pick a local replica."""
        if (choice or self.options.final_model) != "average":
            return super().final_model(choice)
        model = copy.deepcopy(self.model)
        FlatState.of_parameters(model).write(self._agree(metered=False) if self.eager else self.theta)
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
        if self.eager:  # the mean on its way is waited for: a resumed run applies it at the next round
            mean = self.landing() if self.landing is not None else None
            state["eager"] = {"landing": mean, "mine_before": self.mine_before.clone()}
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
        if self.eager and "eager" in state:
            mean = state["eager"]["landing"]
            self.landing = (lambda: mean.clone()) if mean is not None else None
            self.mine_before = state["eager"]["mine_before"].clone()

    def summary(self) -> dict[str, Any]:
        reported = "theta" if self.options.final_model == "average" else self.options.final_model
        return {"outer_rounds": self.rounds, "final_model": reported}


def eager_outer_gradient(mean_before: torch.Tensor, mine: torch.Tensor, mine_before: torch.Tensor,
                         workers: int) -> torch.Tensor:  # fmt: skip
    """Eager's outer gradient: the last round's mean with this worker's own pseudo-gradient of then replaced by
    the one it has now, Δ̄⁽ᵗ⁻¹⁾ + (Δ⁽ᵗ⁾ − Δ⁽ᵗ⁻¹⁾) / M."""
    return mean_before + (mine - mine_before) / workers


def eager_rest(last_mean: torch.Tensor, mine_last: torch.Tensor, workers: int) -> torch.Tensor:
    """What of the last round's mean no eager outer step took: the others' pseudo-gradients, Δ̄⁽ᵀ⁾ − Δ_m⁽ᵀ⁾ / M.
    With it, a worker's outer gradients sum to the blocking run's: every Δ counted once, at weight 1/M."""
    return last_mean - mine_last / workers


def outer_sgd(params: list[torch.Tensor], options: DiLoCoOptions) -> torch.optim.Optimizer:
    """The outer optimizer of DiLoCo and Streaming DiLoCo: SGD with (Nesterov) momentum on the shared weights."""
    nesterov = options.outer_nesterov and options.outer_momentum > 0
    return torch.optim.SGD(params, lr=options.outer_lr, momentum=options.outer_momentum, nesterov=nesterov)
