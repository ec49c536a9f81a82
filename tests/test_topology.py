"""Tests for fast.topology: the built-in graphs, mixing weights, failures, schedules and gossip averaging."""

import networkx
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fast.errors import ConfigError
from fast.topology import (
    Topology,
    complete,
    exponential,
    exponential_one_peer,
    format_topology,
    from_edges,
    from_networkx,
    parse_schedule,
    parse_topology,
    random_matchings,
    random_regular,
    ring,
    star,
    torus,
)

BUILT_IN = ["complete", "ring", "torus:3x4", "exponential", "star", "random-regular:3", "random-regular:2"]


def assert_good_mixing(topology: Topology) -> None:
    """Symmetric, doubly stochastic, supported on channels and the diagonal, dead rows identity."""
    w = topology.weights
    assert w.dtype == torch.float64
    torch.testing.assert_close(w, w.T)
    torch.testing.assert_close(w.sum(dim=1), torch.ones(topology.size, dtype=torch.float64))
    assert (w >= 0).all()
    for i in range(topology.size):
        for j in range(topology.size):
            if i != j and j not in topology.neighbors(i):
                assert w[i, j] == 0
    for rank in topology.dead:
        assert w[rank, rank] == 1
    topology.check_mixing()


def torus_neighbours(rows: int, cols: int, rank: int) -> list[int]:
    i, j = divmod(rank, cols)
    around = {((i + di) % rows) * cols + (j + dj) % cols for di, dj in ((1, 0), (-1, 0), (0, 1), (0, -1))}
    return sorted(around - {rank})


@pytest.mark.parametrize("rows, cols", [(4, 4), (2, 2), (2, 4), (3, 3), (1, 5), (3, 2)])
def test_torus_neighbours_are_the_four_grid_neighbours_with_wraparound(rows, cols):
    topology = torus(rows, cols)
    assert topology.size == rows * cols
    assert topology.name == f"torus:{rows}x{cols}"
    for rank in range(rows * cols):
        assert topology.neighbors(rank) == torus_neighbours(rows, cols, rank)


def test_torus_4x4_explicit_neighbours_and_gap():
    topology = torus(4, 4)
    assert topology.neighbors(0) == [1, 3, 4, 12]
    assert topology.neighbors(5) == [1, 4, 6, 9]
    assert len(topology.edges) == 32
    assert topology.weight(0, 1) == pytest.approx(0.2)
    # W = (I + A) / 5 with torus eigenvalues in {4, 2, 0, -2, -4}: second largest |eigenvalue| is 3/5.
    assert topology.spectral_gap() == pytest.approx(0.4)


def test_small_tori_deduplicate_wrapped_neighbours():
    assert torus(2, 2).neighbors(0) == [1, 2]
    assert torus(2, 4).neighbors(0) == [1, 3, 4]
    assert torus(1, 1).edges == frozenset()
    assert torus(1, 2).edges == frozenset({(0, 1)})


def test_ring():
    topology = ring(6)
    assert [topology.neighbors(r) for r in (0, 3, 5)] == [[1, 5], [2, 4], [0, 4]]
    assert ring(2).edges == frozenset({(0, 1)})
    assert ring(1).edges == frozenset()
    assert ring(1).spectral_gap() == 1.0


def test_exponential_of_8_links_distances_1_2_4_both_ways():
    topology = exponential(8)
    assert topology.neighbors(0) == [1, 2, 4, 6, 7]
    assert topology.neighbors(3) == [1, 2, 4, 5, 7]
    assert exponential(5).neighbors(0) == [1, 2, 3, 4]  # hops 1, 2 both ways
    assert exponential(2).edges == frozenset({(0, 1)})


