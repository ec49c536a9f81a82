"""The Topology: who talks to whom, as data: workers, undirected channels and the mixing matrix W."""

from __future__ import annotations

import operator
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property

import torch

from fast.errors import ConfigError
from fast.topology import mixing


def canonical_edges(size: int, pairs: Iterable[Iterable[int]]) -> frozenset[tuple[int, int]]:
    """Validates an edge list over workers 0..size-1 and returns it as a set of (i, j) with i < j.

    Duplicates and both orientations of a channel collapse into one; self loops and workers out of
    range are a ConfigError.
    """
    edges = set()
    for pair in pairs:
        try:
            i, j = (operator.index(end) for end in pair)
        except (TypeError, ValueError):
            raise ConfigError(
                f"topology edge {pair!r} is not a pair of worker ranks: write each edge as [i, j]"
            ) from None
        for end in (i, j):
            if not 0 <= end < size:
                raise ConfigError(
                    f"topology edge [{i}, {j}] names worker {end} but the workers are 0..{size - 1}: "
                    "fix the edge list or the worker count"
                )
        if i == j:
            raise ConfigError(f"topology edge [{i}, {j}] is a self loop: remove it (a worker always keeps itself)")
        edges.add((min(i, j), max(i, j)))
    return frozenset(edges)


@dataclass(frozen=True, eq=False)
class Topology:
    """Workers 0..size-1, undirected channels `edges` (i < j) and the mixing matrix `weights`.

    Row i of `weights` is what worker i takes from each worker j when it averages with its neighbours:
    x_i <- sum_j W_ij x_j. `weighting` names the rule that made W ("metropolis", "uniform", or "custom"
    for a matrix given by hand); `without` applies it again after failures. Dead workers keep their
    index but have no channels, and their row and column of W are those of the identity.
    """

    size: int
    edges: frozenset[tuple[int, int]]
    weights: torch.Tensor
    name: str
    weighting: str = "custom"
    dead: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ConfigError(f"topology {self.name!r} needs at least one worker, got {self.size}")
        object.__setattr__(self, "edges", canonical_edges(self.size, self.edges))
        object.__setattr__(self, "dead", frozenset(self.dead))
        if any(not 0 <= rank < self.size for rank in self.dead):
            raise ValueError(f"dead workers {sorted(self.dead)} are not all in 0..{self.size - 1}")
        if any(i in self.dead or j in self.dead for i, j in self.edges):
            raise ValueError("a dead worker cannot keep channels: build the topology with Topology.without")
        weights = torch.as_tensor(self.weights, dtype=torch.float64)
        if weights.shape != (self.size, self.size):
            raise ConfigError(
                f"topology {self.name!r}: mixing matrix has shape {tuple(weights.shape)}, "
                f"expected ({self.size}, {self.size})"
            )
        object.__setattr__(self, "weights", weights)

    def __repr__(self) -> str:
        dead = f", dead={sorted(self.dead)}" if self.dead else ""
        return f"Topology({self.name!r}, size={self.size}, edges={len(self.edges)}, {self.weighting}{dead})"

    @property
    def alive(self) -> list[int]:
        """The ranks still in the topology, sorted."""
        return [rank for rank in range(self.size) if rank not in self.dead]

    @cached_property
    def _adjacency(self) -> tuple[tuple[int, ...], ...]:
        neighbours: list[list[int]] = [[] for _ in range(self.size)]
        for i, j in self.edges:
            neighbours[i].append(j)
            neighbours[j].append(i)
        return tuple(tuple(sorted(ranks)) for ranks in neighbours)

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is not a worker of topology {self.name!r} (0..{self.size - 1})")

    def neighbors(self, rank: int) -> list[int]:
        """The workers `rank` has a channel with, sorted (itself excluded; empty for a dead worker)."""
        self._check_rank(rank)
        return list(self._adjacency[rank])

    def degree(self, rank: int) -> int:
        self._check_rank(rank)
        return len(self._adjacency[rank])

    @cached_property
    def _rows(self) -> list[list[float]]:
        """W as Python numbers, read once: the rounds of every step ask for weights, and read no tensor."""
        return self.weights.tolist()

    def weight(self, i: int, j: int) -> float:
        """W_ij: the share of worker j's value that worker i takes when it averages."""
        self._check_rank(i)
        self._check_rank(j)
        return self._rows[i][j]

    def unreachable(self) -> list[int]:
        """The live workers that cannot be reached from the lowest live rank (empty when connected)."""
        alive = self.alive
        seen = {alive[0]}
        frontier = [alive[0]]
        while frontier:
            rank = frontier.pop()
            for neighbour in self._adjacency[rank]:
                if neighbour not in seen:
                    seen.add(neighbour)
                    frontier.append(neighbour)
        return [rank for rank in alive if rank not in seen]

    def is_connected(self) -> bool:
        """Whether every live worker can reach every other through channels of live workers."""
        return not self.unreachable()

    @cached_property
    def _spectral_gap(self) -> float:
        alive = torch.tensor(self.alive)
        if len(alive) == 1:
            return 1.0
        eigenvalues = torch.linalg.eigvalsh(self.weights[alive][:, alive])  # ascending
        second_largest = max(abs(eigenvalues[0].item()), abs(eigenvalues[-2].item()))
        return min(1.0, max(0.0, 1.0 - second_largest))

    def spectral_gap(self) -> float:
        """1 - the second largest |eigenvalue| of W over the live workers: the larger, the faster averaging.

        Gossip averaging shrinks the distance to the mean by a factor of about (1 - gap) per round.
        """
        return self._spectral_gap

    def check_mixing(self) -> None:
        """ConfigError unless the live graph is connected and W symmetric, doubly stochastic, on channels."""
        unreachable = self.unreachable()
        if unreachable:
            raise ConfigError(
                f"topology {self.name!r} is disconnected: workers {_short(unreachable)} cannot reach worker "
                f"{self.alive[0]}: add channels (edges) that join them"
            )
        label = f"topology {self.name!r}"
        mixing.check_mixing_matrix(self.weights, self.edges, label)
        for rank in self.dead:
            if self.weights[rank, rank] != 1.0:
                raise ConfigError(f"{label}: dead worker {rank} must keep W[{rank},{rank}] = 1")

    def without(self, dead: Iterable[int]) -> Topology:
        """The topology after workers `dead` failed: same size and indices, their channels dropped.

        The survivors' weights come from the same rule applied to the surviving graph (a hand-made W
        instead moves each lost weight W_ij onto W_ii, which keeps it symmetric and doubly stochastic).
        Raises ConfigError when no worker survives or the survivors are split into parts.
        """
        lost = frozenset(dead)
        for rank in lost:
            self._check_rank(rank)
        all_dead = self.dead | lost
        if len(all_dead) == self.size:
            raise ConfigError(f"topology {self.name!r}: every worker is dead, there is nothing left to train")
        edges = frozenset((i, j) for i, j in self.edges if i not in all_dead and j not in all_dead)
        if self.weighting in mixing.RULES:
            weights = mixing.mixing_matrix(self.weighting, self.size, edges)
        else:
            weights = self.weights.clone()
            gone = torch.tensor(sorted(all_dead))
            weights += torch.diag(weights[:, gone].sum(dim=1))
            weights[:, gone] = 0.0
            weights[gone, :] = 0.0
            weights[gone, gone] = 1.0
        survivors = Topology(self.size, edges, weights, self.name, self.weighting, all_dead)
        unreachable = survivors.unreachable()
        if unreachable:
            raise ConfigError(
                f"topology {self.name!r} without workers {_short(sorted(all_dead))} is disconnected: "
                f"workers {_short(unreachable)} cannot reach worker {survivors.alive[0]}; "
                "use a better connected topology (exponential, torus, complete)"
            )
        return survivors

    def describe(self) -> str:
        """A human-readable table: each worker's neighbours and weights, then the spectral gap."""
        edge_count = len(self.edges)
        lines = [
            f"topology {self.name}: {self.size} workers, {edge_count} channel{'s' * (edge_count != 1)}, "
            f"{self.weighting} weights"
        ]
        if self.dead:
            lines.append(f"dead workers: {', '.join(map(str, sorted(self.dead)))}")
        width = len(str(self.size - 1))
        for rank in range(self.size):
            if rank in self.dead:
                lines.append(f"  {rank:>{width}}  dead")
                continue
            peers = ", ".join(f"{j} ({self.weight(rank, j):.4f})" for j in self._adjacency[rank])
            lines.append(f"  {rank:>{width}}  self {self.weight(rank, rank):.4f}  neighbours: {peers or 'none'}")
        lines.append(f"spectral gap: {self.spectral_gap():.6f}  (1 - second largest |eigenvalue| of W)")
        return "\n".join(lines)


def _short(ranks: list[int], limit: int = 10) -> str:
    shown = ", ".join(map(str, ranks[:limit]))
    return f"[{shown}{', ...' if len(ranks) > limit else ''}]"
