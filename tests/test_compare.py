"""`fast compare` and `fast report`: variants run in turn into one report; a bad config stops at once."""

from __future__ import annotations

import contextlib
import csv
import io
import os
import shutil
import signal
import time
import tomllib
from pathlib import Path

import pytest

import fast.tools.comparison
from fast.assemble import load_config
from fast.runtime.launch import WorkerFailed
from fast.tools.cli import main

BASE = """
[run]
name = "tiny"
workers = 2
epochs = 1
max_steps = 20
eval_every = 0.5

[data]
name = "digits"

[model]
name = "mlp"
"""

# Not in alphabetical order, so that a rebuilt report shows it kept the variants' order.
THREE_VARIANTS = """
[[variant]]
name = "sync"

[[variant]]
name = "slow-lr"
optimizer.lr = 0.005

[[variant]]
name = "broken"
"""
A = '[[variant]]\nname = "a"\n'
INJECTED = "worker 1 failed: RuntimeError: injected for the test"


def write_config(folder: Path, variants: str, base: str = BASE) -> Path:
    path = folder / "compare.toml"
    path.write_text(base + variants)
    return path


def read_rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as handle:
        return list(csv.DictReader(handle))


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    """One real comparison: two tiny variants that train, and one whose run fails (injected)."""
    folder = tmp_path_factory.mktemp("compare")
    config = write_config(folder, THREE_VARIANTS)
    real_train = fast.tools.comparison.train

    def train_or_fail(variant_config, out):
        if variant_config.run.name == "broken":
            raise WorkerFailed(INJECTED)
        return real_train(variant_config, out=out)

    out = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(out):
        patch.setattr(fast.tools.comparison, "train", train_or_fail)
        code = main(["compare", str(config), "--out", str(folder / "out"), "--set", "run.log_every=5"])
    return folder / "out", code, out.getvalue()


def test_compare_runs_every_variant_into_one_report(compared, no_orphans):
    out, code, printed = compared
    assert code == 1  # one variant failed; the others still ran and were reported
    for name in ("sync", "slow-lr"):
        run = out / name
        assert (run / "summary.json").is_file() and (run / "metrics.jsonl").is_file()
        assert tomllib.loads((run / "config.toml").read_text())["run"]["name"] == name
    configs = [tomllib.loads((out / name / "config.toml").read_text()) for name in ("sync", "slow-lr")]
    assert [c["optimizer"]["lr"] for c in configs] == [0.05, 0.005]
    rows = read_rows(out / "summary.csv")
    assert [r["variant"] for r in rows] == ["sync", "slow-lr", "broken"]
    sync_accuracy, slow_accuracy = (float(r["final_test_accuracy"]) for r in rows[:2])
    assert sync_accuracy > slow_accuracy > 0.1  # same start, same data: the learning rate made the difference
    assert [r["error"] for r in rows] == ["", "", INJECTED]
    html = (out / "report.html").read_text()
    assert all(name in html for name in ("sync", "slow-lr", "broken", "injected for the test"))
    assert (out / "compare.toml").read_text().startswith("# compared with --set run.log_every=5\n")
    assert [c["run"]["log_every"] for c in configs] == [5, 5]
    assert "variant 1/3: sync" in printed and "variant 3/3: broken" in printed
    assert f"broken failed: {INJECTED}" in printed
    assert printed.strip().splitlines()[-1] == str((out / "report.html").resolve())


def test_report_rebuilds_the_same_table_from_the_run_folders(compared, tmp_path):
    out = shutil.copytree(compared[0], tmp_path / "copy")
    expected = read_rows(out / "summary.csv")
    (out / "report.html").unlink()
    (out / "summary.csv").unlink()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["report", str(out)]) == 0
    assert read_rows(out / "summary.csv") == expected
    assert "slow-lr" in (out / "report.html").read_text()
    assert printed.getvalue().strip().splitlines()[-1] == str((out / "report.html").resolve())


