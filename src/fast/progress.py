"""Progress of a run on rank 0: a rich progress bar on a terminal, plain lines otherwise."""

from __future__ import annotations

import sys
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
from rich.progress import Progress as RichProgress


class Progress:
    """Shows epoch, step, loss, last test accuracy and samples/s (all workers) as records arrive."""

    def __init__(self, name: str, total_steps: int, steps_per_epoch: int, samples_per_step: int) -> None:
        self.total, self.per_epoch, self.samples_per_step = total_steps, steps_per_epoch, samples_per_step
        self.name = name
        self.accuracy: float | None = None
        self.loss: float | None = None
        self.tty = sys.stdout.isatty()
        self.next_line = 0
        self.bar: RichProgress | None = None
        if self.tty:
            self.bar = RichProgress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"),
                TimeElapsedColumn(),
                console=Console(),
                transient=False,
            )
            self.task = self.bar.add_task(name, total=total_steps, info="")
            self.bar.start()

    def update(self, record: dict[str, Any]) -> None:
        if "test_accuracy" in record:
            self.accuracy = record["test_accuracy"]
        if "loss" in record:
            self.loss = record["loss"]
        step, t = record["step"], record["time_s"]
        rate = step * self.samples_per_step / t if t > 0 else 0.0
        acc = f"{self.accuracy:.4f}" if self.accuracy is not None else "-"
        loss = f"{self.loss:.4f}" if self.loss is not None else "-"
        info = f"epoch {step / self.per_epoch:.2f}  loss {loss}  test acc {acc}  {rate:,.0f} samples/s"
        if self.bar is not None:
            self.bar.update(self.task, completed=step, info=info)
        elif "test_accuracy" in record or step >= self.next_line:
            print(f"[{self.name}] step {step}/{self.total}  {info}", flush=True)
            self.next_line = step + max(1, self.total // 10)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
