"""What churn costs each strategy: the language model of examples/lm, with and without workers leaving and coming
back (`[faults] churn`).

    .venv/bin/python bench/churn.py [--workers 8] [--seeds 3] [--time 120] [--strategies sync local-sgd ...]
                                    [--equal tokens|time] [--bandwidth 10Mbit] [--latency 50ms] [--real-links]
    .venv/bin/python bench/churn.py --goodput --failure-every 15 --time 600 --steady-time 180 [--first-seed 0] \
                                    [--step-time 1 [--simulated]] --strategies sync local-sgd diloco

Every run's membership is live (`run.membership = "live"`) on emulated links (`[network]`, 10 Mbit/s and 50 ms by
default; `--real-links`: this machine's own). The run without churn trains for `--time` seconds (`run.max_time`). With
churn, each worker, worker 0 too, stays an exponential time of mean a third of that; a new one comes back after a mean
of a tenth of it, healed from a live peer. `--equal tokens` (the default): the run with churn trains on as many samples
as the one without did (`run.max_samples`), however long that takes, so that the perplexities compare the same amount of
training; `--equal time`: it trains for the same time, on fewer samples. Per strategy and seed: the final validation
perplexity, samples, training time, bytes, and the catch-ups' bytes and seconds; then, per strategy, the ratio of its
mean perplexity with churn to its mean without. Target: the periodic family (local-sgd, diloco) within 5%.

`--goodput`: what churn costs in throughput. The run with churn trains for `--time` seconds, failures coming every
`--failure-every` seconds on average across the run (each member's mean stay is that times the workers; a new one
comes back after a mean absence of `--absence`); its goodput is the samples trained per member-second present (a
member is present from the generation it enters to the one that leaves it out: a dead member counts until it is
found gone, a joiner from when it takes part). On a machine of few cores fewer members each step faster, which
flatters churn; so it is held against the steady rate at the churned run's mean members, interpolated between steady
runs of the whole counts on either side (7 and 8 for a mean of 7.4), each `--steady-time` seconds; one steady run per
strategy and count serves every seed (a seed changes the data's order and the first weights, not a step's work).
`--step-time S` emulates each step's compute instead (`run.step_time`): a step whose own work took less than S waits
out the rest, as a host waits for its device, so the members' steps take S however many of them there are, and the
host's work for churn (a joiner's start, packing a heal, forming a group) takes idle cores, not the members' steps, as
where each member has a machine of its own (pick S above a step's own work with every member on the cores: the
summary's `step_compute_s` says it; the steady rates at 7 and 8 members then agree).
`--simulated` (with `--step-time`): the same runs in the simulated engine (`run.engine = "simulated"`, seconds virtual),
each group's forming charged `--form-time` (`run.form_time`, what a real re-form's forming takes here), so that the
engine's goodput under the same churn, job, links and step time is held against the real one's (its members write
no re-formed records and its departures no time of churn's order: it has no idle shares or recovery seconds).
Target: churned / steady >= 0.9 per member-second. Each failure's recovery: the seconds from the churn driver's order to
leave (summary `membership`, `left`: `evicted_unix_time`; the member dies within a heartbeat, 0.5 s) to the first
generation without it formed and healed (its `unix_time`: the survivors take their next step together), the periodic
family's including the local steps the survivors take to the end of the round; median/max over a run's failures, and
over every seed's per strategy (a member that went on its own, not told by churn, has none). The idle shares: the
churned runs' member-seconds present in which a member could train nothing, as shares of them all, by cause: the
members re-forming (their `re-formed` records), joiners sitting out while their state came (`sat_out_s` of their
`healed` records), members dead until the generation without them (their recovery), and joiners present that
never held the state (no `healed` record: churn took them out while it came). The ratio's gap beyond their sum
is steps that churn slows (catch-up bytes on the links, joiners' processes starting on the host's cores) and what a
killed member trained since its last round."""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections import Counter
from pathlib import Path

import fast
from fast.runtime.live import REFORM_PHASES

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "lm" / "lm.toml"
JOB = {"model__width": 96, "run__log_every": 10, "run__epochs": 1000, "run__max_steps": 100_000,
       "run__membership": "live", "run__eval_every": 0, "eval__samples": 200, "schedule__name": "constant"}  # fmt: skip
STRATEGIES = {
    "sync": {"strategy__name": "sync", "strategy__bucket_mb": 8.0},
    "local-sgd": {"strategy__name": "local-sgd", "strategy__period": 8},
    "diloco": {
        "strategy__name": "diloco",
        "strategy__period": 16,
        "strategy__outer_lr": 0.7,
        "strategy__outer_momentum": 0.5,
    },  # fmt: skip
    "gossip": {"strategy__name": "gossip", "strategy__topology": "ring"},
}
PERIODIC = ("local-sgd", "diloco")
TARGET = 0.05


