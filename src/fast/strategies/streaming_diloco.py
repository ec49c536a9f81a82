"""`streaming-diloco`: Streaming DiLoCo (Douillard et al. 2025), DiLoCo synchronised a fragment at a time.

The parameters are split, in order, into `fragments` runs of whole tensors of about equal size. Each fragment p
keeps its own shared weights θ_p and has an outer round every `period` (H) local steps, fragment p's rounds
falling p·H/P steps after fragment 0's, so that one fragment travels at a time and the peak traffic is 1/P of
DiLoCo's. A round of fragment p at step t: its pseudo-gradient Δ_p = θ_p − (the local fragment) is all-reduced
in the background while the worker goes on with `delay` (τ) more inner steps; at step t + τ the mean Δ_p steps
θ_p through the outer optimizer (SGD with Nesterov momentum, `outer_lr`, `outer_momentum`), and the local
fragment becomes α·(itself) + (1 − α)·θ_p, with α = `alpha`. Floating-point buffers are averaged with fragment
0's rounds. With one fragment, τ = 0 and α = 0 this is `diloco`. Any codec applies to the pseudo-gradients
(with its error feedback, per fragment: `fast.exchange.allreduce`). At the end the rounds in flight complete,
a last round of every fragment folds in the steps since its own, and every replica ends holding θ.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from pydantic import Field
from torch import nn

from fast.config import Config
from fast.errors import ConfigError
from fast.perfmodel import Link, StepCost
from fast.perfmodel.step import collective, count
from fast.strategies.diloco import DiLoCoOptions, outer_sgd
from fast.strategies.flat import FlatState
from fast.strategies.periodic import PeriodicAveraging, mean_of_counted, mean_of_sum, once, with_count


class StreamingDiLoCoOptions(DiLoCoOptions):
    fragments: int = Field(4, ge=1, description="parts of the model synchronised in turn (P)")
    delay: int = Field(1, ge=0, description="inner steps a fragment's all-reduce overlaps before it is applied (τ)")
    alpha: float = Field(0.5, ge=0, le=1, description="share of the local fragment kept when θ arrives")


def fragment_bounds(sizes: list[int], fragments: int) -> list[tuple[int, int]]:
    """[start, end) tensor indices: `fragments` consecutive runs of whole tensors of about equal total size."""
    total, cuts, running = sum(sizes), [0], 0
    for i, size in enumerate(sizes[:-1]):
        running += size
        still, left = fragments - len(cuts), len(sizes) - (i + 1)  # fragments yet to open, tensors after this one
        if still > 0 and (running >= total * len(cuts) / fragments or left == still):
            cuts.append(i + 1)
    return list(zip(cuts, [*cuts[1:], len(sizes)], strict=True))


def rounds_due(done: int, period: int, fragments: int) -> list[int]:
    """The fragments whose round starts once `done` local steps are done: fragment p every `period` steps, p·H/P
    steps after fragment 0."""
    return [p for p in range(fragments) if done > 0 and done % period == p * period // fragments]


class StreamingDiLoCo(PeriodicAveraging):
    name = "streaming-diloco"
    Options = StreamingDiLoCoOptions
    catch_up_copies = 2.0  # θ and the outer momentum, fragment by fragment
    cost_options = PeriodicAveraging.cost_options | {"fragments", "delay"}
    overlapped = True
    reduces_in_shared_memory = False  # its fragments' all-reduces run in the background, through the backend

    @classmethod
    def check(cls, options: StreamingDiLoCoOptions, config: Config) -> None:
        if options.eager:
            raise ConfigError("`strategy.eager` with streaming-diloco: its fragments overlap with `delay` and `alpha`"
                              " instead; use strategy diloco for eager updates")  # fmt: skip
        if options.delay >= options.period:
            raise ConfigError(f"`strategy.delay` = {options.delay} must be below strategy.period = {options.period}: "
                              "a fragment's round must land before its next one starts")  # fmt: skip
        if options.fragments > options.period:
            raise ConfigError(f"`strategy.fragments` = {options.fragments} is more than strategy.period = "
                              f"{options.period}: at most one fragment's round starts per step")  # fmt: skip

    @classmethod
    def cost(cls, n: float, workers: int, link: Link, compute_s: float, options: dict[str, Any]) -> StepCost:
        """P rounds of n/P bytes every H steps; a round waits only for what τ steps of compute did not hide."""
        period, fragments = count(options, "period", None, low=1), count(options, "fragments", 1, low=1)
        seconds, nbytes = collective(n / fragments, workers, link, options)
        waited = max(0.0, seconds - count(options, "delay", 0, low=0) * compute_s)
        per_step = fragments / period
        return StepCost(compute_s + waited * per_step, compute_s, seconds * per_step, nbytes * per_step)

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().setup(model, optimizer)
        tensors = [p.detach() for p in model.parameters()]
        o = self.options
        if o.fragments > len(tensors):
            raise ConfigError(f"`strategy.fragments` = {o.fragments}: the model has only {len(tensors)} parameter "
                              "tensors; choose fewer fragments")  # fmt: skip
        bounds = fragment_bounds([t.numel() for t in tensors], o.fragments)
        self.local = [FlatState(tensors[start:end]) for start, end in bounds]
        self.buffers = FlatState.of_buffers(model)
        self.thetas = [state.read().clone() for state in self.local]  # the shared weights of each fragment
        self.outer = outer_sgd(self.thetas, o)
        self.in_flight: dict[int, tuple[int, Callable[[], torch.Tensor | None]]] = {}  # fragment -> (lands at, mean Δ)
        self.last_round = [-1] * o.fragments  # the step of each fragment's last round
        self.steps_taken = 0  # this replica's optimizer steps (steps without data, after its loop ended, are not)
        self.steps_at_round = [0] * o.fragments  # steps_taken when each fragment's last round started
        self.rounds = 0
        self.channel = self.comm.separate_group() if self.compressed is None else None

    def before_optimizer_step(self) -> None:
        super().before_optimizer_step()
        self.steps_taken += 1

    def after_optimizer_step(self, step: int) -> None:
        self.last_step = step
        if self.local_steps(step) == 0:  # the warm-up's last step: the replicas agree, and θ starts from them
            for theta, state in zip(self.thetas, self.local, strict=True):
                theta.copy_(state.read())
        for p, (apply_at, _) in list(self.in_flight.items()):
            if apply_at == step:
                self._land(p, self.options.alpha)
        for p in rounds_due(self.local_steps(step), self.options.period, self.options.fragments):
            self._start(p, step)
            if self.options.delay == 0:
                self._land(p, self.options.alpha)

    joins_when = "between rounds, no fragment in flight"

    def change_point(self, step: int) -> bool:
        """Between rounds: no fragment in flight (a joiner takes θ of every fragment as it stands)."""
        return not self.in_flight

    def regroup(self) -> None:
        if self.compressed is None:
            self.channel = self.comm.separate_group()

    def abandon(self) -> None:
        self.in_flight.clear()  # the rounds under way went with the old group; their local steps are kept

    def _start(self, p: int, step: int) -> None:
        """Fragment p's round: its pseudo-gradient starts on its way; it lands `delay` steps later. Its mean is over
        the workers whose replica moved since the fragment's last round (a worker whose loop has ended sends zeros
        and is not counted); when none moved, the round changes nothing (no outer step, which Nesterov momentum
        would otherwise take on a zero pseudo-gradient: the final θ would depend on how many steps without data
        the workers took before agreeing to stop)."""
        moved = self.steps_taken > self.steps_at_round[p]
        self.steps_at_round[p] = self.steps_taken
        delta = (self.thetas[p] - self.local[p].read()).mul_(float(moved))
        if self.compressed is not None:
            shapes = [t.shape for t in self.local[p].tensors]
            count = torch.full((1,), float(moved), device=delta.device)
            pending = self.compressed.start(delta, f"fragment{p}", shapes=shapes, count=count)
            mean = once(lambda: mean_of_sum(delta, pending.wait(), moved))
        else:
            handle = self.channel.all_reduce(with_count(delta, moved), async_op=True)
            mean = once(lambda: mean_of_counted(handle.wait(), moved))
        self.in_flight[p] = (step + self.options.delay, mean)
        self.last_round[p] = step
        if p == 0 and self.buffers.numel:
            buffers = self.buffers.read()
            self.comm.all_reduce(buffers, op="mean")
            self.buffers.write(buffers)

    @torch.no_grad()
    def _land(self, p: int, alpha: float) -> None:
        """Fragment p's round completes: the mean Δ steps θ_p, and the local fragment moves to θ_p."""
        _, mean_of = self.in_flight.pop(p)
        mean = mean_of()
        self.nobody_contributed = mean is None  # no worker moved since this fragment's last round: all have ended
        if mean is None:
            return
        self.thetas[p].grad = mean
        self.outer.step()
        self.thetas[p].grad = None
        local = self.local[p].read()
        self.local[p].write(local.mul_(alpha).add_(self.thetas[p], alpha=1 - alpha))
        self.rounds += 1

    def end_of_run(self) -> None:
        for p in sorted(self.in_flight):
            self._land(p, self.options.alpha)
        if not self.warming_up(self.last_step):
            for p in range(len(self.local)):
                if self.last_round[p] != self.last_step:
                    self._start(p, self.last_step)
                    self._land(p, 0.0)
                self.local[p].write(self.thetas[p])
        if self.compressed is not None:
            self.compressed.close()

    @torch.no_grad()
    def eval_model(self) -> nn.Module:
        """The model the run would report if it stopped now, as `end_of_run` would make it, without changing the
        run: the rounds in flight land, and a last round of every fragment folds in the steps since its own (its
        all-reduce is measurement traffic). θ alone mixes fragments a round apart (its perplexity reads several
        times the model's)."""
        o = self.options
        if o.final_model != "average":
            return super().eval_model()
        thetas = [theta.clone() for theta in self.thetas]
        outer = outer_sgd(thetas, o)
        outer.load_state_dict(copy.deepcopy(self.outer.state_dict()))
        local = [state.read() for state in self.local]

        def step(p: int, mean: torch.Tensor) -> None:
            for q, theta in enumerate(thetas):
                theta.grad = mean if q == p else None
            outer.step()

        for p, (_, mean_of) in sorted(self.in_flight.items()):
            mean = mean_of()
            if mean is not None:
                step(p, mean)
                local[p].mul_(o.alpha).add_(thetas[p], alpha=1 - o.alpha)
        if not self.warming_up(self.last_step):
            for p in range(len(local)):
                if self.last_round[p] != self.last_step:
                    delta = thetas[p] - local[p]
                    with self.comm.unmetered():
                        self.comm.all_reduce(delta, op="mean")
                    step(p, delta)
        model = copy.deepcopy(self.model)
        FlatState.of_parameters(model).write(torch.cat(thetas))
        return model

    def final_model(self, choice: str | None = None) -> nn.Module:
        """θ, which every worker holds; "best" and "worker:K" pick a local replica."""
        if (choice or self.options.final_model) != "average":
            return super().final_model(choice)
        model = copy.deepcopy(self.model)
        FlatState.of_parameters(model).write(torch.cat(self.thetas))
        return model

    def state_dict(self) -> dict[str, Any]:
        """θ, the outer optimizer, the rounds in flight (waited for: a resumed run applies them at their step), the
        counters and the codec's error feedback; each worker's replica and inner optimizer are its own."""
        landing = {p: (at, mean()) for p, (at, mean) in self.in_flight.items()}
        self.in_flight = {p: (at, lambda m=m: m) for p, (at, m) in landing.items()}  # waited for: kept as they are
        state = {"thetas": [t.clone() for t in self.thetas], "outer": self.outer.state_dict(), "in_flight": landing,
                 "last_round": list(self.last_round), "rounds": self.rounds, "last_step": self.last_step}  # fmt: skip
        if self.compressed is not None:
            state["codec"] = self.compressed.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            for theta, saved in zip(self.thetas, state["thetas"], strict=True):
                theta.copy_(saved)
        self.outer.load_state_dict(state["outer"])
        landing = {int(p): (int(at), None if m is None else m.clone()) for p, (at, m) in state["in_flight"].items()}
        self.in_flight = {p: (at, lambda m=m: m) for p, (at, m) in landing.items()}
        self.last_round, self.rounds = list(state["last_round"]), int(state["rounds"])
        self.last_step = int(state["last_step"])
        if self.compressed is not None and "codec" in state:
            self.compressed.load_state_dict(state["codec"])

    def summary(self) -> dict[str, Any]:
        return {"outer_rounds": self.rounds, "fragments": len(self.local), "final_model": "theta"}
