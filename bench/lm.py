"""The low-communication frontier on the language model of examples/lm: 4 workers linked at 10 Mbit/s, 50 ms.

    .venv/bin/python bench/lm.py [--steps 600] [--seeds 3] [--variants sync diloco ...] [--sync-on-links]
    .venv/bin/python bench/lm.py --curve 1 2 4 8 15 [--steps 600]
    (--out DIR --resume: read the runs that finished in DIR before, run the rest)

Every variant is the user's own script (examples/lm/train.py, the loop API) started by `fast run`, with the same
model (a byte-level transformer, [model] width 96), data, warm-up-then-cosine schedule and AdamW inner optimizer
(`demo`, whose update is its own signum, steps plain SGD), and the same number of steps: the same tokens. The
rows: sync; DiLoCo; Streaming DiLoCo; SparseLoCo at DiLoCo's period; DeMo; DiLoCo with eager updates; NoLoCo.
`sync` is the quality reference: its updates and bytes do not depend on the links, so it trains without them
(unless `--sync-on-links`), one seed, and its time on the emulated link is priced from its measured step
(`fast.pricing`, the cost model `fast predict` uses). The others run on the emulated links, `--seeds` seeds each.

Per variant: the validation perplexity at the end (mean and range over the seeds), MB sent, sync's MB over
its MB, and the time to sync's final perplexity on the emulated link. Targets: a method with at least 1,000x
fewer bytes than sync within 3% of its perplexity; sparseloco within 3% of diloco's perplexity with at least 20x
fewer bytes than diloco at the same period. A report.html of the first seed's runs is written beside them.

`--curve H...` draws the frontier instead: sync, then diloco and sparseloco at each period H, one seed, all without
emulated links (a blocking method's updates and bytes do not depend on them; each one's time on the link is priced
as sync's is), and prints bytes against the perplexity gap to sync.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import fast
from fast.assemble import load_config
from fast.pricing import predicted_step_time
from fast.tools.comparison import write_report

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "lm" / "train.py"
WORKERS = 4
NETWORK = {"network__bandwidth": "10Mbit", "network__latency": "50ms"}
JOB = {"model__width": 96, "run__log_every": 20}
PERIOD = 15  # DiLoCo's, SparseLoCo's, eager DiLoCo's and NoLoCo's H (SparseLoCo's paper: 15)
# The outer step at this horizon (600 steps, 40 rounds at H=15), one seed each (2026-11-27): (outer_lr, outer_momentum)
# (0.7, 0.9), the paper's, 10.61; (0.7, 0.5) 7.39; (1.0, 0) 7.02; (2.0, 0) 11.92. Plain averaging (1.0, 0) is best,
# though within its 3 seeds' range (7.02-7.34) of (0.7, 0.5).
DILOCO = {"strategy__name": "diloco", "strategy__period": PERIOD, "strategy__outer_lr": 1.0,
          "strategy__outer_momentum": 0.0}  # fmt: skip
VARIANTS = {
    "sync": {"strategy__name": "sync", "strategy__bucket_mb": 8.0},
    "diloco": DILOCO,
    "streaming-diloco": {
        **DILOCO,
        "strategy__outer_lr": 0.7,
        "strategy__outer_momentum": 0.5,
        "strategy__name": "streaming-diloco",
        "strategy__period": 2 * PERIOD,
        "strategy__fragments": 2,
        "strategy__delay": 5,
        "codec__name": "fp16",
    },  # fmt: skip
    "sparseloco": {"strategy__name": "sparseloco", "strategy__period": PERIOD},
    "demo": {
        "strategy__name": "demo",
        "strategy__bucket_mb": 8.0,
        "optimizer__name": "SGD",
        "optimizer__lr": 0.001,
        "optimizer__weight_decay": 0.0,
        "optimizer__momentum": 0.0,
        "optimizer__clip_norm": None,  # (FAST clips the averaged gradient: demo's is a sign)
    },  # fmt: skip
    "diloco-eager": {**DILOCO, "strategy__eager": True},
    "noloco": {"strategy__name": "noloco", "strategy__period": PERIOD},
}
TARGET_GAP, TARGET_FEWER, TARGET_SPARSE_GAP, TARGET_SPARSE_FEWER = 0.03, 1000.0, 0.03, 20.0


def first_step_at(summary: dict, perplexity: float) -> tuple[int, float] | None:
    """(step, time) of the first evaluation whose validation perplexity was at most `perplexity`."""
    return next(((e["step"], e["time_s"]) for e in summary["evaluations"] if e["test_perplexity"] <= perplexity), None)


def link_step_s(run: Path, compute_s: float) -> float:
    """A run's step on the emulated link, priced from its measured computation (fast.pricing)."""
    sys.path.insert(0, str(SCRIPT.parent))
    from lm import transformer  # examples/lm/lm.py: the model the runs trained

    config = load_config(run / "config.toml", **NETWORK)
    model = transformer(**config.model.arguments())
    return predicted_step_time(config, model=model, compute_s=compute_s)


