"""`run.max_time`: training ends at a step boundary once its time is up, together or worker by worker."""

import os
import signal

import pytest
import torch

import fast
from fast.errors import ConfigError

JOB = {
    "data__name": "digits",
    "model__name": "mlp",
    "run__workers": 2,
    "run__epochs": 1000,
    "run__batch_size": 16,
    "run__eval_every": 0,
    "run__log_every": 5,
    "run__max_time": "1.5s",
}


@pytest.mark.nondeterministic
@pytest.mark.parametrize("strategy", ["sync", "hogwild"])
def test_a_run_stops_when_its_time_is_up_and_reports_what_it_did(tmp_path, no_orphans, strategy):
    summary = fast.train(None, out=str(tmp_path), strategy__name=strategy, **JOB)
    assert 0 < summary["steps_per_worker"] < 5000  # 1000 epochs of digits would be some 45,000 steps
    assert 1.5 <= summary["wall_time_s"] < 10
    assert summary["evaluations"][-1]["step"] == summary["steps_per_worker"]
    assert summary["final_test_accuracy"] > 0.5


@pytest.mark.parametrize("value", ["0s", "soon", -3])
def test_a_bad_max_time_is_a_one_line_error(value):
    with pytest.raises(ConfigError, match=r"run\.max_time"):
        fast.train(None, **{**JOB, "run__max_time": value})


@pytest.mark.parametrize("value", ["0s", "often"])
def test_a_bad_check_interval_is_a_one_line_error(value):
    with pytest.raises(ConfigError, match=r"run\.check_interval.*duration"):
        fast.train(None, **{**JOB, "run__check_interval": value})


def _dies_at_step_8_on_worker_2(model, x, y):
    _dies_at_step_8_on_worker_2.calls += 1
    if os.environ["RANK"] == "2" and _dies_at_step_8_on_worker_2.calls == 8:
        os.kill(os.getpid(), signal.SIGKILL)
    return torch.nn.functional.cross_entropy(model(x), y)


_dies_at_step_8_on_worker_2.calls = 0


@pytest.mark.nondeterministic
def test_gossip_survivors_agree_on_the_end_of_time_without_the_dead_worker(tmp_path, no_orphans):
    job = {**JOB, "run__workers": 4, "run__max_time": "4s", "run__deadline_s": 2.0}
    summary = fast.train(None, out=str(tmp_path), step_fn=_dies_at_step_8_on_worker_2, strategy__name="gossip", **job)
    assert [f["worker"] for f in summary["failures"]] == [2]
    assert 4 <= summary["wall_time_s"] < 15
    assert summary["steps_per_worker"] > 8
    assert summary["final_test_accuracy"] > 0.5
