"""A worker's metric records: kept for the summary, streamed to `workers/metrics-<rank>.jsonl` as they come, shown
by the progress bar (rank 0) and, with `run.tensorboard`, written as TensorBoard scalars."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from fast.runtime import files
from fast.runtime.progress import Progress


class Records:
    def __init__(self, run_dir: Path, rank: int, tensorboard: bool = False) -> None:
        self.rank = rank
        self.records: list[dict[str, Any]] = []
        self.evals: list[dict[str, Any]] = []  # the evaluations of the reported model (rank 0's)
        self.file = run_dir / "workers" / f"metrics-{rank}.jsonl"
        self.progress: Progress | None = None
        self.writer: Any = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(run_dir / "tensorboard" / f"worker{rank}"))

    def show_progress(self, name: str, total_steps: int | None, steps_per_epoch: int, samples_per_step: int) -> None:
        if self.rank == 0 and os.environ.get("FAST_PROGRESS", "1") != "0" and self.progress is None:
            self.progress = Progress(name, total_steps, steps_per_epoch, samples_per_step)

    def add(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        files.append_line(self.file, json.dumps(record))
        if self.progress is not None:
            self.progress.update(record)
        if self.writer is not None:
            for key, value in record.items():
                if key not in ("worker", "step", "epoch", "kind") and isinstance(value, int | float):
                    self.writer.add_scalar(key, value, record["step"])
            self.writer.flush()

    def add_evaluation(self, result: dict[str, Any]) -> None:
        """An evaluation of the reported model; one at the same step as an earlier one replaces it (the final
        evaluation, after the end of the run's exchanges, supersedes one the loop made at its last step)."""
        if self.evals and self.evals[-1]["step"] == result["step"]:
            self.evals.pop()
        self.evals.append(result)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.close()
            self.progress = None
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    def state(self) -> dict[str, str]:
        return {"records": json.dumps(self.records), "evals": json.dumps(self.evals)}

    def restore(self, state: dict[str, Any]) -> None:
        self.records, self.evals = json.loads(state["records"]), json.loads(state["evals"])
