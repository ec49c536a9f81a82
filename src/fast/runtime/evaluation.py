"""Evaluating the run's reported model: named metrics from the user's function, recorded by worker 0.

The model is the one `final_model` chooses (the average of the replicas, the best one, a worker's, or the
replica itself where they agree); choosing it may be collective. The function runs on worker 0 alone, and the
metrics are sent to the others when the evaluation is collective, so that every worker returns them. Time spent
here is not training time. The first evaluation checks that every target in `run.targets` names a metric the
function returns.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fast.comm import Comm
from fast.errors import ConfigError
from fast.runtime import control

if TYPE_CHECKING:
    from fast.runtime.job import Job

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


def check_targets(job: Job, metrics: dict[str, float]) -> None:
    if job._checked_targets:
        return
    for target in job.config.run.parsed_targets:
        if target.metric not in metrics:
            raise ConfigError(
                f"`run.targets` names {target.label!r}, but the evaluation returns {', '.join(sorted(metrics))}: "
                "fix run.targets or make the eval function return that metric"
            )
    job._checked_targets = True


def evaluate(job: Job, fn: EvalFn, final: bool) -> dict[str, float]:
    """Evaluate, record (worker 0) and return the metrics; `final` is the end of the run's evaluation."""
    strategy = job.strategy
    collective = final or (strategy.collective_eval and not strategy.survives_failures)
    if not collective and not job.is_main:
        return {}
    if collective and not final and job.workers > 1:  # a collective must find every worker here, at this step
        job.control.round(control.EVALUATE, job.step, [], strategy.dead, job._lost)
    divergence = None
    with job.clock.pause(), job.driver.evaluation():
        if collective:
            model = strategy.final_model() if final else strategy.eval_model()
            metrics = metrics_of(fn, model) if job.is_main else {}
            if job.is_main:
                check_targets(job, metrics)
            metrics = broadcast_json(job.comm, metrics, job.comm.ranks[0]) if job.workers > 1 else metrics
            if strategy.decentralised:
                divergence = strategy.divergence()
        else:  # worker 0 alone, while the others train on: its own replica, or the strategy's view
            model = strategy.model if strategy.collective_eval else strategy.eval_model()
            metrics = metrics_of(fn, model)
            check_targets(job, metrics)
    job.final_model = model
    record_evaluation(job, metrics, divergence)
    return metrics


def record_evaluation(job: Job, metrics: dict[str, float], divergence: float | None) -> None:
    """Worker 0 records an evaluation of the reported model: in the summary's `evaluations` and metrics.jsonl."""
    if not job.is_main:
        return
    result: dict[str, Any] = {"step": job.step, "time_s": round(job.clock.now(), 4)}
    result.update({f"test_{name}": value for name, value in metrics.items()})
    if divergence is not None:
        result["divergence"] = divergence
    job.records.add_evaluation(result)
    extra = {k: v for k, v in result.items() if k not in ("step", "time_s")}
    job._record(kind="eval", **extra)


def classification_metrics(dataset: Any, device: torch.device, batch_size: int = 1000) -> EvalFn:
    """The built-in evaluation: accuracy and mean cross-entropy of a classifier on `dataset` (x, y pairs)."""
    from fast.evaluate import evaluate as evaluate_tensors

    tensors = getattr(dataset, "tensors", None)

    def metrics(model: nn.Module) -> dict[str, float]:
        if tensors is not None:
            correct, loss, n = evaluate_tensors(model, tensors[0], tensors[1], device, batch_size)
        else:
            correct = loss = n = 0.0
            loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size)
            for x, y in loader:
                c, s, k = evaluate_tensors(model, x, y, device, batch_size)
                correct, loss, n = correct + c, loss + s, n + k
        return {"accuracy": correct / max(n, 1), "loss": loss / max(n, 1)}

    return metrics
