"""Who talks in each round of a gossip, and with what weights: one plan per round for a fixed topology (with
partial and probabilistic communication) or for a time-varying schedule, the same on every worker.

Every worker gets the same answer from the plan's inputs and the run's seed alone, so both ends of a channel
agree without a word. A dropped exchange must leave the mixing matrix W symmetric and doubly stochastic, so
both ends decide alike: a channel is up in round r when a draw seeded by (seed, r, min(i, j), max(i, j)) says
so (`send_probability`), and a channel that is down moves its weight W_ij onto the diagonal W_ii. With
`peers_per_round = k` each worker calls k random neighbours (a draw seeded by (seed, r, i) that its neighbours
can repeat), and a channel is up when either end called the other. Workers found dead are left out of the
next rounds: the topology is re-made without them (`Topology.without`), weights by the same rule.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from fast.topology.graph import Topology
from fast.topology.schedules import PeerSchedule


def seeded(*key: object) -> random.Random:
    """A generator every worker can rebuild from the same key (str seeds are hashed with SHA-512)."""
    return random.Random(":".join(map(str, ("fast.gossip", *key))))


@dataclass
class Round:
    """One worker's part of a round: whom it sends to, whose values it takes and with what weight, and the
    weight it keeps of its own."""

    sends: list[int]
    takes: dict[int, float]
    keep: float


class Rounds:
    """The plan of every round: over `topology` (indices 0..n-1), or the time-varying `schedule` instead."""

    def __init__(
        self,
        topology: Topology | None,
        schedule: PeerSchedule | None,
        seed: int,
        send_probability: float = 1.0,
        peers_per_round: int | None = None,
    ) -> None:
        self.topology, self.schedule, self.seed = topology, schedule, seed
        self.send_probability, self.peers_per_round = send_probability, peers_per_round
        self.dead: set[int] = set()

    def forget(self, dead: set[int]) -> None:
        """Plan the next rounds without workers `dead` (topology indices) and their channels."""
        self.dead |= dead
        if self.topology is not None:
            self.topology = self.topology.without(self.dead)

    def describe(self) -> str:
        return self.schedule.name if self.schedule is not None else self.topology.name

    def _channel_up(self, round: int, i: int, j: int) -> bool:
        p = self.send_probability
        return p >= 1 or seeded("channel", self.seed, round, min(i, j), max(i, j)).random() < p

    def _calls(self, round: int, i: int) -> list[int]:
        neighbours = self.topology.neighbors(i)
        k = min(self.peers_per_round, len(neighbours))
        return seeded("calls", self.seed, round, i).sample(neighbours, k)

    def _talks(self, round: int, i: int, j: int) -> bool:
        called = self.peers_per_round is None or j in self._calls(round, i) or i in self._calls(round, j)
        return called and self._channel_up(round, i, j)

    def plan(self, i: int, round: int) -> Round:
        """Worker i's part of round `round` (topology indices, not global ranks)."""
        if self.schedule is not None:
            sends, sources = self.schedule.send_to(i, round), self.schedule.receive_from(i, round)
            sends = [j for j in sends if j not in self.dead]
            sources = [j for j in sources if j not in self.dead]
            if self.schedule.symmetric and sources and not self._channel_up(round, i, sources[0]):
                sends, sources = [], []
            share = 1.0 / (1 + len(sources))
            return Round(sends, dict.fromkeys(sources, share), share)
        neighbours = self.topology.neighbors(i)
        up = [j for j in neighbours if self._talks(round, i, j)]
        keep = self.topology.weight(i, i) + sum(self.topology.weight(i, j) for j in neighbours if j not in up)
        return Round(up, {j: self.topology.weight(i, j) for j in up}, keep)
