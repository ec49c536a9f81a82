"""The α-β cost model against hand-computed numbers, its regimes, and the FLOP counts it builds on.

The small case: N = 4 workers, n = 1e6 bytes, α = 20 ms, β = 20 Mbit = 2.5e6 B/s, so one model-sized
message costs α + n/β = 0.42 s, and one of n/4 bytes costs 0.12 s.
"""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from fast.errors import ConfigError
from fast.perfmodel import (
    Link,
    StepCost,
    allreduce_cost,
    compute_communication_ratio,
    flops_per_sample,
    forward_flops_per_sample,
    rank_by_epoch_time,
)
from fast.pricing import priced, step_cost

N, NBYTES = 4, 1e6
WAN = Link(latency_s=0.02, bandwidth_Bps=2.5e6)
LAN = Link(latency_s=0.001, bandwidth_Bps=1.25e8)  # 1 ms, 1 Gbit


def test_link_parses_config_strings_and_prices_a_message():
    assert Link.parse("20ms", "20Mbit") == WAN
    assert WAN.message_time(NBYTES) == pytest.approx(0.42)


@pytest.mark.parametrize("latency, bandwidth", [(-1, 1e6), (0.01, 0), (0.01, -5), (math.nan, 1e6), (0, math.inf)])
def test_link_rejects_impossible_values(latency, bandwidth):
    with pytest.raises(ConfigError):
        Link(latency, bandwidth)


@pytest.mark.parametrize(
    "algorithm, seconds, bytes_per_worker",
    [
        ("ring", 2 * 3 * (0.02 + 1e6 / (4 * 2.5e6)), 2 * 3 * 1e6 / 4),  # 6 × 0.12 s
        ("tree", 2 * 2 * 0.42, 2 * 3 * 1e6 / 4),  # 2⌈log2 4⌉ rounds; 3 messages up, 3 down
        ("recursive-doubling", 2 * 0.42, 2 * 1e6),  # 2 rounds, n sent in each
    ],
)
def test_flat_allreduce_algorithms_match_hand_computed_costs(algorithm, seconds, bytes_per_worker):
    assert allreduce_cost(NBYTES, N, WAN, algorithm) == pytest.approx((seconds, bytes_per_worker))


def test_tree_and_recursive_doubling_round_log2_up_when_workers_are_not_a_power_of_two():
    assert allreduce_cost(NBYTES, 5, WAN, "tree")[0] == pytest.approx(2 * 3 * 0.42)
    assert allreduce_cost(NBYTES, 5, WAN, "recursive-doubling")[0] == pytest.approx(3 * 0.42)


def test_hierarchical_allreduce_matches_hand_computed_cost():
    # Two groups of two: a reduce and a broadcast over the LAN (1 round each), a 2-leader ring over the WAN.
    in_group = 2 * (0.001 + 1e6 / 1.25e8)
    leaders = 2 * (0.02 + 1e6 / (2 * 2.5e6))
    # Per group 1 message up and 1 down (2e6 bytes); the 2 leaders send 1e6 each in their ring.
    expected_bytes = (2 * 2e6 + 2 * 1e6) / 4
    result = allreduce_cost(NBYTES, N, WAN, "hierarchical", group_size=2, inner_link=LAN)
    assert result == pytest.approx((in_group + leaders, expected_bytes))


def test_hierarchical_allreduce_with_a_smaller_last_group():
    # Groups [2, 2, 1]: the in-group tree takes the largest group's 1 round; 3 leaders ring over the WAN.
    seconds, nbytes = allreduce_cost(NBYTES, 5, WAN, "hierarchical", group_size=2, inner_link=LAN)
    assert seconds == pytest.approx(2 * (0.001 + 0.008) + 4 * (0.02 + 1e6 / (3 * 2.5e6)))
    assert nbytes == pytest.approx((2e6 + 2e6 + 0 + 2 * 2 * 1e6) / 5)