def test_star_and_complete():
    topology = star(5)
    assert topology.neighbors(0) == [1, 2, 3, 4]
    assert all(topology.neighbors(leaf) == [0] for leaf in range(1, 5))
    assert topology.weight(0, 3) == pytest.approx(1 / 5)
    assert topology.weight(3, 3) == pytest.approx(4 / 5)
    whole = complete(4)
    assert len(whole.edges) == 6
    torch.testing.assert_close(whole.weights, torch.full((4, 4), 0.25, dtype=torch.float64))
    assert whole.spectral_gap() == pytest.approx(1.0)


def test_random_regular_is_regular_connected_and_seeded():
    first = random_regular(12, 3, seed=7)
    assert all(len(first.neighbors(r)) == 3 for r in range(12))
    assert first.is_connected()
    assert random_regular(12, 3, seed=7).edges == first.edges
    assert any(random_regular(12, 3, seed=s).edges != first.edges for s in range(1, 5))
    assert parse_topology("random-regular:3", 12, seed=7).edges == first.edges


@pytest.mark.parametrize("spec", BUILT_IN)
@pytest.mark.parametrize("weights", ["metropolis", "uniform"])
def test_built_ins_are_symmetric_doubly_stochastic_with_gap_in_0_1(spec, weights):
    topology = parse_topology(spec, 12, weights=weights)
    assert topology.weighting == weights
    assert topology.is_connected()
    assert_good_mixing(topology)
    assert 0 < topology.spectral_gap() <= 1


def test_metropolis_and_uniform_weights_on_an_irregular_graph():
    topology = from_edges(4, [[0, 1], [1, 2], [1, 3]])  # degrees 1, 3, 1, 1
    assert topology.weight(0, 1) == pytest.approx(1 / 4)
    assert topology.weight(0, 0) == pytest.approx(3 / 4)
    assert topology.weight(1, 1) == pytest.approx(1 / 4)
    flat = from_edges(4, [[0, 1], [1, 2], [1, 3]], weights="uniform")
    assert flat.weight(0, 1) == pytest.approx(1 / 4)
    assert_good_mixing(flat)


