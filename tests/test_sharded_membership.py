"""Live membership by replica (`run.membership = "live"` with `run.shards = K`, fast.runtime.live and
fast.runtime.sharded), in real processes over gloo: a process killed with SIGKILL takes its whole replica out (its
launcher stops its sibling at once) while the run goes on; `fast join` brings a whole replica back, admitted as one
member and healed shard for shard from a live replica (never from a file); the run ends with its outputs written by
the lowest live replica, and model.pt loads into the user's class."""

import json
import time

import psutil
import pytest
import torch

from fast.jobs.models import build_model
from tests.test_membership import _healed, _kill_one_then_join, _steps

SHARDED = {"run.shards": 2, "run.name": "live-shards", "optimizer.lr": 0.1}


def _replica_gone(replica: int, timeout_s: float = 20) -> None:
    """Wait until no process of replica `replica` of this module's runs is left (its sibling stopped with it)."""
    end = time.monotonic() + timeout_s
    while True:
        left = []
        for p in psutil.process_iter(["cmdline"]):
            with_name = " ".join(p.info["cmdline"] or [])
            if with_name.startswith(f"fast worker {replica}/") and "(live-shards)" in with_name:
                left.append(with_name)
        if not left:
            return
        assert time.monotonic() < end, left
        time.sleep(0.05)


@pytest.mark.parametrize(
    "strategy",
    [
        {"strategy.name": "sync"},
        pytest.param({"strategy.name": "local-sgd", "strategy.period": 4}, marks=pytest.mark.slow),
        pytest.param(  # θ and outer momentum healed shard by shard (a minute: the joiner starts late)
            {"strategy.name": "diloco", "strategy.period": 4, "strategy.outer_lr": 0.3}, marks=pytest.mark.slow
        ),
    ],
    ids=["sync", "local-sgd", "diloco"],
)
def test_a_killed_process_takes_its_replica_out_and_a_joined_replica_heals_shard_for_shard(
    tmp_path, no_orphans, strategy
):
    run = tmp_path / "run"
    summary = _kill_one_then_join(run, {**SHARDED, **strategy}, killed_at=16, joined_at=None, joiner=4,
                                  while_joining=lambda: _replica_gone(1), workers=2, killed=1)  # fmt: skip
    # members are processes, K consecutive ids a replica: replica 1 (ids 2, 3) went whole, replica 2 (4, 5) came
    events = summary["membership"]
    assert [e["members"] for e in events] == [[0, 1, 2, 3], [0, 1], [0, 1, 4, 5]]
    assert events[1]["left"][0]["member"] in (2, 3) and events[2]["joined"] == [4, 5]
    assert summary["workers_at_end"] == 2 and summary["shards"] == 2
    # shard k of the joiner from shard k of replica 0: its local shards, optimizer state, step, data position and
    # strategy state equal its source's bit for bit before its first step
    for shard in (0, 1):
        (healed,) = _healed(run, 4 + shard)
        assert healed["fingerprint"] == healed["source_fingerprint"] and healed["from"] == shard
        assert healed["step"] == events[2]["step"]
        assert _steps(run, 4 + shard) > 0
    assert not (run / "checkpoints").exists()  # nothing read from (or written to) a file
    for output in ("summary.json", "metrics.jsonl", "model.pt", "config.toml"):
        assert (run / output).is_file(), output
    if strategy["strategy.name"] != "diloco":  # (diloco's replica trains alone about a minute: no bar set for it)
        assert summary["final_test_accuracy"] > 0.9
    model = build_model("mlp", (1, 8, 8), 10)
    model.load_state_dict(torch.load(run / "model.pt", weights_only=True))  # strict: the user's class, whole
    assert json.loads((run / "summary.json").read_text())["written_by"] == 0


@pytest.mark.slow  # (worker 0's duties passing: test_membership's; a replica's leave and heal: the test above)
def test_a_killed_process_of_the_first_replica_passes_worker_0s_duties_to_the_next(tmp_path, no_orphans):
    """Process 0 (shard 0 of the first replica, which does worker 0's duties) killed: its replica goes whole, the
    next replica's shard 0 evaluates and writes the run folder, and a joined replica heals from that one."""
    run = tmp_path / "run"
    summary = _kill_one_then_join(run, SHARDED, killed_at=16, joined_at=None, joiner=4,
                                  while_joining=lambda: _replica_gone(0), workers=2, killed=0)  # fmt: skip
    events = summary["membership"]
    assert [e["members"] for e in events] == [[0, 1, 2, 3], [2, 3], [2, 3, 4, 5]]
    for shard in (0, 1):
        (healed,) = _healed(run, 4 + shard)
        assert healed["fingerprint"] == healed["source_fingerprint"] and healed["from"] == 2 + shard
    assert summary["written_by"] == 2 and summary["final_test_accuracy"] > 0.9
    model = build_model("mlp", (1, 8, 8), 10)
    model.load_state_dict(torch.load(run / "model.pt", weights_only=True))