@given(
    nbytes=st.floats(0, 1e10),
    workers=st.integers(1, 300),
    latency=st.floats(0, 1),
    bandwidth=st.floats(1e3, 1e12),
)
def test_allreduce_identities(nbytes, workers, latency, bandwidth):
    link = Link(latency, bandwidth)
    ring = allreduce_cost(nbytes, workers, link, "ring")
    tree = allreduce_cost(nbytes, workers, link, "tree")
    butterfly = allreduce_cost(nbytes, workers, link, "recursive-doubling")
    assert butterfly[0] == pytest.approx(tree[0] / 2)
    assert ring[1] <= 2 * nbytes
    # Groups of one are a flat ring; one group of everyone on the same link is the tree.
    assert allreduce_cost(nbytes, workers, link, "hierarchical", group_size=1) == pytest.approx(ring)
    assert allreduce_cost(nbytes, workers, link, "hierarchical", group_size=workers) == pytest.approx(tree)


def test_a_single_worker_communicates_nothing():
    for algorithm in ("ring", "tree", "recursive-doubling"):
        assert allreduce_cost(NBYTES, 1, WAN, algorithm) == (0, 0)


def test_latency_bound_favours_recursive_doubling_and_bandwidth_bound_favours_ring():
    small_message, latency_bound_link = 1e3, Link(0.02, 1.25e8)
    ring = allreduce_cost(small_message, 16, latency_bound_link, "ring")[0]
    butterfly = allreduce_cost(small_message, 16, latency_bound_link, "recursive-doubling")[0]
    assert butterfly < ring
    big_message, bandwidth_bound_link = 1e8, Link(1e-5, 1.25e8)
    ring = allreduce_cost(big_message, 16, bandwidth_bound_link, "ring")[0]
    butterfly = allreduce_cost(big_message, 16, bandwidth_bound_link, "recursive-doubling")[0]
    assert ring < butterfly


def test_hierarchical_beats_flat_ring_when_the_inner_link_is_much_faster():
    fast_inner = Link(1e-6, 1e10)
    flat = allreduce_cost(NBYTES, 16, WAN, "ring")[0]
    hierarchical = allreduce_cost(NBYTES, 16, WAN, "hierarchical", group_size=4, inner_link=fast_inner)[0]
    assert hierarchical < flat
    # Over the WAN alone the in-group rounds cost more than the shorter ring saves.
    assert allreduce_cost(NBYTES, 16, WAN, "hierarchical", group_size=4)[0] > flat


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"algorithm": "butterfly"}, "unknown"),
        ({"algorithm": "ring", "group_size": 2}, "hierarchical all-reduce only"),
        ({"algorithm": "tree", "inner_link": LAN}, "hierarchical all-reduce only"),
        ({"algorithm": "hierarchical"}, "group_size"),
        ({"algorithm": "hierarchical", "group_size": 5}, "group_size"),
        ({"workers": 0}, "workers"),
        ({"nbytes": -1.0}, "nbytes"),
    ],
)
def test_allreduce_rejects_bad_arguments(kwargs, message):
    arguments = {"nbytes": NBYTES, "workers": N, "link": WAN} | kwargs
    with pytest.raises(ConfigError, match=message):
        allreduce_cost(**arguments)


def cost(strategy: str, compute_s: float = 0.5, workers: int = N, **options) -> StepCost:
    return step_cost(strategy, nbytes=NBYTES, workers=workers, link=WAN, compute_s=compute_s, **options)