GOODPUT_TARGET = 0.9


def member_seconds(events: list[dict], train_s: float) -> float:
    """The members' time present over a run's generations (`summary["membership"]`), to the end of training."""
    if not events:
        return 0.0
    ends = [e["unix_time"] for e in events[1:]] + [events[0]["unix_time"] + train_s]
    return sum(len(e["members"]) * max(0.0, end - e["unix_time"]) for e, end in zip(events, ends, strict=True))


def recovery_seconds(events: list[dict]) -> list[float]:
    """Per member churn told to leave, the seconds to the first generation without it formed and healed (see the
    module), from a run's generations (`summary["membership"]`); a member that left on its own has none."""
    return [e["unix_time"] - left["evicted_unix_time"] for e in events[1:] for left in e["left"]
            if "evicted_unix_time" in left]  # fmt: skip


def records(run: Path, kind: str) -> list[dict]:
    """The run's workers' records of `kind` ("re-formed", "healed")."""
    return [json.loads(line) for path in sorted((run / "workers").glob("metrics-*.jsonl"))
            for line in path.read_text().splitlines() if f'"{kind}"' in line]  # fmt: skip


def reforming(run: Path) -> dict[str, float]:
    """The members' seconds of re-forming, summed over a run's members (their `re-formed` records), by phase: waiting
    for a generation, for its members to arrive, forming its group, healing; and the longest one re-form took."""
    reforms = records(run, "re-formed")
    spent = {phase: round(sum(r[f"{phase}_s"] for r in reforms), 1) for phase in REFORM_PHASES}
    return {**spent, "longest": max((r["reform_s"] for r in reforms), default=0.0)}


def sat_out(run: Path) -> float:
    """The joiners' seconds sitting out while their state came behind the steps (their `healed` records), summed."""
    return round(sum(r.get("sat_out_s", 0.0) for r in records(run, "healed")), 1)


def never_healed(run: Path, events: list[dict], train_s: float) -> float:
    """The member-seconds present of joiners that never held the state (no `healed` record of theirs: churn took
    them out while it came), from a run's generations (`summary["membership"]`) to the end of training."""
    if not events:
        return 0.0
    healed = {r["worker"] for r in records(run, "healed")}
    end = events[0]["unix_time"] + train_s
    joined = {m: e["unix_time"] for e in events[1:] for m in e["joined"]}
    left = {d["member"]: e["unix_time"] for e in events[1:] for d in e["left"]}
    return round(sum(left.get(m, end) - t for m, t in joined.items() if m not in healed), 1)


def time_lost(row: dict) -> dict[str, float]:
    """A churned run's member-seconds present that could train nothing, by cause: the members re-forming, joiners
    sitting out while their state came, members dead until the generation without them (their recovery seconds),
    joiners that never held the state."""
    reforms = row["reforming_member_s"]
    return {"re-forming": round(sum(reforms[phase] for phase in REFORM_PHASES), 1), "sitting out": row["sat_out_s"],
            "dead": round(sum(row["recovery_s"]), 1), "never healed": row["never_healed_s"]}  # fmt: skip


def idle_shares(pairs: list[tuple[dict, dict]]) -> str:
    """The churned runs' member-seconds lost to each cause (`time_lost`), as shares of their member-seconds."""
    total = sum(c["member_s"] for c, _ in pairs)
    causes = pairs[0][0]["lost_member_s"]
    return "/".join(f"{sum(c['lost_member_s'][cause] for c, _ in pairs) / total:.3f}" for cause in causes)


def median_and_max(seconds: list[float]) -> str:
    """`seconds`' median and max, and how many: "median/max (n)" (a dash when there are none)."""
    return f"{statistics.median(seconds):.1f}/{max(seconds):.1f} ({len(seconds)})" if seconds else "-"


