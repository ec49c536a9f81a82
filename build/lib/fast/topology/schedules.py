"""Time-varying topologies: which peers each worker exchanges with in each round, and that round's W.

Every worker computes the schedule on its own from (size, seed, round) and gets the same answer, so no
coordination is needed to agree on who talks to whom.

Direction: in round r worker i *sends* its value to `send_to(i, r)` and *receives* from
`receive_from(i, r)`; it then averages itself with what it received, with the weights in row i of
`mixing_matrix(r)` (1 / (1 + number received) each). `peers(i, r)` is everyone i exchanges with in
either direction. In a symmetric schedule (random matchings) send_to == receive_from.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Iterable
from functools import lru_cache

import torch

from fast.errors import ConfigError


class PeerSchedule(ABC):
    """Per-round peers over workers 0..size-1; `dead` workers take no part (no peers, identity row)."""

    name: str
    symmetric: bool

    def __init__(self, size: int, dead: Iterable[int] = ()) -> None:
        if size < 1:
            raise ConfigError(f"schedule {self.name!r} needs at least one worker, got {size}")
        self.size = size
        self.dead = frozenset(dead)
        if any(not 0 <= rank < size for rank in self.dead):
            raise ValueError(f"dead workers {sorted(self.dead)} are not all in 0..{size - 1}")
        if len(self.dead) == size:
            raise ConfigError(f"schedule {self.name!r}: every worker is dead, there is nothing left to train")
        self.alive = tuple(rank for rank in range(size) if rank not in self.dead)

    def __repr__(self) -> str:
        dead = f", dead={sorted(self.dead)}" if self.dead else ""
        return f"{type(self).__name__}(size={self.size}{dead})"

    def _check(self, rank: int, round: int) -> None:
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is not a worker of schedule {self.name!r} (0..{self.size - 1})")
        if round < 0:
            raise ValueError(f"round must be >= 0, got {round}")

    @abstractmethod
    def send_to(self, rank: int, round: int) -> list[int]:
        """The workers `rank` sends its value to in `round`."""

    @abstractmethod
    def receive_from(self, rank: int, round: int) -> list[int]:
        """The workers whose values `rank` receives and averages with in `round`."""

    @abstractmethod
    def without(self, dead: Iterable[int]) -> PeerSchedule:
        """The same schedule run by the surviving workers only."""

    def peers(self, rank: int, round: int) -> list[int]:
        """Everyone `rank` exchanges with in `round`, in either direction, sorted."""
        return sorted(set(self.send_to(rank, round)) | set(self.receive_from(rank, round)))

    def mixing_matrix(self, round: int) -> torch.Tensor:
        """W for `round`: worker i averages itself and what it received with equal weights.

        Doubly stochastic, because every live worker receives from as many as it sends to.
        """
        weights = torch.eye(self.size, dtype=torch.float64)
        for rank in self.alive:
            sources = self.receive_from(rank, round)
            share = 1.0 / (1 + len(sources))
            weights[rank, rank] = share
            weights[rank, sources] = share
        return weights


class ExponentialOnePeer(PeerSchedule):
    """One peer per round, cycling through the exponential distances 1, 2, 4, ... < n.

    In round r, with hop = 2^(r mod ceil(log2 n)), the worker at position p among the live workers
    sends to position p + hop and receives from position p - hop (mod the number of live workers).
    Directed: send_to and receive_from differ unless hop = n / 2. For n a power of two, ceil(log2 n)
    consecutive rounds average exactly (their W's commute and multiply to the mean).
    """

    name = "exponential-one-peer"
    symmetric = False

    @property
    def period(self) -> int:
        """How many rounds before the hops repeat: ceil(log2 of the live worker count)."""
        return (len(self.alive) - 1).bit_length()

    def _neighbour(self, rank: int, round: int, direction: int) -> list[int]:
        self._check(rank, round)
        if rank in self.dead or self.period == 0:
            return []
        hop = 2 ** (round % self.period)
        position = self.alive.index(rank)
        return [self.alive[(position + direction * hop) % len(self.alive)]]

    def send_to(self, rank: int, round: int) -> list[int]:
        return self._neighbour(rank, round, +1)

    def receive_from(self, rank: int, round: int) -> list[int]:
        return self._neighbour(rank, round, -1)

    def without(self, dead: Iterable[int]) -> ExponentialOnePeer:
        return ExponentialOnePeer(self.size, self.dead | frozenset(dead))


@lru_cache(maxsize=64)
def _matching(alive: tuple[int, ...], seed: int, round: int) -> dict[int, int]:
    order = list(alive)
    random.Random(f"fast.topology.random_matchings:{seed}:{round}").shuffle(order)
    partner = {}
    for a, b in zip(order[0::2], order[1::2], strict=False):
        partner[a] = b
        partner[b] = a
    return partner


class RandomMatchings(PeerSchedule):
    """Each round a random perfect matching of the live workers (one left out when their number is odd).

    The matching depends only on (seed, round, live workers), so every worker draws the same one. Each
    matched pair averages its two values: symmetric, send_to == receive_from.
    """

    name = "random-matchings"
    symmetric = True

    def __init__(self, size: int, seed: int = 0, dead: Iterable[int] = ()) -> None:
        super().__init__(size, dead)
        self.seed = seed

    def partner(self, rank: int, round: int) -> int | None:
        """Who `rank` is paired with in `round`, or None when it sits the round out."""
        self._check(rank, round)
        return _matching(self.alive, self.seed, round).get(rank)

    def send_to(self, rank: int, round: int) -> list[int]:
        partner = self.partner(rank, round)
        return [] if partner is None else [partner]

    receive_from = send_to

    def without(self, dead: Iterable[int]) -> RandomMatchings:
        return RandomMatchings(self.size, self.seed, self.dead | frozenset(dead))


def exponential_one_peer(n: int) -> ExponentialOnePeer:
    """Round r: send to (rank + 2^(r mod ceil(log2 n))) mod n, receive from (rank - that) mod n."""
    return ExponentialOnePeer(n)


def random_matchings(n: int, seed: int = 0) -> RandomMatchings:
    """Round r: a seeded random perfect matching of the n workers, the same on every worker."""
    return RandomMatchings(n, seed)
