"""Curves for the report from a run's metric records: test metrics, loss, bytes, divergence, staleness."""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Literal

from fast.errors import ConfigError
from fast.targets import Target, parse_target
from fast.tools.report.runs import Run

Curve = tuple[list[float], list[float]]
NOT_REACHED = "not reached"
MEGABYTE = 1e6


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _records_with(run: Run, *keys: str) -> list[dict[str, Any]]:
    return [r for r in run.metrics if all(_number(r.get(key)) is not None for key in keys)]


def metric_curve(run: Run, metric: str, x_key: Literal["epoch", "time_s"]) -> Curve:
    """A test metric against epochs or seconds: the k-th evaluation of every evaluating worker, averaged.

    Workers evaluate on the same schedule but not at the same instant, so evaluations are matched by their
    order rather than by time; with a single evaluating worker this is simply that worker's curve.
    """
    key = f"test_{metric}"
    by_worker: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for record in _records_with(run, key, x_key):
        by_worker[int(record.get("worker", 0))].append(record)
    if not by_worker:
        return [], []
    for records in by_worker.values():
        records.sort(key=lambda r: (r.get("step", 0), r[x_key]))
    xs, ys = [], []
    for k in range(max(len(records) for records in by_worker.values())):
        kth = [records[k] for records in by_worker.values() if k < len(records)]
        xs.append(sum(r[x_key] for r in kth) / len(kth))
        ys.append(sum(r[key] for r in kth) / len(kth))
    return xs, ys


def accuracy_curve(run: Run, x_key: Literal["epoch", "time_s"]) -> Curve:
    """Test accuracy against epochs or seconds (see `metric_curve`)."""
    return metric_curve(run, "accuracy", x_key)


