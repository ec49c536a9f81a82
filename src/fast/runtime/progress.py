"""Progress of a run on worker 0: a rich progress bar on a terminal, plain lines otherwise."""

from __future__ import annotations

import sys
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
from rich.progress import Progress as RichProgress


class Progress:
    """Shows epoch, step, loss, the last evaluation's first metric and samples/s (all workers) as records arrive; on
    a GPU, worker 0's achieved TFLOP/s and model FLOPs utilisation."""

    def __init__(self, name: str, total_steps: int | None, steps_per_epoch: int, samples_per_step: int) -> None:
        self.total, self.per_epoch, self.samples_per_step = total_steps, steps_per_epoch, samples_per_step
        self.name = name
        self.metric: tuple[str, float] | None = None
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
        tested = [(k.removeprefix("test_"), v) for k, v in record.items() if k.startswith("test_") and k != "test_loss"]
        if tested:
            self.metric = tested[0]
        if "loss" in record:
            self.loss = record["loss"]
        step, t = record["step"], record["time_s"]
        rate = step * self.samples_per_step / t if t > 0 else 0.0
        metric = f"test {self.metric[0]} {self.metric[1]:.4f}" if self.metric is not None else "test -"
        loss = f"{self.loss:.4f}" if self.loss is not None else "-"
        info = f"epoch {step / self.per_epoch:.2f}  loss {loss}  {metric}  {rate:,.0f} samples/s"
        if "tflops" in record:  # on a GPU: worker 0's own (fast.runtime.throughput)
            info += f"  {record['tflops']:.3g} TFLOP/s  MFU {record['mfu']:.1%}"
        if self.bar is not None:
            self.bar.update(self.task, completed=step, info=info)
        elif tested or step >= self.next_line:
            total = f"/{self.total}" if self.total else ""
            print(f"[{self.name}] step {step}{total}  {info}", flush=True)
            self.next_line = step + max(1, (self.total or 100) // 10)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
