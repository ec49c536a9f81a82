"""Edge deployment: how much sooner, and with how many fewer bytes, than dense `sync` do strategies reach 0.85?

    .venv/bin/python bench/edge.py [--out DIR] [--target 0.85] [--epochs 4.5] [--sync-epochs 4]
                                   [--variants sync local-sgd local-sgd-sign overlapped-sign ...]

Fashion-MNIST, LeNet-5, 8 local workers, batch 64 each, SGD (lr 0.05, momentum 0.9), every link emulated
at 10 Mbit/s with 50 ms latency each way (`[network]`, so every message pays latency + bytes / bandwidth on
its own link). The variants run one after another through `fast compare` (same seed, same initial weights,
same data partition), which also writes report.html; the table below reads each run's summary.json.

Time to target is wall time from the common start of training to the first test evaluation at or above the
target (evaluation itself is off the clock); MB to target are the bytes all workers had sent by then (from
metrics.jsonl). The shares are each worker's training time spent computing, on the strategy's own work with
messages, and waiting (fast.comm.timeline). Targets of the issue: the best variant reaches 0.85 at least 10x
sooner than dense `sync`, and the best sends at least 100x fewer bytes than `sync` to get there. If `sync` does
not reach the target within its epochs the ratios are lower bounds (its whole run is used) and print as ">=".
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import fast

TARGET_SPEEDUP = 10.0
TARGET_BYTES = 100.0

BASE: dict[str, Any] = {
    "run": {"name": "edge", "seed": 0, "workers": 8, "batch_size": 64, "eval_every": 0.125, "log_every": 2},
    "data": {"name": "fashion-mnist", "partition": "iid"},
    "model": {"name": "lenet"},
    "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
    "network": {"bandwidth": "10Mbit", "latency": "50ms"},
}

TOPK_EF = {"name": "topk", "ratio": 0.01, "error_feedback": True}
SIGN_EF = {"name": "sign", "error_feedback": True}  # one bit per element and a scale, with error feedback


def streaming(fragments: int, delay: int, codec: dict[str, Any], period: int = 16) -> dict[str, Any]:
    """Streaming DiLoCo with plain averaging as its outer step (outer lr 1, no momentum), mixing α = 0.5."""
    strategy = {"name": "streaming-diloco", "period": period, "fragments": fragments, "delay": delay,
                "outer_lr": 1.0, "outer_momentum": 0.0}  # fmt: skip
    return {"strategy": strategy, "codec": codec}


VARIANTS: dict[str, dict[str, Any]] = {
    "sync": {"strategy": {"name": "sync"}},
    "local-sgd": {"strategy": {"name": "local-sgd", "period": 16}},
    "gossip-exp": {"strategy": {"name": "gossip", "schedule": "exponential-one-peer"}},
    "gossip-torus": {"strategy": {"name": "gossip", "topology": "torus:2x4"}},
    "sync-topk-ef": {"strategy": {"name": "sync"}, "codec": TOPK_EF},
    "ssp-allreduce": {
        "strategy": {"name": "ssp", "staleness": 2, "exchange": "all-reduce", "momentum_compensation": True}
    },  # fmt: skip
    "diloco": {"strategy": {"name": "diloco", "period": 16}},
    "diloco-topk": {
        "strategy": {"name": "diloco", "period": 16, "outer_lr": 1.0, "outer_momentum": 0.0},
        "codec": TOPK_EF,
    },  # fmt: skip
    "diloco-sign": {"strategy": {"name": "diloco", "period": 16}, "codec": SIGN_EF},
    "local-sgd-topk": {"strategy": {"name": "local-sgd", "period": 16}, "codec": TOPK_EF},
    "local-sgd-sign": {"strategy": {"name": "local-sgd", "period": 16}, "codec": SIGN_EF},
    "local-sgd-sign-32": {"strategy": {"name": "local-sgd", "period": 32}, "codec": SIGN_EF},
    "streaming-topk": streaming(4, 2, TOPK_EF),
    "streaming-sign": streaming(4, 2, SIGN_EF),
    "streaming-sign-2": streaming(2, 6, SIGN_EF),
    "overlapped-sign": streaming(1, 8, SIGN_EF),  # one fragment: the whole round behind 8 inner steps
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
    parser.add_argument("--epochs", type=float, default=4.5, help="epochs of every variant but sync")
    parser.add_argument("--sync-epochs", type=float, default=4.0, help="epochs of the sync variants")
    parser.add_argument("--variants", nargs="+", default=["sync", "local-sgd", "local-sgd-sign", "overlapped-sign"])
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
        until = reached if reached is not None else summary.get("wall_time_s") or 0.0
        rows.append((outcome.name, summary, reached, bytes_until(outcome.run_dir, until)))
    _, sync_summary, sync_time, sync_bytes = next(row for row in rows if row[0] == "sync")
    bound = sync_time is None  # sync never got there: its whole training time is a lower bound
    sync_time = sync_time if sync_time is not None else sync_summary.get("wall_time_s")

    print(f"\n8 workers, 10 Mbit/s, 50 ms; time to test accuracy {args.target:g} (wall time, evaluation off the clock)")
    header = ["variant", "final acc", "step ms", "MB sent", "to target", "MB to it", "sooner", "fewer B",
              "compute", "comm", "wait"]  # fmt: skip
    print(" ".join(f"{h:>10}" if i else f"{h:<15}" for i, h in enumerate(header)))
    best_time = best_bytes = 0.0
    for name, summary, reached, sent in rows:
        sooner = sync_time / reached if reached and sync_time else None
        fewer = sync_bytes / sent if reached and sent else None
        if name != "sync":
            best_time = max(best_time, sooner or 0.0)
            best_bytes = max(best_bytes, fewer or 0.0)
        mark = ">=" if bound and name != "sync" else ""
        shares = summary.get("time_shares") or {}
        cells = [
            f"{summary.get('final_test_accuracy') or 0:.4f}",
            f"{1e3 * (summary.get('step_time_s') or 0):.0f}",
            f"{(summary.get('bytes_sent') or 0) / 1e6:.1f}",
            f"{reached:.1f} s" if reached is not None else "not reached",
            f"{sent / 1e6:.2f}" if reached is not None else "-",
            f"{mark}{sooner:.1f}x" if sooner is not None else "-",
            f"{mark}{fewer:.0f}x" if fewer is not None else "-",
            *(f"{100 * shares[k]:.0f}%" if k in shares else "-" for k in ("compute", "communicate", "wait")),
        ]
        print(f"{name:<15} " + " ".join(f"{c:>10}" for c in cells))
    for what, best, goal in (("sooner", best_time, TARGET_SPEEDUP), ("fewer bytes", best_bytes, TARGET_BYTES)):
        verdict = "met" if best >= goal else "NOT met"
        print(f"best variant, {what} than sync to {args.target:g}: {'>=' if bound else ''}{best:.1f}x "
              f"(target >= {goal:g}x: {verdict})")  # fmt: skip
    print(f"report: {comparison.report}")


def bytes_until(run_dir: Path, seconds: float) -> float:
    """Bytes all workers had sent by `seconds` of training time: each one's last record at or before then."""
    latest: dict[int, float] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "bytes_sent" in record and record.get("time_s", 0.0) <= seconds:
            worker = int(record.get("worker", 0))
            latest[worker] = max(latest.get(worker, 0.0), float(record["bytes_sent"]))
    return sum(latest.values())


if __name__ == "__main__":
    main()
