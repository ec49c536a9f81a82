"""The end-of-run summary on the terminal."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table


def print_summary(summary: dict[str, Any]) -> None:
    table = Table(title=f"{summary.get('name')} ({summary.get('strategy')}, {summary.get('workers')} workers)")
    table.add_column("figure")
    table.add_column("value", justify="right")

    def fmt(v: Any) -> str:
        return f"{v:.4f}" if isinstance(v, float) else "—" if v is None else str(v)

    for key in (
        "final_test_accuracy",
        "best_test_accuracy",
        "final_test_loss",
        "wall_time_s",
        "samples_per_s",
        "bytes_sent",
        "all_reduce",
        "compression_ratio",
        "mean_staleness",
        "replica_divergence",
    ):
        if key in summary:
            table.add_row(key, fmt(summary[key]))
    for target, seconds in (summary.get("time_to_accuracy_s") or {}).items():
        table.add_row(f"time to {target}", fmt(seconds))
    simulation = summary.get("simulation")
    if simulation:  # the times above are virtual
        table.add_row("engine", f"simulated (virtual times; {simulation['host_s']:.0f} s on this host)")
    console = Console()
    console.print(table)
    if "run_dir" in summary:
        console.print(f"results in {summary['run_dir']}")
