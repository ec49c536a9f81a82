"""FAST's comparison report: load run folders, tabulate them, and write a self-contained report.html."""

from fast.tools.report.html import build_report
from fast.tools.report.runs import Run, load_run
from fast.tools.report.table import rich_table, summary_rows, write_summary_csv

__all__ = ["Run", "build_report", "load_run", "rich_table", "summary_rows", "write_summary_csv"]
