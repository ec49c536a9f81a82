"""Training on slow links: streaming DiLoCo, stale-synchronous over all-reduce, asynchrony-aware momentum, the
timeline of where the time goes, and their cost models."""

from __future__ import annotations

import json

import pytest
import torch

import fast
from fast.assemble import load_config
from fast.errors import ConfigError
from fast.jobs.datasets import load_dataset
from fast.jobs.models import build_model
from fast.perfmodel import Link
from fast.pricing import step_cost
from fast.strategies.compensation import MomentumCompensation, compensated
from fast.strategies.streaming_diloco import fragment_bounds, rounds_due

JOB = {"data__name": "digits", "model__name": "mlp", "run__workers": 3, "run__batch_size": 16, "run__eval_every": 0}


def _weights(run) -> dict[str, torch.Tensor]:
    return torch.load(run / "model.pt", weights_only=True)


def _assert_same_weights(a, b, atol: float = 1e-6) -> None:
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    for key in wa:
        torch.testing.assert_close(wa[key], wb[key], rtol=1e-5, atol=atol)


# -- streaming DiLoCo --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fragments", [1, 2, 3, 5])
def test_fragments_cover_every_parameter_once_and_each_has_one_round_per_period(fragments):
    data = load_dataset("digits")
    model = build_model("lenet" if fragments == 5 else "mlp", data.input_shape, data.num_classes)
    sizes = [p.numel() for p in model.parameters()]
    if fragments > len(sizes):
        pytest.skip("more fragments than tensors")
    bounds = fragment_bounds(sizes, fragments)
    covered = [i for start, end in bounds for i in range(start, end)]
    assert covered == list(range(len(sizes))) and all(end > start for start, end in bounds)
    largest = max(sum(sizes[start:end]) for start, end in bounds)
    assert largest <= sum(sizes) / fragments + max(sizes)  # about equal: a fragment is over by one tensor at most
    period = 12
    for first in range(1, 40):  # any `period` consecutive local steps: every fragment exactly once
        due = [p for done in range(first, first + period) for p in rounds_due(done, period, fragments)]
        assert sorted(due) == list(range(fragments))


def test_streaming_diloco_with_one_fragment_no_delay_and_no_mixing_is_diloco(tmp_path, no_orphans):
    # both through gloo: diloco's blocking averages would otherwise go through shared memory, which adds 3 workers'
    # values in another order than gloo's ring, where streaming's background rounds run
    job = {**JOB, "run__epochs": 2, "strategy__period": 5, "run__shared_memory": False}
    diloco = fast.train(None, out=str(tmp_path / "diloco"), strategy__name="diloco", **job)
    streaming = fast.train(None, out=str(tmp_path / "streaming"), strategy__name="streaming-diloco",
                           strategy__fragments=1, strategy__delay=0, strategy__alpha=0.0, **job)  # fmt: skip
    _assert_same_weights(tmp_path / "diloco", tmp_path / "streaming")
    rounds = diloco["outer_rounds"]
    assert streaming["outer_rounds"] == rounds
    assert diloco["bytes_sent"] == streaming["bytes_sent"]  # each round with the count of the workers that moved


def test_streaming_diloco_overlaps_fragments_through_a_codec_and_ends_with_equal_replicas(tmp_path, no_orphans):
    job = {**JOB, "run__epochs": 2, "strategy__period": 6}
    dense = fast.train(None, out=str(tmp_path / "dense"), strategy__name="streaming-diloco", strategy__fragments=3,
                       strategy__delay=2, **job)  # fmt: skip
    quantised = fast.train(None, out=str(tmp_path / "uint8"), strategy__name="streaming-diloco",
                           strategy__fragments=3, strategy__delay=2, codec__name="uint8", **job)  # fmt: skip
    for summary in (dense, quantised):
        assert summary["final_test_accuracy"] > 0.85
        assert summary["replica_divergence"] < 1e-6  # the last rounds leave every replica at θ
        steps = summary["steps_per_worker"]
        rounds = [p for done in range(1, steps + 1) for p in rounds_due(done, 6, 3)]
        last_rounds = [p for p in range(3) if p not in rounds_due(steps, 6, 3)]  # the end's, for the steps since
        assert summary["outer_rounds"] == len(rounds) + len(last_rounds)
    # uint8 frames are all-gathered, (N - 1) n bytes a worker, against the ring's 2 (N - 1) / N · 4n: 8 / N = 2.67x
    assert quantised["bytes_sent"] < dense["bytes_sent"] / 2.5


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"strategy__delay": 8, "strategy__period": 8}, "`strategy.delay` = 8 must be below strategy.period = 8"),
        ({"strategy__fragments": 9, "strategy__period": 8}, "`strategy.fragments` = 9 is more than strategy.period"),
        ({"codec__name": "dgc", "optimizer__momentum": 0.0}, "`codec.name` = 'dgc' does not work with strategy"),
    ],
)
def test_impossible_streaming_options_are_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(None, strategy__name="streaming-diloco", **overrides)


