"""The simulated engine at scale: host cost and memory against workers (256 to 1,024), churn at 1,024 workers at the
failure rate of bench/churn.py, and the papers' questions at 8 to 128 workers.

    .venv/bin/python bench/sim_scale.py [--workers 256 512 1024] [--epochs 1] [--sections scale churn figures]
                                        [--only NAME] [--failure-every 15 | --stay 120] [--absence 3] [--churn-time 150]
                                        [--churn-strategies sync local-sgd] [--latency 5ms] [--form-time 0.2s]
                                        [--repeat] [--reports DIR] [--out FILE]

Fashion-MNIST, LeNet-5, batch 16 per worker, SGD (lr 0.05, momentum 0.9), links of 100 Mbit/s and 5 ms (`--latency`:
another), a step charged 5 ms of compute (`run.step_time`, so that every run repeats exactly). Each run is a process
of its own, so that its peak memory is its own.

- `scale`: at each worker count, `gossip` on a square torus with `send_probability` 1.0, 0.5 and 0.25 (the partial
  communication of papers 000/001), `local-sgd` (period 8), and `async-ps` with one server shard per 16 workers (and
  `staleness_lr`), one epoch. A run's host time in three: its set-up (until every worker has begun its first step),
  its training (to worker 0's `job.finish`) and its end (final model, evaluations, outputs). Host milliseconds per
  simulated worker-step count the training alone, and should stay flat as the workers grow; the ratio to the fewest
  workers is printed per variant. Every run must end within 30 minutes and 16 GiB.
- `churn`: at the largest worker count, live `sync` and `local-sgd` (period 4; `--churn-strategies` may add `diloco`,
  period 4, or `gossip`), each for `--churn-time` virtual seconds (`run.max_time`), without churn and with `[faults]
  churn` at the failure rate of bench/churn.py: a failure of the run every `--failure-every` virtual seconds on
  average (each worker, worker 0 too, stays an exponential time of mean that times the workers; never the last), or
  each worker's mean stay `--stay` (bench/churn.py's per worker: 120 s), each leaver replaced by a new worker after an
  exponential absence of mean `--absence`. Goodput, as the issue defines it:
  samples trained per member-second present, churned over steady. A member is present while it is in a formed
  generation (from the generation's forming to the next one's): a leaver counts until the members re-form without it
  (the stall it causes is churn's cost), a joiner from the generation that took it in. Each generation's group
  takes `--form-time` to form (`run.form_time`: a real run's meeting at its store and connections). Compute is
  virtual and charged per step, so fewer members do not step faster (the skew bench/churn.py must normalise on 2
  cores is absent); a smaller ring's all-reduce is a little shorter, which the per-member-second figure keeps.
  `--repeat`: each churned run twice, which must be equal (deterministic by seed).
- `figures`: `fast compare` of `examples/scale/trend.toml` (paper 004: `sync` against `async-ps` at 8, 32 and 128
  workers) and of `examples/scale/partial.toml` (gossip's send probability against the workers, with replica
  divergence), one report.html each under --reports.
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

MEMORY_LIMIT_MB, HOST_LIMIT_S = 16 * 1024, 30 * 60
CHURN_STRATEGIES = {
    "sync": {"name": "sync"},
    "local-sgd": {"name": "local-sgd", "period": 4},
    "diloco": {"name": "diloco", "period": 4},
    "gossip": {"name": "gossip"},  # (a torus of the workers: see churn)
}


def config(workers: int, strategy: dict[str, Any], epochs: float, latency: str = "5ms",
           form_time: str = "free") -> dict[str, Any]:  # fmt: skip
    return {
        "run": {"name": strategy["name"], "seed": 0, "workers": workers, "batch_size": 16, "epochs": epochs,
                "eval_every": 0, "engine": "simulated", "step_time": "5ms", "targets": [0.7], "log_every": 10,
                "form_time": form_time},
        "data": {"name": "fashion-mnist"},
        "model": {"name": "lenet"},
        "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
        "strategy": strategy,
        "network": {"bandwidth": "100Mbit", "latency": latency},
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
        plan.append(("async-ps", n, {"name": "async-ps", "servers": shards, "staleness_lr": True}))
    return plan


def member_seconds(summary: dict[str, Any]) -> float:
    """The member-seconds present in a run's training: each formed generation's members, from its forming to the next
    one's (the last to the end of training); a run of fixed membership, its workers all along."""
    events, end = summary.get("membership") or [], summary["wall_time_s"]
    if not events:
        return summary["workers"] * end
    times = [e["unix_time"] for e in events] + [end]
    return sum(len(e["members"]) * max(0.0, later - e["unix_time"]) for e, later in zip(events, times[1:], strict=True))


