"""Tests of the comparison report on hand-written run folders shaped like `fast train`'s output."""

from __future__ import annotations

import base64
import csv
import json
import math
import re
from pathlib import Path

import pytest
from rich.console import Console

from fast.errors import ConfigError, DataError
from fast.tools.report import build_report, load_run, rich_table, summary_rows, write_summary_csv
from fast.tools.report.series import NOT_REACHED, loss_curve, megabytes_sent_curve
from fast.tools.report.table import target_key

FIGURE_TITLES = [
    "Test accuracy vs epochs",
    "Test accuracy vs wall time",
    "Training loss vs wall time",
    "Cumulative MB sent vs wall time",
    "Replica divergence vs wall time",
    "Staleness of applied updates",
    "Time to target accuracy",
]


def write_run(
    folder: Path,
    name: str,
    strategy: str,
    *,
    speed: float,
    final_accuracy: float,
    bytes_per_step: int,
    staleness: dict[str, int] | None = None,
    divergence: float | None = None,
    codec: str = "none",
    evaluating_workers: int = 1,
) -> Path:
    """A 4-worker, 2-epoch run: loss falls, accuracy climbs to `final_accuracy`, bytes grow per step."""
    folder.mkdir(parents=True)
    workers, steps, log_every = 4, 100, 10
    records = []
    for step in range(log_every, steps + 1, log_every):
        for worker in range(workers):
            time_s = step / speed + 0.01 * worker
            record = {
                "worker": worker,
                "step": step,
                "epoch": 2 * step / steps,
                "time_s": time_s,
                "loss": 2.3 * math.exp(-step / 40) + 0.05 * worker,
                "samples": 64 * step,
                "bytes_sent": bytes_per_step * step,
                "bytes_received": bytes_per_step * step,
            }
            if step % 50 == 0 and worker < evaluating_workers:
                record["test_accuracy"] = final_accuracy * step / steps
                record["test_loss"] = 2.3 * (1 - step / steps) + 0.3
            records.append(record)
        if divergence is not None:
            records.append({"worker": 0, "step": step, "time_s": step / speed, "divergence": divergence * step / steps})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    wall_time = steps / speed
    reached = {
        "0.5": wall_time * 0.5 if final_accuracy >= 0.5 else None,
        "0.8": wall_time if final_accuracy >= 0.8 else None,
    }
    summary = {
        "name": name,
        "strategy": strategy,
        "workers": workers,
        "epochs": 2,
        "final_test_accuracy": final_accuracy,
        "final_test_loss": 0.3,
        "best_test_accuracy": final_accuracy,
        "wall_time_s": wall_time,
        "samples_per_s": workers * 64 * steps / wall_time,
        "bytes_sent": workers * bytes_per_step * steps,
        "bytes_received": workers * bytes_per_step * steps,
        "bytes_sent_uncompressed": workers * 4_000_000 * steps,
        "compression_ratio": 4_000_000 / bytes_per_step,
        "time_to_accuracy_s": reached,
        "mean_staleness": None if staleness is None else 1.25,
        "max_staleness": None if staleness is None else max(int(s) for s in staleness),
        "staleness_histogram": staleness,
        "replica_divergence": divergence,
        "worker_test_accuracy": None,
        "step_time_s": 1 / speed,
        "predicted_step_time_s": 1.1 / speed,
        "skipped_steps": 3 if strategy == "async" else 0,
        "failures": [{"worker": 2, "step": 40, "kind": "crash"}] if strategy == "async" else [],
        "config": {
            "run": {"workers": workers, "targets": [0.5, 0.8]},
            "strategy": {"name": strategy},
            "codec": {"name": codec},
            "network": {
                "bandwidth_mbps": 100,
                "latency_ms": 5,
                "jitter_ms": 1,
                "loss": 0.001,
                "sites": None,
                "links": [],
                "site_of": {},
            },  # unset: not shown
            "compute": {"stragglers": [3], "slowdown": 2.0, "heavy_tail": 0.0, "heavy_tail_max": 20.0},
            "faults": {"crash": [], "link_down": []},
            "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 0.0},
        },
        "env": {"python": "3.11", "torch": "2.13.0", "host": "test"},
    }
    (folder / "summary.json").write_text(json.dumps(summary))
    return folder