def test_report_of_a_folder_without_runs_is_a_one_line_error(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "no run folders" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize(
    ("variants", "message"),
    [
        (A + '[[variant]]\nname = "b"\noptimizer.lrr = 0.1\n', "variant 'b': unknown key `optimizer.lrr`"),
        ('[[variant]]\nname = "a"\nstrategy.name = "nope"\n', "variant 'a': `strategy.name` = 'nope'"),
        (A + '[[variant]]\nname = "A"\n', "two variants are named 'a' and 'A'"),
        ('[[variant]]\nname = "a/b"\n', "cannot be a folder name"),
        ('[[variant]]\nname = ".."\n', "cannot be a folder name"),
        ("[[variant]]\noptimizer.lr = 0.1\n", "has no `name`"),
        (A + '[[variant]]\nname = "b"\nrun.seed = 1\n', "different `run.seed`"),
        ("", "no [[variant]] tables"),
    ],
)
def test_a_bad_variant_stops_everything_before_anything_runs(tmp_path, capsys, variants, message):
    config = write_config(tmp_path, variants)
    assert main(["compare", str(config), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_set_applies_to_every_variant_after_its_own_keys(tmp_path, capsys):
    config = write_config(tmp_path, THREE_VARIANTS)
    planned = fast.tools.comparison.plan(config, optimizer__lr=0.2)
    assert [(v.name, v.config.run.name, v.config.optimizer.lr) for v in planned] == [
        ("sync", "sync", 0.2),
        ("slow-lr", "slow-lr", 0.2),
        ("broken", "broken", 0.2),
    ]
    assert main(["compare", str(config), "--set", "run.wrokers=2", "--out", str(tmp_path / "out")]) == 2
    assert "variant 'sync': unknown key `run.wrokers`" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_ctrl_c_stops_the_comparison_and_keeps_what_finished(tmp_path, monkeypatch, capsys):
    config = write_config(
        tmp_path, '[[variant]]\nname = "one"\n[[variant]]\nname = "two"\n[[variant]]\nname = "three"\n'
    )
    started = []

    def fail_then_interrupt(variant_config, out):
        started.append(variant_config.run.name)
        if variant_config.run.name == "one":
            raise WorkerFailed(INJECTED)
        try:  # the launcher turns Ctrl-C into a failed run, as here; the comparison must stop all the same
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        except KeyboardInterrupt:
            raise WorkerFailed("interrupted (Ctrl-C): every worker was stopped") from None

    monkeypatch.setattr(fast.tools.comparison, "train", fail_then_interrupt)
    assert main(["compare", str(config), "--out", str(tmp_path / "out")]) == 130
    assert started == ["one", "two"]
    assert [r["variant"] for r in read_rows(tmp_path / "out" / "summary.csv")] == ["one"]
    assert (tmp_path / "out" / "report.html").is_file()
    assert "interrupted after 1 of 3 variants" in capsys.readouterr().out
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_variants_merge_overrides_into_the_base():
    base = {"run": {"workers": 4}, "strategy": {"name": "gossip", "topology": "ring"}}
    found = fast.tools.comparison.variants(
        base
        | {
            "variant": [
                {"name": "torus", "strategy": {"topology": "torus:2x2"}},
                {"name": "ssp", "strategy": {"staleness": 2, "name": "ssp"}, "run": {"workers": 2}},
            ]
        }
    )
    assert found == [
        ("torus", {"run": {"workers": 4}, "strategy": {"name": "gossip", "topology": "torus:2x2"}}),
        ("ssp", {"run": {"workers": 2}, "strategy": {"name": "ssp", "staleness": 2}}),
    ]
    assert base["strategy"]["topology"] == "ring"  # the base is not modified


def test_the_demo_config_is_valid():
    demo = Path(__file__).parents[1] / "examples" / "demo.toml"
    found = fast.tools.comparison.variants(demo)
    assert len(found) >= 2 and found[0][0] == "sync"
    for name, data in found:
        config = load_config(data)
        job = (config.data.name, config.model.name, config.run.workers)
        assert job == ("fashion-mnist", "lenet", 4), name
