"""Restarts (`run.max_restarts`): a worker killed mid-run under a strategy that needs every worker is restarted
with the others by torch's elastic agent, every worker resumes from its last checkpoint and the run completes,
redoing at most the steps since that checkpoint; when the restarts are used up the run ends with one line."""

import json
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

import fast
from tests.outputs import assert_same_model

FAST = str(Path(sys.executable).with_name("fast"))  # the command line of this venv
EVERY = 5  # checkpoint_every
KILLED_AT = 12  # the step (1-based) at which worker 1 kills itself, in its first life: after the checkpoint of 10
JOB = {
    "data__name": "digits",
    "model__name": "mlp",
    "run__workers": 2,
    "run__epochs": 1,  # 22 steps per worker
    "run__batch_size": 32,
    "run__eval_every": 0.5,
    "run__log_every": 1,
    "run__checkpoint_every": EVERY,
    "run__max_restarts": 1,
    "optimizer__lr": 0.05,
}


def _killed_once(model, x, y):
    """Worker 1 is SIGKILLed at its KILLED_AT-th step of its first life."""
    _killed_once.calls += 1
    first_life = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if os.environ["RANK"] == "1" and _killed_once.calls == KILLED_AT and first_life:
        os.kill(os.getpid(), signal.SIGKILL)
    return torch.nn.functional.cross_entropy(model(x), y)


_killed_once.calls = 0


def _steps_logged(path) -> list[int]:
    return [r["step"] for r in map(json.loads, path.read_text().splitlines()) if "loss" in r]


# (strategy, whether the restarted run must end with exactly the uninterrupted run's weights, accuracy floor)
STRATEGIES = [
    pytest.param({"strategy__name": "sync"}, True, 0.8, id="sync"),
    # late gradients are folded in as they arrive: the order depends on timing, so no exact weights
    pytest.param({"strategy__name": "ssp", "strategy__staleness": 1}, False, 0.8, id="ssp"),
    pytest.param(
        {"strategy__name": "local-sgd", "strategy__period": 4}, True, 0.8, id="local-sgd", marks=pytest.mark.slow
    ),
    pytest.param(
        {"strategy__name": "diloco", "strategy__period": 4, "strategy__outer_lr": 0.7}, True, 0.7, id="diloco"
    ),
]


@pytest.mark.parametrize(("strategy", "exact", "floor"), STRATEGIES)
def test_a_killed_worker_is_restarted_and_the_run_completes_from_the_last_checkpoint(
    tmp_path, no_orphans, strategy, exact, floor
):
    summary = fast.train(None, out=str(tmp_path / "killed"), step_fn=_killed_once, **JOB, **strategy)
    total = summary["steps_per_worker"]
    assert total == 22 and summary["restarts"] == 1
    assert summary["final_test_accuracy"] > floor
    assert summary["evaluations"][-1]["step"] == total
    # metrics.jsonl: every step of every worker once (the first life's steps after the checkpoint are dropped)
    merged = [json.loads(line) for line in (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()]
    logged = Counter((r["worker"], r["step"]) for r in merged if "loss" in r)
    assert logged == Counter({(w, s): 1 for w in (0, 1) for s in range(1, total + 1)})
    # each worker's own log keeps both lives: the steps done twice are those after the last checkpoint (10)
    for rank in (0, 1):
        twice = sorted(
            s
            for s, n in Counter(_steps_logged(tmp_path / "killed" / "workers" / f"metrics-{rank}.jsonl")).items()
            if n > 1
        )
        assert twice and twice[0] == 11 and twice == list(range(11, twice[-1] + 1)), (rank, twice)
        assert twice[-1] < 10 + EVERY  # at most one checkpoint interval lost
    assert max(_steps_logged(tmp_path / "killed" / "workers" / "metrics-1.jsonl")[:KILLED_AT]) == KILLED_AT - 1
    if exact:  # every bit of strategy state came back: the same weights as a run that was never killed
        whole = fast.train(None, out=str(tmp_path / "whole"), **JOB, **strategy)
        assert_same_model(tmp_path / "whole", tmp_path / "killed")
        assert whole["restarts"] == 0
        for key in ("final_test_accuracy", "bytes_sent", "averagings", "outer_rounds"):
            assert summary.get(key) == whole.get(key), key


def test_restarts_used_up_end_with_a_one_line_error(tmp_path, no_orphans):
    """Through the command line: worker 1 crashes before step 3 (a [faults] crash) in every life, before any
    checkpoint; after one restart the run ends with one line naming it, and no traceback from torch's agent."""
    config = tmp_path / "job.toml"
    config.write_text("[[faults.crash]]\nworker = 1\nstep = 3\n")
    sets = [f"{key.replace('__', '.')}={value}" for key, value in JOB.items()]
    done = subprocess.run(
        [FAST, "train", str(config), "--out", str(tmp_path / "run"), *(a for s in sets for a in ("--set", s))],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "FAST_PROGRESS": "0"},
    )
    assert done.returncode == 1
    lines = done.stderr.splitlines()
    assert "Traceback" not in done.stderr and not any(line.startswith("E1") for line in lines), done.stderr
    assert lines[-1] == "fast: error: worker 1 failed and 1 restart(s) are used up: exited with code 1", lines
    assert "fast: a worker failed; restart 1 of 1: every worker resumes from its last checkpoint" in lines