@pytest.mark.parametrize("spec", ["complete", "ring", "torus:2x4", "exponential", "star", "random-regular:3"])
def test_gossip_averaging_converges_to_the_mean(spec):
    topology = parse_topology(spec, 8)
    values = torch.randn(8, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    mean = values.mean(dim=0)
    for _ in range(300):
        values = topology.weights @ values
        torch.testing.assert_close(values.mean(dim=0), mean)
    torch.testing.assert_close(values, mean.expand(8, 3), atol=1e-8, rtol=0)


@pytest.mark.parametrize(
    "edges, message",
    [
        ([[0, 1], [2, 3]], "disconnected"),
        ([[0, 1], [1, 4]], "worker 4"),
        ([[0, 1], [1, 1], [1, 2], [2, 3]], "self loop"),
        ([[0, 1, 2]], "pair"),
    ],
)
def test_bad_edge_lists_raise_config_error(edges, message):
    with pytest.raises(ConfigError, match=message):
        parse_topology(edges, 4)


def test_torus_size_mismatch_names_the_key_and_the_fix():
    with pytest.raises(ConfigError, match=r"strategy\.topology.*16 workers.*8.*'torus:2x4'"):
        parse_topology("torus:4x4", 8)
    with pytest.raises(ConfigError, match="torus:RxC"):
        parse_topology("torus", 8)


@pytest.mark.parametrize("spec", ["hypercube", "random-regular:x", 42])
def test_unknown_specs_raise_config_error(spec):
    with pytest.raises(ConfigError, match="strategy.topology"):
        parse_topology(spec, 8)


def test_impossible_random_regular_and_weights_raise_config_error():
    for spec in ["random-regular:3", "random-regular:9", "random-regular:1"]:
        with pytest.raises(ConfigError, match="random-regular"):
            parse_topology(spec, 9 if spec != "random-regular:1" else 4)
    with pytest.raises(ConfigError, match="metropolis"):
        ring(4, weights="max-degree")


def test_check_mixing_rejects_bad_hand_made_weights():
    edges = frozenset({(0, 1), (1, 2)})
    good = torch.tensor([[0.5, 0.5, 0], [0.5, 0.25, 0.25], [0, 0.25, 0.75]], dtype=torch.float64)
    Topology(3, edges, good, "hand", "custom").check_mixing()
    not_symmetric = good.clone()
    not_symmetric[0, 1], not_symmetric[0, 0] = 0.4, 0.6
    off_channel = good.clone()
    off_channel[0, 2] = off_channel[2, 0] = 0.25
    off_channel[0, 0], off_channel[2, 2] = 0.25, 0.5
    not_stochastic = good * 1.1
    for weights, message in [
        (not_symmetric, "not symmetric"),
        (off_channel, "no channel"),
        (not_stochastic, "doubly stochastic"),
    ]:
        with pytest.raises(ConfigError, match=message):
            Topology(3, edges, weights, "hand", "custom").check_mixing()


def test_without_recomputes_weights_on_the_survivors():
    topology = torus(4, 4).without([5])
    assert topology.size == 16
    assert topology.dead == frozenset({5})
    assert topology.neighbors(5) == []
    assert 5 not in topology.neighbors(1)
    assert topology.weight(1, 1) == pytest.approx(0.4)  # degree 3 next to degree-4 neighbours
    assert_good_mixing(topology)
    again = topology.without([10])
    assert again.dead == frozenset({5, 10})
    assert_good_mixing(again)
    assert 0 < again.spectral_gap() < 1
    assert "dead" in again.describe()


def test_without_on_hand_made_weights_folds_lost_weight_onto_the_diagonal():
    w = torch.tensor([[0.5, 0.25, 0.25], [0.25, 0.5, 0.25], [0.25, 0.25, 0.5]], dtype=torch.float64)
    hand_made = Topology(3, frozenset({(0, 1), (1, 2), (0, 2)}), w, "hand")
    assert hand_made.weighting == "custom"
    survivors = hand_made.without([2])
    expected = torch.tensor([[0.75, 0.25, 0], [0.25, 0.75, 0], [0, 0, 1]], dtype=torch.float64)
    torch.testing.assert_close(survivors.weights, expected)
    assert_good_mixing(survivors)


def test_without_raises_when_survivors_are_disconnected():
    with pytest.raises(ConfigError, match="disconnected"):
        ring(6).without([0, 3])
    with pytest.raises(ConfigError, match="disconnected"):
        star(5).without([0])
    with pytest.raises(ConfigError, match="every worker"):
        ring(2).without([0, 1])


@settings(max_examples=40, deadline=None)
@given(
    size=st.integers(2, 9),
    extra=st.lists(st.tuples(st.integers(0, 8), st.integers(0, 8)), max_size=20),
    dead=st.sets(st.integers(0, 8), max_size=4),
    weights=st.sampled_from(["metropolis", "uniform"]),
)
def test_any_connected_graph_and_any_failures_keep_the_mixing_properties(size, extra, dead, weights):
    path = [(i, i + 1) for i in range(size - 1)]
    edges = path + [(i % size, j % size) for i, j in extra if i % size != j % size]
    topology = from_edges(size, edges, weights=weights)
    assert_good_mixing(topology)
    dead = {rank % size for rank in dead}
    try:
        survivors = topology.without(dead)
    except ConfigError:
        assert len(dead) == size or not _connected_without(size, edges, dead)
        return
    assert survivors.weighting == weights
    assert_good_mixing(survivors)
    assert 0 < survivors.spectral_gap() <= 1


def _connected_without(size, edges, dead):
    graph = networkx.Graph([(i, j) for i, j in edges if i not in dead and j not in dead])
    graph.add_nodes_from(r for r in range(size) if r not in dead)
    return networkx.is_connected(graph)


def test_networkx_graphs():
    grid = from_networkx(networkx.grid_2d_graph(4, 4, periodic=True))  # (i, j) labels, rank i * 4 + j
    assert grid.edges == torus(4, 4).edges
    petersen = parse_topology(networkx.petersen_graph(), 10)
    assert all(len(petersen.neighbors(r)) == 3 for r in range(10))
    assert_good_mixing(petersen)
    with pytest.raises(ConfigError, match="disconnected"):
        from_networkx(networkx.empty_graph(3))
    with pytest.raises(ConfigError, match="directed"):
        from_networkx(networkx.DiGraph([(0, 1)]))
    with pytest.raises(ConfigError, match="10 workers"):
        parse_topology(networkx.petersen_graph(), 8)


def test_format_topology_prints_neighbours_weights_and_gap():
    text = format_topology("torus:4x4", None)
    assert "16 workers" in text
    assert "0  self 0.2000  neighbours: 1 (0.2000), 3 (0.2000), 4 (0.2000), 12 (0.2000)" in text
    assert "spectral gap: 0.400000" in text
    assert "ring" in format_topology("ring", 5)
    with pytest.raises(ConfigError, match="--workers"):
        format_topology("ring", None)


def test_exponential_one_peer_cycles_through_hops():
    schedule = exponential_one_peer(8)
    assert schedule.period == 3
    assert [schedule.send_to(0, r) for r in range(4)] == [[1], [2], [4], [1]]
    assert [schedule.receive_from(0, r) for r in range(3)] == [[7], [6], [4]]
    for r in range(6):
        for rank in range(8):
            (target,) = schedule.send_to(rank, r)
            assert rank in schedule.receive_from(target, r)
    assert exponential_one_peer(1).peers(0, 5) == []
    assert parse_schedule("exponential-one-peer", 8).send_to(3, 1) == [5]


def test_exponential_one_peer_averages_exactly_in_log2_n_rounds_for_a_power_of_two():
    schedule = exponential_one_peer(8)
    product = torch.eye(8, dtype=torch.float64)
    for r in range(3):
        w = schedule.mixing_matrix(r)
        torch.testing.assert_close(w.sum(dim=0), torch.ones(8, dtype=torch.float64))
        torch.testing.assert_close(w.sum(dim=1), torch.ones(8, dtype=torch.float64))
        product = w @ product
    torch.testing.assert_close(product, torch.full((8, 8), 1 / 8, dtype=torch.float64))


def test_random_matchings_are_symmetric_perfect_and_seeded():
    schedule = random_matchings(7, seed=3)
    for r in range(10):
        left_out = [rank for rank in range(7) if not schedule.peers(rank, r)]
        assert len(left_out) == 1
        for rank in range(7):
            for peer in schedule.peers(rank, r):
                assert schedule.peers(peer, r) == [rank]
                assert schedule.send_to(rank, r) == schedule.receive_from(rank, r)
        w = schedule.mixing_matrix(r)
        torch.testing.assert_close(w, w.T)
    again = random_matchings(7, seed=3)
    assert all(again.peers(k, r) == schedule.peers(k, r) for k in range(7) for r in range(10))
    other = parse_schedule("random-matchings", 7, seed=4)
    assert any(other.peers(k, r) != schedule.peers(k, r) for k in range(7) for r in range(10))
    with pytest.raises(ConfigError, match="random-matchings"):
        parse_schedule("one-peer", 8)


@pytest.mark.parametrize("schedule", [random_matchings(10, seed=1), exponential_one_peer(10)])
def test_time_varying_gossip_converges_to_the_mean_also_after_failures(schedule):
    for current in (schedule, schedule.without([2, 7])):
        alive = torch.tensor(current.alive)
        values = torch.randn(10, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        mean = values[alive].mean()
        for r in range(200):
            assert all(current.peers(dead, r) == [] for dead in current.dead)
            values = current.mixing_matrix(r) @ values
        torch.testing.assert_close(values[alive], mean.expand(len(alive)), atol=1e-8, rtol=0)