def train(name: str, overrides: dict, steps: int, out: Path, seed: int = 0, links: bool = True,
          reuse: bool = False) -> dict:  # fmt: skip
    """One run of the user's script under `overrides` for `steps` steps: its summary (with `reuse`, the summary of
    a run that finished in `out` before)."""
    finished = out / f"{name}-seed{seed}" / "summary.json"
    if reuse and finished.exists():
        print(f"== {name} seed {seed}: finished before, read from {finished}", flush=True)
        return json.loads(finished.read_text())
    if reuse:
        shutil.rmtree(finished.parent, ignore_errors=True)  # a run cut short: it starts again
    overrides = {**JOB, **(NETWORK if links else {}), **overrides, "run__max_steps": steps, "run__epochs": 100,
                 "run__seed": seed}  # fmt: skip
    print(f"== {name} seed {seed}: {steps} steps{'' if links else ' (no emulated links)'}", flush=True)
    started = time.monotonic()
    summary = fast.run(str(SCRIPT), workers=WORKERS, out=str(out / f"{name}-seed{seed}"), **overrides)
    print(f"   {time.monotonic() - started:.0f} s", flush=True)
    return summary


def price_on_links(run: Path, summary: dict) -> float:
    """Give a run trained without links its evaluations' times on the emulated link; its priced step."""
    step_s = link_step_s(run, summary["step_compute_s"])
    for e in summary["evaluations"]:
        e["time_s"] = e["step"] * step_s
    return step_s


