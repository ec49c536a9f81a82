"""Resume: an interrupted `sync`, `async-ps`, asynchronous `easgd` or `ea-wild` run resumed with `--resume` picks up
its checkpoints (the servers' and masters' snapshots too) from the newest step every process holds and ends as the
uninterrupted run would; checkpoints are atomic, kept two per process, and load with weights_only."""

import json
import os
import threading
from pathlib import Path

import pytest
import torch

import fast
from fast.runtime import checkpoints as checkpoint
from fast.runtime.launch import WorkerFailed
from fast.strategies.async_ps import AsyncPSOptions, ShardState
from fast.strategies.elastic import CenterState
from fast.strategies.snapshots import Snapshots
from tests.outputs import assert_same_model

JOB = {
    "data__name": "digits",
    "model__name": "mlp",
    "run__workers": 2,
    "run__epochs": 2,
    "run__batch_size": 32,
    "run__eval_every": 0.5,
    "run__checkpoint_every": 5,
    "optimizer__lr": 0.05,
}
PS = {"strategy__name": "async-ps", "strategy__servers": 1, "strategy__server_momentum": 0.5}


def _crash_once(model, x, y):
    """Rank CRASH_RANK (default 1) exits at its CRASH_AT-th step, in the first life only unless CRASH_EVERY_LIFE."""
    _crash_once.calls += 1
    first_life = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" or "CRASH_EVERY_LIFE" in os.environ
    crashing = os.environ["RANK"] == os.environ.get("CRASH_RANK", "1")
    if crashing and _crash_once.calls == int(os.environ.get("CRASH_AT", "0")) and first_life:
        os._exit(9)
    return torch.nn.functional.cross_entropy(model(x), y)


_crash_once.calls = 0


def _flat(state: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in state.values()])


def _whole_and_cut_after_step_15(tmp_path, monkeypatch, job: dict) -> tuple[dict, Path]:
    """One worker and one server (or master): the uninterrupted run's summary, and the checkpoints folder of a
    run whose worker died at step 17, which must hold the last two checkpoints of each process and nothing else
    (no temporary file left)."""
    whole = fast.train(None, out=str(tmp_path / "whole"), **job)
    monkeypatch.setenv("CRASH_AT", "17")  # after the checkpoint of step 15
    monkeypatch.setenv("CRASH_RANK", "0")  # rank 0's death ends the run (another's would not)
    with pytest.raises(WorkerFailed, match="worker 0 exited with code 9"):
        fast.train(None, out=str(tmp_path / "cut"), step_fn=_crash_once, **job)
    folder = tmp_path / "cut" / "checkpoints"
    names = ["server1-step10.pt", "server1-step15.pt", "worker0-step10.pt", "worker0-step15.pt"]
    assert sorted(p.name for p in folder.iterdir()) == names
    return whole, folder


def test_interrupted_and_resumed_sync_ends_with_exactly_the_uninterrupted_weights(tmp_path, monkeypatch, no_orphans):
    whole = fast.train(None, out=str(tmp_path / "whole"), **JOB)
    monkeypatch.setenv("CRASH_AT", "17")  # after the checkpoint of step 15
    with pytest.raises(WorkerFailed, match="worker 1 exited with code 9"):
        fast.train(None, out=str(tmp_path / "cut"), step_fn=_crash_once, **JOB)
    assert checkpoint.saved_steps(tmp_path / "cut", 0) == checkpoint.saved_steps(tmp_path / "cut", 1) == [10, 15]
    monkeypatch.delenv("CRASH_AT")
    resumed = fast.train(resume=str(tmp_path / "cut"))
    assert_same_model(tmp_path / "whole", tmp_path / "cut")
    assert resumed["final_test_accuracy"] == whole["final_test_accuracy"]
    assert resumed["bytes_sent"] == whole["bytes_sent"]


def _logged_steps(run_dir, rank: int) -> list[int]:
    """The steps a worker's own log records, both lives of a resumed run included."""
    lines = (run_dir / "workers" / f"metrics-{rank}.jsonl").read_text().splitlines()
    return [r["step"] for r in map(json.loads, lines) if "loss" in r]


