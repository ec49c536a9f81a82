"""The cost model against measurement: predicted and measured time per step under emulated links.

    .venv/bin/python bench/costmodel.py [--out DIR] [--steps 60] [--bandwidth 20Mbit] [--latency 20ms]
                                        [--variants sync local-sgd ssp-allreduce streaming-diloco ...]

Fashion-MNIST, LeNet-5, 4 local workers, batch 64 each, every link emulated (`[network]`). Each variant
trains `--steps` steps through `fast compare` (evaluation only at the end, off the clock). The measured
step time is the run's wall time over its steps; the predicted one is `fast.perfmodel` fed with the run's
own measured compute time per step (the slowest worker's work, its communication waits left out) and
the link, as in summary.json's `predicted_step_time_s`. Target: `sync` (dense, and with top-k frames all-gathered),
`local-sgd`, `gossip`, both `ssp` exchanges, `diloco` (blocking and eager), `streaming-diloco`, `ad-psgd`,
`sparseloco`, `demo` and `noloco` within 25% (measured/predicted between 0.75 and 1.25); the others are shown for
reference.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import fast

TOLERANCE = 0.25
CHECKED = (
    "sync",
    "sync-topk-ef",
    "local-sgd",
    "gossip-torus",
    "ssp",
    "ssp-allreduce",
    "streaming-diloco",
    "diloco",
    "ad-psgd",
    "sparseloco",
    "demo",
    "diloco-eager",
    "noloco",
)

VARIANTS: dict[str, dict[str, Any]] = {
    "sync": {"strategy": {"name": "sync"}},
    "sync-topk-ef": {"strategy": {"name": "sync"}, "codec": {"name": "topk", "ratio": 0.01, "error_feedback": True}},
    "local-sgd": {"strategy": {"name": "local-sgd", "period": 8}},
    "gossip-torus": {"strategy": {"name": "gossip", "topology": "torus:2x2"}},
    "async-ps": {"strategy": {"name": "async-ps", "servers": 1}},
    "ea-wild": {"strategy": {"name": "ea-wild"}},
    "easgd-async": {"strategy": {"name": "easgd", "variant": "async", "tau": 4}},
    "ad-psgd": {"strategy": {"name": "ad-psgd", "topology": "ring"}},
    "ssp": {"strategy": {"name": "ssp", "staleness": 2}},
    "ssp-allreduce": {"strategy": {"name": "ssp", "staleness": 2, "exchange": "all-reduce"}},
    "diloco": {"strategy": {"name": "diloco", "period": 8}},
    "streaming-diloco": {"strategy": {"name": "streaming-diloco", "period": 8, "fragments": 4, "delay": 1}},
    "sparseloco": {"strategy": {"name": "sparseloco", "period": 8}},
    "demo": {"strategy": {"name": "demo"}, "optimizer": {"name": "sgd", "lr": 0.001, "momentum": 0.0}},
    "diloco-eager": {"strategy": {"name": "diloco", "period": 8, "eager": True}},
    "noloco": {"strategy": {"name": "noloco", "period": 8}},
}


def job(names: list[str], steps: int, bandwidth: str, latency: str) -> dict[str, Any]:
    run = {"name": "costmodel", "seed": 0, "workers": 4, "batch_size": 64, "epochs": 1, "max_steps": steps}
    return {
        "run": {**run, "eval_every": 0, "log_every": 10},
        "data": {"name": "fashion-mnist"},
        "model": {"name": "lenet"},
        "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
        "network": {"bandwidth": bandwidth, "latency": latency},
        "variant": [{"name": name, **VARIANTS[name]} for name in names],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="folder of the runs and report.html")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--bandwidth", default="20Mbit")
    parser.add_argument("--latency", default="20ms")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS))
    args = parser.parse_args()
    unknown = sorted(set(args.variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown --variants {unknown}: choose from {', '.join(VARIANTS)}")
    out = args.out or Path(tempfile.mkdtemp(prefix="fast-bench-costmodel-"))
    comparison = fast.compare(job(args.variants, args.steps, args.bandwidth, args.latency), out)

    print(f"\n4 workers, {args.bandwidth}, {args.latency}; {args.steps} steps each")
    print(f"{'variant':<17} {'compute ms':>10} {'predicted ms':>12} {'measured ms':>11} {'meas/pred':>9}  verdict")
    checked = []
    for outcome in comparison.outcomes:
        summary = json.loads((outcome.run_dir / "summary.json").read_text())
        measured, predicted = summary.get("step_time_s"), summary.get("predicted_step_time_s")
        ratio = measured / predicted if measured and predicted else None
        verdict = ""
        if outcome.name in CHECKED:
            ok = ratio is not None and abs(ratio - 1) <= TOLERANCE
            checked.append(ok)
            verdict = "within 25%" if ok else "OUTSIDE 25%"
        print(
            f"{outcome.name:<17} {1e3 * (summary.get('step_compute_s') or 0):>10.1f} "
            f"{1e3 * (predicted or 0):>12.1f} {1e3 * (measured or 0):>11.1f} "
            f"{f'{ratio:.2f}' if ratio else '-':>9}  {verdict}"
        )
    print(f"checked variants ({', '.join(CHECKED)}) within {TOLERANCE:.0%}: {sum(checked)} of {len(checked)}")
    print(f"report: {comparison.report}")


if __name__ == "__main__":
    main()
