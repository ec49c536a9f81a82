"""The simulated engine at scale: host cost and memory against workers, and the papers' questions at 8 to 256 workers.

    .venv/bin/python bench/sim_scale.py [--workers 16 64 256] [--epochs 1] [--sections scale churn figures]
                                        [--only NAME] [--reports DIR] [--out results.json]

Fashion-MNIST, LeNet-5, batch 16 per worker (so that 256 workers still take 14 steps an epoch), SGD (lr 0.05,
momentum 0.9), links of 100 Mbit/s and 5 ms, a step charged 5 ms of compute (`run.step_time`, so every run
repeats exactly). Each run is a process of its own, so that its peak memory is its own.

- `scale`: at each worker count, `gossip` on a square torus with `send_probability` 1.0, 0.5 and 0.25 (the
  partial communication of papers 000/001: accuracy and replica divergence against the probability and the
  workers), `local-sgd` (period 8), and `async-ps` with one server shard per 16 workers (and `staleness_lr`: at
  64 workers and more, undivided updates diverge). Host seconds per
  simulated worker-step should stay about flat as workers grow (a cost linear in workers x steps); they count
  training only, from the start to worker 0's `job.finish` (the end evaluates every replica of a decentralised
  run, a cost that grows with workers, not steps). Every 256-worker run must end within 30 minutes and 8 GiB.
- `churn`: at the largest worker count, `gossip` (torus) and `diloco` (period 4), live, without churn and with
  `[faults] churn` (each worker's mean lifetime ten times the steady run's virtual time, mean absence a tenth of
  it: about one worker in ten leaves and is replaced during the run, a change every step or so; a lifetime of a
  third of a 14-step run would take a member out every few milliseconds at 256 workers, and nearly every step
  would break): host seconds, peak memory, accuracy, membership changes and catch-up bytes. Each churn run is
  made twice: the two must be equal (deterministic by seed). Within the same 30 minutes and 8 GiB.
- `figures`: `fast compare` of `examples/scale/trend.toml` (paper 004: at a fixed per-worker batch, `sync`
  against `async-ps` at 8, 32 and 128 workers; asynchronous accuracy should fall as workers grow while
  synchronous accuracy holds) and of `examples/scale/partial.toml` (gossip's send probability against the
  workers, with replica divergence), one report.html each under --reports.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

MEMORY_LIMIT_MB, HOST_LIMIT_S = 8 * 1024, 30 * 60


def config(workers: int, strategy: dict[str, Any], epochs: float) -> dict[str, Any]:
    return {
        "run": {"name": strategy["name"], "seed": 0, "workers": workers, "batch_size": 16, "epochs": epochs,
                "eval_every": 0, "engine": "simulated", "step_time": "5ms", "targets": [0.7], "log_every": 10},
        "data": {"name": "fashion-mnist"},
        "model": {"name": "lenet"},
        "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
        "strategy": strategy,
        "network": {"bandwidth": "100Mbit", "latency": "5ms"},
    }  # fmt: skip


def torus(workers: int) -> str:
    rows = 2 ** (int(math.log2(workers)) // 2)
    return f"torus:{rows}x{workers // rows}"


def scale_plan(workers: list[int]) -> list[tuple[str, int, dict[str, Any]]]:
    plan = []
    for n in workers:
        for p in (1.0, 0.5, 0.25):
            plan.append((f"gossip p={p:g}", n, {"name": "gossip", "topology": torus(n), "send_probability": p}))
        plan.append(("local-sgd", n, {"name": "local-sgd", "period": 8}))
        shards = max(1, n // 16)  # each update divided by its staleness, which grows with the workers
        plan.append((f"async-ps ({shards} shards)", n, {"name": "async-ps", "servers": shards, "staleness_lr": True}))
    return plan


def run_one(job: dict[str, Any]) -> dict[str, Any]:
    """One run in this process (a child of main): its summary's figures, as JSON on stdout."""
    import fast

    with tempfile.TemporaryDirectory(prefix="fast-sim-scale-") as out:
        summary = fast.train(job, out=out)
    sim = summary["simulation"]
    worker_steps = summary["steps_per_worker"] * summary["workers"]
    return {
        "steps_per_worker": summary["steps_per_worker"],
        "virtual_s": summary["wall_time_s"],
        "host_s": sim["host_s"],
        "host_ms_per_worker_step": 1000 * sim["training_host_s"] / worker_steps,
        "peak_memory_mb": sim["peak_memory_mb"],
        "accuracy": summary["final_test_accuracy"],
        "divergence": summary.get("replica_divergence"),
        "bytes_sent": summary["bytes_sent"],
        "changes": max(0, len(summary.get("membership", [])) - 1),
        "catch_up_bytes": summary.get("catch_up_bytes"),
        "workers_at_end": summary.get("workers_at_end"),
        "membership": summary.get("membership"),
    }