def one_run(out: Path, strategy: str, seed: int, workers: int, seconds: float, churn: tuple[float, float] | None,
            deployment: dict[str, str], samples: int | None = None) -> dict:  # fmt: skip
    """One run of `seconds` of training, or (`samples`) of that many samples, with a backstop of 5x the time;
    `churn`: each member's mean stay and mean absence, in seconds."""
    limit = seconds if samples is None else 5 * seconds
    options = {**JOB, **STRATEGIES[strategy], **deployment, "run__seed": seed, "run__workers": workers,
               "run__max_time": f"{limit}s"}  # fmt: skip
    if samples is not None:
        options["run__max_samples"] = samples
    if churn is not None:
        options.update(faults__churn__lifetime=f"{churn[0]:g}s", faults__churn__absence=f"{churn[1]:g}s")
    started = time.monotonic()
    summary = fast.train(str(CONFIG), out=str(out), **options)
    events = summary.get("membership", [])
    return {
        "strategy": strategy,
        "seed": seed,
        "churn": churn is not None,
        "workers": workers,
        "member_s": round(member_seconds(events, summary["wall_time_s"]), 1),
        "perplexity": summary.get("final_test_perplexity"),
        "steps": summary["steps_per_worker"],
        "samples": summary["samples"],
        "train_s": summary["wall_time_s"],
        "wall_s": round(time.monotonic() - started, 1),
        "bytes_sent": summary["bytes_sent"],
        "catch_up_bytes": summary.get("catch_up_bytes", 0),
        "catch_up_s": round(sum(e["catch_up_s"] for e in events[1:]), 3),
        "lines_resumed": sum(len(e.get("resumed", [])) for e in events[1:]),  # (a joiner's state a departure cut)
        "lines_restarted": dict(Counter(why for e in events[1:] for why in e.get("restarted", {}).values())),
        "changes": max(0, len(events) - 1),
        "leaves": sum(len(e["left"]) for e in events[1:]),
        "recovery_s": [round(s, 2) for s in recovery_seconds(events)],
        "workers_at_end": summary.get("workers_at_end"),
        "reforming_member_s": reforming(out),
        "sat_out_s": sat_out(out),
        "never_healed_s": never_healed(out, events, summary["wall_time_s"]),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--time", type=float, default=120.0, help="training seconds of the run without churn")
    parser.add_argument(
        "--equal",
        choices=["tokens", "time"],
        default="tokens",
        help="the run with churn trains on as many samples (tokens), or for as long (time)",
    )
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=list(STRATEGIES))
    parser.add_argument("--out", type=Path, default=Path("runs/bench-churn"))
    parser.add_argument("--bandwidth", default="10Mbit", help="every emulated link, each direction")
    parser.add_argument("--latency", default="50ms", help="every emulated link, one way")
    parser.add_argument("--real-links", action="store_true", help="no [network]: this machine's own links")
    parser.add_argument("--goodput", action="store_true", help="samples per member-second, churned over steady")
    parser.add_argument("--failure-every", type=float, help="--goodput: seconds between failures, on average")
    parser.add_argument("--absence", type=float, default=5.0, help="--goodput: a member's mean time away (seconds)")
    parser.add_argument("--steady-time", type=float, help="--goodput: the steady run's seconds (default --time): "
                        "its samples per member-second is a rate, level after its first seconds")  # fmt: skip
    parser.add_argument("--step-time", type=float, help="each step's compute emulated, in seconds (run.step_time): "
                        "the members' steps take as long however many of them share this machine's cores")  # fmt: skip
    parser.add_argument("--simulated", action="store_true", help="the same runs in the simulated engine")
    parser.add_argument("--form-time", default="0.2s", help="--simulated: what forming a group costs each member")
    parser.add_argument("--first-seed", type=int, default=0, help="the seeds are this one and the next ones")
    args = parser.parse_args()
    deployment = {} if args.real_links else {"network__bandwidth": args.bandwidth, "network__latency": args.latency}
    if args.step_time is not None:
        deployment["run__step_time"] = f"{args.step_time:g}s"
    if args.simulated:
        if args.step_time is None:
            raise SystemExit("bench/churn.py --simulated needs --step-time SECONDS, the real runs' (for example 1)")
        deployment.update(run__engine="simulated", run__form_time=args.form_time)
    if args.goodput:
        return goodput(args, deployment)
    rows = []
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        for strategy in args.strategies:
            samples = None
            for churn in (False, True):  # alternated, so that a drift of the host hits both alike
                name = f"{strategy}-{'churn' if churn else 'steady'}-seed{seed}"
                draws = (args.time / 3, args.time / 10) if churn else None
                row = one_run(args.out / name, strategy, seed, args.workers, args.time, draws, deployment, samples)
                if args.equal == "tokens":
                    samples = row["samples"]
                rows.append(row)
                print(json.dumps(row), flush=True)
    (args.out / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"\nat equal {args.equal}")
    print(f"{'strategy':<10} {'steady ppl':>11} {'churn ppl':>10} {'ratio':>7} {'samples':>15} {'train s':>13} "
          f"{'changes':>8} {'catch-up MB':>12} {'catch-up s':>11}")  # fmt: skip
    met = True
    for strategy in args.strategies:
        steady = [r["perplexity"] for r in rows if r["strategy"] == strategy and not r["churn"]]
        churned = [r for r in rows if r["strategy"] == strategy and r["churn"]]
        ratio = statistics.mean(r["perplexity"] for r in churned) / statistics.mean(steady)
        if strategy in PERIODIC:
            met = met and ratio <= 1 + TARGET
        with_churn = statistics.mean(r["perplexity"] for r in churned)
        both = [r for r in rows if r["strategy"] == strategy]
        samples = "/".join(f"{statistics.mean(r['samples'] for r in both if r['churn'] == c):.0f}" for c in (0, 1))
        seconds = "/".join(f"{statistics.mean(r['train_s'] for r in both if r['churn'] == c):.0f}" for c in (0, 1))
        print(f"{strategy:<10} {statistics.mean(steady):>11.3f} {with_churn:>10.3f} {ratio:>7.3f} {samples:>15}"
              f" {seconds:>13}"
              f" {statistics.mean(r['changes'] for r in churned):>8.1f}"
              f" {statistics.mean(r['catch_up_bytes'] for r in churned) / 1e6:>12.2f}"
              f" {statistics.mean(r['catch_up_s'] for r in churned):>11.2f}")  # fmt: skip
    print(f"\nperiodic family under churn within {TARGET:.0%} of its perplexity without: {'met' if met else 'NOT met'}")
    return 0


