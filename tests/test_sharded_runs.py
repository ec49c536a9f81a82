"""Sharded replicas end to end (`run.shards = K`, fast.runtime.sharded): W = 2 replicas of K = 2 processes through
`fast train`, `fast run` and torchrun, real processes over gloo on the CPU. tests/test_shards.py proves the core
(HSDP's sync against DDP over 4 processes, diloco on local shards, DCP checkpoints, the gathered state); here the wired
path equals the unsharded one, each family trains the digits job, model.pt loads into the user's class, a checkpoint
resumes exactly and at K = 1, emulated links join replicas (counted per replica link) and a crash ends a replica, and
every strategy that cannot take shards says why in one line.

The differences against K = 1 are float32 summation order (FSDP2's reduce-scatter inside the replica, then the
replicas' all-reduce); measured here as the largest over tensors of max|a - b| / max|b| of model.pt, with margin in
the bounds (the measurements in the comments).
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from unittest.mock import ANY

import pytest
import torch

import fast
from fast.assemble import load_config
from fast.errors import ConfigError
from fast.jobs.models import build_model
from fast.runtime.launch import WorkerFailed
from tests.outputs import assert_same_model

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
ENV = {**os.environ, "FAST_PROGRESS": "0", "OMP_NUM_THREADS": "1"}
DIGITS = {"data__name": "digits", "model__name": "mlp", "run__workers": 2, "run__batch_size": 32, "run__eval_every": 0}
BOUND = 2e-6  # float32 summation order


def _relative(first: Path, second: Path) -> float:
    a, b = (torch.load(folder / "model.pt", weights_only=True) for folder in (first, second))
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max()) for k in b)


def _at_one_and_two(tmp_path: Path, **job) -> tuple[dict, dict]:
    one = fast.train(None, out=str(tmp_path / "one"), **DIGITS, **job)
    two = fast.train(None, out=str(tmp_path / "two"), run__shards=2, **DIGITS, **job)
    return one, two


def test_sync_of_two_replicas_of_two_shards_equals_sync_of_two_whole_workers(tmp_path):
    one, two = _at_one_and_two(tmp_path, run__max_steps=12)
    assert _relative(tmp_path / "two", tmp_path / "one") < BOUND  # measured: 1.8e-7 after 22 steps
    assert two["shards"] == 2 and two["workers"] == 2 and two["samples"] == one["samples"] == 12 * 2 * 32
    # bytes between replicas, shard by shard: the same gradients, and each shard's own count of contributors
    assert two["bytes_sent"] - one["bytes_sent"] == 12 * 2 * 4


def test_diloco_of_two_replicas_of_two_shards_equals_diloco_of_two_whole_workers_after_three_rounds(tmp_path):
    one, two = _at_one_and_two(tmp_path, run__max_steps=12, strategy__name="diloco", strategy__period=4)
    assert one["outer_rounds"] == two["outer_rounds"] == 3
    assert _relative(tmp_path / "two", tmp_path / "one") < BOUND  # measured: 2.7e-7


FAMILIES = {
    "sync": {},
    "local-sgd": {"strategy__period": 4},
    "diloco": {"strategy__period": 4, "strategy__outer_momentum": 0.5},
    "streaming-diloco": {"strategy__period": 4, "strategy__fragments": 2, "strategy__outer_momentum": 0.5},
    "sparseloco": {"strategy__period": 4},
    "easgd": {},
    "gossip": {"codec__name": "topk", "optimizer__lr": 0.2},  # CHOCO-SGD (plain gossip survives lost workers)
}


@pytest.mark.parametrize("strategy", FAMILIES)
def test_each_family_trains_the_digits_job_sharded_and_model_pt_loads_into_the_users_class(tmp_path, strategy):
    job = {**DIGITS, "run__epochs": 3, "optimizer__lr": 0.1, "strategy__name": strategy, **FAMILIES[strategy]}
    summary = fast.train(None, out=str(tmp_path), run__shards=2, **job)
    assert summary["final_test_accuracy"] > 0.9  # measured: 0.94 to 0.98
    model = build_model("mlp", (1, 8, 8), 10)
    model.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))  # strict: the user's class, whole
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert {r["worker"] for r in records} == {0, 1, 2, 3}  # every process of the two replicas records


def test_emulated_links_carry_the_replicas_exchange_shard_by_shard_and_count_it_per_replica_link(tmp_path):
    """[network] between 2 replicas of 2 shards: shard k of one replica exchanges its shard with shard k of the other
    on a lane of the replica link (half its bandwidth); FSDP2's traffic inside a replica crosses no emulated link."""
    steps, bandwidth = 10, 20e6 / 8  # 20 Mbit
    slow = {"run__max_steps": steps, "network__bandwidth": "20Mbit", "network__latency": "5ms"}
    one, two = _at_one_and_two(tmp_path, **slow)
    assert two["deployment"]["network"]["shards"] == 2 and len(two["deployment"]["per_rank"]) == 4
    links = {(link["src"], link["dst"]): link["bytes"] for link in two["deployment"]["bytes_per_link"]}
    whole = {(link["src"], link["dst"]): link["bytes"] for link in one["deployment"]["bytes_per_link"]}
    # the same gradients cross each replica link as the whole workers' link, FSDP2's shards unpadded (33 rows: 17 and
    # 16), plus the count of contributors each shard's all-reduce carries (4 bytes a step; one for a whole worker)
    assert set(links) == set(whole) == {(0, 1), (1, 0)}  # (measured: 2,033,120 and 2,033,080 bytes each way)
    assert all(links[pair] - whole[pair] == steps * 4 for pair in links)
    assert sum(links.values()) == two["bytes_sent"]
    # each shard sends its half on its lane (half the bandwidth): a replica's exchange takes the whole link's time,
    # as the whole workers' does. A floor, which the emulation never undercuts (measured: 0.93 s and 0.99 s blocked)
    for summary, sent in ((one, whole[0, 1]), (two, links[0, 1])):
        assert summary["time_blocked_share"] * summary["wall_time_s"] >= sent / bandwidth


