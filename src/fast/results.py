"""The run's outputs: every process's figures are gathered to rank 0, which writes metrics and summary."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

import fast
from fast import checkpoint
from fast.deployment import describe as describe_deployment
from fast.deployment import emulated, record_of
from fast.errors import ConfigError
from fast.evaluate import evaluate

if TYPE_CHECKING:
    from fast.worker import Worker


def environment() -> dict[str, Any]:
    try:
        commit = (
            subprocess.run(
                ["git", "rev-parse", "HEAD"],
                capture_output=True,
                text=True,
                timeout=5,
                cwd=Path(__file__).parent,
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {
        "fast_version": fast.__version__,
        "git_commit": commit,
        "torch_version": torch.__version__,
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
    }


def _predicted_step_time(worker: Worker, compute_s: float | None) -> float | None:
    """The cost model's step time for this run (fast.predict) from the compute time the run measured, to
    set beside the measured step time; None when the strategy has no cost model."""
    from fast.predict import predicted_step_time

    try:
        return predicted_step_time(worker.config, dataset=worker.data, model=worker.model, compute_s=compute_s)
    except ConfigError:
        return None


def _own_figures(worker: Worker) -> dict[str, Any]:
    """What this process contributes to the summary."""
    own = {
        "rank": worker.rank,
        "server": worker.is_server,
        "records": worker.records,
        "staleness": worker.strategy.staleness,
        "counter": worker.world.counter.snapshot(),
        "strategy": worker.strategy.summary(),
        "steps": 0 if worker.is_server else worker.total_steps,
        "skipped_steps": worker.skipped_steps,
        "time_s": getattr(worker, "trained_s", 0.0),  # the clock at its last step (servers: 0)
        "compute_s": worker.machine.compute_s,
    }
    if emulated(worker.config):
        own["deployment"] = record_of(worker.machine, worker.world)
    if not worker.is_server and worker.strategy.decentralised:
        correct, _, n = evaluate(worker.model, worker.data.x_test, worker.data.y_test, worker.device)
        own["own_test_accuracy"] = correct / n
    return own


def gather_and_write(worker: Worker, model: nn.Module | None) -> dict[str, Any] | None:
    """Collective over all processes: rank 0 writes metrics.jsonl, summary.json and model.pt."""
    own = _own_figures(worker)
    payload = torch.frombuffer(bytearray(json.dumps(own).encode()), dtype=torch.uint8)
    with worker.world.unmetered():
        parts = worker.world.all_gather_bytes(payload.to(worker.world.device))
    if worker.rank != 0:
        return None
    everyone = [json.loads(bytes(p.cpu().numpy().tobytes()).decode()) for p in parts]
    return write_outputs(worker, everyone, model, summarize(worker, everyone))


def write_outputs(
    worker: Worker, everyone: list[dict[str, Any]], model: nn.Module | None, summary: dict[str, Any]
) -> dict[str, Any]:
    """Rank 0 writes metrics.jsonl (every process's records), model.pt and summary.json."""
    run_dir = worker.run_dir
    records = sorted((r for p in everyone for r in p["records"]), key=lambda r: (r["time_s"], r["worker"]))
    tmp = run_dir / "metrics.jsonl.tmp"
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    os.replace(tmp, run_dir / "metrics.jsonl")
    if model is not None:
        checkpoint.save_atomic({k: v.detach().cpu() for k, v in model.state_dict().items()}, run_dir / "model.pt")
    tmp = run_dir / "summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=2) + "\n")
    os.replace(tmp, run_dir / "summary.json")
    return summary


def summarize(worker: Worker, everyone: list[dict[str, Any]]) -> dict[str, Any]:
    config, run = worker.config, worker.config.run
    trainers = [p for p in everyone if not p["server"]]
    evals = worker.evals
    final = evals[-1] if evals else {}
    wall = max(p["time_s"] for p in trainers)
    computes = [p["compute_s"] for p in trainers if p.get("compute_s") is not None]
    # a step's own work (its time minus its waits on communication) on the slowest worker, who sets the wall time
    compute_s = max(computes) if computes else None
    samples = sum(p["steps"] for p in trainers) * run.batch_size
    sent = sum(p["counter"]["bytes_sent"] for p in everyone)
    uncompressed = sum(p["counter"]["bytes_sent_uncompressed"] for p in everyone)
    staleness = [s for p in everyone for s in p["staleness"]]
    time_to = {}
    for target in run.targets:
        hit = next((e["time_s"] for e in evals if e["test_accuracy"] >= target), None)
        time_to[f"{target:g}"] = hit
    decentralised = worker.strategy.decentralised
    summary: dict[str, Any] = {
        "name": run.name,
        "strategy": config.strategy.name,
        "codec": config.codec.name,
        "workers": run.workers,
        "servers": len(everyone) - len(trainers),
        "epochs": run.epochs,
        "steps_per_worker": worker.total_steps,
        "final_model": worker.strategy.options.final_model if decentralised else "replica",
        "final_test_accuracy": final.get("test_accuracy"),
        "final_test_loss": final.get("test_loss"),
        "best_test_accuracy": max((e["test_accuracy"] for e in evals), default=None),
        "wall_time_s": wall,
        "samples_per_s": samples / wall if wall > 0 else None,
        "step_time_s": wall / worker.total_steps if worker.total_steps else None,
        "bytes_sent": sent,
        "bytes_received": sum(p["counter"]["bytes_received"] for p in everyone),
        "bytes_sent_uncompressed": uncompressed,
        "compression_ratio": uncompressed / sent if sent else None,
        "time_to_accuracy_s": time_to,
        "mean_staleness": sum(staleness) / len(staleness) if staleness else None,
        "max_staleness": max(staleness) if staleness else None,
        "staleness_histogram": {str(k): v for k, v in sorted(Counter(staleness).items())} or None,
        "skipped_steps": sum(p["skipped_steps"] for p in everyone),
        "restarts": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),  # by the elastic agent (max_restarts)
        "replica_divergence": final.get("divergence"),
        "worker_test_accuracy": [p.get("own_test_accuracy") for p in trainers] if decentralised else None,
        "evaluations": evals,
        "config": config.to_dict(),
        "env": environment(),
        "step_compute_s": compute_s,
        "predicted_step_time_s": _predicted_step_time(worker, compute_s),
    }
    if emulated(config):
        summary["deployment"] = describe_deployment(config, [p["deployment"] for p in everyone])
    for p in everyone:  # strategy figures (a server's included); rank 0's come last and win
        if p["rank"]:
            summary.update(p["strategy"])
    summary.update(everyone[0]["strategy"])
    return summary