# -- stale-synchronous over all-reduce ---------------------------------------------------------------------------
def test_ssp_over_all_reduce_with_staleness_zero_is_sync_and_sends_syncs_bytes(tmp_path, no_orphans):
    job = {**JOB, "run__epochs": 1}
    sync = fast.train(None, out=str(tmp_path / "sync"), strategy__name="sync", **job)
    ssp = fast.train(None, out=str(tmp_path / "ssp"), strategy__name="ssp", strategy__staleness=0,
                     strategy__exchange="all-reduce", **job)  # fmt: skip
    _assert_same_weights(tmp_path / "sync", tmp_path / "ssp")
    # the same all-reduce of the gradients; sync's buckets add one count per bucket and worker
    assert abs(ssp["bytes_sent"] - sync["bytes_sent"]) < 1e-4 * sync["bytes_sent"]


def test_ssp_over_all_reduce_applies_the_others_gradients_exactly_s_steps_late(tmp_path, no_orphans):
    summary = fast.train(None, out=str(tmp_path), strategy__name="ssp", strategy__staleness=2,
                         strategy__exchange="all-reduce", run__epochs=1, **JOB)  # fmt: skip
    steps = summary["steps_per_worker"]
    # each step's sum is applied 2 steps later; the last two at the end, after the last step: 2 and 1 steps late
    assert summary["staleness_histogram"] == {"1": 3, "2": 3 * (steps - 1)}
    assert summary["exchange"] == "all-reduce" and summary["final_test_accuracy"] > 0.3  # it learns (chance: 0.1)


def test_ssp_broadcast_sends_every_gradient_to_every_peer(tmp_path, no_orphans):
    summary = fast.train(None, out=str(tmp_path), strategy__name="ssp", strategy__staleness=1, run__epochs=1, **JOB)
    data = load_dataset("digits")
    numel = sum(p.numel() for p in build_model("mlp", data.input_shape, data.num_classes).parameters())
    steps, workers = summary["steps_per_worker"], 3
    headers = (steps + 1) * 8  # a step header per step, and the END of the stream
    assert summary["bytes_sent"] == workers * (workers - 1) * (steps * numel * 4 + headers)


# -- asynchrony-aware momentum -----------------------------------------------------------------------------------
def test_the_compensated_momentum_keeps_the_long_run_step_of_the_configured_one():
    assert compensated(0.9, 0.0) == pytest.approx(0.9)
    for staleness in (0.5, 1.0, 3.0):
        explicit = compensated(0.9, staleness)
        implicit = staleness / (1 + staleness)
        assert (1 - explicit) * (1 - implicit) == pytest.approx(1 - 0.9)
    assert compensated(0.9, 20.0) == 0.0  # never negative
    sgd = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1, momentum=0.9)
    adam = torch.optim.Adam(torch.nn.Linear(2, 2).parameters(), betas=(0.8, 0.99))
    for optimizer, read in ((sgd, lambda g: g["momentum"]), (adam, lambda g: g["betas"][0])):
        compensation = MomentumCompensation(optimizer)
        compensation.update([1, 1, 2, 0])  # mean 1: implicit 0.5
        target = 0.9 if optimizer is sgd else 0.8
        assert read(optimizer.param_groups[0]) == pytest.approx(1 - (1 - target) * 2)
    assert adam.param_groups[0]["betas"][1] == 0.99


@pytest.mark.nondeterministic
@pytest.mark.parametrize(
    "strategy",
    [
        {"strategy__name": "ssp", "strategy__staleness": 2, "strategy__exchange": "all-reduce"},
        {"strategy__name": "async-ps"},
        {"strategy__name": "ad-psgd"},
        {"strategy__name": "async-broadcast"},
        {"strategy__name": "ea-wild", "strategy__rho": 1.0},
    ],
    ids=["ssp", "async-ps", "ad-psgd", "async-broadcast", "ea-wild"],
)
def test_momentum_compensation_lowers_momentum_by_the_staleness_each_strategy_measures(tmp_path, no_orphans,
                                                                                       strategy):  # fmt: skip
    summary = fast.train(None, out=str(tmp_path), run__epochs=2, optimizer__momentum=0.9,
                         strategy__momentum_compensation=True, **strategy, **JOB)  # fmt: skip
    staleness = summary["compensated_staleness"]
    # ad-psgd counts the averagings its listener thread answered while the step computed: on a loaded host the
    # listener may not run then in a whole run (1 run in 6 with two busy loops beside it), and 0 is then right
    assert staleness > 0 or (strategy["strategy__name"] == "ad-psgd" and staleness == 0)
    assert summary["explicit_momentum"] == pytest.approx(compensated(0.9, staleness), abs=1e-3)
    assert summary["final_test_accuracy"] > 0.8


