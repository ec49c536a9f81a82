"""`fast compare` and `fast report`: run a job's variants one after another, then one report comparing them.

Every variant starts from the same seed, hence the same initial weights and data partition. Each runs in its
own folder DIR/<variant> exactly as `fast train` writes it; a variant that fails is recorded (a summary.json
with `status = "failed"` and the error) and the next one runs. report.html and summary.csv are rewritten
after every variant, so an interruption keeps everything that finished.

With a script (`fast compare --script train.py variants.toml`), each variant is the user's own loop run as `fast run`
runs it: the file's keys, base and variant, are the launcher's `--set` on top of the script's own config.
"""

from __future__ import annotations

import copy
import json
import os
import re
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import tomli_w
from rich.console import Console
from rich.table import Table

from fast.assemble import load_config
from fast.config import Config, load_dict
from fast.errors import ConfigError, DataError, FastError
from fast.factories import add_search_path
from fast.jobs.datasets import load_dataset
from fast.runtime.launch import Interrupted
from fast.runtime.run_folder import claimed, new_folder
from fast.targets import Target
from fast.tools.report import build_report, load_run, summary_rows, write_summary_csv
from fast.tools.report.html import configured_targets
from fast.tools.report.runs import METRICS_FILE, SUMMARY_FILE, Run
from fast.tools.report.series import ordered, recorded_targets
from fast.tools.report.table import MISSING, table_columns
from fast.tools.start import run_script, train
from fast.tools.variants import dotted, variants

REPORT_FILE = "report.html"
SUMMARY_CSV = "summary.csv"
CONFIG_COPY = "compare.toml"  # the config the comparison ran, kept beside its results
FAILED = "failed"
LOG_WIDTH = 160
DEPLOYMENT_SECTIONS = ("network", "compute", "faults")
ZERO = re.compile(r"0+(\.0*)?\s*[a-zA-Z]*")
FILE_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


@dataclass(frozen=True)
class Variant:
    """One configuration to compare: its name (also its folder's), its validated config, and the keys the file
    and the overrides set for it (dotted: what a script's run is given)."""

    name: str
    config: Config
    keys: dict[str, Any]


@dataclass(frozen=True)
class Outcome:
    """How a variant ended: its run folder, and the error's one-line message if it failed."""

    name: str
    run_dir: Path
    error: str | None = None


@dataclass(frozen=True)
class Comparison:
    """What `compare` produced: the report and how each variant ended."""

    report: Path
    outcomes: list[Outcome]

    @property
    def failed(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.error is not None]


def plan(source: str | Path | dict[str, Any], checks_data: bool = True, **overrides: Any) -> list[Variant]:
    """Every variant's validated config, in file order; the first problem raises ConfigError naming it.

    `overrides` (dotted keys, `__` for dots as in `fast.train`) apply to every variant, after its own keys.
    Each variant's `run.name` becomes the variant's name, so that runs and report label it the same way.
    """
    found = variants(source)
    if not found:
        raise ConfigError(
            "the config has no [[variant]] tables: add one per configuration to compare, each with a `name`"
        )
    planned: list[Variant] = []
    folders: dict[str, str] = {}
    for name, data in found:
        _check_name(name, folders)
        data = copy.deepcopy(data)
        if isinstance(data.get("run", {}), dict):
            data.setdefault("run", {})["name"] = name
        try:
            config = load_config(data, **overrides)
        except ConfigError as error:
            raise ConfigError(f"variant {name!r}: {error}") from None
        keys = {**dotted(data), **{key.replace("__", "."): value for key, value in overrides.items()}}
        planned.append(Variant(name, config, keys))
    seeds = {v.config.run.seed for v in planned}
    if len(seeds) > 1:
        by_seed = ", ".join(f"{v.name}={v.config.run.seed}" for v in planned)
        raise ConfigError(
            f"variants set different `run.seed` values ({by_seed}): set the seed once in the base job so "
            "that every variant starts from the same weights and data partition"
        )
    if checks_data:  # (a script's data is its own)
        _check_data(planned)
    return planned


