"""`easgd` and `eamsgd`: elastic averaging SGD (Zhang, Choromanska, LeCun 2015; paper 004 eqs. 2–3).

Each worker trains its own replica wᵢ, tied to a center w̃ by an elastic force. Every `tau` steps, with the
moving rate α (= η·ρ in paper 004's notation: `rho` sets α = optimizer.lr · rho; `alpha` sets it directly;
by default α = 0.9 / workers, Zhang et al.'s β = 0.9):

- `variant = "sync"`: all workers and the center exchange at once. w̃ ← w̃ + α Σᵢ(wᵢ − w̃) and
  wᵢ ← wᵢ − α(wᵢ − w̃), both from the old values. The center is held by every worker identically and updated
  from one all-reduce of the replicas; no server is needed.
- `variant = "async"`: the round-robin asynchronous EASGD. A master process (rank run.workers) holds the
  center; a worker sends it wᵢ and gets the center back, the master applies w̃ ← w̃ + α(wᵢ − w̃) for each
  arriving worker, one at a time, and the worker applies wᵢ ← wᵢ − α(wᵢ − w̃) with the same w̃.

The exchange happens after backward and before the optimizer step, so the gradient and the elastic pull
are both taken at w_t as in eq. 2 (with plain SGD one step is exactly wᵢ − η∇f(wᵢ) − α(wᵢ − w̃)).
Floating-point buffers (BatchNorm statistics) are pulled and averaged with the parameters.

`eamsgd` is the same with Nesterov momentum as the local optimizer (Zhang et al.'s EAMSGD): it needs
optimizer.name = "sgd" and turns Nesterov momentum on (`momentum`, default optimizer.momentum).

The reported model is the center. Staleness (async): for each center update, the number of updates other
workers made to the center since this worker's previous exchange, recorded by the master.

The asynchronous variant survives a worker's death (`survives_failures`). The master receives exchanges in a
listener thread (`fast.strategies.messages`) and probes a worker that has been silent for a while: one whose
connection is closed, or that stays silent past the deadline, is recorded (at the steps it had done at its
last exchange) and forgotten, its past pulls staying in the center; one only slow that speaks again is taken
back. The master finishes when every live worker is done, and the run ends with the survivors. So that the
end of the run, which then averages the survivors' replicas (`fast.survivors`), reports the center, every
worker loads the final center into its replica when `final_model` is "average"; "best" and "worker:K" keep
the replicas. The synchronous variant needs every worker at each all-reduce: a death there stays fatal.
"""

from __future__ import annotations

import copy
from typing import Any, Literal

import torch
from pydantic import Field
from torch import nn

from fast.config import Config
from fast.errors import CommError, ConfigError
from fast.strategies.base import Strategy, StrategyContext, StrategyOptions
from fast.strategies.flat import FlatState
from fast.strategies.messages import Channel, Listener, PeerDeaths

# async: exchanges go to the master's listener on tags 0 (header) and 1 (weights); it answers on 2
EXCHANGE_TAG, CENTER_TAG, INIT_TAG, FINAL_TAG = 0, 2, 3, 4


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