@pytest.fixture(scope="module")
def run_dirs(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("runs")
    return [
        write_run(root / "sync", "sync-allreduce", "sync", speed=20, final_accuracy=0.912, bytes_per_step=4_000_000),
        write_run(
            root / "async",
            "async-ps",
            "async",
            speed=50,
            final_accuracy=0.874,
            bytes_per_step=4_000_000,
            staleness={"0": 40, "1": 25, "2": 10, "4": 5},
            divergence=0.02,
        ),
        write_run(
            root / "gossip",
            "gossip-topk",
            "gossip",
            speed=60,
            final_accuracy=0.71,
            bytes_per_step=400_000,
            divergence=0.08,
            codec="topk",
            evaluating_workers=4,
        ),
    ]


@pytest.fixture(scope="module")
def report(run_dirs: list[Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_report(run_dirs, tmp_path_factory.mktemp("report") / "report.html", title="Three strategies")


def test_report_has_every_figure_as_an_embedded_png(report: Path) -> None:
    html = report.read_text()
    images = re.findall(r'<img alt="([^"]+)" src="data:image/png;base64,([A-Za-z0-9+/=]+)">', html)
    assert [title for title, _ in images] == FIGURE_TITLES
    for _, data in images:
        assert base64.b64decode(data).startswith(b"\x89PNG\r\n\x1a\n")
    for title in FIGURE_TITLES:
        assert f"<h3>{title}</h3>" in html


def test_report_table_names_every_variant_with_its_numbers(report: Path) -> None:
    html = report.read_text()
    table = html[html.index('<section id="summary">') : html.index('<section id="figures">')]
    for name, accuracy, codec in [
        ("sync-allreduce", "91.2%", "none"),
        ("async-ps", "87.4%", "none"),
        ("gossip-topk", "71.0%", "topk"),
    ]:
        row = next(r for r in table.split("<tr>") if name in r)
        assert accuracy in row and f">{codec}<" in row
    assert "not reached" in table  # gossip-topk never reached 80%
    assert "time to 80% (s)" in table and "time to 50% (s)" in table
    assert ">10.0×<" in table  # gossip's compression ratio
    assert "<h1>Three strategies</h1>" in html


def test_report_shows_deployment_and_events(report: Path) -> None:
    html = report.read_text()
    deployment = html[html.index('<section id="deployment">') : html.index('<section id="summary">')]
    for text in [
        "workers",
        "bandwidth (Mbit/s): 100",
        "latency (ms): 5",
        "jitter (ms): 1",
        "stragglers",
        "slowdown",
    ]:
        assert text in deployment
    assert "sites" not in deployment and "links" not in deployment and "site of" not in deployment
    # only what the deployment has: no heavy tail (0), hence no cap on it; no faults
    assert "heavy" not in deployment and "faults" not in deployment and "crash" not in deployment
    runs = html[html.index('<section id="runs">') :]
    assert "sgd (lr: 0.05, momentum: 0.9)" in runs
    events = html[html.index('<section id="events">') : html.index('<section id="runs">')]
    assert "async-ps" in events and "3 skipped steps" in events and "crash" in events


def test_report_is_self_contained(report: Path) -> None:
    html = report.read_text()
    assert "http://" not in html and "https://" not in html
    assert not re.search(r'(src|href)="(?!data:)', html)
    assert "<script" not in html and "<link" not in html


def test_summary_csv_has_one_row_per_variant(report: Path) -> None:
    with (report.parent / "summary.csv").open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [row["variant"] for row in rows] == ["sync-allreduce", "async-ps", "gossip-topk"]
    assert float(rows[0]["final_test_accuracy"]) == pytest.approx(0.912)
    assert float(rows[0]["mb_sent"]) == pytest.approx(1600.0)
    assert rows[2][target_key(0.8)] == NOT_REACHED
    assert rows[0]["max_staleness"] == "" and rows[1]["max_staleness"] == "4"


def test_summary_rows_derive_unrecorded_targets_from_the_accuracy_curve(run_dirs: list[Path]) -> None:
    runs = [load_run(d) for d in run_dirs]
    rows = summary_rows(runs, targets=[0.4, 0.9])
    # sync evaluates at steps 50 (45.6%) and 100 (91.2%), 20 steps per second.
    assert rows[0][target_key(0.4)] == pytest.approx(2.5)
    assert rows[0][target_key(0.9)] == pytest.approx(5.0)
    assert rows[1][target_key(0.9)] == NOT_REACHED


def test_rich_table_lists_every_variant(run_dirs: list[Path]) -> None:
    rows = summary_rows([load_run(d) for d in run_dirs])
    console = Console(record=True, width=250)
    console.print(rich_table(rows))
    text = console.export_text()
    assert all(name in text for name in ["sync-allreduce", "async-ps", "gossip-topk"])
    assert "91.2%" in text and "not reached" in text


def test_run_without_metrics_or_optional_keys_renders_no_data_notes(tmp_path: Path) -> None:
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "summary.json").write_text(json.dumps({"name": "bare", "strategy": "sync", "final_test_accuracy": None}))
    html = build_report([bare], tmp_path / "out" / "report.html").read_text()
    assert "data:image/png" not in html
    assert html.count('class="nodata"') == len(FIGURE_TITLES)
    assert "—" in html and "bare" in html
    with (tmp_path / "out" / "summary.csv").open(newline="") as handle:
        assert [row["variant"] for row in csv.DictReader(handle)] == ["bare"]


def test_variants_with_the_same_name_get_distinct_labels(tmp_path: Path) -> None:
    first = write_run(tmp_path / "a", "sync", "sync", speed=20, final_accuracy=0.9, bytes_per_step=1000)
    second = write_run(tmp_path / "b", "sync", "sync", speed=30, final_accuracy=0.9, bytes_per_step=1000)
    rows = summary_rows([load_run(first), load_run(second)])
    assert [row["variant"] for row in rows] == ["sync (a)", "sync (b)"]
    write_summary_csv(rows, tmp_path / "s.csv")
    assert len((tmp_path / "s.csv").read_text().splitlines()) == 3


def test_curves_aggregate_over_workers(tmp_path: Path) -> None:
    run = tmp_path / "r"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({"name": "r", "strategy": "sync"}))
    records = [
        {"worker": 0, "time_s": 1.0, "loss": 2.0, "bytes_sent": 1_000_000},
        {"worker": 1, "time_s": 1.0, "loss": 4.0, "bytes_sent": 3_000_000},
        {"worker": 0, "time_s": 2.0, "loss": 1.0, "bytes_sent": 2_000_000},
        {"worker": 1, "time_s": 2.0, "loss": 3.0, "bytes_sent": 5_000_000},
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    loaded = load_run(run)
    assert megabytes_sent_curve(loaded) == ([1.0, 1.0, 2.0, 2.0], [1.0, 4.0, 5.0, 7.0])
    times, losses = loss_curve(loaded, smoothing_window=1)
    assert times == [1.0, 2.0] and losses == [3.0, 2.0]


def test_truncated_last_metrics_line_is_ignored_but_corruption_elsewhere_is_an_error(tmp_path: Path) -> None:
    run = tmp_path / "r"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({"name": "r", "strategy": "sync"}))
    (run / "metrics.jsonl").write_text('{"worker": 0, "time_s": 1.0, "loss": 2.0}\n{"worker": 1, "ti')
    assert len(load_run(run).metrics) == 1
    (run / "metrics.jsonl").write_text('{"worker": 0, "ti\n{"worker": 0, "time_s": 1.0, "loss": 2.0}\n')
    with pytest.raises(DataError, match="line 1"):
        load_run(run)


def test_bad_inputs_raise_one_line_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="does not exist"):
        load_run(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="summary.json is missing"):
        load_run(tmp_path / "empty")
    (tmp_path / "nameless").mkdir()
    (tmp_path / "nameless" / "summary.json").write_text(json.dumps({"strategy": "sync"}))
    with pytest.raises(DataError, match="'name'"):
        load_run(tmp_path / "nameless")
    with pytest.raises(ConfigError, match="no run folders"):
        build_report([], tmp_path / "report.html")