def run_one(job: dict[str, Any]) -> dict[str, Any]:
    """One run in this process (a child of main): its summary's figures, as JSON on stdout."""
    import fast

    with tempfile.TemporaryDirectory(prefix="fast-sim-scale-") as out:
        summary = fast.train(job, out=out)
    sim = summary["simulation"]
    events = summary.get("membership") or []
    worker_steps = summary["steps_per_worker"] * summary["workers"]
    setup_s, training_s = sim["setup_host_s"] or 0.0, sim["training_host_s"] or sim["host_s"]
    setup_cpu, training_cpu = sim["setup_cpu_s"] or 0.0, sim["training_cpu_s"] or sim["cpu_s"]
    return {
        "steps_per_worker": summary["steps_per_worker"],
        "virtual_s": summary["wall_time_s"],
        "host_s": sim["host_s"],
        "setup_host_s": setup_s,
        "end_host_s": round(sim["host_s"] - training_s, 3),
        "host_ms_per_worker_step": 1000 * (training_s - setup_s) / worker_steps if worker_steps else None,
        "cpu_s": sim["cpu_s"],
        "cpu_ms_per_worker_step": 1000 * (training_cpu - setup_cpu) / worker_steps if worker_steps else None,
        "peak_memory_mb": sim["peak_memory_mb"],
        "accuracy": summary["final_test_accuracy"],
        "divergence": summary.get("replica_divergence"),
        "bytes_sent": summary["bytes_sent"],
        "samples": summary["samples"],
        "member_s": member_seconds(summary),
        "changes": max(0, len(events) - 1),
        "left": sum(len(e["left"]) for e in events),
        "joined": sum(len(e["joined"]) for e in events),
        "catch_up_bytes": summary.get("catch_up_bytes"),
        "workers_at_end": summary.get("workers_at_end"),
        "membership": [(e["generation"], e["step"], e["members"]) for e in events],
    }


def cell(value: Any, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}" if isinstance(value, float) else str(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[256, 512, 1024])
    parser.add_argument("--epochs", type=float, default=1.0)
    parser.add_argument("--sections", nargs="+", choices=["scale", "churn", "figures"], default=["scale", "churn"])
    parser.add_argument("--reports", default="runs/sim-scale", help="where the figures' reports go")
    parser.add_argument("--out", help="write the rows as JSON here")
    parser.add_argument("--only", help="scale: only the variants whose name contains this, e.g. async-ps")
    parser.add_argument("--failure-every", type=float, default=15.0, help="churn: mean virtual s between failures")
    parser.add_argument("--stay", type=float, help="churn: each worker's mean stay (virtual s), for --failure-every: "
                        "bench/churn.py's is 120 (a failure every 15 s across 8 workers)")  # fmt: skip
    parser.add_argument("--absence", type=float, default=3.0, help="churn: mean virtual seconds before a replacement")
    parser.add_argument("--churn-time", type=float, default=150.0, help="churn: virtual seconds of training per run")
    parser.add_argument("--churn-strategies", nargs="+", choices=list(CHURN_STRATEGIES), default=["sync", "local-sgd"])
    parser.add_argument(
        "--latency", default="5ms", help="the links' latency (a ring of 1,024 pays it 2,046 times an all-reduce)"
    )
    parser.add_argument("--form-time", default="0.2s", help="churn: what forming a group costs each member "
                        "(run.form_time; a real run's form_s, 8 members on this machine: 0.2 s)")  # fmt: skip
    parser.add_argument("--repeat", action="store_true", help="churn: run each churned run twice, to compare")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child's job, as JSON
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(json.loads(args.one))))
        return
    rows: list[dict[str, Any]] = []
    if "scale" in args.sections:
        rows += scale(args)
    if "churn" in args.sections:
        rows += churn(args)
    if "figures" in args.sections:
        figures(Path(args.reports))
    if args.out:
        kept = [{k: v for k, v in row.items() if k != "membership"} for row in rows]
        Path(args.out).write_text(json.dumps(kept, indent=2))