def test_an_injected_crash_of_a_worker_ends_the_processes_of_its_replica(tmp_path, no_orphans):
    with pytest.raises(WorkerFailed, match=r"worker [23] exited with code 1"):  # (processes 2 and 3: replica 1)
        fast.train(None, out=str(tmp_path), run__shards=2, run__max_steps=20, faults__crash=[{"worker": 1, "step": 3}],
                   **DIGITS)  # fmt: skip
    faults = {}
    for process in range(4):
        file = tmp_path / "workers" / f"metrics-{process}.jsonl"
        events = [json.loads(line) for line in file.read_text().splitlines()] if file.exists() else []
        faults[process] = [e for e in events if e.get("kind") == "fault"]
    # each of replica 1's processes crashes at step 3 (measured: both record it; one the launcher stopped first would
    # not), and no process of replica 0
    crash = {"kind": "fault", "fault": "crash", "time_s": ANY, "step": 3}
    assert faults[0] == faults[1] == [] and (faults[2] or faults[3])
    assert all(faults[process] in ([], [{"worker": process, **crash}]) for process in (2, 3))


def _crash(model, x, y):
    """Process 3 (replica 1's shard 1) dies at its CRASH_AT-th step, in the first life."""
    _crash.calls += 1
    if os.environ["RANK"] == "3" and _crash.calls == int(os.environ.get("CRASH_AT", "0")):
        os._exit(9)
    return torch.nn.functional.cross_entropy(model(x), y)


_crash.calls = 0


def test_a_sharded_checkpoint_resumes_exactly_and_at_one_shard(tmp_path, monkeypatch, no_orphans):
    """diloco, whose θ and outer momentum are laid out like the local shards: they reshard with the model."""
    job = {**DIGITS, "run__shards": 2, "run__max_steps": 24, "run__checkpoint_every": 5, "strategy__name": "diloco",
           "strategy__period": 4, "optimizer__name": "adamw", "optimizer__lr": 0.01}  # fmt: skip
    fast.train(None, out=str(tmp_path / "whole"), **job)
    monkeypatch.setenv("CRASH_AT", "17")  # after the checkpoint of step 15, mid-round
    with pytest.raises(WorkerFailed, match="worker 3 exited with code 9"):
        fast.train(None, out=str(tmp_path / "cut"), step_fn=_crash, **job)
    folders = ["replica0-step10", "replica0-step15", "replica1-step10", "replica1-step15"]
    assert sorted(p.name for p in (tmp_path / "cut" / "checkpoints").iterdir()) == folders
    monkeypatch.delenv("CRASH_AT")
    shutil.copytree(tmp_path / "cut", tmp_path / "at-one")
    fast.train(resume=str(tmp_path / "cut"))
    assert_same_model(tmp_path / "whole", tmp_path / "cut")
    at_one = fast.train(resume=str(tmp_path / "at-one"), run__shards=1)  # each worker reads its replica's folder
    assert at_one["steps_per_worker"] == 24 and "shards" not in at_one
    assert _relative(tmp_path / "at-one", tmp_path / "whole") < BOUND  # measured: 4.3e-7


