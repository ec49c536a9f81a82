"""Stale updates on the demo's network: stale-synchronous over all-reduce against `sync`, and asynchrony-aware
momentum for `ssp` and `async-ps`.

    .venv/bin/python bench/async_momentum.py [--out DIR] [--seeds 0 1 2] [--epochs 1]
                                             [--variants sync ssp-allreduce-comp ssp-comp async-ps async-ps-comp]

Fashion-MNIST, LeNet-5, 4 local workers, batch 64 each, SGD (lr 0.05, momentum 0.9), every link emulated at
20 Mbit/s and 20 ms (examples/demo.toml's job). Each seed runs every variant through `fast compare` (same
initial weights and data partition within a seed). Targets: `ssp` over all-reduce sends `sync`'s bytes with a
shorter step; with `momentum_compensation`, `ssp` (s = 2) and `async-ps` end within 1 point of `sync`'s final
test accuracy, on the mean over the seeds.

`--sweep` adds `ssp` over all-reduce, uncompensated, at other (momentum, lr) pairs, and `sync` without momentum:
whether any momentum reaches `sync`'s accuracy at this staleness. `--engine simulated` runs the job in virtual
time (a step charged 10 ms, links as above), about 15 host seconds a run: `sync` and `ssp` over all-reduce do
the very same arithmetic on both engines (their updates do not depend on timing), the asynchronous variants do
not (their staleness comes from the timing).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

import fast

WITHIN = 0.01  # of sync's final accuracy
BASE: dict[str, Any] = {
    "run": {"name": "momentum", "workers": 4, "batch_size": 64, "eval_every": 0.5},
    "data": {"name": "fashion-mnist", "partition": "iid"},
    "model": {"name": "lenet"},
    "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
    "network": {"bandwidth": "20Mbit", "latency": "20ms"},
}
SSP = {"name": "ssp", "staleness": 2}
VARIANTS: dict[str, dict[str, Any]] = {
    "sync": {"name": "sync"},
    "ssp": SSP,
    "ssp-comp": {**SSP, "momentum_compensation": True},
    "ssp-allreduce": {**SSP, "exchange": "all-reduce"},
    "ssp-allreduce-comp": {**SSP, "exchange": "all-reduce", "momentum_compensation": True},
    "async-ps": {"name": "async-ps"},
    "async-ps-comp": {"name": "async-ps", "momentum_compensation": True},
}
CHECKED = ("ssp-comp", "ssp-allreduce-comp", "async-ps-comp")
SWEEP = [(0.8, 0.05), (0.7, 0.05), (0.5, 0.1), (0.0, 0.2), (0.0, 0.5)]  # (momentum, lr) of ssp over all-reduce


def sweep_variants() -> list[dict[str, Any]]:
    """`ssp` over all-reduce, uncompensated, at the SWEEP's (momentum, lr), and `sync` without momentum."""
    variants = [{"name": f"ssp-allreduce-m{m:g}-lr{lr:g}", "strategy": VARIANTS["ssp-allreduce"],
                 "optimizer": {**BASE["optimizer"], "momentum": m, "lr": lr}} for m, lr in SWEEP]  # fmt: skip
    variants.append({"name": "sync-m0-lr0.2", "strategy": VARIANTS["sync"],
                     "optimizer": {**BASE["optimizer"], "momentum": 0.0, "lr": 0.2}})  # fmt: skip
    return variants


def explicit_momentum(summary: dict[str, Any]) -> float:
    """The momentum the run's updates were applied with: compensated, the servers' (async-ps), or the optimizer's."""
    if "explicit_momentum" in summary:
        return summary["explicit_momentum"]
    config = summary["config"]
    if summary["strategy"] == "async-ps":
        return config["strategy"].get("server_momentum", 0.0)
    return config["optimizer"]["momentum"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--epochs", type=float, default=1.0)
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS),
                        default=["sync", "ssp-allreduce-comp", "ssp-comp", "async-ps", "async-ps-comp"])  # fmt: skip
    parser.add_argument("--sweep", action="store_true", help="add ssp over all-reduce at other (momentum, lr)")
    parser.add_argument("--engine", choices=["processes", "simulated"], default="processes")
    args = parser.parse_args()
    if "sync" not in args.variants:
        parser.error("--variants must include sync")
    out = args.out or Path(tempfile.mkdtemp(prefix="fast-bench-momentum-"))
    variants = [{"name": name, "strategy": VARIANTS[name]} for name in args.variants]
    variants += sweep_variants() if args.sweep else []
    results: dict[str, list[dict[str, Any]]] = {variant["name"]: [] for variant in variants}
    run = {**BASE["run"], "epochs": args.epochs}
    if args.engine == "simulated":
        run.update(engine="simulated", step_time="10ms")
    for seed in args.seeds:
        job = {**BASE, "run": {**run, "seed": seed}, "variant": variants}
        comparison = fast.compare(job, out / f"seed{seed}")
        for outcome in comparison.outcomes:
            results[outcome.name].append(json.loads((outcome.run_dir / "summary.json").read_text()))

    sync = results["sync"]
    sync_mean = statistics.mean(s["final_test_accuracy"] for s in sync)
    print(f"\n4 workers, 20 Mbit/s, 20 ms; {args.epochs:g} epoch(s); seeds {args.seeds}; {args.engine} engine")
    print(f"{'variant':<26} {'final acc (each seed)':<24} {'mean':>7} {'vs sync':>8} {'MB sent':>8} {'step ms':>8} "
          f"{'explicit μ':>10}")  # fmt: skip
    verdicts = []
    for name, runs in results.items():
        accuracies = [s["final_test_accuracy"] for s in runs]
        mean = statistics.mean(accuracies)
        momentum = statistics.mean(explicit_momentum(s) for s in runs)
        print(
            f"{name:<26} {' '.join(f'{a:.4f}' for a in accuracies):<24} {mean:>7.4f} {mean - sync_mean:>+8.4f} "
            f"{statistics.mean(s['bytes_sent'] for s in runs) / 1e6:>8.1f} "
            f"{1e3 * statistics.mean(s['step_time_s'] for s in runs):>8.0f} {momentum:>10.3f}"
        )
        if name in CHECKED:
            verdicts.append((name, mean >= sync_mean - WITHIN))
    for name, ok in verdicts:
        print(f"{name}: within {100 * WITHIN:g} point of sync: {'met' if ok else 'NOT met'}")
    if "ssp-allreduce" in results or "ssp-allreduce-comp" in results:
        runs = results.get("ssp-allreduce") or results["ssp-allreduce-comp"]
        ratio = statistics.mean(s["bytes_sent"] for s in runs) / statistics.mean(s["bytes_sent"] for s in sync)
        faster = statistics.mean(s["step_time_s"] for s in sync) / statistics.mean(s["step_time_s"] for s in runs)
        print(f"ssp over all-reduce: {ratio:.3f}x sync's bytes, steps {faster:.2f}x as fast as sync's")
    print(f"runs: {out}")


if __name__ == "__main__":
    main()
