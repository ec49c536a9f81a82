"""No process outlives its run, and a run keeps to its own folder and to this machine: the launcher of `fast train`,
`fast run` or `fast compare` killed (SIGKILL) or terminated (SIGTERM) leaves no process and no scratch file, SIGTERM
ends a run as Ctrl-C does (exit code 143, the resume hint), Ctrl-C or SIGTERM at any moment of start-up is one line,
a local live run listens on loopback only, and two runs never share a folder."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from fast.comm.bootstrap import free_port
from fast.runtime import launch as launch_module
from tests.processes import in_session

FAST = str(Path(sys.executable).with_name("fast"))
LONG = ["--set", "data.name=digits", "--set", "run.workers=2", "--set", "run.epochs=1000", "--set",
        "run.batch_size=32", "--set", "run.eval_every=0"]  # fmt: skip
SCRIPT = """
import fast
job = fast.init()
import torch
model = torch.nn.Linear(4, 2)
model, optimizer = job.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
for step in range(10**7):
    loss = model(torch.randn(8, 4)).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    job.log(loss=loss)
job.finish()
"""
COMPARE = """
[run]
workers = 2
epochs = 1000
batch_size = 32
eval_every = 0
[data]
name = "digits"
[[variant]]
name = "sync"
[[variant]]
name = "gossip"
strategy = { name = "gossip" }
"""


def scratch_of(pid: int) -> list[str]:
    """The scratch files a launcher `pid` made: its rendezvous folder in /tmp, its files in /dev/shm."""
    folders = [Path("/tmp"), Path("/dev/shm")]
    return [str(p) for folder in folders if folder.is_dir() for p in folder.glob(f"fast-run-{pid}-*")]


def start(command: list[str], cwd: Path) -> subprocess.Popen:
    """`command` in a session of its own, as a terminal's job (Ctrl-C signals its whole process group)."""
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=cwd,
                            start_new_session=True, env={**os.environ, "FAST_PROGRESS": "0"},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip


