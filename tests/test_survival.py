"""Strategies that survive failures: a worker killed with SIGKILL mid-run is dropped and the survivors finish."""

import os
import signal

import pytest
import torch

import fast
from fast.launch import WorkerFailed

JOB = {
    "data__name": "digits",
    "model__name": "mlp",
    "run__workers": 4,
    "run__epochs": 3,
    "run__batch_size": 32,
    "run__eval_every": 1.0,
    "run__deadline_s": 5.0,
    "optimizer__lr": 0.05,
}
DIES_AT = 10  # the step (1-based) at which worker 2 kills itself


def _killed_at_step(model, x, y):
    _killed_at_step.calls += 1
    if os.environ["RANK"] == os.environ.get("KILLED_RANK", "2") and _killed_at_step.calls == DIES_AT:
        os.kill(os.getpid(), signal.SIGKILL)
    return torch.nn.functional.cross_entropy(model(x), y)


_killed_at_step.calls = 0


@pytest.mark.parametrize(
    "strategy",
    [
        {"strategy__name": "gossip", "strategy__topology": "ring"},
        {"strategy__name": "async-ps", "strategy__servers": 1},
    ],
    ids=["gossip-ring", "async-ps"],
)
def test_a_worker_killed_mid_run_is_dropped_and_the_survivors_finish(tmp_path, no_orphans, strategy):
    summary = fast.train(None, out=str(tmp_path), step_fn=_killed_at_step, **JOB, **strategy)
    failures = summary["failures"]
    assert [f["worker"] for f in failures] == [2]
    assert failures[0]["step"] is not None and failures[0]["step"] <= DIES_AT
    assert failures[0]["time_s"] >= 0 and failures[0]["how"]
    assert summary["final_test_accuracy"] > 0.85
    assert summary["evaluations"][-1]["step"] == summary["steps_per_worker"]
    assert (tmp_path / "model.pt").exists()


def test_rank_0_writes_the_outputs_so_its_death_still_ends_the_run(tmp_path, monkeypatch, no_orphans):
    monkeypatch.setenv("KILLED_RANK", "0")
    with pytest.raises(WorkerFailed, match="worker 0 was killed by signal 9"):
        fast.train(
            None, out=str(tmp_path), step_fn=_killed_at_step, **{**JOB, "run__epochs": 1}, strategy__name="gossip"
        )