class EASGD(Strategy):
    name = "easgd"
    Options = EASGDOptions
    # the async variant; the launcher reads this before a variant is known, and the sync variant says False
    # on its instances, so a death there ends the run (its all-reduce fails on every worker)
    survives_failures = True

    def __init__(self, options: EASGDOptions, ctx: StrategyContext) -> None:
        super().__init__(options, ctx)
        self.alpha = moving_rate(options, ctx.config)
        self.is_async = options.variant == "async"
        self.survives_failures = self.is_async
        self.master = ctx.workers  # the master's global rank (async only)
        self.exchanges = 0
        self.step = 0

    @property
    def collective_eval(self) -> bool:  # type: ignore[override]
        return not self.is_async  # async workers never wait for each other; rank 0 evaluates its center copy

    @classmethod
    def server_count(cls, options: EASGDOptions, workers: int) -> int:
        return 1 if options.variant == "async" else 0

    @classmethod
    def check(cls, options: EASGDOptions, config: Config) -> None:
        if options.alpha is not None and options.rho is not None:
            raise ConfigError(
                "`strategy.alpha` and `strategy.rho` are both set: set either alpha or rho (α = lr * rho)"
            )
        alpha = moving_rate(options, config)
        if not 0 < alpha < 1:
            raise ConfigError(
                f"the moving rate α = {alpha:g} (optimizer.lr * strategy.rho) is outside (0, 1): "
                f"lower `strategy.rho` or set `strategy.alpha`"
            )
        if options.variant == "sync" and alpha * config.run.workers > 1:
            raise ConfigError(
                f"`strategy.alpha` = {alpha:g} with {config.run.workers} workers moves the center by "
                f"α·workers = {alpha * config.run.workers:g} > 1 per exchange (unstable): use α <= 1 / workers"
            )

    # -- workers ---------------------------------------------------------------------------------------------
    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().setup(model, optimizer)
        self.state = FlatState.of_model(model)
        self.center = self.state.read().cpu() if self.is_async else self.state.read()
        self.introduced = False
        if self.is_async:
            self.channel = Channel(self.world)  # the server creates the same group in setup_server

    def before_step(self, step: int) -> None:
        if self.is_async and not self.introduced and self.comm.rank == self.comm.ranks[0]:
            # rank 0 gives the master the starting center (after a resume: the one in its checkpoint);
            # like the base class's initial broadcast, this is set-up traffic and is not counted
            with self.channel.unmetered():
                self.channel.send(self.center, self.master, INIT_TAG)
        self.introduced = True

    def after_backward(self, step: int) -> None:
        self.step = step
        if step > 0 and step % self.options.tau == 0:
            self.exchange()

    @torch.no_grad()
    def exchange(self) -> None:
        """One elastic exchange with the center (all workers at once, or this worker with the master)."""
        weights = self.state.read()
        if self.is_async:
            self.channel.send_message(self.master, [float(self.step)], weights, tag=EXCHANGE_TAG)
            self.channel.recv(self.center, self.master, CENTER_TAG)
            old_center = self.center.to(weights.device)
        else:
            total = weights.clone()
            self.comm.all_reduce(total)
            old_center = self.center
            self.center = old_center + self.alpha * (total - self.comm.size * old_center)
        self.state.write(weights - self.alpha * (weights - old_center))
        self.exchanges += 1

    def end_of_run(self) -> None:
        if self.is_async:  # tell the master, then get its final center
            self.channel.send_done(self.master, [0.0], tag=EXCHANGE_TAG)
            # the master answers when every worker is done or taken for dead, which takes it up to a deadline
            self.channel.recv(self.center, self.master, FINAL_TAG, deadline_s=3 * self.channel.deadline_s)
            if self.options.final_model == "average":  # the end of the run averages replicas: make it the center
                self.state.write(self.center.to(self.state.tensors[0].device))

    def final_model(self, choice: str | None = None) -> nn.Module:
        """The center, which every worker holds (no communication); "best" and "worker:K" pick a replica."""
        if (choice or self.options.final_model) != "average":
            return super().final_model(choice)
        return self.center_model()

    def eval_model(self) -> nn.Module:
        return self.center_model()

    def center_model(self) -> nn.Module:
        model = copy.deepcopy(self.model)
        FlatState.of_model(model).write(self.center)
        return model

    def state_dict(self) -> dict[str, Any]:
        return {"center": self.center.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.center.copy_(state["center"])

    def summary(self) -> dict[str, Any]:
        if self.ctx.rank >= self.ctx.workers:
            return {"center_updates": self.center_updates}
        reported = "center" if self.options.final_model == "average" else self.options.final_model
        return {"final_model": reported, "moving_rate": self.alpha, "elastic_exchanges": self.exchanges}

    # -- the master (async) --------------------------------------------------------------------------------
    def setup_server(self, model: nn.Module) -> None:
        self.channel = Channel(self.world)

    def serve(self, model: nn.Module) -> None:
        """Serve elastic exchanges one worker at a time (in a listener thread) until every live worker is
        done, then send each the center."""
        self.center = FlatState.of_model(model).read().cpu()
        with self.channel.unmetered():  # set-up traffic, as on worker 0's side
            self.channel.recv(self.center, 0, INIT_TAG)
        self.center_updates = 0
        self.updates_seen = dict.fromkeys(range(self.ctx.workers), 0)  # center updates each worker knows of
        self.deaths = PeerDeaths(self)
        workers = range(self.ctx.workers)
        listener = Listener(self.channel, workers, 2, self.center.numel(), self._elastic, self.deaths.found)
        listener.start()
        listener.finish(self.dead, self.deaths.found)
        for worker in sorted(set(listener.done_headers) - self.dead):
            try:
                self.channel.send(self.center, worker, FINAL_TAG)
            except CommError as e:
                self.deaths.found(worker, f"did not take the final center: {e}")

    @torch.no_grad()
    def _elastic(self, worker: int, header: torch.Tensor, weights: torch.Tensor | None) -> None:
        """Listener thread: answer one exchange with the center, then move the center toward the worker."""
        with self.deaths.lock:
            if worker in self.dead:  # only slow, not dead: take it back
                self.dead.discard(worker)
                self.failures = [f for f in self.failures if f["worker"] != worker]
        self.deaths.heard[worker] = int(header[1].item())
        try:
            self.channel.send(self.center, worker, CENTER_TAG)
        except CommError as e:
            self.deaths.found(worker, str(e))
            return
        self.center.add_(weights - self.center, alpha=self.alpha)
        self.staleness.append(self.center_updates - self.updates_seen[worker])
        self.center_updates += 1
        self.updates_seen[worker] = self.center_updates


class EAMSGDOptions(EASGDOptions):
    momentum: float | None = Field(None, gt=0, lt=1, description="Nesterov momentum δ; default optimizer.momentum")


class EAMSGD(EASGD):
    """EASGD whose local optimizer is SGD with Nesterov momentum (Zhang et al. 2015, Algorithm 2)."""

    name = "eamsgd"
    Options = EAMSGDOptions

    @classmethod
    def check(cls, options: EAMSGDOptions, config: Config) -> None:
        super().check(options, config)
        if config.optimizer.name != "sgd":
            raise ConfigError(
                f'eamsgd runs Nesterov momentum SGD locally but optimizer.name = "{config.optimizer.name}": '
                f'set optimizer.name = "sgd" (or use strategy easgd)'
            )
        if options.momentum is None and config.optimizer.momentum == 0:
            raise ConfigError("eamsgd needs momentum: set `strategy.momentum` (or optimizer.momentum) above 0")

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().setup(model, optimizer)
        for group in optimizer.param_groups:
            if self.options.momentum is not None:
                group["momentum"] = self.options.momentum
            group["nesterov"] = True
            group["dampening"] = 0.0
