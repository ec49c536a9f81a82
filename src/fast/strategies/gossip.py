"""`gossip`: D-PSGD (Lian et al. 2017; paper 002 Sec. 3.4.2), and what the whole gossip family shares.

Each step every worker mixes its replica with its neighbours' through the mixing matrix W of the topology,
x_i <- sum_j W_ij x_j, and the optimizer then applies the gradient computed at the unmixed replica (the
paper's Algorithm 1). The exchange is posted before the forward pass and waited for after backward, so
communication overlaps the computation.

With a `[codec]`, gossip is CHOCO-SGD (Koloskova et al. 2019; `fast.comm.compressed.ChocoGossip`): after
each optimizer step a worker sends its neighbours the compressed difference between its model and its
public estimate, and moves towards their estimates with step `consensus_lr`. Compressing the weights
themselves would not converge. CHOCO needs a fixed W (a topology, every channel up every round) and a
codec without error feedback (the estimates already keep what was not sent).

Options shared by the family (gossip, ad-psgd, push-sum), declared in `PeerOptions`:

- `topology`: a spec for `parse_topology` ("ring", "torus:RxC", "exponential", ...) or an edge list;
- `schedule`: "exponential-one-peer" | "random-matchings", a time-varying peer choice that replaces the
  topology in each round;
- `send_probability`: the probability that an exchange HAPPENS (papers 000/001, incomplete topology
  training); 1 - send_probability is its drop rate;
- `peers_per_round`: how many random neighbours a worker calls per round.

In D-PSGD a dropped exchange must leave W symmetric and doubly stochastic, so both ends of a channel decide
alike: each channel is up in round r when a draw seeded by (seed, r, min(i, j), max(i, j)) says so, and a
channel that is down moves its weight W_ij onto the diagonal W_ii. With `peers_per_round = k` each worker
calls k random neighbours (a draw seeded by (seed, r, i) that its neighbours can repeat), and a channel is
up when either end called the other.

A worker that dies (D-PSGD without a codec) is noticed by its neighbours when their exchange with it fails
(the connection closes, or the deadline passes): they record it, move its weight for that round onto their
own, and from the next round mix on `Topology.without(dead)` (weights re-made by the same rule, so W stays
symmetric and doubly stochastic over the survivors). Every message carries its sender's list of the dead,
so the news reaches the workers that are not the dead one's neighbours within a few rounds. CHOCO-SGD keeps
estimates of fixed neighbours and does not survive a death.

On an emulated lossy link (`[network] loss`, or a link that is down) D-PSGD's messages are droppable: a
worker whose neighbour's message was lost keeps that neighbour's share of the round on its own replica, as
for a channel that is down. The other end may have received its message and mixed, so in that round W is
row-stochastic but not symmetric; the average drifts by what the two replicas differed, and consensus still
holds. The summary counts `lost_messages`.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import Field
from torch import nn

from fast.codecs import ErrorFeedback, build_codec
from fast.comm import Handle, MessageLost
from fast.comm.channel import PatientChannel
from fast.comm.compressed import ChocoGossip, worker_codec
from fast.config import Config
from fast.errors import CommError, ConfigError
from fast.strategies.base import Strategy, StrategyContext, StrategyOptions
from fast.strategies.flat import FlatState
from fast.topology import PeerSchedule, Topology, parse_schedule, parse_topology

Schedule = Literal["exponential-one-peer", "random-matchings"]


class PeerOptions(StrategyOptions):
    """Who may talk to whom, and how much of that talk happens (the gossip family's keys)."""

    topology: str | list[list[int]] = Field(
        "ring",
        description='"ring", "torus:RxC", "exponential", "complete", "star", "random-regular:K" or [[i, j]]',
    )
    schedule: Schedule | None = Field(None, description="time-varying peers that replace the topology per round")
    send_probability: float = Field(1.0, ge=0, le=1, description="probability that an exchange happens")
    peers_per_round: int | None = Field(None, ge=1, description="random neighbours called per round; None = all")


class GossipOptions(PeerOptions):
    weights: Literal["metropolis", "uniform"] = Field("metropolis", description="the mixing rule for W")
    consensus_lr: float = Field(0.5, gt=0, le=1, description="CHOCO-SGD's consensus step size (with a codec)")


def build_topology(options: PeerOptions, workers: int, seed: int, weights: str = "metropolis") -> Topology:
    """The topology the options name, over `workers`; every problem is a ConfigError naming the key."""
    spec = options.topology
    if isinstance(spec, list):
        try:
            named = 1 + max((int(end) for edge in spec for end in edge), default=-1)
        except (TypeError, ValueError):
            named = workers  # not a list of pairs: parse_topology says what is wrong
        if named != workers:
            raise ConfigError(
                f"`strategy.topology` edge list names workers 0..{named - 1} but run.workers = {workers}: "
                "give every worker a channel or change run.workers"
            )
    try:
        return parse_topology(spec, workers, weights=weights, seed=seed)
    except ConfigError as e:
        if "strategy.topology" in str(e):
            raise
        raise ConfigError(f"`strategy.topology`: {e}") from None


def check_peer_options(options: PeerOptions, config: Config) -> None:
    """ConfigError for a topology that does not fit the run, or a schedule combined with what it replaces."""
    if options.schedule is None:
        build_topology(options, config.run.workers, config.run.seed, getattr(options, "weights", "metropolis"))
        return
    for key in ("topology", "peers_per_round"):
        if key in options.model_fields_set:
            raise ConfigError(
                f"`strategy.{key}` and `strategy.schedule` are both set: the schedule chooses the peers of "
                "every round, so remove one of them"
            )


class RandomPeers:
    """Whom an asynchronous worker contacts after a step (ad-psgd, push-sum): with `send_probability`, the
    schedule's peer of that round or `peers_per_round` random neighbours. Ranks returned are global."""

    def __init__(self, options: PeerOptions, ctx: StrategyContext) -> None:
        self.ranks = ctx.comm.ranks
        self.me = ctx.comm.index()
        self.probability = options.send_probability
        self.count = options.peers_per_round or 1
        self.generator = ctx.generator
        self.schedule: PeerSchedule | None = None
        self.topology: Topology | None = None
        seed = ctx.config.run.seed
        if options.schedule is not None:
            self.schedule = parse_schedule(options.schedule, len(self.ranks), seed=seed)
            others = [j for j in range(len(self.ranks)) if j != self.me]
            self.targets_ever = self.sources_ever = [self.ranks[j] for j in others]
        else:
            self.topology = build_topology(options, len(self.ranks), seed)
            neighbours = self.topology.neighbors(self.me)
            self.targets_ever = self.sources_ever = [self.ranks[j] for j in neighbours]

    def describe(self) -> str:
        return self.schedule.name if self.schedule is not None else self.topology.name

    def targets(self, step: int) -> list[int]:
        if torch.rand((), generator=self.generator).item() >= self.probability:
            return []
        if self.schedule is not None:
            return [self.ranks[j] for j in self.schedule.send_to(self.me, step)]
        neighbours = self.topology.neighbors(self.me)
        chosen = torch.randperm(len(neighbours), generator=self.generator)[: self.count]
        return [self.ranks[neighbours[int(k)]] for k in chosen]


def check_choco(options: GossipOptions, config: Config) -> None:
    """ConfigError for what CHOCO-SGD (gossip with a codec) cannot do: a changing W, or error feedback."""
    for key, changes in (
        ("schedule", options.schedule is not None),
        ("send_probability", options.send_probability < 1),
        ("peers_per_round", options.peers_per_round is not None),
    ):
        if changes:
            raise ConfigError(
                f"`strategy.{key}` with codec {config.codec.name!r}: CHOCO-SGD keeps estimates of fixed "
                f"neighbours, so W must not change; remove strategy.{key} or set codec.name = 'none'"
            )
    if isinstance(build_codec(config.codec.name, **config.codec.options()), ErrorFeedback):
        raise ConfigError(
            "`codec.error_feedback` is on with strategy gossip: CHOCO-SGD's public estimates already keep "
            "what was not sent; set codec.error_feedback = false"
        )


# -- D-PSGD -----------------------------------------------------------------------------------------------
def _seeded(*key: object) -> random.Random:
    """A generator every worker can rebuild from the same key (str seeds are hashed with SHA-512)."""
    return random.Random(":".join(map(str, ("fast.gossip", *key))))


@dataclass
class Round:
    """One worker's part of a gossip round: whom it sends to, whose values it takes and with what weight."""

    sends: list[int]
    takes: dict[int, float]
    keep: float


class GossipRounds:
    """Who talks in each round of D-PSGD and with what weights: every worker gets the same answer, from the
    options, the worker count and the run's seed alone, so both ends of a channel agree without a word."""

    def __init__(self, options: GossipOptions, size: int, seed: int) -> None:
        self.options, self.seed = options, seed
        self.schedule: PeerSchedule | None = None
        self.topology: Topology | None = None
        self.dead: set[int] = set()
        if options.schedule is not None:
            self.schedule = parse_schedule(options.schedule, size, seed=seed)
        else:
            self.topology = build_topology(options, size, seed, options.weights)

    def forget(self, dead: set[int]) -> None:
        """Plan the next rounds without workers `dead` (topology indices) and their channels."""
        self.dead |= dead
        if self.topology is not None:
            self.topology = self.topology.without(self.dead)

    def describe(self) -> str:
        return self.schedule.name if self.schedule is not None else self.topology.name

    def _channel_up(self, round: int, i: int, j: int) -> bool:
        p = self.options.send_probability
        return p >= 1 or _seeded("channel", self.seed, round, min(i, j), max(i, j)).random() < p

    def _calls(self, round: int, i: int) -> list[int]:
        neighbours = self.topology.neighbors(i)
        k = min(self.options.peers_per_round, len(neighbours))
        return _seeded("calls", self.seed, round, i).sample(neighbours, k)

    def _talks(self, round: int, i: int, j: int) -> bool:
        called = self.options.peers_per_round is None or j in self._calls(round, i) or i in self._calls(round, j)
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


class Gossip(Strategy):
    name = "gossip"
    Options = GossipOptions
    survives_failures = True  # D-PSGD only: with a codec (CHOCO-SGD) a death stays fatal
    # CHOCO's codecs must shrink what they compress: E|Q(v) - v|^2 < |v|^2 (not qsgd, terngrad)
    codecs = ("none", "fp16", "bf16", "uint8", "sign", "topk", "randomk", "powersgd")

    @classmethod
    def check(cls, options: GossipOptions, config: Config) -> None:
        check_peer_options(options, config)
        if options.schedule == "exponential-one-peer" and options.send_probability < 1:
            raise ConfigError(
                "`strategy.send_probability` < 1 with schedule exponential-one-peer: a dropped one-way "
                "message makes the mixing not doubly stochastic; use schedule random-matchings or a topology"
            )
        if config.codec.name != "none":
            check_choco(options, config)

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().setup(model, optimizer)
        self.state = FlatState.of_replica(model)
        self.rounds = GossipRounds(self.options, self.comm.size, self.ctx.config.run.seed)
        self.exchanges = self.steps = self.lost_messages = 0
        self.newly_dead: set[int] = set()  # topology indices found dead in the current round
        codec = self.ctx.config.codec
        self.choco: ChocoGossip | None = None
        if codec.name == "none":
            # D-PSGD's exchanges wait at most the deadline without letting gloo time out, which would cut this
            # worker off from every neighbour, not just the silent one
            self.channel = PatientChannel(self.comm)
        else:
            i, topology, ranks = self.comm.index(), self.rounds.topology, self.comm.ranks
            self.choco = ChocoGossip(
                self.comm,
                worker_codec(codec.name, codec.options(), self.ctx.rank),
                {ranks[j]: topology.weight(i, j) for j in topology.neighbors(i)},
                topology.weight(i, i),
                self.options.consensus_lr,
                self.state.read(),
                shapes=[t.shape for t in self.state.tensors],
            )

    # -- the exchange, overlapped with forward and backward ----------------------------------------------
    def before_step(self, step: int) -> None:
        if self.choco is not None:  # CHOCO exchanges after the optimizer step
            return
        self.round = self.rounds.plan(self.comm.index(), step)
        self.mine = self.state.read()
        ranks = self.comm.ranks
        # the message: the replica, then one flag per worker this one knows to be dead
        dead = torch.zeros(self.comm.size)
        dead[sorted(self.rounds.dead)] = 1.0
        message = torch.cat([self.mine, dead.to(self.mine)])
        self.inbox = {j: torch.empty_like(message) for j in self.round.takes}
        self.handles: list[tuple[int, Handle]] = []
        link = self.channel.comm
        for j, buffer in self.inbox.items():
            self._post(step, j, link.irecv, buffer, ranks[j])
        for j in self.round.sends:
            self._post(step, j, link.isend, message, ranks[j], 0, True)  # droppable: a loss is survivable

    def _post(self, step: int, j: int, start: Callable[..., Handle], *args: object) -> None:
        try:
            self.handles.append((j, start(*args)))
        except CommError as e:
            self._lost(j, step, str(e))

    def _lost(self, j: int, step: int, how: str) -> None:
        self.lost(self.comm.ranks[j], step, how)
        self.newly_dead.add(j)

    def after_backward(self, step: int) -> None:
        if self.choco is not None:
            return
        missing: set[int] = set()  # neighbours whose message was lost on its (emulated) link this round
        for j, handle in self.handles:
            if j in self.newly_dead:
                continue  # its other operation failed already
            try:
                self.channel.wait(handle)
            except MessageLost:
                missing.add(j)
            except CommError as e:
                self._lost(j, step, str(e))
        self.lost_messages += len(missing)
        numel = self.state.numel
        mixed = self.mine * self.round.keep
        for j, theirs in self.inbox.items():
            if j in self.newly_dead or j in missing:  # its share of this round stays with this worker
                mixed.add_(self.mine, alpha=self.round.takes[j])
                continue
            mixed.add_(theirs[:numel], alpha=self.round.takes[j])
            for k in theirs[numel:].nonzero().flatten().tolist():
                if k not in self.rounds.dead and k != self.comm.index():
                    self._lost(k, step, f"told by worker {self.comm.ranks[j]}")
        self.state.write(mixed)
        self.exchanges += len(self.inbox) - len((self.newly_dead | missing) & self.inbox.keys())
        self.steps += 1
        if self.newly_dead:
            self.rounds.forget(self.newly_dead)
            self.newly_dead = set()
        self.handles, self.inbox = [], {}

    def after_optimizer_step(self, step: int) -> None:
        if self.choco is not None:
            self.state.write(self.choco.step(self.state.read()))
            self.exchanges += len(self.choco.weights)
            self.steps += 1

    def state_dict(self) -> dict[str, object]:
        return {"choco": self.choco.state_dict()} if self.choco is not None else {}

    def load_state_dict(self, state: dict[str, object]) -> None:
        if self.choco is not None and "choco" in state:
            self.choco.load_state_dict(state["choco"])

    def summary(self) -> dict[str, object]:
        figures: dict[str, object] = {
            "topology": self.rounds.describe(),
            "mean_peers_per_step": self.exchanges / self.steps if self.steps else 0.0,
            "lost_messages": self.lost_messages,
        }
        if self.rounds.topology is not None:
            figures["spectral_gap"] = self.rounds.topology.spectral_gap()
        return figures
