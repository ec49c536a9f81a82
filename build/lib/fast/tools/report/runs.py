"""Reading a run folder written by `fast train`: its summary.json and metrics.jsonl, as plain Python data."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fast.errors import DataError

SUMMARY_FILE = "summary.json"
METRICS_FILE = "metrics.jsonl"


@dataclass(frozen=True)
class Run:
    """One trained variant: its folder, its summary and its metric records in file order."""

    directory: Path
    summary: dict[str, Any]
    metrics: list[dict[str, Any]] = field(default_factory=list)

    @property
    def name(self) -> str:
        return str(self.summary["name"])

    @property
    def strategy(self) -> str:
        return str(self.summary["strategy"])

    @property
    def config(self) -> dict[str, Any]:
        config = self.summary.get("config")
        return config if isinstance(config, dict) else {}


def load_run(run_dir: Path) -> Run:
    """Load `run_dir`; without metrics.jsonl the run has no curves, without summary.json it is an error."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise DataError(f"run folder {run_dir} does not exist: pass a folder written by `fast train`")
    summary = _read_summary(run_dir / SUMMARY_FILE)
    metrics_path = run_dir / METRICS_FILE
    metrics = _read_metrics(metrics_path) if metrics_path.is_file() else []
    return Run(directory=run_dir, summary=summary, metrics=metrics)


def _read_summary(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise DataError(f"{path} is missing: the run did not finish; rerun `fast train` for that folder")
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise DataError(f"{path} is not valid JSON ({error}); rerun `fast train` for that folder") from error
    if not isinstance(summary, dict):
        raise DataError(f"{path} must hold a JSON object; rerun `fast train` for that folder")
    for key in ("name", "strategy"):
        if not summary.get(key):
            raise DataError(f"{path} lacks the key {key!r}; add it or rerun `fast train` for that folder")
    return summary


def _read_metrics(path: Path) -> list[dict[str, Any]]:
    lines = path.read_text(encoding="utf-8").splitlines()
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            # A run killed mid-write leaves a truncated last line; everything before it is still good.
            if number == len(lines):
                break
            raise DataError(f"{path} line {number} is not JSON ({error}); remove the line or rerun") from error
        if isinstance(record, dict):
            records.append(record)
    return records


def distinct_labels(runs: list[Run]) -> list[str]:
    """The variant names, made unique by appending the folder name where two runs share a name."""
    names = [run.name for run in runs]
    labels = [
        name if names.count(name) == 1 else f"{name} ({run.directory.name})"
        for name, run in zip(names, runs, strict=True)
    ]
    seen: dict[str, int] = {}
    unique = []
    for label in labels:
        seen[label] = seen.get(label, 0) + 1
        unique.append(label if seen[label] == 1 else f"{label} #{seen[label]}")
    return unique
