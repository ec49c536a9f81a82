"""Every value the validator accepts runs; every other input is refused in one line with exit code 2: numbers past
what the machinery can hold, files that are not UTF-8 TOML, paths that are not what they should be, an address that
does not resolve, a batch larger than a shard, and (as root) a full disk and a tiny /dev/shm."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fast.comm.shared_memory import new_shared_file
from fast.errors import say
from fast.tools.cli import main

FAST = str(Path(sys.executable).with_name("fast"))
JOB = '[run]\nworkers = 2\nepochs = 1\nbatch_size = 32\neval_every = 0\n[data]\nname = "digits"\n'
ROOT = os.geteuid() == 0 and shutil.which("unshare") is not None and shutil.which("mount") is not None


def _refused(capsys, argv: list[str], *words: str) -> None:
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fast: error: ") and all(w in lines[0] for w in words), lines


@pytest.mark.parametrize(
    ("setting", "words"),
    [
        ("run.epochs=inf", ["`run.epochs`", "finite"]),
        ("run.deadline_s=1e30", ["`run.deadline_s`", "less than or equal to 1000000"]),
        ("run.seed=99999999999999999999999", ["`run.seed`", "4294967295"]),
        ("run.threads_per_worker=100000", ["`run.threads_per_worker`", "1024"]),
        ("run.master_addr=no.such.host.invalid", ["run.master_addr 'no.such.host.invalid' does not resolve"]),
        ("run.batch_size=5000", ["batch size 5000", "larger than the smallest worker's shard, 719 of the 1438"]),
        ("data.loader_workers=100000", ["`data.loader_workers`"]),
    ],
)
def test_numbers_and_addresses_past_what_runs_are_refused(tmp_path, capsys, setting, words):
    (tmp_path / "job.toml").write_text(JOB)
    _refused(capsys, ["train", str(tmp_path / "job.toml"), "--out", str(tmp_path / "run"), "--set", setting], *words)


def test_the_largest_accepted_values_run(tmp_path, no_orphans):
    (tmp_path / "job.toml").write_text(JOB)
    settings = ["run.seed=4294967295", "run.deadline_s=1000000", "run.threads_per_worker=1024", "run.batch_size=719"]
    argv = ["train", str(tmp_path / "job.toml"), "--out", str(tmp_path / "run")]
    assert main([*argv, *(arg for s in settings for arg in ("--set", s))]) == 0
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps_per_worker"] == 1


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda p: p.write_bytes(b'[run]\nname = "caf\xe9"\n'), ["is not UTF-8 text (byte 17 is not)"]),
        (lambda p: p.write_text("[run]\nworkers = 2\n", encoding="utf-16"), ["is not UTF-8 text (byte 0 is not)"]),
        (lambda p: p.mkdir(), ["is a folder: give the path of a TOML file"]),
    ],
    ids=["latin-1", "utf-16", "folder"],
)
def test_a_config_that_is_not_utf8_toml_is_refused(tmp_path, capsys, make, words):
    make(tmp_path / "job.toml")
    _refused(capsys, ["train", str(tmp_path / "job.toml"), "--out", str(tmp_path / "run")], *words)


def test_out_naming_a_file_is_refused(tmp_path, capsys):
    (tmp_path / "job.toml").write_text(JOB)
    (tmp_path / "taken").write_text("mine")
    _refused(capsys, ["train", str(tmp_path / "job.toml"), "--out", str(tmp_path / "taken")], "is a file")
    assert (tmp_path / "taken").read_text() == "mine"


@pytest.mark.parametrize("workers", ["0", "-3"])
def test_fast_run_with_no_workers_is_refused(tmp_path, capsys, workers):
    (tmp_path / "loop.py").write_text("import fast\nfast.init()\n")
    _refused(capsys, ["run", "--workers", workers, str(tmp_path / "loop.py")], f"--workers {workers}")


@pytest.mark.parametrize(
    ("settings", "key"),
    [(["run.membership=live", "faults.churn={lifetime='6s', absence='2s', seed=1}"], "faults.churn.seed"),
     (["model.width=3", "compute.slowdwn=2"], "compute.slowdwn")],
    ids=["in-a-table", "beside-a-key-of-the-scripts"],
)  # fmt: skip
def test_fast_run_refuses_an_unknown_key_before_it_starts_a_worker(tmp_path, capsys, settings, key):
    """No config of the script's gives a table a key the schema lacks, so the launcher says so itself: once, not
    once from each worker. A key that the script's own config may make valid ([model] width, with its factory)
    is still left to its fast.init."""
    (tmp_path / "loop.py").write_text("import fast\nfast.init()\n")
    sets = [arg for setting in settings for arg in ("--set", setting)]
    assert main(["run", "--out", str(tmp_path / "run"), *sets, str(tmp_path / "loop.py")]) == 2
    said = capsys.readouterr().err.strip()
    assert said == f"fast: error: unknown key `{key}`: remove it or check its spelling (see docs/configuration.md)"


def test_a_script_that_trains_at_its_top_level_is_told_to_guard_it(tmp_path, no_orphans):
    """A process that imported torch before FAST starts its workers from a fork server, which imports the script
    again in each of them: the call at the script's top level would train again in every worker."""
    script = tmp_path / "unguarded.py"
    (tmp_path / "job.toml").write_text(JOB)
    script.write_text(f"import torch\nimport fast\nfast.train('job.toml', out={str(tmp_path / 'run')!r})\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines[-1] == "fast: error: worker 0 exited with code 2; the run was stopped", done.stderr
    assert all('under `if __name__ == "__main__":`' in line for line in lines[:-1]) and lines[:-1], done.stderr


class _Writes(io.RawIOBase):
    """An unbuffered stream's bytes, write by write: what a pipe that several processes share receives."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        self.writes.append(bytes(data))
        return len(data)


def test_a_workers_one_line_error_reaches_an_unbuffered_stderr_in_one_write():
    """Under PYTHONUNBUFFERED print writes a line's text and its newline apart: two workers told to guard their
    script once wrote their lines as one (CI), and the test above failed."""
    raw = _Writes()
    say("fast: error: worker 1: ...", io.TextIOWrapper(raw, write_through=True))  # stderr, unbuffered
    assert raw.writes == [b"fast: error: worker 1: ...\n"]


def test_a_shared_memory_file_is_readable_by_its_owner_only():
    path = new_shared_file("sum", 4096)
    try:
        assert path is not None and path.stat().st_mode & 0o777 == 0o600
    finally:
        path.unlink()


# -- as root: a full disk, a tiny /dev/shm (mount namespaces of the test's own) ------------------------------------
@pytest.mark.skipif(not ROOT, reason="mounting a small file system needs root (unshare, mount)")
def test_a_full_disk_names_the_file_and_keeps_what_was_written(tmp_path):
    (tmp_path / "job.toml").write_text(JOB)
    full = tmp_path / "full"
    full.mkdir()
    command = f"mount -t tmpfs -o size=64k tmpfs {full} && {FAST} train {tmp_path / 'job.toml'} --out {full / 'run'}"
    done = subprocess.run(["unshare", "-m", "sh", "-c", f"{command}; cp -r {full / 'run'} {tmp_path / 'kept'}"],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    lines = done.stderr.strip().splitlines()
    assert lines[-1] == (f"fast: error: worker 0 failed: cannot write {full / 'run' / 'model.pt'}: No space left on "
                         "device: free space there (or write the run elsewhere with --out); the run's other files are "
                         "kept"), done.stderr  # fmt: skip
    summary = json.loads((tmp_path / "kept" / "summary.json").read_text())
    assert summary["unwritten"] == ["model.pt"] and (tmp_path / "kept" / "metrics.jsonl").stat().st_size > 0
    assert not any(p.name.startswith(".") and "tmp" in p.name for p in (tmp_path / "kept").iterdir())


@pytest.mark.skipif(not ROOT, reason="mounting a small /dev/shm needs root (unshare, mount)")
@pytest.mark.parametrize(
    ("setting", "outcome"),
    [
        ("strategy.name=sync", "backend"),  # the sums fall back from shared memory to gloo
        ("strategy.name=hogwild", "hogwild shares its model through /dev/shm, which has no room for"),
        pytest.param(
            "run.max_restarts=1",
            "torch's elastic agent keeps its locks in /dev/shm, which is full",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_a_tiny_dev_shm_falls_back_or_is_one_line_and_nothing_is_left_there(tmp_path, setting, outcome):
    (tmp_path / "job.toml").write_text(JOB)
    run = tmp_path / "run"
    command = (f"mount -t tmpfs -o size=4k tmpfs /dev/shm && {FAST} train {tmp_path / 'job.toml'} --out {run} "
               f"--set {setting}; echo rc=$?; ls -A /dev/shm")  # fmt: skip
    done = subprocess.run(["unshare", "-m", "sh", "-c", command], capture_output=True, text=True, timeout=300)
    rc = [line for line in done.stdout.splitlines() if line.startswith("rc=")]
    assert done.stdout.strip().splitlines()[-1] == rc[0], f"left in /dev/shm: {done.stdout}"
    if outcome == "backend":
        assert rc == ["rc=0"], done.stderr
        assert json.loads((run / "summary.json").read_text())["all_reduce"] == "backend"
    else:
        assert rc == ["rc=2"] and done.stderr.strip().splitlines()[-1].startswith("fast: error: "), done.stderr
        assert len(done.stderr.strip().splitlines()) == 1 and outcome in done.stderr