@pytest.mark.parametrize(
    "strategy, options, expected",
    [
        ("none", {}, StepCost(0.5, 0.5, 0.0, 0.0)),
        ("sync", {}, StepCost(0.5 + 0.72, 0.5, 0.72, 1.5e6)),
        ("sync", {"algorithm": "recursive-doubling"}, StepCost(0.5 + 0.84, 0.5, 0.84, 2e6)),
        ("sync", {"overlap": 0.5}, StepCost(0.5 + 0.72 - 0.25, 0.5, 0.72, 1.5e6)),
        ("sync", {"overlap": 1.0}, StepCost(0.72, 0.5, 0.72, 1.5e6)),
        ("sync", {"hierarchical": 2, "inner_link": LAN}, StepCost(0.5 + 0.458, 0.5, 0.458, 1.5e6)),
        # frames that cannot be added (top-k): a ring of the lengths, then of the frames: 3 x (2 x 0.02 + 0.4) s
        ("sync", {"gathered": True}, StepCost(0.5 + 1.32, 0.5, 1.32, 3e6)),
        ("local-sgd", {"period": 4, "gathered": True}, StepCost(0.5 + 0.33, 0.5, 0.33, 3e6 / 4)),
        ("ssp", {}, StepCost(1.26, 0.5, 3 * 0.42, 3e6)),  # each gradient to each of the 3 peers
        ("ssp", {"exchange": "all-reduce"}, StepCost(0.72, 0.5, 0.72, 1.5e6)),  # sync's all-reduce, overlapped
        # One server: a worker's push then pull (2 x 0.42 s) against the server's busier direction, 4 shards of
        # n in (pushes) or out (pulls) at 0.4 s each, the two directions overlapping (full duplex).
        ("async-ps", {}, StepCost(1.6, 0.5, 1.6, 2e6)),
        ("async-ps", {"servers": 2}, StepCost(0.5 + 0.84, 0.5, 0.84, 2e6)),
        ("async-ps", {"push_every": 2, "pull_every": 4}, StepCost(0.5 + 0.315, 0.5, 0.8, 0.75e6)),
        # Every 4 steps, send the weights to the master and get the center back, 4 workers on one master.
        ("easgd", {"tau": 4, "variant": "async"}, StepCost(0.5 + 0.21, 0.5, 0.4, 2e6 / 4)),
        # Synchronous EASGD: one ring all-reduce (0.72 s) every 4 steps.
        ("easgd", {"tau": 4}, StepCost(0.5 + 0.18, 0.5, 0.18, 1.5e6 / 4)),
        # Groups of 2 ring-all-reduce over the LAN (2 × 4 ms + 2 × 1 ms); 2 leaders meet the master.
        (
            "ea-wild",
            {"tau": 4, "group_size": 2, "inner_link": LAN},
            StepCost(0.5 + 0.01, 0.5, 0.01 + 2 * 0.42 / 4, (2 * 2e6 + 2 * 2e6 / 4) / 4),
        ),
        ("local-sgd", {"period": 4}, StepCost(0.5 + 0.18, 0.5, 0.18, 1.5e6 / 4)),
        ("diloco", {"period": 4}, StepCost(0.5 + 0.18, 0.5, 0.18, 1.5e6 / 4)),
        ("gossip", {"degree": 2}, StepCost(0.5 + 0.84, 0.5, 0.84, 2e6)),
        (
            "gossip",
            {"degree": 2, "peers_per_round": 1, "send_probability": 0.5},
            StepCost(0.5 + 0.21, 0.5, 0.21, 0.5e6),
        ),
        # A round trip (2 x 0.42 s) after each step, and at each of the two NICs an M/D/1 wait: the NICs are busy
        # 0.8 s of each step T, so T = 0.5 + 0.84 + 2 (0.8 / T) 0.4 / (2 (1 - 0.8 / T)): T = 1.6968.
        ("ad-psgd", {}, StepCost(1.6968174, 0.5, 1.1968174, 2e6)),
        ("push-sum", {"send_probability": 0.5}, StepCost(0.5, 0.5, 0.21, 0.5e6)),
        ("async-broadcast", {}, StepCost(1.26, 0.5, 3 * 0.42, 3e6)),
    ],
)
def test_step_cost_matches_hand_computed_numbers(strategy, options, expected):
    result = cost(strategy, **options)
    assert result.time_s == pytest.approx(expected.time_s)
    assert result.compute_s == expected.compute_s
    assert result.comm_s == pytest.approx(expected.comm_s)
    assert result.bytes_per_worker == pytest.approx(expected.bytes_per_worker)


def test_every_strategy_with_a_cost_model_lists_its_options():
    required = {
        "easgd": {"tau": 2},
        "eamsgd": {"tau": 2, "variant": "async"},
        "ea-wild": {"tau": 2},
        "local-sgd": {"period": 2},
        "diloco": {"period": 2},
        "streaming-diloco": {"period": 4, "fragments": 2},
        "sparseloco": {"period": 2},
        "noloco": {"period": 2},
    }
    required["gossip"] = {"degree": 2}
    built_in = [name for name, cls in priced().items() if cls.__module__.startswith("fast.")]  # not the examples'
    for strategy in built_in:
        assert cost(strategy, **required.get(strategy, {})).time_s >= 0.5


def test_gossip_cost_grows_with_degree():
    costs = [cost("gossip", workers=8, degree=d).comm_s for d in range(1, 8)]
    assert all(a < b for a, b in zip(costs, costs[1:], strict=False))


