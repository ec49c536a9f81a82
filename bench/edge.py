"""Edge deployment: is a non-`sync` strategy at least 5x faster than dense `sync` to 0.85 test accuracy?

    .venv/bin/python bench/edge.py [--out DIR] [--target 0.85] [--epochs 3] [--sync-epochs 2.5]
                                   [--variants sync local-sgd gossip-exp sync-topk-ef]

Fashion-MNIST, LeNet-5, 8 local workers, batch 64 each, SGD (lr 0.05, momentum 0.9), every link emulated
at 10 Mbit/s with 50 ms latency each way (`[network]`, so every message pays latency + bytes / bandwidth on
its own link). The variants run one after another through `fast compare` (same seed, same initial weights,
same data partition), which also writes report.html; the table below reads each run's summary.json.

Time to target is wall time from the common start of training to the first test evaluation at or above the
target (evaluation itself is off the clock). Target of the issue: the best non-`sync` variant reaches 0.85
at least 5x sooner than dense `sync`. If `sync` does not reach the target within its epochs, the ratio is
a lower bound (its whole training time is used) and is printed as ">=".
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import fast

TARGET_SPEEDUP = 5.0

BASE: dict[str, Any] = {
    "run": {"name": "edge", "seed": 0, "workers": 8, "batch_size": 64, "eval_every": 0.25},
    "data": {"name": "fashion-mnist", "partition": "iid"},
    "model": {"name": "lenet"},
    "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
    "network": {"bandwidth": "10Mbit", "latency": "50ms"},
}

VARIANTS: dict[str, dict[str, Any]] = {
    "sync": {"strategy": {"name": "sync"}},
    "local-sgd": {"strategy": {"name": "local-sgd", "period": 16}},
    "gossip-exp": {"strategy": {"name": "gossip", "schedule": "exponential-one-peer"}},
    "sync-topk-ef": {"strategy": {"name": "sync"}, "codec": {"name": "topk", "ratio": 0.01, "error_feedback": True}},
    "diloco": {"strategy": {"name": "diloco", "period": 16}},
    "gossip-torus": {"strategy": {"name": "gossip", "topology": "torus:2x4"}},
}


def job(names: list[str], target: float, epochs: float, sync_epochs: float) -> dict[str, Any]:
    variants = []
    for name in names:
        overrides = VARIANTS[name]
        run = {"epochs": sync_epochs if overrides["strategy"]["name"] == "sync" else epochs}
        variants.append({"name": name, **overrides, "run": run})
    return {**BASE, "run": {**BASE["run"], "targets": [target]}, "variant": variants}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="folder of the runs and report.html")
    parser.add_argument("--target", type=float, default=0.85)
    parser.add_argument("--epochs", type=float, default=3.0, help="epochs of every variant but sync")
    parser.add_argument("--sync-epochs", type=float, default=2.5, help="epochs of the sync variants")
    parser.add_argument("--variants", nargs="+", default=["sync", "local-sgd", "gossip-exp", "sync-topk-ef"])
    args = parser.parse_args()
    unknown = sorted(set(args.variants) - set(VARIANTS))
    if unknown or "sync" not in args.variants:
        parser.error(f"--variants must include sync and come from {', '.join(VARIANTS)} (got {unknown or 'no sync'})")
    out = args.out or Path(tempfile.mkdtemp(prefix="fast-bench-edge-"))
    comparison = fast.compare(job(args.variants, args.target, args.epochs, args.sync_epochs), out)

    key = f"{args.target:g}"
    rows = []
    for outcome in comparison.outcomes:
        summary = json.loads((outcome.run_dir / "summary.json").read_text())
        reached = (summary.get("time_to_accuracy_s") or {}).get(key)
        rows.append((outcome.name, summary, reached))
    sync_summary, sync_time = next((s, t) for name, s, t in rows if name == "sync")
    bound = sync_time is None  # sync never got there: its whole training time is a lower bound
    sync_time = sync_time if sync_time is not None else sync_summary.get("wall_time_s")

    print(f"\n8 workers, 10 Mbit/s, 50 ms; time to test accuracy {args.target:g} (wall time, evaluation off the clock)")
    print(f"{'variant':<14} {'final acc':>9} {'step ms':>8} {'MB sent':>9} {'to target':>10} {'sync/this':>10}")
    best = 0.0
    for name, summary, reached in rows:
        ratio = sync_time / reached if reached and sync_time else None
        if name != "sync" and ratio is not None:
            best = max(best, ratio)
        shown = f"{'>=' if bound and name != 'sync' else ''}{ratio:.2f}" if ratio is not None else "-"
        print(
            f"{name:<14} {summary.get('final_test_accuracy') or 0:>9.4f} "
            f"{1e3 * (summary.get('step_time_s') or 0):>8.0f} "
            f"{(summary.get('bytes_sent') or 0) / 1e6:>9.1f} "
            f"{f'{reached:.1f} s' if reached is not None else 'not reached':>10} {shown:>10}"
        )
    verdict = "met" if best >= TARGET_SPEEDUP else "NOT met"
    speedup = f"{'>=' if bound else ''}{best:.2f}x"
    print(f"best non-sync speed-up to {args.target:g}: {speedup} (target >= {TARGET_SPEEDUP:g}x: {verdict})")
    print(f"report: {comparison.report}")


if __name__ == "__main__":
    main()
