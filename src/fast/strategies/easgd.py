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

Checkpoints (`run.checkpoint_every = K`). A worker's checkpoint holds its copy of the center (sync: the center
itself). The asynchronous master checkpoints its own state (`CenterState`: the center, the updates it has had
from each worker, the updates each worker knew of at its last exchange, and the staleness records) without
stopping anyone, as async-ps's servers do: after its step-N checkpoint each worker sends the master a
CHECKPOINT marker for step N behind its exchanges, on the same ordered channel (unmetered: not training
traffic). The first marker for N makes the master copy its state; from then on an exchange from a worker that
has not sent its marker yet goes into both the live state and the copy, one from a worker that has goes into
the live state only (`fast.strategies.snapshots`). When every live worker's marker is in, the copy holds exactly every
worker's exchanges of its first N steps and none later, and the master writes it (`server<rank>-step<N>.pt`,
`server_checkpoints`). On resume every process resumes from the newest step all of them hold
(`fast.checkpoint`), the master from its copy of that step, so the center goes on as it was at that step. A
worker's copy of the center, like its replica, may hold later exchanges of faster workers, as any copy it
gets may. A worker found dead (or done) holds no snapshot back: later ones hold its exchanges up to its end.
"""

from __future__ import annotations

import copy
from typing import Any, Literal

import torch
from pydantic import Field
from torch import nn

from fast.config import Config
from fast.errors import CommError, ConfigError
from fast.strategies.base import ModelLayout, Strategy, StrategyContext, StrategyOptions
from fast.strategies.flat import FlatState
from fast.strategies.messages import Channel, Listener, PeerDeaths
from fast.strategies.snapshots import Snapshots

# async: exchanges (and checkpoint markers) go to the master's listener on tags 0 (header) and 1 (weights); it
# answers on 2
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


class EASGD(Strategy):
    name = "easgd"
    Options = EASGDOptions
    # the async variant; the launcher reads this before a variant is known, and the sync variant says False
    # on its instances, so a death there ends the run (its all-reduce fails on every worker)
    survives_failures = True
    server_checkpoints = True  # the async master's snapshots (the module docstring); the sync variant has none

    def __init__(self, options: EASGDOptions, ctx: StrategyContext) -> None:
        super().__init__(options, ctx)
        self.alpha = moving_rate(options, ctx.config)
        self.is_async = options.variant == "async"
        self.survives_failures = self.is_async
        self.stops_alone = self.is_async  # async workers never wait for each other
        self.master = ctx.workers  # the master's global rank (async only)
        self.exchanges = 0
        self.step = 0
        self.done_steps = 0

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
        if self.is_async:
            self.channel = Channel(self.world)  # the master creates the same group in setup_server
            if self.comm.rank == self.comm.ranks[0]:
                # rank 0 gives the master the starting center (a resumed master then loads its own snapshot);
                # like the base class's initial broadcast, this is set-up traffic and is not counted
                with self.channel.unmetered():
                    self.channel.send(self.center, self.master, INIT_TAG)

    def after_backward(self, step: int) -> None:
        self.step = step
        if step > 0 and step % self.options.tau == 0:
            self.exchange()

    def after_optimizer_step(self, step: int) -> None:
        self.done_steps = step + 1

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
        """A worker's part of a checkpoint: its center (async: its copy, as of its last exchange). Called at a
        checkpoint step of the async variant, it first sends the master the worker's CHECKPOINT marker for that
        step, behind its exchanges."""
        if self.is_async:
            with self.channel.unmetered():
                self.channel.send_marker(self.master, [float(self.done_steps)], tag=EXCHANGE_TAG)
        return {"center": self.center.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A worker's checkpoint, or the master's snapshot (its own file, written through `ctx.save_checkpoint`)."""
        if self.ctx.rank >= self.ctx.workers:
            self.live.load_state_dict(state["center"])
            self.snapshots = Snapshots(self.live, self.ctx.workers, committed=int(state["step"]))
            return
        self.center.copy_(state["center"])

    def summary(self) -> dict[str, Any]:
        if self.ctx.rank >= self.ctx.workers:
            return {"center_updates": self.live.total()}
        reported = "center" if self.options.final_model == "average" else self.options.final_model
        return {"final_model": reported, "moving_rate": self.alpha, "elastic_exchanges": self.exchanges}

    # -- the master (async) --------------------------------------------------------------------------------
    def setup_server(self, layout: ModelLayout) -> None:
        self.channel = Channel(self.world)
        self.center = torch.zeros(layout.state)
        with self.channel.unmetered():  # set-up traffic, as on worker 0's side
            self.channel.recv(self.center, 0, INIT_TAG)
        self.live = CenterState(self.center, self.ctx.workers)  # a resumed master loads its snapshot into it
        self.staleness = self.live.staleness
        self.snapshots = Snapshots(self.live, self.ctx.workers)
        self.deaths = PeerDeaths(self)

    def serve(self) -> None:
        """Serve elastic exchanges one worker at a time (in a listener thread) until every live worker is
        done, then send each the center."""
        workers = range(self.ctx.workers)
        listener = Listener(
            self.channel, workers, 2, self.center.numel(), self._elastic, self._gone, on_marker=self._marked
        )
        listener.start()
        listener.finish(self.dead, self._gone)
        done = set(listener.done_headers)
        self._save_snapshots(done)  # the workers done send no more markers
        for worker in sorted(done - self.dead):
            try:
                self.channel.send(self.center, worker, FINAL_TAG)
            except CommError as e:
                self.deaths.found(worker, f"did not take the final center: {e}")

    @torch.no_grad()
    def _elastic(self, worker: int, header: torch.Tensor, weights: torch.Tensor | None) -> None:
        """Listener thread: answer one exchange with the center, then move the center toward the worker (and
        every snapshot under way of a step the worker has not reached)."""
        with self.deaths.lock:
            if worker in self.dead:  # only slow, not dead: take it back
                self.dead.discard(worker)
                self.failures = [f for f in self.failures if f["worker"] != worker]
        self.deaths.heard[worker] = int(header[1].item())
        try:
            self.channel.send(self.center, worker, CENTER_TAG)
        except CommError as e:
            self._gone(worker, str(e))
            return
        with self.snapshots.applying(worker) as states:
            for state in states:
                state.apply(worker, weights, self.alpha)

    def _marked(self, worker: int, header: torch.Tensor) -> None:
        """Listener thread: a worker's CHECKPOINT marker (header [MARKER, step])."""
        self.snapshots.mark(worker, int(header[1].item()))
        self._save_snapshots()

    def _gone(self, worker: int, how: str) -> None:
        """A worker found dead: recorded once, and it holds no snapshot back."""
        self.deaths.found(worker, how)
        self._save_snapshots()

    def _save_snapshots(self, done: set[int] | None = None) -> None:
        """Write every snapshot that no live worker still holds back (`done`: workers that sent DONE)."""
        with self.deaths.lock:
            gone = set(self.dead) | (done or set())
        self.snapshots.save_complete(gone, self._save)

    def _save(self, step: int, state: CenterState) -> None:
        if self.ctx.save_checkpoint is not None:
            self.ctx.save_checkpoint({"step": step, "center": state.state_dict()})


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