def test_async_step_is_bound_by_compute_or_communication_whichever_is_longer():
    assert cost("ssp", compute_s=2.0).time_s == 2.0
    assert cost("ssp", compute_s=0.1).time_s == pytest.approx(1.26)


def test_local_sgd_cost_falls_with_the_averaging_period_towards_compute_alone():
    times = [cost("local-sgd", period=h).time_s for h in (1, 2, 8, 64)]
    assert times[0] == pytest.approx(cost("sync").time_s)
    assert all(a > b > 0.5 for a, b in zip(times, times[1:], strict=False))


def test_peer_to_peer_strategies_cost_nothing_with_one_worker():
    assert cost("ad-psgd", workers=1).comm_s == 0
    assert cost("async-broadcast", workers=1).comm_s == 0


@pytest.mark.parametrize(
    "strategy, options, message",
    [
        ("allreduce", {}, "no cost model"),
        ("sync", {"tau": 4}, "do not apply"),
        ("easgd", {}, "tau"),
        ("local-sgd", {"period": 0}, "period"),
        ("sync", {"overlap": 1.5}, "overlap"),
        ("sync", {"hierarchical": 2, "algorithm": "ring"}, "not both"),
        ("gossip", {}, "degree"),
        ("gossip", {"degree": 4}, "degree"),
        ("gossip", {"degree": 2, "peers_per_round": 3}, "peers_per_round"),
        ("push-sum", {"send_probability": 0}, "send_probability"),
        ("async-ps", {"servers": 1.5}, "servers"),
        ("ea-wild", {"tau": 1, "group_size": 8}, "group_size"),
    ],
)
def test_step_cost_rejects_bad_strategies_and_options(strategy, options, message):
    with pytest.raises(ConfigError, match=message):
        cost(strategy, **options)


def test_step_cost_rejects_negative_compute_time():
    with pytest.raises(ConfigError, match="compute_s"):
        cost("sync", compute_s=-1.0)


def test_rank_by_epoch_time_orders_fastest_first():
    ssp = {"exchange": "all-reduce"}
    costs = {name: cost(name, **opts) for name, opts in [("sync", {}), ("ssp", ssp), ("async-ps", {})]}
    assert rank_by_epoch_time(costs, 100) == ["ssp", "sync", "async-ps"]
    # With per-variant steps (e.g. different batch sizes) fewer, slower steps can win.
    assert rank_by_epoch_time(costs, {"sync": 10, "ssp": 100, "async-ps": 1})[0] == "async-ps"
    with pytest.raises(ConfigError, match="ssp"):
        rank_by_epoch_time(costs, {"sync": 10, "async-ps": 1})


def test_flops_of_a_linear_layer_are_two_per_multiply_add_times_three_for_training():
    assert forward_flops_per_sample(nn.Linear(100, 10), (100,)) == 2 * 100 * 10
    assert flops_per_sample(nn.Linear(100, 10), (100,)) == 3 * 2 * 100 * 10


def test_flops_of_a_convolution():
    # An 8x8 output map of 8 channels, each value 3·3·3 multiply-adds; bias not counted.
    assert forward_flops_per_sample(nn.Conv2d(3, 8, 3), (3, 10, 10)) == 2 * 8 * 8 * 8 * 3 * 3 * 3


def test_flops_of_an_lstm_count_its_four_gates_at_every_step():
    torch.set_num_threads(1)
    lstm = nn.LSTM(20, 30, batch_first=True)
    lstm.train()
    # 5 steps, 4 gates of 30 units, each reading 20 inputs and 30 hidden values.
    assert forward_flops_per_sample(lstm, (5, 20)) == 2 * 5 * 4 * 30 * (20 + 30)
    assert lstm.training and torch.backends.mkldnn.enabled


def test_compute_communication_ratio_is_forward_flops_per_parameter():
    model = nn.Sequential(nn.Linear(100, 10), nn.ReLU(), nn.Linear(10, 2))
    parameters = 100 * 10 + 10 + 10 * 2 + 2
    assert compute_communication_ratio(model, (100,)) == pytest.approx(2 * (100 * 10 + 10 * 2) / parameters)
    with pytest.raises(ConfigError, match="no trainable parameters"):
        compute_communication_ratio(nn.ReLU(), (3,))