def goodput(args: argparse.Namespace, deployment: dict[str, str]) -> int:
    """Per strategy and seed, a churned run, held against the steady rate at its mean members (`steady_rate`, once per
    strategy and count); their samples per member-second."""
    if args.failure_every is None:
        raise SystemExit("bench/churn.py --goodput needs --failure-every SECONDS (a failure every 15 s: 15)")
    draws = (args.failure_every * args.workers, args.absence)
    rows: list[dict] = []
    steady_runs: dict[tuple[str, int], dict] = {}

    def steady_rate(strategy: str, members: int, seed: int) -> float:
        """Samples per member-second of a steady run of `members`, one per strategy and count (a seed changes the
        data's order and the first weights, not a step's work)."""
        if (strategy, members) not in steady_runs:
            steady = one_run(args.out / f"{strategy}-steady-{members}", strategy, seed, members,
                             args.steady_time or args.time, None, deployment)  # fmt: skip
            steady["goodput"] = steady["samples"] / steady["member_s"]
            steady_runs[strategy, members] = steady
            rows.append(steady)
            print(json.dumps(steady), flush=True)
        return steady_runs[strategy, members]["goodput"]

    pairs = []
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        for strategy in args.strategies:
            churned = one_run(args.out / f"{strategy}-churn-seed{seed}", strategy, seed, args.workers, args.time,
                              draws, deployment)  # fmt: skip
            churned["recovery_median_max_s"] = median_and_max(churned["recovery_s"])
            churned["lost_member_s"] = time_lost(churned)
            churned["goodput"] = churned["samples"] / churned["member_s"]
            rows.append(churned)
            print(json.dumps(churned), flush=True)
            # the steady rate at the churned run's mean members, between the whole counts on either side
            members = max(1.0, churned["member_s"] / churned["train_s"])
            low, high = math.floor(members), math.ceil(members)
            below, above = steady_rate(strategy, low, seed), steady_rate(strategy, high, seed)
            pairs.append((churned, {"goodput": below + (members - low) * (above - below)}))
    (args.out / "goodput.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"\nfailures every {args.failure_every:g} s on average (each member's mean stay "
          f"{draws[0]:g} s, mean absence {draws[1]:g} s), {args.time:g} s a churned run, "
          f"{args.steady_time or args.time:g} s a steady one, {args.seeds} seeds")  # fmt: skip
    idle = "idle share: re-form/sit out/dead/unhealed"
    print(f"{'strategy':<10} {'failures':>9} {'members':>8} {'churned/s':>10} {'steady/s':>9} {'ratio':>6}"
          f" {'min-max':<11} {'recovery s median/max (n)':>26}  {idle:>42}")  # fmt: skip
    met = True
    for strategy in args.strategies:
        ours = [(c, s) for c, s in pairs if c["strategy"] == strategy]
        ratios = [c["goodput"] / s["goodput"] for c, s in ours]
        met = met and statistics.mean(ratios) >= GOODPUT_TARGET
        spread = f"{min(ratios):.3f}-{max(ratios):.3f}" if len(ratios) > 1 else ""
        print(f"{strategy:<10} {statistics.mean(c['leaves'] for c, _ in ours):>9.1f}"
              f" {statistics.mean(c['member_s'] / c['train_s'] for c, _ in ours):>8.2f}"
              f" {statistics.mean(c['goodput'] for c, _ in ours):>10.1f}"
              f" {statistics.mean(s['goodput'] for _, s in ours):>9.1f}"
              f" {statistics.mean(ratios):>6.3f} {spread:<11}"
              f" {median_and_max([s for c, _ in ours for s in c['recovery_s']]):>26}"
              f"  {'-' if args.simulated else idle_shares(ours):>42}")  # fmt: skip
    print(f"\nsamples per member-second, churned / steady >= {GOODPUT_TARGET}: {'met' if met else 'NOT met'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