def cell(value: Any, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}" if isinstance(value, float) else str(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--epochs", type=float, default=1.0)
    parser.add_argument("--sections", nargs="+", choices=["scale", "churn", "figures"], default=["scale", "figures"])
    parser.add_argument("--reports", default="runs/sim-scale", help="where the figures' reports go")
    parser.add_argument("--out", help="write the rows as JSON here")
    parser.add_argument("--only", help="scale: only the variants whose name contains this, e.g. async-ps")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child's job, as JSON
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(json.loads(args.one))))
        return
    if "scale" in args.sections:
        scale(args)
    if "churn" in args.sections:
        churn(max(args.workers), args.epochs)
    if "figures" in args.sections:
        figures(Path(args.reports))


def _one_process(job: dict[str, Any]) -> dict[str, Any] | str:
    """The figures of `job`, run in a process of its own (its peak memory its own), or why it failed."""
    done = subprocess.run([sys.executable, __file__, "--one", json.dumps(job)], capture_output=True, text=True)
    if done.returncode != 0:
        return f"failed: {done.stderr.strip().splitlines()[-1:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def churn(workers: int, epochs: float) -> None:
    print("| workers | variant | churn | steps/worker | virtual s | host s | peak MB | accuracy | changes | "
          "catch-up MB | workers at end | repeats |\n|---|---|---|---|---|---|---|---|---|---|---|---|",
          flush=True)  # fmt: skip
    strategies = {"gossip": {"name": "gossip", "topology": torus(workers)}, "diloco": {"name": "diloco", "period": 4}}
    for name, strategy in strategies.items():
        job = config(workers, strategy, epochs)
        job["run"]["membership"] = "live"
        steady = _one_process(job)
        if isinstance(steady, str):
            print(f"| {workers} | {name} | no | {steady} |", flush=True)
            continue
        lifetime, absence = steady["virtual_s"] * 10, steady["virtual_s"] / 10
        job["faults"] = {"churn": {"lifetime": f"{lifetime:.4g}s", "absence": f"{absence:.4g}s"}}
        churned, again = _one_process(job), _one_process(job)
        for label, row in (("no", steady), (f"{lifetime:.2g} s / {absence:.2g} s", churned)):
            if isinstance(row, str):
                print(f"| {workers} | {name} | {label} | {row} |", flush=True)
                continue
            repeats = "-" if row is steady else "yes" if isinstance(again, dict) and all(
                again[k] == row[k] for k in ("membership", "accuracy", "bytes_sent")) else "NO"  # fmt: skip
            print(f"| {workers} | {name} | {label} | {row['steps_per_worker']} | {cell(row['virtual_s'], 2)} | "
                  f"{cell(row['host_s'])} | {cell(row['peak_memory_mb'], 0)} | {cell(row['accuracy'], 4)} | "
                  f"{row['changes']} | {cell((row['catch_up_bytes'] or 0) / 1e6)} | {row['workers_at_end']} | "
                  f"{repeats} |", flush=True)  # fmt: skip


def figures(reports: Path) -> None:
    import fast

    examples = Path(__file__).resolve().parent.parent / "examples" / "scale"
    for name in ("trend", "partial"):
        comparison = fast.compare(str(examples / f"{name}.toml"), out=str(reports / name))
        print(f"{name}: {comparison.report}", flush=True)


def scale(args: argparse.Namespace) -> None:
    plan = [row for row in scale_plan(args.workers) if args.only is None or args.only in row[0]]
    print("| workers | variant | steps/worker | virtual s | host s | host ms per worker-step | peak MB | accuracy | "
          "divergence |\n|---|---|---|---|---|---|---|---|---|", flush=True)  # fmt: skip
    rows = []
    for name, workers, strategy in plan:
        figures = _one_process(config(workers, strategy, args.epochs))
        if isinstance(figures, str):
            print(f"| {workers} | {name} | {figures} |", flush=True)
            continue
        row = {"variant": name, "workers": workers, **figures}
        rows.append(row)
        print(f"| {workers} | {name} | {row['steps_per_worker']} | {cell(row['virtual_s'])} | {cell(row['host_s'])} | "
              f"{cell(row['host_ms_per_worker_step'], 2)} | {cell(row['peak_memory_mb'], 0)} | "
              f"{cell(row['accuracy'], 4)} | {cell(row['divergence'], 4)} |", flush=True)  # fmt: skip
    largest = [r for r in rows if r["workers"] == max(args.workers)]
    if largest and "scale" in args.sections:
        worst_s = max(r["host_s"] for r in largest)
        worst_mb = max(r["peak_memory_mb"] for r in largest)
        met = worst_s < HOST_LIMIT_S and worst_mb < MEMORY_LIMIT_MB
        print(f"\n{max(args.workers)} workers: longest run {worst_s:.0f} host s (limit {HOST_LIMIT_S}), highest peak "
              f"{worst_mb:.0f} MB (limit {MEMORY_LIMIT_MB}): {'met' if met else 'NOT met'}")  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