@pytest.mark.parametrize(
    ("deleted", "restart_at"),
    [
        pytest.param(["worker1-step15.pt"], 10, id="newest-missing"),
        pytest.param(["worker1-step15.pt", "worker1-step10.pt"], 0, id="none-left"),
    ],
)
def test_when_a_worker_lacks_the_newest_checkpoint_every_worker_resumes_from_the_newest_common_step(
    tmp_path, no_orphans, deleted, restart_at
):
    """A crash between worker 0's rename and worker 1's leaves worker 0 one checkpoint ahead (here: worker 1's
    files deleted). The workers agree on the newest step both hold (10; 0 when worker 1 has none) and the `sync`
    run still ends with exactly the uninterrupted run's weights and byte counts."""
    job = {**JOB, "run__log_every": 1}
    whole = fast.train(None, out=str(tmp_path / "whole"), **job)
    cut = tmp_path / "cut"
    fast.train(None, out=str(cut), run__max_steps=17, **job)  # stops after its checkpoints of steps 10 and 15
    for name in deleted:
        (cut / "checkpoints" / name).unlink()
    resumed = fast.train(resume=str(cut), run__max_steps=1000)
    total = resumed["steps_per_worker"]
    for rank in (0, 1):  # each worker's own log keeps both lives: the second starts after the agreed step
        assert _logged_steps(cut, rank) == [*range(1, 18), *range(restart_at + 1, total + 1)], rank
    assert_same_model(tmp_path / "whole", cut)
    assert resumed["final_test_accuracy"] == whole["final_test_accuracy"]
    assert resumed["bytes_sent"] == whole["bytes_sent"]
    # worker 0's step-15 file belonged to the life that ended; the resumed run wrote its own
    assert checkpoint.saved_steps(cut, 0) == checkpoint.saved_steps(cut, 1) == [35, 40]


def test_each_process_keeps_its_last_two_checkpoints_and_the_newest_step_all_hold_is_chosen(tmp_path):
    for step in (5, 10, 15):
        checkpoint.save({"step": step}, tmp_path, 3, step)
    checkpoint.save({"step": 5}, tmp_path, 3, 5, server=True)
    assert checkpoint.saved_steps(tmp_path, 3) == [10, 15]  # the oldest was deleted once 15 was in place
    assert checkpoint.saved_steps(tmp_path, 3, server=True) == [5]
    assert checkpoint.load(checkpoint.checkpoint_path(tmp_path, 3, 10))["step"] == 10
    assert checkpoint.newest_common_step([[10, 15], [5, 10], None]) == 10  # None: takes no part
    assert checkpoint.newest_common_step([[10, 15], [10, 15]]) == 15
    assert checkpoint.newest_common_step([[30, 35], [5, 10]]) is None  # workers far apart (asynchronous)
    assert checkpoint.newest_common_step([[10, 15], []]) is None
    assert checkpoint.newest_common_step([None]) is None
    checkpoint.discard_after(tmp_path, 3, 10)
    assert checkpoint.saved_steps(tmp_path, 3) == [10]


# -- async-ps: the servers' snapshots ----------------------------------------------------------------------------
def test_interrupted_and_resumed_async_ps_with_one_worker_ends_with_exactly_the_uninterrupted_weights(
    tmp_path, monkeypatch, no_orphans
):
    """One worker makes async-ps deterministic: server SGD with momentum. The resumed run must continue from
    the servers' snapshot (weights and momentum), or its weights would differ from the uninterrupted run's."""
    job = {**JOB, **PS, "run__workers": 1, "run__epochs": 1}
    whole, folder = _whole_and_cut_after_step_15(tmp_path, monkeypatch, job)
    server = torch.load(folder / "server1-step15.pt", weights_only=True)
    worker = torch.load(folder / "worker0-step15.pt", weights_only=True)
    assert server["strategy"]["step"] == worker["step"] == 15
    snapshot = server["strategy"]["shard"]
    assert snapshot["version"] == 15 and snapshot["updates_from"] == {0: 15}
    assert snapshot["optimizer"]["state"][0]["momentum_buffer"].abs().sum() > 0
    # the weights the worker resumes from (pulled at step 15) are the server's weights in the snapshot
    assert torch.equal(_flat(worker["model"]), snapshot["shard"])
    monkeypatch.delenv("CRASH_AT")
    resumed = fast.train(resume=str(tmp_path / "cut"))
    assert_same_model(tmp_path / "whole", tmp_path / "cut")
    assert resumed["server_updates"] == whole["server_updates"] == whole["steps_per_worker"]
    assert resumed["final_test_accuracy"] == whole["final_test_accuracy"]
    assert resumed["bytes_sent"] == whole["bytes_sent"]