def _one_process(job: dict[str, Any]) -> dict[str, Any] | str:
    """The figures of `job`, run in a process of its own (its peak memory its own), or why it failed."""
    done = subprocess.run([sys.executable, __file__, "--one", json.dumps(job)], capture_output=True, text=True)
    if done.returncode != 0:
        return f"failed: {done.stderr.strip().splitlines()[-1:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def scale(args: argparse.Namespace) -> list[dict[str, Any]]:
    plan = [row for row in scale_plan(args.workers) if args.only is None or args.only in row[0]]
    print("| workers | variant | steps/worker | virtual s | host s | set-up s | host ms per worker-step | CPU ms per "
          "worker-step | end s | peak MB | accuracy | divergence |\n|---|---|---|---|---|---|---|---|---|---|---|---|",
          flush=True)  # fmt: skip
    rows = []
    for name, workers, strategy in plan:
        figures = _one_process(config(workers, strategy, args.epochs, args.latency))
        if isinstance(figures, str):
            print(f"| {workers} | {name} | {figures} |", flush=True)
            continue
        row = {"section": "scale", "variant": name, "workers": workers, **figures}
        rows.append(row)
        print(f"| {workers} | {name} | {row['steps_per_worker']} | {cell(row['virtual_s'])} | {cell(row['host_s'])} | "
              f"{cell(row['setup_host_s'])} | {cell(row['host_ms_per_worker_step'], 2)} | "
              f"{cell(row['cpu_ms_per_worker_step'], 2)} | {cell(row['end_host_s'])} | "
              f"{cell(row['peak_memory_mb'], 0)} | {cell(row['accuracy'], 4)} | {cell(row['divergence'], 4)} |",
              flush=True)  # fmt: skip
    print("\nper worker-step, against the fewest workers (flat: about 1), host time / the process's CPU time (on a "
          "host that others load, the CPU time is the run's own):")  # fmt: skip
    for name in dict.fromkeys(r["variant"] for r in rows):
        mine = sorted((r["workers"], r["host_ms_per_worker_step"], r["cpu_ms_per_worker_step"]) for r in rows
                      if r["variant"] == name)  # fmt: skip
        print(f"  {name}: " + ", ".join(f"{n}: {ms / mine[0][1]:.2f} / {cpu / mine[0][2]:.2f}" for n, ms, cpu in mine))
    if rows:
        worst_s, worst_mb = max(r["host_s"] for r in rows), max(r["peak_memory_mb"] for r in rows)
        met = worst_s < HOST_LIMIT_S and worst_mb < MEMORY_LIMIT_MB
        print(f"longest run {worst_s:.0f} host s (limit {HOST_LIMIT_S}), highest peak {worst_mb:.0f} MB (limit "
              f"{MEMORY_LIMIT_MB}): {'met' if met else 'NOT met'}")  # fmt: skip
    return rows


def churn(args: argparse.Namespace) -> list[dict[str, Any]]:
    workers = max(args.workers)
    lifetime = args.stay or args.failure_every * workers  # the run loses a member every `every` s on average
    every = lifetime / workers
    print(f"\nchurn at {workers} workers: a failure every {every:g} virtual s on average (each worker's mean stay "
          f"{lifetime:g} s), mean absence {args.absence:g} s, {args.churn_time:g} virtual s of training per run, "
          f"links of {args.latency}, a group formed in {args.form_time}\n",
          flush=True)  # fmt: skip
    print("| strategy | churn | steps/worker | virtual s | host s | peak MB | accuracy | leaves / joins | catch-up MB "
          "| samples | member-s | samples per member-s | goodput | repeats |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|", flush=True)  # fmt: skip
    rows = []
    for name in args.churn_strategies:
        strategy = dict(CHURN_STRATEGIES[name])
        if name == "gossip":
            strategy["topology"] = torus(workers)
        job = config(workers, strategy, 10_000, args.latency, args.form_time)
        job["run"].update(membership="live", max_time=f"{args.churn_time:g}s")
        steady = _one_process(job)
        job["faults"] = {"churn": {"lifetime": f"{lifetime:g}s", "absence": f"{args.absence:g}s"}}
        churned = _one_process(job)
        again = _one_process(job) if args.repeat and isinstance(churned, dict) else None
        for label, row in (("no", steady), ("yes", churned)):
            if isinstance(row, str):
                print(f"| {name} | {label} | {row} |", flush=True)
                continue
            rows.append({"section": "churn", "variant": name, "workers": workers, "churn": label == "yes", **row})
            rate = row["samples"] / row["member_s"]
            goodput = rate / (steady["samples"] / steady["member_s"]) if isinstance(steady, dict) else None
            rows[-1]["goodput"] = goodput
            repeats = "-" if row is steady or again is None else "yes" if isinstance(again, dict) and all(
                again[k] == row[k] for k in ("membership", "accuracy", "bytes_sent", "samples")) else "NO"  # fmt: skip
            print(f"| {name} | {label} | {row['steps_per_worker']} | {cell(row['virtual_s'])} | {cell(row['host_s'])} "
                  f"| {cell(row['peak_memory_mb'], 0)} | {cell(row['accuracy'], 4)} | {row['left']} / {row['joined']} "
                  f"| {cell((row['catch_up_bytes'] or 0) / 1e6)} | {row['samples']:,} | {cell(row['member_s'], 0)} "
                  f"| {cell(rate, 3)} | {cell(goodput, 3)} | {repeats} |", flush=True)  # fmt: skip
    return rows


def figures(reports: Path) -> None:
    import fast

    examples = Path(__file__).resolve().parent.parent / "examples" / "scale"
    for name in ("trend", "partial"):
        comparison = fast.compare(str(examples / f"{name}.toml"), out=str(reports / name))
        print(f"{name}: {comparison.report}", flush=True)


if __name__ == "__main__":
    main()