def loss_curve(run: Run, bins: int = 60, smoothing_window: int = 3) -> Curve:
    """Training loss against seconds: mean of all workers' records in equal time bins, lightly smoothed."""
    records = sorted(_records_with(run, "loss", "time_s"), key=lambda r: r["time_s"])
    if not records:
        return [], []
    start, end = records[0]["time_s"], records[-1]["time_s"]
    workers = len({r.get("worker", 0) for r in records})
    bins = max(1, min(bins, len(records) // workers))
    width = (end - start) / bins or 1.0
    sums: dict[int, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    for record in records:
        index = min(int((record["time_s"] - start) / width), bins - 1)
        bucket = sums[index]
        bucket[0] += record["time_s"]
        bucket[1] += record["loss"]
        bucket[2] += 1
    times = [sums[i][0] / sums[i][2] for i in sorted(sums)]
    losses = [sums[i][1] / sums[i][2] for i in sorted(sums)]
    return times, _moving_average(losses, smoothing_window)


def _moving_average(values: list[float], window: int) -> list[float]:
    half = window // 2
    smoothed = []
    for i in range(len(values)):
        neighbourhood = values[max(0, i - half) : i + half + 1]
        smoothed.append(sum(neighbourhood) / len(neighbourhood))
    return smoothed


def _workers_megabytes_sent(run: Run) -> Curve:
    """Megabytes sent so far by the workers against seconds, from their records: each one's latest count, summed."""
    latest: dict[int, float] = {}
    times, totals = [], []
    for record in sorted(_records_with(run, "bytes_sent", "time_s"), key=lambda r: r["time_s"]):
        latest[int(record.get("worker", 0))] = record["bytes_sent"]
        times.append(record["time_s"])
        totals.append(sum(latest.values()) / MEGABYTE)
    return times, totals


def megabytes_not_in_records(run: Run) -> float:
    """Megabytes of the run's total (the summary's `bytes_sent`, the table's MB sent) that no record shows over
    time: what its servers sent (they keep no records), and what the workers sent after their last record."""
    times, totals = _workers_megabytes_sent(run)
    total = _number(run.summary.get("bytes_sent"))
    if not times or total is None:
        return 0.0
    return max(0.0, total / MEGABYTE - totals[-1])


def megabytes_sent_curve(run: Run) -> Curve:
    """Megabytes sent so far against seconds: the workers' records summed, then a last point at the end of the run
    with the run's total, so that the curve ends at the table's MB sent (see `megabytes_not_in_records`)."""
    times, totals = _workers_megabytes_sent(run)
    if megabytes_not_in_records(run) > 0:
        end = _number(run.summary.get("wall_time_s"))
        times.append(max(times[-1], end) if end is not None else times[-1])
        totals.append(run.summary["bytes_sent"] / MEGABYTE)
    return times, totals


def membership_curve(run: Run) -> Curve:
    """Workers in a live run (`run.membership = "live"`) against seconds since its first membership, until its end."""
    changes = [c for c in run.summary.get("membership") or [] if isinstance(c, dict) and "unix_time" in c]
    if not changes:
        return [], []
    start = changes[0]["unix_time"]
    times = [c["unix_time"] - start for c in changes]
    counts = [float(len(c.get("members", []))) for c in changes]
    end = _number(run.summary.get("wall_time_s"))
    if end is not None and end > times[-1]:
        times.append(end)
        counts.append(counts[-1])
    return times, counts


def divergence_curve(run: Run) -> Curve:
    """Replica divergence (mean relative distance of the replicas to their average) against seconds."""
    records = sorted(_records_with(run, "divergence", "time_s"), key=lambda r: r["time_s"])
    return [r["time_s"] for r in records], [r["divergence"] for r in records]


def staleness_fractions(run: Run) -> dict[int, float]:
    """The fraction of applied updates at each staleness, from the summary's histogram ({} if none)."""
    histogram = run.summary.get("staleness_histogram")
    if not isinstance(histogram, dict):
        return {}
    counts = {int(k): float(v) for k, v in histogram.items() if _number(v) is not None and float(v) > 0}
    total = sum(counts.values())
    return {staleness: count / total for staleness, count in sorted(counts.items())} if total else {}


def as_target(target: float | str | Target) -> Target:
    """A Target from a Target, a label ("error <= 0.1") or a number (test accuracy)."""
    return target if isinstance(target, Target) else parse_target(target)


def time_to_target(run: Run, target: float | str | Target) -> float | str | None:
    """Seconds until the run first reached `target` (a test accuracy, or a Target), NOT_REACHED, or None when
    unknown.

    The summary's own figure wins (it is measured on the run's chosen final model); for a target the run
    was not asked about, the first evaluation on the metric's curve that reaches it is used instead.
    """
    target = as_target(target)
    recorded = run.summary.get("time_to_target_s")
    if isinstance(recorded, dict):
        for key, seconds in recorded.items():
            if _same(key, target):
                return _number(seconds) if seconds is not None else NOT_REACHED
    legacy = run.summary.get("time_to_accuracy_s")
    if isinstance(legacy, dict) and target.metric == "accuracy" and target.op == ">=":
        for key, seconds in legacy.items():
            if _parses_to(key, target.value):
                return _number(seconds) if seconds is not None else NOT_REACHED
    times, values = metric_curve(run, target.metric, "time_s")
    if not times:
        return None
    return next((t for t, value in zip(times, values, strict=True) if target.reached(value)), NOT_REACHED)


def _same(label: str, target: Target) -> bool:
    try:
        theirs = parse_target(label)
    except ConfigError:
        return False
    return (theirs.metric, theirs.op) == (target.metric, target.op) and math.isclose(theirs.value, target.value)


def _parses_to(key: str, target: float) -> bool:
    try:
        return math.isclose(float(key), target, abs_tol=1e-9)
    except ValueError:
        return False


def ordered(targets: list[Target]) -> list[Target]:
    """Distinct targets, test accuracy first, then by metric and value."""
    unique: dict[tuple[str, str, float], Target] = {}
    for t in targets:
        unique.setdefault((t.metric, t.op, round(t.value, 12)), t)
    return sorted(unique.values(), key=lambda t: (t.metric != "accuracy", t.metric, t.value))


def recorded_targets(runs: list[Run]) -> list[Target]:
    """Every target some run's summary reports a time for."""
    found: list[Target] = []
    for run in runs:
        for key in run.summary.get("time_to_target_s") or {}:
            try:
                found.append(parse_target(key))
            except ConfigError:
                continue
        for key in run.summary.get("time_to_accuracy_s") or {}:
            try:
                found.append(Target("accuracy", ">=", float(key)))
            except ValueError:
                continue
    return ordered(found)