def _pushes(steps: int, push_every: int) -> int:
    """A worker's pushes over `steps` steps: every push_every steps, and what is left at the end."""
    return steps // push_every + (steps % push_every > 0)


@pytest.mark.nondeterministic
def test_async_ps_with_two_workers_resumes_from_a_consistent_server_snapshot(tmp_path, no_orphans):
    """A run stopped at step 20 (run.max_steps) is resumed for the whole run. The workers went at their own
    pace, yet the server's snapshot holds exactly the updates of both workers' steps up to 15, their last
    checkpoint, so after the resume the server has applied every worker's pushes exactly once."""
    push_every = 2  # a checkpoint at an odd step keeps a gradient not pushed yet in the worker's state
    job = {**JOB, **PS, "strategy__push_every": push_every}
    fast.train(None, out=str(tmp_path), run__max_steps=20, **job)
    folder = tmp_path / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == [
        f"{kind}{rank}-step{step}.pt"
        for kind, rank in [("server", 2), ("worker", 0), ("worker", 1)]
        for step in (10, 15)
    ]
    server = checkpoint.load(checkpoint.checkpoint_path(tmp_path, 2, 15, server=True))["strategy"]
    assert [checkpoint.load(checkpoint.checkpoint_path(tmp_path, rank, 15))["step"] for rank in (0, 1)] == [15, 15]
    step, snapshot = server["step"], server["shard"]
    assert step == 15 and snapshot["updates_from"] == {0: 7, 1: 7}  # a consistent cut: 15 // push_every each
    assert snapshot["version"] == len(snapshot["staleness"]) == 14
    resumed = fast.train(resume=str(tmp_path), run__max_steps=1000)
    total = resumed["steps_per_worker"]
    assert total == 2 * 22  # two epochs of 22 steps
    assert resumed["server_updates"] == 2 * _pushes(total, push_every)  # every push once, none twice
    assert resumed["final_test_accuracy"] > 0.7  # over 10 seeds: 0.80 to 0.93 (bench/accuracy_spread.py)
    assert resumed["evaluations"][-1]["step"] == total


def _state(workers: int = 2) -> ShardState:
    options = AsyncPSOptions(name="async-ps", server_momentum=0.5, delay_compensation=0.1)
    return ShardState(torch.arange(4.0), options, lr=0.1, weight_decay=0.0, workers=workers)


def _same(a: ShardState, b: ShardState) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert torch.equal(sa["shard"], sb["shard"])
    assert torch.equal(sa["optimizer"]["state"][0]["momentum_buffer"], sb["optimizer"]["state"][0]["momentum_buffer"])
    assert (sa["version"], sa["updates_from"], sa["pulled_version"]) == (
        sb["version"],
        sb["updates_from"],
        sb["pulled_version"],
    )
    assert all(torch.equal(sa["backup"][w], sb["backup"][w]) for w in sa["backup"])
    assert torch.equal(sa["staleness"], sb["staleness"])