REFUSED = {
    "ssp": {},
    "ad-psgd": {},
    "async-broadcast": {},
    "push-sum": {},
    "async-ps": {},
    "ea-wild": {},
    "easgd": {"strategy__variant": "async"},
    "hogwild": {},
    "gossip": {},
    "noloco": {},
    "demo": {},
}


@pytest.mark.parametrize("strategy", REFUSED)
def test_a_strategy_that_cannot_take_shards_refuses_them_in_one_line(strategy):
    with pytest.raises(ConfigError) as refused:
        load_config(None, run__workers=2, run__shards=2, strategy__name=strategy, **REFUSED[strategy])
    message = str(refused.value)
    assert message.startswith(f"run.shards = 2: strategy {strategy!r} does not run on sharded replicas (")
    assert "\n" not in message and "sharded runs take: " in message


@pytest.mark.parametrize(
    "keys, words",
    [
        ({"strategy__name": "diloco", "strategy__final_model": "best"}, "final_model = 'best'"),
        (
            {"run__membership": "live", "strategy__name": "streaming-diloco", "strategy__period": 4},
            "run.membership = 'live' and this strategy",
        ),  # (sync, local-sgd and diloco take it: test_sharded_membership)
        ({"run__engine": "simulated"}, 'run.engine = "simulated"'),
        (
            {"run__membership": "live", "faults__churn": {"lifetime": "20s", "absence": "5s"}},
            "[faults] churn",
        ),  # ([network], [compute] and [faults] crash or link_down apply to replicas: test_emulated_links_...)
        ({"run__batch_size": 33}, "run.batch_size = 33 does not split"),
    ],
)
def test_keys_a_sharded_run_cannot_take_are_refused_in_one_line(keys, words):
    with pytest.raises(ConfigError, match="run.shards = 2") as refused:
        load_config(None, run__workers=2, run__shards=2, **keys)
    assert words in str(refused.value) and "\n" not in str(refused.value)


def test_the_cli_refuses_shards_with_exit_code_2_in_one_line(tmp_path):
    done = subprocess.run([str(BIN / "fast"), "train", "--set", "run.shards=2", "--set", "strategy.name=hogwild",
                           "--out", str(tmp_path)], env=ENV, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1 and "shared memory" in done.stderr


def test_the_language_model_example_runs_sharded_under_fast_run_and_torchrun(tmp_path):
    small = {"run.max_steps": 6, "run.log_every": 2, "model.width": 32, "model.layers": 2, "data.megabytes": 0.2}
    script = str(ROOT / "examples" / "lm" / "train.py")
    summary = fast.run(script, workers=2, out=str(tmp_path / "run"), run__shards=2,
                       **{key.replace(".", "__"): value for key, value in small.items()})  # fmt: skip
    assert summary["shards"] == 2 and summary["workers"] == 2 and summary["final_test_perplexity"] < 256
    overrides = json.dumps({"run.workers": 2, "run.shards": 2, **small})  # (what `fast run --set` hands its processes)
    torchrun = [str(BIN / "torchrun"), "--nproc-per-node", "4", "--log-dir", str(tmp_path / "torchrun-logs")]
    done = subprocess.run([*torchrun, script], cwd=tmp_path,
                          env={**ENV, "FAST_OVERRIDES": overrides}, capture_output=True, text=True,
                          timeout=240)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    (run,) = (tmp_path / "runs").iterdir()
    assert json.loads((run / "summary.json").read_text())["shards"] == 2