def test_a_curve_of_one_point_shows_and_is_named(run_dirs: list[Path], tmp_path: Path) -> None:
    """Gossip and ssp measure divergence at the final (collective) evaluation only: one point, drawn as a marker."""
    lone = write_run(tmp_path / "ssp", "ssp", "ssp", speed=40, final_accuracy=0.8, bytes_per_step=4_000_000,
                     divergence=0.01)  # fmt: skip
    records = [json.loads(line) for line in (lone / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in records if "divergence" in r][-1]
    kept = [r for r in records if "divergence" not in r or r is last]
    (lone / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
    html = build_report([*run_dirs, lone], tmp_path / "report.html").read_text()
    figure = html[html.index("<h3>Replica divergence vs wall time</h3>") :]
    assert "One point only: ssp." in figure[: figure.index("<h3>", 5)]


def test_the_bytes_curve_ends_at_the_tables_total_with_the_servers_bytes(tmp_path: Path) -> None:
    """The servers of async-ps keep no metric records, yet send about half of its bytes: the curve's last step adds
    them at the end of the run, so that it ends where the table's MB sent is, and the caption says so."""
    folder = write_run(tmp_path / "ps", "async-ps", "async-ps", speed=50, final_accuracy=0.8, bytes_per_step=1_000_000)
    summary = json.loads((folder / "summary.json").read_text())
    workers_total = summary["bytes_sent"]  # what the workers' records add up to: 400 MB
    summary.update(bytes_sent=2 * workers_total, servers=1)
    (folder / "summary.json").write_text(json.dumps(summary))
    times, totals = megabytes_sent_curve(load_run(folder))
    assert totals[-2] == workers_total / 1e6 and totals[-1] == 2 * workers_total / 1e6
    assert times[-1] == max(times[-2], summary["wall_time_s"])  # at the end of the run
    steady = write_run(tmp_path / "sync", "sync", "sync", speed=20, final_accuracy=0.9, bytes_per_step=1_000_000)
    assert megabytes_sent_curve(load_run(steady))[1][-1] == 400.0  # records that reach the total: no extra point
    html = build_report([folder, steady], tmp_path / "report.html").read_text()
    row = next(r for r in summary_rows([load_run(folder)]) if r["variant"] == "async-ps")
    assert row["mb_sent"] == totals[-1]
    figure = html[html.index("<h3>Cumulative MB sent vs wall time</h3>") :]
    caption = figure[: figure.index("</figure>")]
    assert "async-ps: 400.0 MB from its server)" in caption and "sync:" not in caption