def test_a_server_snapshot_holds_exactly_the_updates_sent_before_each_workers_marker(tmp_path):
    g = [torch.full((4,), float(i + 1)) for i in range(6)]
    live = _state()
    snapshots = Snapshots(live, senders=2)

    def push(worker: int, gradient: torch.Tensor) -> None:
        with snapshots.applying(worker) as states:
            for state in states:
                state.apply(worker, gradient)

    def pull(worker: int) -> torch.Tensor:
        sent = live.shard.detach().clone()
        with snapshots.applying(worker) as states:
            for state in states:
                state.pulled(worker, sent)
        return sent

    def complete(gone: set[int]) -> list[tuple[int, ShardState]]:
        saved: list[tuple[int, ShardState]] = []
        snapshots.save_complete(gone, lambda step, state: saved.append((step, state)))
        return saved

    push(0, g[0])
    push(1, g[1])
    snapshots.mark(0, 5)  # worker 0 reached its checkpoint of step 5; worker 1 has not
    push(0, g[2])  # after worker 0's marker: not in the snapshot of step 5
    pulled_by_1 = pull(1)  # before worker 1's marker: in it
    push(1, g[3])
    snapshots.mark(0, 10)  # worker 0 is a whole interval ahead: a second snapshot under way
    push(0, g[4])
    assert complete(gone=set()) == []  # worker 1 holds both back
    snapshots.mark(1, 5)
    push(1, g[5])  # in the snapshot of step 10 only
    [(step, five)] = complete(gone=set())
    assert step == 5 and snapshots.committed == 5 and list(snapshots.pending) == [10]

    expected = _state()  # only what each worker sent before its step-5 marker, in arrival order
    expected.apply(0, g[0])
    expected.apply(1, g[1])
    expected.pulled(1, pulled_by_1)
    expected.apply(1, g[3])
    _same(five, expected)
    assert five.updates_from == {0: 1, 1: 2} and live.updates_from == {0: 3, 1: 3}

    # worker 1 dies before its step-10 marker: the snapshot of step 10 completes without it
    [(step, ten)] = complete(gone={1})
    assert step == 10 and ten.updates_from == {0: 2, 1: 3}
    expected_ten = _state()  # everything but worker 0's push after its marker of step 10
    for worker, gradient in [(0, g[0]), (1, g[1]), (0, g[2])]:
        expected_ten.apply(worker, gradient)
    expected_ten.pulled(1, pulled_by_1)
    expected_ten.apply(1, g[3])
    expected_ten.apply(1, g[5])
    _same(ten, expected_ten)
    # a snapshot round-trips through a file loaded with weights_only
    checkpoint.save_atomic({"step": 5, "shard": five.state_dict()}, tmp_path / "server.pt")
    loaded = _state()
    loaded.load_state_dict(checkpoint.load(tmp_path / "server.pt")["shard"])
    _same(loaded, expected)
    loaded.apply(0, g[0])  # the momentum was restored too
    expected.apply(0, g[0])
    _same(loaded, expected)


class _NotWeights:
    """Anything a checkpoint must not hold: an object that loading would have to import and build."""


def test_a_checkpoint_is_replaced_atomically_and_loads_with_weights_only(tmp_path, monkeypatch):
    path = checkpoint.checkpoint_path(tmp_path, 2, 5, server=True)
    assert path == tmp_path / "checkpoints" / "server2-step5.pt"
    checkpoint.save_atomic({"step": 5, "shard": torch.ones(3)}, path)

    def save_half_then_fail(obj, f, *args, **kwargs):
        f.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", save_half_then_fail)
    with pytest.raises(OSError, match="disk full"):
        checkpoint.save_atomic({"step": 10, "shard": torch.zeros(3)}, path)
    monkeypatch.undo()
    assert [p.name for p in path.parent.iterdir()] == ["server2-step5.pt"]  # the old file, no temporary one
    state = checkpoint.load(path)
    assert state["step"] == 5 and torch.equal(state["shard"], torch.ones(3))
    checkpoint.save_atomic({"step": 15, "object": _NotWeights()}, path)  # pickled objects are refused on load
    with pytest.raises(Exception, match="(?i)weights.only"):
        checkpoint.load(path)


# -- easgd (async) and ea-wild: the master's snapshots of its center ----------------------------------------------
EASGD = {"strategy__name": "easgd", "strategy__variant": "async", "strategy__tau": 2}
EA_WILD = {"strategy__name": "ea-wild"}  # tau = 1: an exchange every step
MASTERS = [pytest.param(EASGD, id="easgd-async"), pytest.param(EA_WILD, id="ea-wild")]


def _exchanges(strategy: dict, steps: int) -> int:
    """A worker's exchanges in its first `steps` steps: easgd's at steps tau, 2 tau, ... (0-based), ea-wild's at
    every step."""
    return (steps - 1) // strategy["strategy__tau"] if strategy is EASGD else steps


def _master_snapshot(run_dir, step: int, master: int) -> dict:
    state = checkpoint.load(checkpoint.checkpoint_path(run_dir, master, step, server=True))["strategy"]
    assert state["step"] == step
    return state["center"]


