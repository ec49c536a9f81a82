"""One worker 4x slower: do asynchronous strategies keep the throughput that `sync` loses, and still learn?

    .venv/bin/python bench/stragglers.py [--out DIR] [--time 120s] [--target 0.85]
                                         [--variants sync async-ps ad-psgd push-sum gossip-ring]

Fashion-MNIST, LeNet-5, 4 local workers, batch 64 each, SGD (lr 0.05, momentum 0.9), native communication;
`[compute] slowdown = [1, 1, 1, 4]`: worker 3 sleeps 3x its measured compute time at every step, so its steps
take 4x as long. Every variant trains for the same time (`run.max_time`, evaluation off the clock; 100
epochs, so that the clock always binds first), through `fast compare` (same seed, initial weights and data
partition; report.html beside the runs). Asynchronous workers end on their own clock, so a fast worker's
extra steps count; lock-step variants end together.

samples/s is every worker's samples over the run's wall time. Targets of the issue: `async-ps` and the
asynchronous gossip variants process at least 2x the samples/s of `sync` and still reach the target test
accuracy. D-PSGD (`gossip-ring`) is lock-step with its neighbours, hence with everyone: it is shown for
reference, bounded by the straggler like `sync`.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import fast

TARGET_THROUGHPUT = 2.0
ASYNCHRONOUS = ("async-ps", "ad-psgd", "push-sum")

BASE: dict[str, Any] = {
    "run": {"name": "stragglers", "seed": 0, "workers": 4, "batch_size": 64, "epochs": 100, "eval_every": 0.5},
    "data": {"name": "fashion-mnist", "partition": "iid"},
    "model": {"name": "lenet"},
    "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
    "compute": {"slowdown": [1, 1, 1, 4]},
}

VARIANTS: dict[str, dict[str, Any]] = {
    "sync": {"strategy": {"name": "sync"}},
    "async-ps": {"strategy": {"name": "async-ps", "servers": 1}},
    "ad-psgd": {"strategy": {"name": "ad-psgd", "topology": "ring"}},
    "push-sum": {"strategy": {"name": "push-sum", "topology": "ring"}},
    "gossip-ring": {"strategy": {"name": "gossip", "topology": "ring"}},
}


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def times(value: float | None) -> str:
    return f"{value:.2f}x" if value is not None else "-"


def job(names: list[str], target: float, max_time: str) -> dict[str, Any]:
    run = {**BASE["run"], "targets": [target], "max_time": max_time}
    return {**BASE, "run": run, "variant": [{"name": name, **VARIANTS[name]} for name in names]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="folder of the runs and report.html")
    parser.add_argument("--time", default="120s", help="training time of every variant (epochs never bind first)")
    parser.add_argument("--target", type=float, default=0.85)
    parser.add_argument("--variants", nargs="+", default=["sync", "async-ps", "ad-psgd", "gossip-ring"])
    args = parser.parse_args()
    unknown = sorted(set(args.variants) - set(VARIANTS))
    if unknown or "sync" not in args.variants:
        parser.error(f"--variants must include sync and come from {', '.join(VARIANTS)} (got {unknown or 'no sync'})")
    out = args.out or Path(tempfile.mkdtemp(prefix="fast-bench-stragglers-"))
    comparison = fast.compare(job(args.variants, args.target, args.time), out)

    summaries = {o.name: json.loads((o.run_dir / "summary.json").read_text()) for o in comparison.outcomes}
    show(summaries, f"{args.target:g}", args.time)
    print(f"report: {comparison.report}")


def show(summaries: dict[str, dict[str, Any]], key: str, time_label: str) -> None:
    """The table: each variant against sync, and whether the asynchronous ones meet the target."""
    base = summaries["sync"]
    print(f"\n4 workers, worker 3 4x slower, {time_label} of training each; target test accuracy {key}")
    print(
        f"{'variant':<12} {'samples/s':>10} {'vs sync':>8} {'w0 steps':>9} {'vs sync':>8} {'best acc':>9} "
        f"{'to target':>11} {'vs sync':>8}  verdict"
    )
    verdicts = []
    for name, summary in summaries.items():
        rate = ratio(summary.get("samples_per_s"), base.get("samples_per_s"))
        fast_worker = ratio(summary.get("steps_per_worker"), base.get("steps_per_worker"))
        reached = (summary.get("time_to_accuracy_s") or {}).get(key)
        sooner = ratio(base["time_to_accuracy_s"].get(key), reached)
        verdict = ""
        if name in ASYNCHRONOUS:
            ok = rate is not None and rate >= TARGET_THROUGHPUT and reached is not None
            verdicts.append(ok)
            verdict = "met" if ok else "NOT met"
        print(
            f"{name:<12} {summary.get('samples_per_s') or 0:>10.0f} {times(rate):>8} "
            f"{summary.get('steps_per_worker') or 0:>9} {times(fast_worker):>8} "
            f"{summary.get('best_test_accuracy') or 0.0:>9.4f} "
            f"{f'{reached:.1f} s' if reached is not None else 'not reached':>11} {times(sooner):>8}  {verdict}"
        )
    print(
        f"asynchronous variants at >= {TARGET_THROUGHPUT:g}x sync's samples/s and reaching {key}: "
        f"{sum(verdicts)} of {len(verdicts)}"
    )
    # the work of one step alone on a core (sync's workers compute side by side, then wait): the cores a variant
    # keeps busy is its steps per second times that; no variant can keep more cores busy than the machine has
    work_s, batch = base.get("step_compute_s"), BASE["run"]["batch_size"]
    if work_s:
        busy = {name: (s.get("samples_per_s") or 0) / batch * work_s for name, s in summaries.items()}
        shown = ", ".join(f"{name} {cores:.2f}" for name, cores in busy.items())
        print(f"cores kept busy (steps/s x sync's {1e3 * work_s:.1f} ms of work per step): {shown}")
        print(
            f"w0 steps: worker 0's steps (a fast worker). With {os.cpu_count()} cores, no variant can exceed "
            f"{os.cpu_count() / busy['sync']:.2f}x sync's samples/s here: while sync's fast workers wait for the "
            "straggler, cores idle; asynchronous workers keep every core busy."
        )


if __name__ == "__main__":
    main()