# -- where the time goes -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", ["sync", "async-ps"])
def test_a_trace_holds_every_workers_spans_in_the_chrome_trace_format(tmp_path, no_orphans, strategy):
    summary = fast.train(None, out=str(tmp_path), strategy__name=strategy, run__epochs=1, run__trace=True,
                         network__bandwidth="100Mbit", network__latency="1ms", **JOB)  # fmt: skip
    trace = json.loads((tmp_path / "trace.json").read_text())
    events = trace["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    for event in spans:  # complete events: name, category, microseconds from the trace's start, process, thread
        assert isinstance(event["name"], str) and isinstance(event["cat"], str)
        assert event["ts"] >= 0 and event["dur"] >= 0 and isinstance(event["pid"], int)
        assert isinstance(event["tid"], int)
    processes = 3 + (strategy == "async-ps")
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert sorted(names) == list(range(processes)) and names[0] == "worker 0/3"
    for worker in range(3):
        mine = {e["name"] for e in spans if e["pid"] == worker}
        assert {"forward+backward", "optimizer", "strategy.after_backward", "wait"} <= mine
        steps = [e for e in spans if e["pid"] == worker and e["name"] == "optimizer"]
        assert len(steps) == summary["steps_per_worker"]
    shares = summary["time_shares"]
    assert set(shares) == {"compute", "communicate", "wait", "other"}
    assert sum(shares.values()) == pytest.approx(1.0, abs=0.01) and shares["compute"] > 0
    assert shares["communicate"] + shares["wait"] > 0
    if strategy == "sync":  # (3 processes on 2 cores: some worker is always late to some all-reduce)
        waits = [e for e in spans if e["name"] == "wait"]
        for part in [e for e in spans if e["name"] == "waiting for peers"][:50]:  # inside a wait of its worker
            assert any(w["pid"] == part["pid"] and w["ts"] - 1e3 <= part["ts"] and
                       part["ts"] + part["dur"] <= w["ts"] + w["dur"] + 1e3 for w in waits), part  # fmt: skip


@pytest.mark.parametrize("codec", ["none", "topk"])
def test_a_step_blocked_on_a_slow_link_is_communication_with_or_without_a_codec(tmp_path, no_orphans, codec):
    """A dense all-reduce is waited on in the training thread; a top-k exchange runs in a background thread whose
    result the step waits for: on a slow link without a straggler both are time blocked on the transfer, which is
    communication, not waiting for peers (before, dense sync read 97% "wait" and top-k 93% "communicate")."""
    summary = fast.train(None, out=str(tmp_path), strategy__name="sync", run__max_steps=20, codec__name=codec,
                         network__bandwidth="20Mbit", network__latency="20ms", **JOB)  # fmt: skip
    shares = summary["time_shares"]
    assert summary["time_blocked_share"] > 0.5
    assert shares["communicate"] > 0.5 and shares["communicate"] > 3 * shares["wait"], shares


def test_a_straggler_makes_the_others_wait_for_it_and_not_communicate(tmp_path, no_orphans):
    """Worker 2 computes ten times slower; the link is fast: workers 0 and 1 spend most of their time waiting for
    it inside the all-reduce (waiting for peers), worker 2 hardly waits at all."""
    summary = fast.train(None, out=str(tmp_path), strategy__name="sync", run__max_steps=60,
                         compute__slowdown={"2": 10.0}, **JOB)  # fmt: skip
    fast_workers, straggler = summary["worker_time_shares"][:2], summary["worker_time_shares"][2]
    for shares in fast_workers:
        assert shares["wait"] > 0.5 and shares["wait"] > 3 * shares["communicate"], summary["worker_time_shares"]
    assert straggler["wait"] < 0.1 and straggler["compute"] > 0.5, straggler


# -- the cost model ----------------------------------------------------------------------------------------------
LINK = Link(latency_s=0.05, bandwidth_Bps=10e6 / 8)


def test_streaming_rounds_cost_a_fragment_at_a_time_and_hide_behind_the_delay():
    n, compute = 1e6, 0.1
    diloco = step_cost("diloco", nbytes=n, workers=8, link=LINK, compute_s=compute, period=16)
    streaming = {delay: step_cost("streaming-diloco", nbytes=n, workers=8, link=LINK, compute_s=compute,
                                  period=16, fragments=4, delay=delay) for delay in (0, 2, 50)}  # fmt: skip
    assert streaming[0].bytes_per_worker == pytest.approx(diloco.bytes_per_worker)  # the same bytes, in 4 parts
    assert streaming[0].time_s > diloco.time_s  # not overlapped, 4 rounds pay 4 latencies
    assert streaming[2].time_s < streaming[0].time_s and streaming[50].time_s == pytest.approx(compute)


def test_ssp_over_all_reduce_costs_syncs_bytes_and_hides_them_behind_compute():
    n, compute = 1e6, 0.5
    sync = step_cost("sync", nbytes=n, workers=4, link=LINK, compute_s=compute)
    hidden = step_cost("ssp", nbytes=n, workers=4, link=LINK, compute_s=compute, staleness=2, exchange="all-reduce")
    broadcast = step_cost("ssp", nbytes=n, workers=4, link=LINK, compute_s=compute, staleness=2)
    assert hidden.bytes_per_worker == sync.bytes_per_worker < broadcast.bytes_per_worker
    assert hidden.time_s == pytest.approx(max(compute, sync.comm_s)) and hidden.time_s < sync.time_s
    assert broadcast.bytes_per_worker == pytest.approx(3 * n)