def _check_name(name: Any, folders: dict[str, str]) -> None:
    if not isinstance(name, str) or not FILE_SAFE_NAME.match(name):
        raise ConfigError(
            f"variant name {name!r} cannot be a folder name: use 1-64 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    folder = name.lower()  # some file systems ignore case
    if folder in folders:
        first = folders[folder]
        raise ConfigError(f"two variants are named {first!r} and {name!r}: give each a distinct name")
    folders[folder] = name


def _check_data(planned: list[Variant]) -> None:
    """Load each distinct data set once, so that a missing one stops the comparison before anything runs."""
    seen = set()
    for v in planned:
        data, seed = v.config.data, v.config.run.seed
        if data.factory is not None:  # the user's own data: made by their function in each run
            continue
        key = (data.name, data.dir, data.synthetic_train, data.synthetic_test, seed)
        if key not in seen:
            seen.add(key)
            try:
                load_dataset(
                    data.name,
                    seed=seed,
                    data_dir=data.dir,
                    synthetic_train=data.synthetic_train,
                    synthetic_test=data.synthetic_test,
                )
            except (ConfigError, DataError) as error:
                raise type(error)(f"variant {v.name!r}: {error}") from None


def default_out_dir(source: str | Path | dict[str, Any]) -> Path:
    """runs/NAME-compare-TIME, made now and no other comparison's."""
    return new_folder(Path("runs"), f"{_base_name(source)}-compare")


def _base_name(source: str | Path | dict[str, Any]) -> str:
    raw = source if isinstance(source, dict) else load_dict(source)
    run = raw.get("run")
    name = run.get("name") if isinstance(run, dict) else None
    if isinstance(name, str) and name:
        return name
    return "compare" if isinstance(source, dict) else Path(source).stem


def compare(
    source: str | Path | dict[str, Any],
    out: str | Path | None = None,
    *,
    script: str | Path | None = None,
    script_args: list[str] | None = None,
    console: Console | None = None,
    **overrides: Any,
) -> Comparison:
    """Validate every variant, run them one after another into `out`/<variant>, and write the report.

    `overrides` (`run__max_steps=20`, or dotted keys) apply to every variant, as `--set` does. With `script` (and
    its `script_args`), each variant is the user's own script run by `fast run`, the variant's keys its `--set`.
    Shows which variant runs (i of n) and each run's own progress; at the end prints the comparison table and,
    as the last line, the path of report.html. A Ctrl-C stops at once and keeps what finished.
    """
    console = console or _console()
    if isinstance(source, str | Path) and Path(source).is_file():
        add_search_path(str(Path(source).resolve().parent))  # the config's own modules ([model] factory, ...)
    if script is not None and not Path(script).is_file():
        raise ConfigError(f"fast compare --script {script}: no such file: give the path of a Python script")
    planned = plan(source, checks_data=script is None, **overrides)
    out_dir = Path(out) if out is not None else default_out_dir(source)
    runner = _script_runner(str(script), script_args or []) if script is not None else _train
    with claimed(out_dir):
        return _compare(source, out_dir, planned, console, overrides, runner)


def _compare(source: str | Path | dict[str, Any], out_dir: Path, planned: list[Variant], console: Console,
             overrides: dict[str, Any], runner: Callable[[Variant, Path], Any]) -> Comparison:  # fmt: skip
    _keep_config(source, overrides, out_dir / CONFIG_COPY)
    title = f"FAST comparison: {_base_name(source)}"
    outcomes: list[Outcome] = []
    report: Path | None = None
    rows: list[dict[str, Any]] = []
    started = time.monotonic()
    try:
        with _RememberInterrupt() as interrupt:
            for i, variant in enumerate(planned, start=1):
                elapsed = f"  ({_duration(time.monotonic() - started)} so far)" if i > 1 else ""
                console.rule(f"[bold]variant {i}/{len(planned)}: {variant.name}[/]{elapsed}")
                console.print(describe(variant.config), highlight=False)
                variant_started = time.monotonic()
                outcome = _run_variant(variant, out_dir / variant.name, interrupt, runner)
                outcomes.append(outcome)
                console.print(_verdict(outcome, time.monotonic() - variant_started), highlight=False)
                report, rows = write_report(out_dir, [o.run_dir for o in outcomes], title=title)
    except (KeyboardInterrupt, Interrupted):  # Ctrl-C, SIGTERM or SIGHUP
        kept = f"; the report of those is {report.resolve()}" if report is not None else ""
        console.print(f"interrupted after {len(outcomes)} of {len(planned)} variants{kept}", highlight=False)
        raise
    assert report is not None  # plan() gives at least one variant
    show_table(rows, console)
    finished = sum(o.error is None for o in outcomes)
    total = _duration(time.monotonic() - started)
    console.print(f"{finished} of {_count(len(planned), 'variant')} finished in {total}", highlight=False)
    console.print(str(report.resolve()), highlight=False, soft_wrap=True)
    return Comparison(report, outcomes)


def _console() -> Console:
    """The terminal; written to a file or pipe, wide enough that the tables are not squeezed."""
    console = Console()
    return console if console.is_terminal else Console(width=LOG_WIDTH)


def _keep_config(source: str | Path | dict[str, Any], overrides: dict[str, Any], path: Path) -> None:
    text = tomli_w.dumps(source) if isinstance(source, dict) else Path(source).read_text()
    if overrides:
        settings = " ".join(f"--set {key.replace('__', '.')}={value!r}" for key, value in overrides.items())
        text = f"# compared with {settings}\n{text}"
    path.write_text(text)


def _train(variant: Variant, run_dir: Path) -> Any:
    return train(variant.config, out=run_dir)


def _script_runner(script: str, script_args: list[str]) -> Callable[[Variant, Path], Any]:
    def run(variant: Variant, run_dir: Path) -> Any:
        return run_script(script, script_args, out=run_dir, **variant.keys)

    return run


def _run_variant(variant: Variant, run_dir: Path, interrupt: _RememberInterrupt,
                 runner: Callable[[Variant, Path], Any] = _train) -> Outcome:  # fmt: skip
    _clear_outputs(run_dir)
    try:
        runner(variant, run_dir)
    except Interrupted:  # Ctrl-C, SIGTERM or SIGHUP stops the comparison
        raise
    except Exception as error:  # any failure of one variant is recorded; the comparison goes on
        if interrupt.seen:  # the launcher turns Ctrl-C into a failed run: stop the comparison instead
            raise KeyboardInterrupt from None
        message = str(error).strip().splitlines()[0] if str(error).strip() else ""
        if not isinstance(error, FastError):
            message = f"{type(error).__name__}: {message}" if message else type(error).__name__
        _write_failure(run_dir, variant.config, message)
        return Outcome(variant.name, run_dir, message)
    return Outcome(variant.name, run_dir)


def _clear_outputs(run_dir: Path) -> None:
    """Remove what an earlier run left in this folder, so that no stale result is reported as this one's."""
    for path in [run_dir / SUMMARY_FILE, run_dir / METRICS_FILE, *run_dir.glob("workers/metrics-*.jsonl")]:
        path.unlink(missing_ok=True)


def _write_failure(run_dir: Path, config: Config, message: str) -> None:
    """A summary.json for a run that failed: enough for the report to list it, with the error."""
    summary = {
        "name": config.run.name,
        "strategy": config.strategy.name,
        "codec": config.codec.name,
        "workers": config.run.workers,
        "epochs": config.run.epochs,
        "status": FAILED,
        "error": message,
        "failures": [f"the run failed: {message}"],
        "config": config.to_dict(),
    }
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / f"{SUMMARY_FILE}.tmp"
    tmp.write_text(json.dumps(summary, indent=2) + "\n")
    os.replace(tmp, run_dir / SUMMARY_FILE)


class _RememberInterrupt:
    """Notes a Ctrl-C (then raises KeyboardInterrupt as usual), even where the launcher catches it."""

    def __init__(self) -> None:
        self.seen = False
        self.installed = False
        self.previous: Any = signal.SIG_DFL

    def __enter__(self) -> _RememberInterrupt:
        try:
            if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
                self.previous = signal.signal(signal.SIGINT, self._handle)
                self.installed = True
        except ValueError:  # not the main thread: signals cannot be watched here
            pass
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.seen = True
        if callable(self.previous):
            self.previous(signum, frame)
        raise KeyboardInterrupt

    def __exit__(self, *exc: object) -> None:
        if self.installed:
            signal.signal(signal.SIGINT, self.previous if self.previous is not None else signal.SIG_DFL)


def describe(config: Config) -> str:
    """One line: strategy and codec with their options, workers, epochs, and any emulated deployment."""
    parts = [_component("strategy", config.strategy.name, config.strategy.options())]
    if config.codec.name != "none":
        parts.append(_component("codec", config.codec.name, config.codec.options()))
    workers, epochs = config.run.workers, config.run.epochs
    parts.append(f"{_count(workers, 'worker')}, {_count(epochs, 'epoch')}")
    as_dict = config.to_dict()
    for section in DEPLOYMENT_SECTIONS:
        table = as_dict.get(section)
        settings = table.items() if isinstance(table, dict) else []
        shown = ", ".join(f"{key}={value}" for key, value in settings if not _is_unset(value))
        if shown:
            parts.append(f"{section} {shown}")
    return " · ".join(parts)


def _is_unset(value: Any) -> bool:
    """Empty tables and lists, zeros and zero durations ("0ms"): defaults not worth a mention."""
    if isinstance(value, dict | list | tuple):
        return not value
    if isinstance(value, bool):
        return False
    if isinstance(value, int | float):
        return value == 0
    return isinstance(value, str) and ZERO.fullmatch(value) is not None


def _count(number: float, noun: str) -> str:
    return f"{number:g} {noun}{'' if number == 1 else 's'}"


def _component(kind: str, name: str, options: dict[str, Any]) -> str:
    if not options:
        return f"{kind} {name}"
    return f"{kind} {name} ({', '.join(f'{k}={v}' for k, v in options.items())})"


def _verdict(outcome: Outcome, seconds: float) -> str:
    if outcome.error is not None:
        return f"✗ {outcome.name} failed after {_duration(seconds)}: {outcome.error}"
    summary = load_run(outcome.run_dir).summary
    accuracy, wall = summary.get("final_test_accuracy"), summary.get("wall_time_s")
    figures = []
    if isinstance(accuracy, int | float):
        figures.append(f"final test accuracy {accuracy:.2%}")
    if isinstance(wall, int | float):
        figures.append(f"trained in {_duration(wall)}")
    figures.append(f"{_duration(seconds)} in all")
    return f"✓ {outcome.name}: {', '.join(figures)}"


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    return f"{minutes}:{secs:02d}" if minutes else f"{seconds:.1f} s"


def report_targets(runs: list[Run]) -> list[Target]:
    """The targets to tabulate: those the runs recorded times for and those their configs ask for."""
    return ordered(recorded_targets(runs) + configured_targets(runs))


def write_report(
    directory: Path, run_dirs: list[Path], *, title: str = "FAST comparison"
) -> tuple[Path, list[dict[str, Any]]]:
    """Write report.html and summary.csv in `directory` for these run folders; return the HTML path and rows.

    summary.csv has one row per run, with an `error` column giving why a failed run failed.
    """
    runs = [load_run(d) for d in run_dirs]
    targets = report_targets(runs)
    html = build_report(run_dirs, directory / REPORT_FILE, title=title, targets=targets)
    rows = summary_rows(runs, targets)
    for row, run in zip(rows, runs, strict=True):
        row["error"] = run.summary.get("error") if run.summary.get("status") == FAILED else None
    write_summary_csv(rows, directory / SUMMARY_CSV)
    return html, rows


def show_table(rows: list[dict[str, Any]], console: Console) -> None:
    """The comparison as on the report, one table per column group, then why each failed variant failed.

    Columns no variant has a value for are left out, so that the tables fit a terminal.
    """
    columns = [c for c in table_columns(rows) if any(c.cell(row) != MISSING for row in rows)]
    for group in dict.fromkeys(c.group for c in columns):
        shown = [c for c in columns if c.key == "variant" or (c.group == group and c.key != "variant")]
        table = Table(title=group, header_style="bold", title_style="bold")
        for column in shown:
            table.add_column(column.header, justify="right" if column.numeric else "left")
        for row in rows:
            table.add_row(*(column.cell(row) for column in shown))
        console.print(table)
    for row in rows:
        if row.get("error"):
            console.print(f"✗ {row['variant']} failed: {row['error']}", highlight=False)


def find_run_dirs(directory: str | Path) -> list[Path]:
    """The run folders in `directory` (subfolders holding a summary.json), in the order they were compared.

    That order is the variants' order in the kept compare.toml; folders it does not name come after, by name.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise DataError(f"{directory} is not a folder: give the folder `fast compare` wrote")
    found = sorted(p for p in directory.iterdir() if (p / SUMMARY_FILE).is_file())
    if not found:
        raise DataError(
            f"no run folders (subfolders with a {SUMMARY_FILE}) in {directory}: give the folder "
            "`fast compare` wrote, or run `fast compare` first"
        )
    order = {name: i for i, name in enumerate(_compared_names(directory / CONFIG_COPY))}
    return sorted(found, key=lambda p: (order.get(p.name, len(order)), p.name))


def _compared_names(config_copy: Path) -> list[str]:
    """The variant names in a kept compare.toml, in order; none if it is missing or unreadable."""
    if not config_copy.is_file():
        return []
    try:
        tables = load_dict(config_copy).get("variant")
    except ConfigError:
        return []
    if not isinstance(tables, list):
        return []
    return [t["name"] for t in tables if isinstance(t, dict) and isinstance(t.get("name"), str)]


def rebuild_report(directory: str | Path, *, console: Console | None = None) -> Path:
    """`fast report DIR`: rewrite report.html and summary.csv from the run folders in DIR; print the table."""
    console = console or _console()
    directory = Path(directory)
    run_dirs = find_run_dirs(directory)
    try:
        base = _base_name(directory / CONFIG_COPY)
    except ConfigError:  # no readable compare.toml: the folder's name will do
        base = directory.name
    report, rows = write_report(directory, run_dirs, title=f"FAST comparison: {base}")
    show_table(rows, console)
    console.print(str(report.resolve()), highlight=False, soft_wrap=True)
    return report
