"""The built-in topologies: complete, ring, torus, exponential, star, random regular, edge list, networkx."""

from __future__ import annotations

import random
from collections.abc import Iterable
from typing import TYPE_CHECKING

from fast.errors import ConfigError
from fast.topology import mixing
from fast.topology.graph import Topology, canonical_edges

if TYPE_CHECKING:
    import networkx

RANDOM_REGULAR_ATTEMPTS = 1000


def build(size: int, edges: Iterable[Iterable[int]], name: str, weights: str = "metropolis") -> Topology:
    """A checked Topology over workers 0..size-1 with the named mixing rule ("metropolis" or "uniform")."""
    if size < 1:
        raise ConfigError(f"topology {name!r} needs at least one worker, got {size}")
    channels = canonical_edges(size, edges)
    topology = Topology(size, channels, mixing.mixing_matrix(weights, size, channels), name, weights)
    topology.check_mixing()
    return topology


def complete(n: int, weights: str = "metropolis") -> Topology:
    """Every worker talks to every other."""
    return build(n, ((i, j) for i in range(n) for j in range(i + 1, n)), "complete", weights)


def ring(n: int, weights: str = "metropolis") -> Topology:
    """Worker i talks to i - 1 and i + 1 (mod n); two workers share a single channel."""
    return build(n, ((i, (i + 1) % n) for i in range(n) if n > 1), "ring", weights)


def torus(rows: int, cols: int, weights: str = "metropolis") -> Topology:
    """The 2D toroidal grid of Viviani et al., the extended design: worker (i, j), rank i * cols + j, talks to (i±1,
    j) and (i, j±1).

    Indices wrap around; in a dimension of width 2 the two wrapped neighbours are the same worker and of
    width 1 the worker itself, so those channels collapse (torus(1, n) is ring(n)).
    """
    if rows < 1 or cols < 1:
        raise ConfigError(f"torus:{rows}x{cols} needs at least one row and one column")

    def rank(i: int, j: int) -> int:
        return (i % rows) * cols + (j % cols)

    edges = [
        (rank(i, j), other)
        for i in range(rows)
        for j in range(cols)
        for other in (rank(i + 1, j), rank(i, j + 1))
        if other != rank(i, j)
    ]
    return build(rows * cols, edges, f"torus:{rows}x{cols}", weights)


def exponential(n: int, weights: str = "metropolis") -> Topology:
    """Worker i talks to i ± 2^k (mod n) for k = 0 .. floor(log2(n - 1)): O(log n) peers, fast mixing."""
    hops = [2**k for k in range((n - 1).bit_length())] if n > 1 else []
    return build(n, ((i, (i + hop) % n) for i in range(n) for hop in hops), "exponential", weights)


def star(n: int, weights: str = "metropolis") -> Topology:
    """Worker 0 is the hub and talks to every other worker; the others talk only to the hub."""
    return build(n, ((0, j) for j in range(1, n)), "star", weights)


def random_regular(n: int, k: int, seed: int = 0, weights: str = "metropolis") -> Topology:
    """A connected random k-regular graph, the same for the same (n, k, seed).

    Draws graphs from networkx's random_regular_graph with seeds derived from `seed` until one is
    connected, so every worker that calls it with the same arguments builds the same graph.
    """
    import networkx

    name = f"random-regular:{k}"
    if not 1 <= k < n:
        raise ConfigError(f"{name} needs 1 <= K < workers ({n}): choose a degree K between 1 and {n - 1}")
    if n * k % 2:
        raise ConfigError(f"{name} on {n} workers is impossible (workers x K must be even): choose an even K")
    if k == 1 and n > 2:
        raise ConfigError(f"{name} on {n} workers is a set of pairs, never connected: choose K >= 2")
    draws = random.Random(f"fast.topology.random_regular:{n}:{k}:{seed}")
    for _ in range(RANDOM_REGULAR_ATTEMPTS):
        graph = networkx.random_regular_graph(k, n, seed=draws.getrandbits(32))
        if networkx.is_connected(graph):
            return build(n, graph.edges(), name, weights)
    raise ConfigError(
        f"{name} on {n} workers: no connected graph in {RANDOM_REGULAR_ATTEMPTS} draws: choose a larger K"
    )


def from_edges(n: int, edges: Iterable[Iterable[int]], weights: str = "metropolis") -> Topology:
    """A user's undirected edge list over workers 0..n-1, e.g. [[0, 1], [1, 2], [2, 0]]."""
    return build(n, edges, "edges", weights)


def from_networkx(graph: networkx.Graph, weights: str = "metropolis") -> Topology:
    """An undirected networkx graph. Nodes 0..n-1 are ranks; other labels get ranks in sorted order.

    For example nx.grid_2d_graph(4, 4, periodic=True) labels (i, j) become ranks i * 4 + j.
    """
    import networkx

    if graph.is_directed():
        raise ConfigError("topology graph is directed: pass graph.to_undirected() (channels are two-way)")
    self_loops = list(networkx.selfloop_edges(graph))
    if self_loops:
        raise ConfigError(f"topology graph has self loop {self_loops[0]!r}: remove it (a worker keeps itself)")
    size = graph.number_of_nodes()
    if set(graph.nodes) != set(range(size)):
        try:
            order = sorted(graph.nodes)
        except TypeError:
            raise ConfigError(
                "topology graph nodes cannot be sorted into ranks: pass networkx.convert_node_labels_to_integers(graph)"
            ) from None
        graph = networkx.relabel_nodes(graph, {node: rank for rank, node in enumerate(order)})
    return build(size, graph.edges(), "networkx", weights)