def wait_for_workers(proc: subprocess.Popen, count: int = 2, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        if sum("fast worker" in line for line in in_session(proc.pid)) >= count:
            time.sleep(1.0)  # past their start: training
            return
        time.sleep(0.1)
    raise AssertionError(f"no workers after {timeout}s: {in_session(proc.pid)}")


def until(condition: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout}s: {condition}"
        time.sleep(0.1)


def kill_session(sid: int) -> None:
    """Every process of session `sid` killed, stopped or not (a stopped worker's lifeline cannot end it)."""
    for p in psutil.process_iter():
        with contextlib.suppress(ProcessLookupError, psutil.Error):
            if os.getsid(p.pid) == sid:
                p.kill()


def gone_within(sid: int, seconds: float) -> list[str]:
    deadline = time.monotonic() + seconds
    while in_session(sid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return in_session(sid)


def _command(kind: str, tmp_path: Path) -> list[str]:
    if kind == "train":
        return [FAST, "train", "--out", str(tmp_path / "run"), *LONG]
    if kind == "run":
        (tmp_path / "loop.py").write_text(SCRIPT)
        return [FAST, "run", "--workers", "2", "--out", str(tmp_path / "run"), str(tmp_path / "loop.py")]
    (tmp_path / "compare.toml").write_text(COMPARE)
    return [FAST, "compare", str(tmp_path / "compare.toml"), "--out", str(tmp_path / "out")]


@pytest.mark.parametrize(
    "kind", ["train", pytest.param("run", marks=pytest.mark.slow), pytest.param("compare", marks=pytest.mark.slow)]
)
@pytest.mark.parametrize(
    "how", [signal.SIGKILL, pytest.param(signal.SIGTERM, marks=pytest.mark.slow)], ids=["SIGKILL", "SIGTERM"]
)  # (SIGTERM goes the way of Ctrl-C, which test_sigterm_ends_a_run_as_ctrl_c_does_with_the_resume_hint covers)
def test_killing_the_launcher_leaves_no_process_and_no_scratch_file(tmp_path, kind, how):
    proc = start(_command(kind, tmp_path), tmp_path)
    try:
        wait_for_workers(proc)
        os.kill(proc.pid, how)  # the launcher only, as `kill PID` or the OOM killer would
        _, err = proc.communicate(timeout=30)
        left = gone_within(proc.pid, 5.0)
    finally:
        if in_session(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
    assert not left, f"left after the launcher's {how.name}: {left}"
    assert not scratch_of(proc.pid)
    if how == signal.SIGTERM:
        assert proc.returncode == 143
        assert err.strip().splitlines()[-1].startswith("fast: "), err
        assert "interrupted (SIGTERM)" in err and "Traceback" not in err


def test_sigterm_ends_a_run_as_ctrl_c_does_with_the_resume_hint(tmp_path, no_orphans):
    run = tmp_path / "run"
    proc = start([FAST, "train", "--out", str(run), *LONG, "--set", "run.checkpoint_every=20"], tmp_path)
    try:
        deadline = time.monotonic() + 90
        while not any(run.glob("checkpoints/worker1-step*.pt")) and time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.1)
        os.kill(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 143
    hint = f"; continue with: fast train --resume {run}"
    assert err.splitlines() == [f"fast: error: interrupted (SIGTERM): every worker was stopped{hint}"], err
    assert not gone_within(proc.pid, 5.0) and (run / "workers" / "metrics-0.jsonl").stat().st_size > 0


@pytest.mark.parametrize(
    "how", [signal.SIGINT, pytest.param(signal.SIGTERM, marks=pytest.mark.slow)], ids=["Ctrl-C", "SIGTERM"]
)
def test_an_interrupt_at_any_moment_of_start_up_is_one_line_and_leaves_nothing(tmp_path, how):
    for delay in (0.2, 1.0, 2.0, 3.0):
        proc = start([FAST, "train", "--out", str(tmp_path / f"run-{delay}"), *LONG], tmp_path)
        time.sleep(delay)
        (os.killpg if how == signal.SIGINT else os.kill)(proc.pid, how)  # Ctrl-C reaches the whole group
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 128 + how, (delay, err)
        assert len(err.strip().splitlines()) == 1 and err.startswith("fast: "), (delay, err)
        assert not gone_within(proc.pid, 5.0) and not scratch_of(proc.pid), delay


def _listening(pids: set[int]) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket (IPv4 and IPv6) held by `pids`, read from /proc/net/tcp and tcp6."""
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            pass
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[9] in inodes:
                address, port = fields[1].split(":")
                found.add((address, int(port, 16)))
    return found


LOOPBACK = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}


@pytest.mark.slow
def test_a_live_local_run_listens_on_loopback_only(tmp_path):
    proc = start([FAST, "train", "--out", str(tmp_path / "run"), *LONG, "--set", "run.max_restarts=1"], tmp_path)
    seen: set[tuple[str, int]] = set()
    try:
        wait_for_workers(proc)
        for _ in range(20):
            tree = psutil.Process(proc.pid)
            seen |= _listening({tree.pid, *(c.pid for c in tree.children(recursive=True))})
            time.sleep(0.1)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.communicate(timeout=30)
    assert seen, "no socket seen: the check itself is broken"
    assert {address for address, _ in seen} <= LOOPBACK, seen


@pytest.mark.slow
def test_two_runs_started_together_without_out_get_two_folders_and_both_summaries(tmp_path):
    command = [FAST, "train", "--set", "data.name=digits", "--set", "run.workers=2", "--set", "run.epochs=1",
               "--set", "run.eval_every=0"]  # fmt: skip
    procs = [start(command, tmp_path) for _ in range(2)]
    errors = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errors
    folders = sorted((tmp_path / "runs").iterdir())
    assert len(folders) == 2
    for folder in folders:
        summary = json.loads((folder / "summary.json").read_text())
        assert summary["steps_per_worker"] > 0 and (folder / "model.pt").is_file()
        workers = {json.loads(line)["worker"] for line in (folder / "metrics.jsonl").read_text().splitlines()}
        assert workers == {0, 1}


def test_a_folder_a_live_run_holds_is_refused_to_a_second_run(tmp_path, no_orphans):
    run = tmp_path / "run"
    first = start([FAST, "train", "--out", str(run), *LONG], tmp_path)
    try:
        wait_for_workers(first)
        second = subprocess.run([FAST, "train", "--out", str(run), *LONG], capture_output=True, text=True,
                                timeout=120)  # fmt: skip
        still = first.poll() is None
    finally:
        os.killpg(first.pid, signal.SIGTERM)
        first.communicate(timeout=30)
    assert second.returncode == 2 and still
    assert second.stderr.strip().splitlines() == [
        f"fast: error: run folder {run.resolve()} belongs to a run that is still going (process {first.pid}): give "
        "another --out, or wait until it ends"
    ]


@pytest.mark.slow
def test_two_live_runs_on_one_master_port_both_finish(tmp_path):
    """A local live run meets through files: the port it is given is not bound, so two can share it."""
    settings = ["data.name=digits", "run.workers=2", "run.epochs=1", "run.eval_every=0", "run.max_restarts=1",
                "run.master_port=29517"]  # fmt: skip
    command = [FAST, "train", *(arg for setting in settings for arg in ("--set", setting))]
    procs = [start([*command, "--out", str(tmp_path / f"run-{i}")], tmp_path) for i in range(2)]
    errors = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errors
    assert all((tmp_path / f"run-{i}" / "summary.json").is_file() for i in range(2))


def test_ctrl_z_pauses_every_process_of_the_run_and_fg_resumes_them(tmp_path):
    run = tmp_path / "run"
    metrics = run / "workers" / "metrics-0.jsonl"
    proc = start([FAST, "train", "--out", str(run), *LONG], tmp_path)
    try:
        wait_for_workers(proc)
        until(metrics.exists, 90)  # training (on 2 busy cores the first record may take a while)
        os.killpg(proc.pid, signal.SIGTSTP)  # the terminal's Ctrl-Z reaches the launcher's group only
        end = time.monotonic() + 10  # (on 2 busy cores the launcher may take a while to run its handler)
        while True:
            time.sleep(0.5)
            paused = {p.pid: p.status() for p in [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(True)]}
            if set(paused.values()) == {psutil.STATUS_STOPPED} or time.monotonic() > end:
                break
        records = (run / "workers" / "metrics-0.jsonl").stat().st_size
        time.sleep(1.0)
        grown = (run / "workers" / "metrics-0.jsonl").stat().st_size - records
        os.killpg(proc.pid, signal.SIGCONT)  # fg
        time.sleep(1.5)
        assert (run / "workers" / "metrics-0.jsonl").stat().st_size > records + grown
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    # the launcher and its 2 workers (forked from it: a launcher that may not has a fork server and a resource
    # tracker besides)
    assert set(paused.values()) == {psutil.STATUS_STOPPED} and len(paused) >= 3 and grown == 0, paused
    assert proc.returncode == 130 and err.strip().startswith("fast: error: interrupted (Ctrl-C)"), err


def _signal_handlers() -> list[str]:
    return [str(signal.getsignal(number)) for number in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)]


def test_a_worker_forked_from_its_launcher_takes_termination_signals_as_a_new_process_does(monkeypatch):
    """A launcher that may (no threads beyond torch's, no CUDA) forks its workers itself, no fork server, inside the
    launch's hold on Ctrl-C, SIGTERM and SIGHUP: they must not keep its handlers, which would hold a SIGTERM back for
    good."""
    monkeypatch.setattr(launch_module, "may_fork_here", lambda: True)  # (pytest's process runs threads of its own)
    outputs = launch_module.launch(_signal_handlers, 1, port=free_port())
    assert outputs[0] == [str(signal.SIG_DFL), str(signal.SIG_DFL), str(signal.SIG_IGN)]


NATIVE_THREAD = """
import ctypes, time
from fast.runtime import launch
alone = launch.may_fork_here()
libc = ctypes.CDLL(None)
thread = ctypes.c_ulong()  # a thread of native code, which Python's threading does not see: it sleeps 30 s
libc.pthread_create(ctypes.byref(thread), None, ctypes.cast(libc.sleep, ctypes.c_void_p), ctypes.c_void_p(30))
time.sleep(0.5)
print(alone, launch.may_fork_here())
"""
PARALLEL_OP = """
from fast.runtime import launch
import torch
alone = launch.may_fork_here()
torch.set_num_threads(2)
x = torch.ones(1 << 20)
(x + x).sum()  # a parallel op: torch's intra-op pool starts
print(alone, launch.may_fork_here())
"""
POOL_BEFORE_FAST = """
import torch
torch.set_num_threads(2)
x = torch.ones(1 << 20)
(x + x).sum()  # the pool starts before FAST is imported: no count of threads after can tell it from torch's own
from fast.runtime import launch
print(launch.may_fork_here(), launch.may_fork_here())
"""


@pytest.mark.parametrize(
    ("script", "may"),
    [(NATIVE_THREAD, "True False"), (PARALLEL_OP, "True False"), (POOL_BEFORE_FAST, "False False")],
    ids=["native thread", "intra-op pool", "torch before FAST"],
)
def test_a_launcher_forks_its_workers_itself_only_while_it_runs_no_thread_beyond_torchs(script, may):
    """A fresh process that has imported FAST may fork its workers itself; once a native thread runs in it (a Rust
    runtime's, as torchft's lighthouse starts: a child forked past it crashed), or torch's intra-op pool has started
    (a child forked past it hangs in its first parallel op), it may not; nor may one that imported torch before FAST
    (its pool may have started uncounted)."""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == may.split(), done.stderr
