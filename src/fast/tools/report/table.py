"""The comparison table, one row per variant: built once, written as summary.csv, a terminal table or HTML."""

from __future__ import annotations

import csv
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.table import Table

from fast.targets import Target
from fast.tools.report.runs import Run, distinct_labels
from fast.tools.report.series import MEGABYTE, NOT_REACHED, as_target, ordered, recorded_targets, time_to_target

MISSING = "—"
OUTCOME = "Accuracy and speed"
COST = "Communication and consistency"
# of each worker's training time (fast.comm.timeline): wait is waiting for peers, communicate includes transfers
SHARES = ("compute", "communicate", "wait")
_TARGET_KEY = re.compile(r"^time_to_(?:(?P<metric>[A-Za-z_]\w*)(?P<op><=|>=))?(?P<value>[0-9.e+-]+)_s$")
_METRIC_KEY = re.compile(r"^(?P<kind>final|best)_test_(?P<metric>\w+)$")


def target_key(target: float | str | Target) -> str:
    """The row key of a target's time: `time_to_0.85_s` for test accuracy, `time_to_error<=0.1_s` otherwise."""
    t = as_target(target)
    if t.metric == "accuracy" and t.op == ">=":
        return f"time_to_{t.value:g}_s"
    return f"time_to_{t.metric}{t.op}{t.value:g}_s"


def summary_rows(runs: list[Run], targets: list[float | Target] | None = None) -> list[dict[str, Any]]:
    """One row per run, raw values (None where unknown, NOT_REACHED for a target never met).

    `targets` (test accuracies or Targets) defaults to every target any run's summary reports a time for.
    """
    targets = recorded_targets(runs) if targets is None else ordered([as_target(t) for t in targets])
    metrics = list(dict.fromkeys(t.metric for t in targets if t.metric not in ("accuracy", "loss")))
    rows = []
    for label, run in zip(distinct_labels(runs), runs, strict=True):
        s = run.summary
        codec = run.config.get("codec")
        bytes_sent = _value(s, "bytes_sent")
        row: dict[str, Any] = {
            "variant": label,
            "strategy": run.strategy,
            "codec": codec.get("name") if isinstance(codec, dict) else None,
            "workers": _value(s, "workers"),
            "final_test_accuracy": _value(s, "final_test_accuracy"),
            "best_test_accuracy": _value(s, "best_test_accuracy"),
        }
        for metric in metrics:
            row[f"final_test_{metric}"] = _value(s, f"final_test_{metric}")
            row[f"best_test_{metric}"] = _value(s, f"best_test_{metric}")
        for target in targets:
            row[target_key(target)] = time_to_target(run, target)
        row |= {
            "samples_per_s": _value(s, "samples_per_s"),
            "mb_sent": None if bytes_sent is None else bytes_sent / MEGABYTE,
            "compression_ratio": _value(s, "compression_ratio"),
            "mean_staleness": _value(s, "mean_staleness"),
            "max_staleness": _value(s, "max_staleness"),
            "replica_divergence": _value(s, "replica_divergence"),
            "step_time_s": _value(s, "step_time_s"),
            "predicted_step_time_s": _value(s, "predicted_step_time_s"),
        }
        shares = s.get("time_shares") if isinstance(s.get("time_shares"), dict) else {}
        row |= {f"{kind}_share": _value(shares, kind) for kind in SHARES}
        rows.append(row)
    return rows


def _value(summary: dict[str, Any], key: str) -> float | int | None:
    value = summary.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return value if math.isfinite(value) else None


def write_summary_csv(rows: list[dict[str, Any]], path: Path) -> Path:
    """Write the rows as CSV with raw values; unknown cells are empty."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fields = list(dict.fromkeys(key for row in rows for key in row))
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        for row in rows:
            writer.writerow({key: "" if row.get(key) is None else row[key] for key in fields})
    return path


@dataclass(frozen=True)
class Column:
    """How one row key is shown: header, formatting, whether it is a number, and which table it joins."""

    key: str
    header: str
    format: Callable[[Any], str]
    numeric: bool = True
    group: str = OUTCOME

    def cell(self, row: dict[str, Any]) -> str:
        value = row.get(self.key)
        if value is None:
            return MISSING
        if value == NOT_REACHED:
            return NOT_REACHED
        return self.format(value)


def _fixed(digits: int, suffix: str = "", scale: float = 1.0) -> Callable[[Any], str]:
    return lambda value: f"{value * scale:,.{digits}f}{suffix}"


def _significant(value: Any) -> str:
    return f"{value:.3g}"


def _megabytes(value: Any) -> str:
    if value >= 100:
        return f"{value:,.0f}"
    return f"{value:.1f}" if value >= 10 else f"{value:.3g}"


def table_columns(rows: list[dict[str, Any]]) -> list[Column]:
    """The displayed columns for these rows, time-to-target columns included in row order."""
    keys = list(dict.fromkeys(key for row in rows for key in row))
    targets = [key for key in keys if _TARGET_KEY.match(key)]
    metrics = [
        Column(key, f"{m['kind']} test {m['metric']}", _significant)
        for key in keys
        if (m := _METRIC_KEY.match(key)) and m["metric"] not in ("accuracy", "loss")
    ]
    return [
        Column("variant", "variant", str, numeric=False),
        Column("strategy", "strategy", str, numeric=False),
        Column("codec", "codec", str, numeric=False),
        Column("workers", "workers", _fixed(0)),
        Column("final_test_accuracy", "final test acc", _fixed(1, "%", 100)),
        Column("best_test_accuracy", "best test acc", _fixed(1, "%", 100)),
        *metrics,
        *[Column(key, f"time to {_target_name(key)} (s)", _fixed(1)) for key in targets],
        Column("samples_per_s", "samples/s", _fixed(0)),
        Column("mb_sent", "MB sent", _megabytes, group=COST),
        Column("compression_ratio", "compression", _fixed(1, "×"), group=COST),
        Column("mean_staleness", "mean staleness", _fixed(2), group=COST),
        Column("max_staleness", "max staleness", _fixed(0), group=COST),
        Column("replica_divergence", "replica divergence", _significant, group=COST),
        Column("step_time_s", "step time (ms)", _fixed(1, scale=1000), group=COST),
        Column("predicted_step_time_s", "predicted step time (ms)", _fixed(1, scale=1000), group=COST),
        *[Column(f"{kind}_share", f"{kind} share", _fixed(0, "%", 100), group=COST) for kind in SHARES],
    ]


def _target_name(key: str) -> str:
    match = _TARGET_KEY.match(key)
    if match["metric"] is None:
        return f"{float(match['value']) * 100:g}%"
    return f"{match['metric']} {match['op'].replace('<=', '≤').replace('>=', '≥')} {float(match['value']):g}"


def rich_table(rows: list[dict[str, Any]]) -> Table:
    """The rows as a rich table for the terminal, formatted like the HTML report."""
    table = Table(title="FAST comparison", header_style="bold", show_lines=False)
    columns = [c for c in table_columns(rows) if not c.key.endswith("_share")]  # the time shares: in the report
    for column in columns:
        table.add_column(column.header, justify="right" if column.numeric else "left")
    for row in rows:
        table.add_row(*(column.cell(row) for column in columns))
    return table
