"""Injected faults (`[faults]`) under strategies that survive them: the crash is recorded and the run completes."""

import json
import os
import signal
import time

import pytest
import torch

import fast
from fast.runtime.launch import WorkerFailed
from tests.test_survival import JOB as SURVIVAL_JOB

JOB = {**SURVIVAL_JOB, "network__bandwidth": "1Gbit", "network__latency": "1ms"}  # faults need emulation


@pytest.mark.nondeterministic
@pytest.mark.parametrize("crash", [{"worker": 2, "step": 10}, {"worker": 1, "time": "1s"}], ids=["step", "time"])
def test_an_injected_crash_under_gossip_is_survived_and_recorded(tmp_path, no_orphans, crash):
    job = {**JOB, "run__epochs": 20} if "time" in crash else JOB  # long enough to be running at 1 s
    summary = fast.train(
        None, out=str(tmp_path), strategy__name="gossip", strategy__topology="ring", faults__crash=[crash], **job
    )
    assert [f["worker"] for f in summary["failures"]] == [crash["worker"]]
    assert summary["final_test_accuracy"] > 0.85
    assert summary["evaluations"][-1]["step"] == summary["steps_per_worker"]
    events = (tmp_path / "workers" / f"metrics-{crash['worker']}.jsonl").read_text().splitlines()
    assert json.loads(events[-1])["fault"] == "crash"  # the crash itself is recorded by the crashing worker


def test_an_injected_crash_under_sync_ends_the_run_with_a_clear_error(tmp_path, no_orphans):
    with pytest.raises(WorkerFailed, match="worker 2"):
        fast.train(None, out=str(tmp_path), strategy__name="sync", faults__crash=[{"worker": 2, "step": 5}], **JOB)


def _freezes_at_step_10_on_worker_2(model, x, y):
    _freezes_at_step_10_on_worker_2.calls += 1
    if os.environ["RANK"] == "2" and _freezes_at_step_10_on_worker_2.calls == 10:
        os.kill(os.getpid(), signal.SIGSTOP)  # alive but silent for ever, as a hung machine
    return torch.nn.functional.cross_entropy(model(x), y)


_freezes_at_step_10_on_worker_2.calls = 0


@pytest.mark.parametrize("strategy", ["gossip", "async-ps"])
def test_a_frozen_worker_never_keeps_the_run_open(tmp_path, no_orphans, strategy):
    """SIGSTOP: alive to the kernel, silent to its peers. The run ends within a bounded time, having either
    dropped the frozen worker or stopped with an error; no process is left behind (a frozen peer stalls its
    neighbours, whose own peers may then time out on them, so which of the two happens is not fixed)."""
    started = time.monotonic()
    try:
        summary = fast.train(
            None,
            out=str(tmp_path),
            step_fn=_freezes_at_step_10_on_worker_2,
            strategy__name=strategy,
            **{**JOB, "run__deadline_s": 2.0},
        )
    except WorkerFailed as error:
        assert strategy == "gossip" and len(str(error).splitlines()) == 1
    else:
        lost = [f["worker"] for f in summary["failures"]]
        # async-ps workers depend on the server only: exactly the frozen one is lost, and every other one's
        # figures reach the summary, although worker 0 waits for the frozen one at the end first
        assert lost == [2] if strategy == "async-ps" else 2 in lost
    assert time.monotonic() - started < 45