def curve(periods: list[int], steps: int, out: Path, reuse: bool = False) -> int:
    """sync, then diloco and sparseloco at each period: bytes against the perplexity gap, all without links."""
    runs = {"sync": train("sync", VARIANTS["sync"], steps, out, links=False, reuse=reuse)}
    for period in periods:
        for method in ("diloco", "sparseloco"):
            overrides = {**VARIANTS[method], "strategy__period": period}
            runs[f"{method}-H{period}"] = train(f"{method}-H{period}", overrides, steps, out, links=False, reuse=reuse)
    (out / "curve.json").write_text(json.dumps(runs, indent=1))
    sync = runs["sync"]
    print(f"\n{'run':<16} {'val ppl':>8} {'gap':>8} {'MB sent':>9} {'sync/x':>8} {'priced s':>9} {'t to sync ppl':>13}")
    for name, summary in runs.items():
        step_s = price_on_links(out / f"{name}-seed0", summary)
        ppl, sent = summary["final_test_perplexity"], summary["bytes_sent"]
        reached = first_step_at(summary, sync["final_test_perplexity"])
        print(f"{name:<16} {ppl:>8.3f} {ppl / sync['final_test_perplexity'] - 1:>+8.1%} {sent / 1e6:>9.2f} "
              f"{sync['bytes_sent'] / sent:>7.0f}x {steps * step_s:>9.0f} "
              f"{f'{reached[1]:.0f} s' if reached else 'not reached':>13}")  # fmt: skip
    write_report(out, [out / f"{name}-seed0" for name in runs], title="FAST: bytes against perplexity")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600, help="every variant's steps (the same tokens)")
    parser.add_argument("--seeds", type=int, default=3, help="seeds of each low-communication variant")
    parser.add_argument("--out", default=f"runs/bench-lm-{time.strftime('%Y%m%d-%H%M%S')}")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--sync-on-links", action="store_true", help="sync on the emulated links too")
    parser.add_argument("--curve", nargs="+", type=int, metavar="H", help="bytes against the gap over these periods")
    parser.add_argument("--resume", action="store_true", help="read the runs that finished in --out, run the rest")
    args = parser.parse_args()
    out = Path(args.out)
    if args.curve:
        return curve(args.curve, args.steps, out, reuse=args.resume)
    runs: dict[str, list[dict]] = {}
    for name in args.variants:
        reference = name == "sync"
        links = {} if reference and not args.sync_on_links else NETWORK
        for seed in range(1 if reference else args.seeds):
            summary = train(name, VARIANTS[name], args.steps, out, seed, links=bool(links), reuse=args.resume)
            runs.setdefault(name, []).append(summary)
    write_report(out, [out / f"{name}-seed0" for name in runs], title="FAST: the low-communication frontier")
    (out / "bench.json").write_text(json.dumps(runs, indent=1))

    sync = runs["sync"][0] if "sync" in runs else None
    sync_ppl = sync["final_test_perplexity"] if sync else None
    if sync is not None and not args.sync_on_links:  # its time on the link: its steps at the priced step
        price_on_links(out / "sync-seed0", sync)
    print(f"\n{'variant':<17} {'seeds':>5} {'val ppl':>8} {'range':>15} {'vs sync':>8} {'MB sent':>9} {'sync/x':>8} "
          f"{'t to sync ppl':>13}")  # fmt: skip
    figures: dict[str, dict] = {}
    for name, summaries in runs.items():
        ppl = [s["final_test_perplexity"] for s in summaries]
        sent = statistics.mean(s["bytes_sent"] for s in summaries)
        reached = [first_step_at(s, sync_ppl) for s in summaries] if sync_ppl else []
        times = [r[1] for r in reached if r is not None]
        figures[name] = {"ppl": statistics.mean(ppl), "sent": sent}
        gap = statistics.mean(ppl) / sync_ppl - 1 if sync_ppl else None
        fewer = sync["bytes_sent"] / sent if sync and sent else None
        figures[name].update(gap=gap, fewer=fewer)
        reach = f"{statistics.mean(times):.0f} s" if len(times) == len(summaries) and times else "not reached"
        print(f"{name:<17} {len(ppl):>5} {statistics.mean(ppl):>8.3f} {f'{min(ppl):.3f}-{max(ppl):.3f}':>15} "
              f"{f'{gap:+.1%}' if gap is not None else '-':>8} {sent / 1e6:>9.2f} "
              f"{f'{fewer:.0f}x' if fewer else '-':>8} {reach:>13}")  # fmt: skip
    frontier = [n for n, f in figures.items() if f["fewer"] and f["fewer"] >= TARGET_FEWER and f["gap"] <= TARGET_GAP]
    print(f"\n>= {TARGET_FEWER:.0f}x fewer bytes than sync within {TARGET_GAP:.0%} of its perplexity: "
          f"{'met by ' + ', '.join(frontier) if frontier else 'not met'}")  # fmt: skip
    if "sparseloco" in figures and "diloco" in figures:
        sparse, dense = figures["sparseloco"], figures["diloco"]
        gap, fewer = sparse["ppl"] / dense["ppl"] - 1, dense["sent"] / sparse["sent"]
        met = gap <= TARGET_SPARSE_GAP and fewer >= TARGET_SPARSE_FEWER
        print(
            f"sparseloco against diloco at H={PERIOD}: {gap:+.1%} perplexity, {fewer:.0f}x fewer bytes "
            f"(target within {TARGET_SPARSE_GAP:.0%}, >= {TARGET_SPARSE_FEWER:.0f}x): {'met' if met else 'NOT met'}"
        )
    print(f"report: {(out / 'report.html').resolve()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
