"""Evaluating the run's reported model: named metrics from the user's function, recorded by worker 0.

The model is the one `final_model` chooses (the average of the replicas, the best one, a worker's, or the
replica itself where they agree); choosing it may be collective. The function runs on worker 0 alone, and the
metrics are sent to the others when the evaluation is collective, so that every worker returns them. Time spent
here is not training time. The first evaluation checks that every target in `run.targets` names a metric the
function returns.

A sharded run's replicas (`run.shards` > 1) evaluate the sharded model, every shard of replica 0 together: a forward
is collective inside a replica (fast.runtime.sharded).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fast.comm import Comm, timing
from fast.errors import ConfigError, UsageError
from fast.runtime import control

EvalFn = Callable[[nn.Module], dict[str, float]]


def broadcast_json(comm: Comm, value: Any, src: int) -> Any:
    """`value` (JSON-able, given on `src`) on every member of `comm`: measurement traffic, not counted."""
    payload = json.dumps(value).encode() if comm.rank == src else b""
    length = torch.tensor([len(payload)], dtype=torch.int64, device=comm.device)
    with comm.unmetered():
        comm.broadcast(length, src=src)
        data = torch.zeros(int(length), dtype=torch.uint8, device=comm.device)
        if comm.rank == src:
            data.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        comm.broadcast(data, src=src)
    return json.loads(bytes(data.cpu().numpy().tobytes()).decode())


def metrics_of(fn: EvalFn, model: nn.Module) -> dict[str, float]:
    """`fn(model)` as {name: float}; ConfigError when it returns anything else."""
    with torch.no_grad():
        result = fn(model)
    if not isinstance(result, dict) or not result:
        raise ConfigError(
            f"the eval function returned {type(result).__name__}: it must return a dict of named numbers, "
            'e.g. {"accuracy": 0.91, "loss": 0.3}'
        )
    metrics = {}
    for name, value in result.items():
        try:
            metrics[str(name)] = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"the eval function's metric {name!r} is {value!r}, not a number") from None
    return metrics


class Evaluating:
    """The job's evaluations (a part of fast.runtime.job.Job)."""

    def evaluate(self, eval_fn: Callable[[nn.Module], dict[str, float]] | None = None) -> dict[str, float]:
        """Named metrics of the run's reported model (`final_model`), computed by `eval_fn(model)` on worker 0 and
        recorded; returned on worker 0, and on every worker when the strategy evaluates collectively (under
        the asynchronous strategies the others go on at once and get {})."""
        fn = self._on_model(eval_fn) or self._eval_fn
        if fn is None:
            raise UsageError("job.evaluate() needs an eval function the first time: job.evaluate(fn), fn(model) -> {}")
        self._eval_fn = fn
        return self._evaluate(fn, final=False)

    def _on_model(self, fn: Callable[[Any], Any] | None) -> Callable[[nn.Module], Any] | None:
        """The user's function of the model as the job calls it, on a module: a JAX job's takes the pytree."""
        return self.frontend.on_tree(fn) if fn is not None and self.frontend is not None else fn

    def model_for_eval(self) -> Any:
        """The model the run reports now (collective for strategies whose replicas differ); a JAX job's pytree; a
        sharded run's gathered whole in the user's class on each replica's shard 0 (None on its other shards;
        collective inside every replica)."""
        model = self.strategy.eval_model()
        if self.sharded is not None:
            return self._whole_model(model)
        return self.frontend.on_tree(lambda params: params)(model) if self.frontend is not None else model

    def _check_targets(self, metrics: dict[str, float]) -> None:
        if self._checked_targets:
            return
        for target in self.config.run.parsed_targets:
            if target.metric not in metrics:
                raise ConfigError(
                    f"`run.targets` names {target.label!r}, but the evaluation returns {', '.join(sorted(metrics))}: "
                    "fix run.targets or make the eval function return that metric"
                )
        self._checked_targets = True

    def _evaluate(self, fn: EvalFn, final: bool) -> dict[str, float]:
        """Evaluate, record (worker 0) and return the metrics; `final` is the end of the run's evaluation."""
        strategy = self.strategy
        # during the run, worker 0 alone where a peer may be gone (its strategy survives it, or the membership
        # re-forms without it)
        # (detached members of a live run share no group: worker 0 alone, at the end too)
        collective = (final and not self.detached) or (
            strategy.collective_eval and not strategy.survives_failures and not self.live
        )
        if not collective and not self.is_main:
            return {}
        if collective and not final and self.workers > 1:  # a collective must find every worker here, at this step
            self.control.round(control.EVALUATE, self.step, [], strategy.dead, self._lost)
        divergence = None
        with self.clock.pause(), self.driver.evaluation():
            if collective:
                model = strategy.final_model() if final else strategy.eval_model()
                if self.sharded is not None:  # replica 0's shards together, on the sharded model holding `model`
                    metrics = self._sharded_metrics(fn, model, during_run=not final)
                else:
                    metrics = self._metrics_of(fn, model, during_run=not final) if self.is_main else {}
                if self.is_main:
                    self._check_targets(metrics)
                metrics = broadcast_json(self.comm, metrics, self.comm.ranks[0]) if self.workers > 1 else metrics
                if strategy.replicas_differ:
                    divergence = self._divergence()
            else:  # worker 0 alone, while the others train on: its own replica, or the strategy's view
                model = strategy.model if strategy.collective_eval else strategy.eval_model()
                metrics = self._metrics_of(fn, model, during_run=True)
                self._check_targets(metrics)
        self.final_model = model
        self._record_evaluation(metrics, divergence)
        return metrics

    def _metrics_of(self, fn: EvalFn, model: nn.Module, during_run: bool = False) -> dict[str, float]:
        started = timing.now()
        with self.machine.evaluating():  # a simulated machine charges it as `run.eval_time` says
            metrics = metrics_of(fn, model)
        (self.eval_seconds if during_run else self.final_eval_seconds).append(timing.now() - started)
        return metrics

    def _record_evaluation(self, metrics: dict[str, float], divergence: float | None) -> None:
        """Worker 0 records an evaluation of the reported model: in the summary's `evaluations` and metrics.jsonl."""
        if not self.is_main:
            return
        result: dict[str, Any] = {"step": self.step, "time_s": round(self.clock.now(), 4)}
        result.update({f"test_{name}": value for name, value in metrics.items()})
        if divergence is not None:
            result["divergence"] = divergence
        self.records.add_evaluation(result)
        extra = {k: v for k, v in result.items() if k not in ("step", "time_s")}
        self._record(kind="eval", **extra)