@pytest.mark.parametrize("strategy", MASTERS)
def test_interrupted_and_resumed_master_with_one_worker_ends_with_exactly_the_uninterrupted_weights(
    tmp_path, monkeypatch, no_orphans, strategy
):
    """One worker makes the master deterministic. The resumed run must continue from the master's snapshot of
    its center (which moved on with the worker's last exchange, so the worker's own copy differs), or its
    weights would differ from the uninterrupted run's."""
    job = {**JOB, **strategy, "run__workers": 1, "run__epochs": 1}
    whole, folder = _whole_and_cut_after_step_15(tmp_path, monkeypatch, job)
    snapshot = _master_snapshot(tmp_path / "cut", 15, master=1)
    exchanges = _exchanges(strategy, 15)
    assert snapshot["updates"].tolist() == snapshot["seen"].tolist() == [exchanges]
    assert snapshot["staleness"].tolist() == [0] * exchanges
    worker = checkpoint.load(folder / "worker0-step15.pt")
    assert not torch.equal(snapshot["center"], worker["strategy"]["center"])
    monkeypatch.delenv("CRASH_AT")
    resumed = fast.train(resume=str(tmp_path / "cut"))
    assert_same_model(tmp_path / "whole", tmp_path / "cut")
    assert resumed["center_updates"] == whole["center_updates"] == _exchanges(strategy, whole["steps_per_worker"])
    assert resumed["staleness_histogram"] == whole["staleness_histogram"]
    assert resumed["final_test_accuracy"] == whole["final_test_accuracy"] > 0.8
    assert resumed["bytes_sent"] == whole["bytes_sent"]
    # the resumed master's later snapshots are exactly the uninterrupted master's
    steps = checkpoint.saved_steps(tmp_path / "whole", 1, server=True)
    assert len(steps) == 2 and checkpoint.saved_steps(tmp_path / "cut", 1, server=True) == steps
    for step in steps:
        theirs, ours = _master_snapshot(tmp_path / "whole", step, 1), _master_snapshot(tmp_path / "cut", step, 1)
        assert theirs.keys() == ours.keys() and all(torch.equal(theirs[k], ours[k]) for k in theirs), step


@pytest.mark.nondeterministic
@pytest.mark.parametrize("strategy", MASTERS)
def test_with_two_workers_the_master_resumes_from_its_snapshot_of_the_common_step(tmp_path, no_orphans, strategy):
    """A run stopped at step 20 (run.max_steps). Its master's snapshot of step 15 holds exactly both workers'
    exchanges of their first 15 steps; a resume for no more steps reports that very center, and a resume for
    the whole run makes each exchange once, none twice."""
    fast.train(None, out=str(tmp_path), run__max_steps=20, **JOB, **strategy)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        f"{kind}{rank}-step{step}.pt"
        for kind, rank in [("server", 2), ("worker", 0), ("worker", 1)]
        for step in (10, 15)
    ]
    snapshot = _master_snapshot(tmp_path, 15, master=2)
    exchanges = _exchanges(strategy, 15)
    assert snapshot["updates"].tolist() == [exchanges, exchanges]  # a consistent cut
    assert len(snapshot["staleness"]) == 2 * exchanges
    fast.train(resume=str(tmp_path), run__max_steps=15)  # resumed at step 15 and ended there: the master's center
    model = torch.load(tmp_path / "model.pt", weights_only=True)
    assert torch.equal(_flat(model), snapshot["center"])
    resumed = fast.train(resume=str(tmp_path), run__max_steps=1000)
    total = resumed["steps_per_worker"]
    assert total == 2 * 22  # two epochs of 22 steps
    assert resumed["center_updates"] == 2 * _exchanges(strategy, total)  # every exchange once, none twice
    assert sum(resumed["staleness_histogram"].values()) == resumed["center_updates"]
    assert resumed["final_test_accuracy"] > 0.8
    assert resumed["evaluations"][-1]["step"] == total


