"""Resume exactly: a `sync` run interrupted by a crash and resumed ends with the uninterrupted run's weights."""

import os

import pytest
import torch

import fast
from fast.launch import WorkerFailed

JOB = {"data__name": "digits", "model__name": "mlp", "run__workers": 2, "run__epochs": 2, "run__batch_size": 32,
       "run__eval_every": 0.5, "run__checkpoint_every": 5, "optimizer__lr": 0.05}


def _crash_once(model, x, y):
    _crash_once.calls += 1
    first_life = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" or "CRASH_EVERY_LIFE" in os.environ
    if os.environ["RANK"] == "1" and _crash_once.calls == int(os.environ.get("CRASH_AT", "0")) and first_life:
        os._exit(9)
    return torch.nn.functional.cross_entropy(model(x), y)


_crash_once.calls = 0


def test_interrupted_and_resumed_sync_ends_with_exactly_the_uninterrupted_weights(tmp_path, monkeypatch, no_orphans):
    whole = fast.train(None, out=str(tmp_path / "whole"), **JOB)
    monkeypatch.setenv("CRASH_AT", "17")  # after the checkpoint of step 15
    with pytest.raises(WorkerFailed, match="worker 1 exited with code 9"):
        fast.train(None, out=str(tmp_path / "cut"), step_fn=_crash_once, **JOB)
    assert (tmp_path / "cut" / "checkpoints" / "worker0.pt").exists()
    monkeypatch.delenv("CRASH_AT")
    resumed = fast.train(resume=str(tmp_path / "cut"))
    a = torch.load(tmp_path / "whole" / "model.pt", weights_only=True)
    b = torch.load(tmp_path / "cut" / "model.pt", weights_only=True)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert resumed["final_test_accuracy"] == whole["final_test_accuracy"]
    assert resumed["bytes_sent"] == whole["bytes_sent"]


def test_a_killed_sync_worker_is_restarted_by_the_elastic_agent_and_the_run_completes(tmp_path, monkeypatch,
                                                                                       no_orphans):
    monkeypatch.setenv("CRASH_AT", "12")  # rank 1 dies once, after the checkpoint of step 10
    summary = fast.train(None, out=str(tmp_path), step_fn=_crash_once, run__max_restarts=1,
                         **{**JOB, "run__epochs": 1})
    assert summary["final_test_accuracy"] > 0.8


def test_restarts_used_up_end_with_a_clear_error(tmp_path, monkeypatch, no_orphans):
    monkeypatch.setenv("CRASH_AT", "3")  # before the first checkpoint, in every life
    monkeypatch.setenv("CRASH_EVERY_LIFE", "1")
    with pytest.raises(WorkerFailed, match=r"worker \d failed and 1 restart\(s\) are used up: "):
        fast.train(None, out=str(tmp_path), step_fn=_crash_once, run__max_restarts=1, **{**JOB, "run__epochs": 1})
