"""The language model of examples/lm on 4 workers linked at 10 Mbit/s, 50 ms: sync, local SGD and DiLoCo.

    .venv/bin/python bench/lm.py [--steps 300] [--out DIR]          # about 20 minutes on 2 cores

Every variant is the user's own script (examples/lm/train.py, the loop API) started by `fast run`, with the same
seed, model (a byte-level transformer, [model] width 96), data, AdamW inner optimizer and warm-up-then-cosine
schedule, on the same emulated links. `sync` trains `--steps` steps; the others, whose steps are cheap on such
links, train twice as many, so that the question is how soon and with how many bytes each gets to the validation
perplexity sync ends at. DiLoCo's outer optimizer is Nesterov SGD (lr 0.7, momentum 0.5: with so few outer
rounds, the paper's 0.9 overshoots); one DiLoCo variant also sends its pseudo-gradients as 8-bit integers.
`streaming-fp16` is Streaming DiLoCo: 4 fragments, each synchronised every 300 steps a quarter period apart, the
all-reduce of fp16 pseudo-gradients overlapping 5 inner steps.

Targets: a DiLoCo variant within 5% of sync's final validation perplexity with at least 50x fewer bytes, and at
sync's final perplexity sooner in wall time than sync; streaming within 5% with at least 200x fewer bytes.
A report.html of the runs is written beside them.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import fast
from fast.tools.comparison import write_report

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "lm" / "train.py"
WORKERS = 4
NETWORK = {"network__bandwidth": "10Mbit", "network__latency": "50ms"}
JOB = {"model__width": 96, "run__log_every": 20, "run__seed": 0}
LONGER = 2  # the variants other than sync train this many times sync's steps
DILOCO = {"strategy__name": "diloco", "strategy__outer_lr": 0.7, "strategy__outer_momentum": 0.5}
VARIANTS = {
    "sync": {"strategy__name": "sync", "strategy__bucket_mb": 8.0},
    "local-sgd": {"strategy__name": "local-sgd", "strategy__period": 25},
    "diloco": {**DILOCO, "strategy__period": 120},
    "diloco-uint8": {**DILOCO, "strategy__period": 60, "codec__name": "uint8"},
    "streaming-fp16": {
        **DILOCO,
        "strategy__name": "streaming-diloco",
        "strategy__period": 300,
        "strategy__fragments": 4,
        "strategy__delay": 5,
        "codec__name": "fp16",
    },  # fmt: skip
}
TARGET_PERPLEXITY_GAP, TARGET_BYTES, TARGET_STREAMING_BYTES = 0.05, 50.0, 200.0


def first_time_at(summary: dict, perplexity: float) -> float | None:
    """The first evaluation time at which the run's validation perplexity was at most `perplexity`."""
    return next((e["time_s"] for e in summary["evaluations"] if e["test_perplexity"] <= perplexity), None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="sync's steps (the others train twice as many)")
    parser.add_argument("--out", default=f"runs/bench-lm-{time.strftime('%Y%m%d-%H%M%S')}")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    args = parser.parse_args()
    out = Path(args.out)
    summaries: dict[str, dict] = {}
    for name in args.variants:
        steps = args.steps if name == "sync" else LONGER * args.steps
        overrides = {**JOB, **NETWORK, **VARIANTS[name], "run__max_steps": steps, "run__epochs": 2 * LONGER}
        print(f"== {name}: {steps} steps", flush=True)
        started = time.monotonic()
        summaries[name] = fast.run(str(SCRIPT), workers=WORKERS, out=str(out / name), **overrides)
        print(f"   {time.monotonic() - started:.0f} s", flush=True)
    write_report(out, [out / name for name in summaries], title="FAST: the language model on 10 Mbit/s, 50 ms")
    sync = summaries.get("sync")
    print()
    header = f"{'variant':<14} {'steps':>6} {'val ppl':>8} {'vs sync':>8} {'MB sent':>9} {'bytes/x':>8} {'wall s':>8}"
    print(header + f" {'t to sync ppl':>13} {'sooner':>7}")
    met = []
    for name, s in summaries.items():
        ppl, sent, wall = s["final_test_perplexity"], s["bytes_sent"], s["wall_time_s"]
        if sync is None:
            print(f"{name:<14} {s['steps_per_worker']:>6} {ppl:>8.3f} {sent / 1e6:>9.1f} {wall:>8.0f}")
            continue
        gap = ppl / sync["final_test_perplexity"] - 1
        fewer = sync["bytes_sent"] / sent if sent else float("inf")
        reach = first_time_at(s, sync["final_test_perplexity"])
        sync_reach = first_time_at(sync, sync["final_test_perplexity"])
        sooner = sync_reach / reach if reach else None
        print(
            f"{name:<14} {s['steps_per_worker']:>6} {ppl:>8.3f} {gap:>+8.1%} {sent / 1e6:>9.1f} {fewer:>7.1f}x "
            f"{wall:>8.0f} {f'{reach:.0f}' if reach is not None else 'not reached':>13} "
            f"{f'{sooner:.1f}x' if sooner else '-':>7}"
        )
        if name.startswith("diloco") and gap <= TARGET_PERPLEXITY_GAP and fewer >= TARGET_BYTES and sooner:
            met.append(name)
        if name.startswith("streaming") and gap <= TARGET_PERPLEXITY_GAP and fewer >= TARGET_STREAMING_BYTES:
            met.append(name)
    (out / "bench.json").write_text(json.dumps(summaries, indent=1))
    print(f"\nreport: {(out / 'report.html').resolve()}")
    print(
        f"target (a DiLoCo variant within {TARGET_PERPLEXITY_GAP:.0%} of sync's perplexity, >= {TARGET_BYTES:.0f}x "
        f"fewer bytes, at sync's perplexity sooner; streaming within {TARGET_PERPLEXITY_GAP:.0%} with >= "
        f"{TARGET_STREAMING_BYTES:.0f}x fewer bytes): {'met by ' + ', '.join(met) if met else 'not met'}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