@pytest.mark.nondeterministic
@pytest.mark.parametrize("strategy", MASTERS)
def test_a_dead_worker_does_not_hold_back_the_masters_snapshots(tmp_path, monkeypatch, no_orphans, strategy):
    """Worker 1 dies at its step 12; the master's snapshots go on without it and hold its exchanges up to then."""
    monkeypatch.setenv("CRASH_AT", "12")  # worker 1 exits in its step 11 (0-based), after its checkpoint of 10
    summary = fast.train(None, out=str(tmp_path), step_fn=_crash_once, **JOB, **strategy, run__deadline_s=5.0)
    assert [f["worker"] for f in summary["failures"]] == [1]
    total = summary["steps_per_worker"]
    last = (total - 1) // 5 * 5  # the last checkpoint, before the last step
    assert checkpoint.saved_steps(tmp_path, 1) == [5, 10]
    assert checkpoint.saved_steps(tmp_path, 2, server=True) == checkpoint.saved_steps(tmp_path, 0) == [last - 5, last]
    updates = _master_snapshot(tmp_path, last, master=2)["updates"].tolist()
    assert updates[0] == _exchanges(strategy, last)
    # worker 1's exchanges before its death: ea-wild's of step 11 left before the step, and may have arrived
    assert updates[1] in (_exchanges(strategy, 11), _exchanges(strategy, 12))
    assert summary["final_test_accuracy"] > 0.8


def test_a_master_snapshot_holds_exactly_the_exchanges_sent_before_each_senders_marker(tmp_path):
    w = [torch.full((3,), float(i + 1)) for i in range(5)]
    live = CenterState(torch.zeros(3), senders=2)
    snapshots = Snapshots(live, senders=2)
    saved: dict[int, dict[str, torch.Tensor]] = {}

    def exchange(sender: int, weights: torch.Tensor) -> None:
        with snapshots.applying(sender) as states:
            for state in states:
                state.apply(sender, weights, 0.25)

    def save(gone: set[int]) -> list[int]:
        return snapshots.save_complete(gone, lambda step, state: saved.__setitem__(step, state.state_dict()))

    exchange(0, w[0])
    exchange(1, w[1])
    snapshots.mark(0, 5)  # sender 0 reached its checkpoint of step 5; sender 1 has not
    exchange(0, w[2])  # after sender 0's marker: not in the snapshot of step 5
    exchange(1, w[3])  # before sender 1's marker: in it
    assert save(gone=set()) == []  # sender 1 holds it back
    snapshots.mark(1, 5)
    assert save(gone=set()) == [5] and snapshots.committed == 5 and not snapshots.pending

    expected = CenterState(torch.zeros(3), senders=2)  # only what each sent before its marker, in arrival order
    for sender, weights in [(0, w[0]), (1, w[1]), (1, w[3])]:
        expected.apply(sender, weights, 0.25)
    for key, value in expected.state_dict().items():
        assert torch.equal(saved[5][key], value), key
    assert saved[5]["updates"].tolist() == [1, 2] and live.updates == [2, 2]
    assert saved[5]["staleness"].tolist() == [0, 1, 0] and live.staleness == [0, 1, 1, 1]

    # a copy waits for an exchange being applied, so that it holds all of it or none
    inside, release = threading.Event(), threading.Event()

    def slow_exchange() -> None:
        with snapshots.applying(1) as states:
            inside.set()
            release.wait(5)
            for state in states:
                state.apply(1, w[4], 0.25)

    applying = threading.Thread(target=slow_exchange)
    applying.start()
    assert inside.wait(5)
    marking = threading.Thread(target=snapshots.mark, args=(0, 10))
    marking.start()
    marking.join(0.3)
    assert marking.is_alive()  # waiting for the exchange under way
    release.set()
    applying.join(5)
    marking.join(5)
    assert not marking.is_alive() and torch.equal(snapshots.pending[10].center, live.center)

    # sender 1 dies before its marker of step 10: the snapshot completes without it
    assert save(gone={1}) == [10]
    assert torch.equal(saved[10]["center"], live.center) and saved[10]["updates"].tolist() == [2, 3]
    # a snapshot round-trips through a file loaded with weights_only
    checkpoint.save_atomic({"step": 10, "center": saved[10]}, tmp_path / "server.pt")
    loaded = CenterState(torch.zeros(3), senders=2)
    loaded.load_state_dict(checkpoint.load(tmp_path / "server.pt")["center"])
    assert torch.equal(loaded.center, live.center)
    assert (loaded.updates, loaded.seen, loaded.staleness) == (live.updates, live.seen, live.staleness)
