"""`easgd` and `eamsgd`: elastic averaging SGD, synchronous (Zhang, Choromanska, LeCun 2015; Wongpanich et al. 2020).

Each worker trains its own replica wᵢ, tied to a center w̃ by an elastic force. Every `tau` steps, with the
moving rate α (= η·ρ in Wongpanich et al. 2020's notation: `rho` sets α = optimizer.lr · rho; `alpha` sets it directly;
by default α = 0.9 / workers, Zhang et al.'s β = 0.9), all workers and the center exchange at once:
w̃ ← w̃ + α Σᵢ(wᵢ − w̃) and wᵢ ← wᵢ − α(wᵢ − w̃), both from the old values. The center is held by every worker
identically and updated from one all-reduce of the replicas; no server is needed. (`variant = "async"` is the
round-robin asynchronous EASGD with a master process: fast.strategies.easgd_async.)

The exchange happens after backward and before the optimizer step, so the gradient and the elastic pull
are both taken at w_t as in eq. 2 (with plain SGD one step is exactly wᵢ − η∇f(wᵢ) − α(wᵢ − w̃)).
Floating-point buffers (BatchNorm statistics) are pulled and averaged with the parameters.

`eamsgd` is the same with Nesterov momentum as the local optimizer (Zhang et al.'s EAMSGD): it needs
optimizer.name = "sgd" and turns Nesterov momentum on (`momentum`, default optimizer.momentum).

The reported model is the center ("best" and "worker:K" pick a replica). The all-reduce needs every worker:
a death ends the run. A worker's checkpoint holds the center.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field
from torch import nn

from fast.config import Config
from fast.errors import ConfigError
from fast.perfmodel import Link, StepCost, allreduce_cost
from fast.perfmodel.step import count
from fast.strategies.base import Strategy, StrategyOptions
from fast.strategies.elastic import ReportsCenter
from fast.strategies.flat import FlatState


class EASGDOptions(StrategyOptions):
    variant: Literal["sync", "async"] = Field("sync", description='"sync" (all-reduce) or "async" (a master)')
    tau: int = Field(4, ge=1, description="communication period: steps between two elastic exchanges")
    alpha: float | None = Field(None, gt=0, lt=1, description="moving rate α; default 0.9 / workers")
    rho: float | None = Field(None, gt=0, description="elasticity ρ; sets α = optimizer.lr * rho")


def moving_rate(options: EASGDOptions, config: Config) -> float:
    """α of eqs. 2–3: `alpha`, else lr·`rho`, else Zhang et al.'s β / p with β = 0.9."""
    if options.alpha is not None:
        return options.alpha
    if options.rho is not None:
        return config.optimizer.lr * options.rho
    return 0.9 / config.run.workers


def check_elastic(options: EASGDOptions, config: Config) -> None:
    """ConfigError for a moving rate that cannot work (both variants)."""
    if options.alpha is not None and options.rho is not None:
        raise ConfigError("`strategy.alpha` and `strategy.rho` are both set: set either alpha or rho (α = lr * rho)")
    alpha = moving_rate(options, config)
    if not 0 < alpha < 1:
        raise ConfigError(
            f"the moving rate α = {alpha:g} (optimizer.lr * strategy.rho) is outside (0, 1): "
            f"lower `strategy.rho` or set `strategy.alpha`"
        )


class EASGD(ReportsCenter, Strategy):
    name = "easgd"
    Options = EASGDOptions
    cost_options = frozenset({"tau", "variant"})

    @classmethod
    def check(cls, options: EASGDOptions, config: Config) -> None:
        check_elastic(options, config)
        alpha = moving_rate(options, config)
        if options.variant == "sync" and alpha * config.run.workers > 1:
            raise ConfigError(
                f"`strategy.alpha` = {alpha:g} with {config.run.workers} workers moves the center by "
                f"α·workers = {alpha * config.run.workers:g} > 1 per exchange (unstable): use α <= 1 / workers"
            )

    @classmethod
    def cost(cls, n: float, workers: int, link: Link, compute_s: float, options: dict[str, Any]) -> StepCost:
        """One all-reduce of the replicas every tau steps."""
        tau = count(options, "tau", None, low=1)
        seconds, nbytes = allreduce_cost(n, workers, link)
        return StepCost(compute_s + seconds / tau, compute_s, seconds / tau, nbytes / tau)

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().setup(model, optimizer)
        self.alpha = moving_rate(self.options, self.ctx.config)
        self.state = FlatState.of_model(model)
        self.center = self.state.read()
        self.exchanges = 0

    def after_backward(self, step: int) -> None:
        if step > 0 and step % self.options.tau == 0:
            self.exchange()

    @torch.no_grad()
    def exchange(self) -> None:
        """One elastic exchange of every worker with the center, from one all-reduce of the replicas."""
        weights = self.state.read()
        total = weights.clone()
        self.comm.all_reduce(total)
        old_center = self.center
        self.center = old_center + self.alpha * (total - self.comm.size * old_center)
        self.state.write(weights - self.alpha * (weights - old_center))
        self.exchanges += 1

    def state_dict(self) -> dict[str, Any]:
        return {"center": self.center.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.center.copy_(state["center"])

    def summary(self) -> dict[str, Any]:
        reported = "center" if self.options.final_model == "average" else self.options.final_model
        return {"final_model": reported, "moving_rate": self.alpha, "elastic_exchanges": self.exchanges}


class EAMSGDOptions(EASGDOptions):
    momentum: float | None = Field(None, gt=0, lt=1, description="Nesterov momentum δ; default optimizer.momentum")


def check_eamsgd(options: EAMSGDOptions, config: Config) -> None:
    if config.optimizer.name != "sgd":
        raise ConfigError(
            f'eamsgd runs Nesterov momentum SGD locally but optimizer.name = "{config.optimizer.name}": '
            f'set optimizer.name = "sgd" (or use strategy easgd)'
        )
    if options.momentum is None and config.optimizer.momentum == 0:
        raise ConfigError("eamsgd needs momentum: set `strategy.momentum` (or optimizer.momentum) above 0")


def use_nesterov(optimizer: torch.optim.Optimizer, momentum: float | None) -> None:
    """EAMSGD's local optimizer: the SGD given, with Nesterov momentum (`momentum`, else its own)."""
    for group in optimizer.param_groups:
        if momentum is not None:
            group["momentum"] = momentum
        group["nesterov"] = True
        group["dampening"] = 0.0


class EAMSGD(EASGD):
    """EASGD whose local optimizer is SGD with Nesterov momentum (Zhang et al. 2015, Algorithm 2)."""

    name = "eamsgd"
    Options = EAMSGDOptions

    @classmethod
    def check(cls, options: EAMSGDOptions, config: Config) -> None:
        super().check(options, config)
        check_eamsgd(options, config)

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().setup(model, optimizer)
        use_nesterov(optimizer, self.options.momentum)
