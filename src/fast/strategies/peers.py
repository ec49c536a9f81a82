"""What the peer-to-peer strategies share: the gossip family's options (who may talk to whom, how much of that talk
happens), the choice of peers each step, the peers found dead, and the asynchronous peers' protocol (`AsyncPeers`).

Options of the family (gossip, ad-psgd, push-sum), declared in `PeerOptions`:

- `topology`: a spec for `parse_topology` ("ring", "torus:RxC", "exponential", ...) or an edge list;
- `schedule`: "exponential-one-peer" | "random-matchings", a time-varying peer choice that replaces the
  topology in each round;
- `send_probability`: the probability that an exchange HAPPENS (Viviani et al., incomplete topology
  training); 1 - send_probability is its drop rate;
- `peers_per_round`: how many random neighbours a worker calls per round.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import ClassVar, Literal

import torch
from pydantic import Field

from fast.comm import timing
from fast.comm.messages import Listener, Mailbox
from fast.config import Config
from fast.errors import CommError, ConfigError
from fast.strategies.base import Strategy, StrategyContext, StrategyOptions
from fast.topology import PeerSchedule, Topology, parse_schedule, parse_topology
from fast.topology.rounds import Rounds

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


def rounds_for(options: PeerOptions, workers: int, seed: int) -> Rounds:
    """The per-round plan the options make (fast.topology.rounds)."""
    if options.schedule is not None:
        schedule = parse_schedule(options.schedule, workers, seed=seed)
        return Rounds(None, schedule, seed, options.send_probability, options.peers_per_round)
    topology = build_topology(options, workers, seed, getattr(options, "weights", "metropolis"))
    return Rounds(topology, None, seed, options.send_probability, options.peers_per_round)


def degree(options: PeerOptions, workers: int, seed: int) -> int:
    """Neighbours a worker may talk to: the topology's largest degree, or everyone under a schedule."""
    if options.schedule is not None or workers == 1:
        return max(1, workers - 1)
    topology = build_topology(options, workers, seed)
    return max(topology.degree(rank) for rank in range(workers))


class PeerChoice:
    """Whom an asynchronous worker contacts after a step (ad-psgd, push-sum): with `send_probability`, the
    schedule's peer of that round or `peers_per_round` random neighbours, never one found dead (a schedule is
    re-made over the live workers). Ranks are global."""

    def __init__(self, options: PeerOptions, ctx: StrategyContext) -> None:
        self.ranks = ctx.comm.ranks
        self.me = ctx.comm.index()
        self.probability = options.send_probability
        self.count = options.peers_per_round or 1
        self.generator = ctx.generator
        self.schedule: PeerSchedule | None = None
        self.topology: Topology | None = None
        self.dead: set[int] = set()
        seed = ctx.config.run.seed
        if options.schedule is not None:
            self.schedule = parse_schedule(options.schedule, len(self.ranks), seed=seed)
            others = [j for j in range(len(self.ranks)) if j != self.me]
            self.ever = [self.ranks[j] for j in others]
        else:
            self.topology = build_topology(options, len(self.ranks), seed)
            self.ever = [self.ranks[j] for j in self.topology.neighbors(self.me)]

    def describe(self) -> str:
        return self.schedule.name if self.schedule is not None else self.topology.name

    def forget(self, peer: int) -> None:
        self.dead.add(peer)
        if self.schedule is not None:
            self.schedule = self.schedule.without([self.ranks.index(peer)])

    def targets(self, step: int) -> list[int]:
        if torch.rand((), generator=self.generator).item() >= self.probability:
            return []
        if self.schedule is not None:
            return [self.ranks[j] for j in self.schedule.send_to(self.me, step)]
        neighbours = [j for j in self.topology.neighbors(self.me) if self.ranks[j] not in self.dead]
        chosen = torch.randperm(len(neighbours), generator=self.generator)[: self.count]
        return [self.ranks[neighbours[int(k)]] for k in chosen]


class PeerDeaths:
    """The peers a worker finds dead, from its training thread or its listener, each recorded once with
    `Strategy.lost`. The step recorded is the last one the dead peer was heard to have done (its messages
    carry their step), else this worker's own step. `forget(peer)` then drops it from whom the strategy
    contacts."""

    def __init__(self, strategy: Strategy, forget: Callable[[int], None] = lambda peer: None) -> None:
        self.strategy, self.forget = strategy, forget
        self.lock = timing.Lock()
        self.heard: dict[int, int] = {}  # peer -> the steps it had done when it last sent something
        self.own_step = 0  # steps this worker has done

    def found(self, peer: int, how: str) -> None:
        with self.lock:
            if peer in self.strategy.dead:
                return
            self.strategy.lost(peer, self.heard.get(peer, self.own_step), how)
            self.forget(peer)

    def taken_back(self, peer: int) -> None:
        """A peer taken for dead spoke again (it was only slow): it is alive after all."""
        with self.lock:
            if peer in self.strategy.dead:
                self.strategy.dead.discard(peer)
                self.strategy.failures = [f for f in self.strategy.failures if f["worker"] != peer]


class AsyncPeers(Strategy):
    """The protocol of the workers that talk whenever they like (ad-psgd, push-sum, async-broadcast): a mailbox
    over the workers whose listener thread hands each message to `arrive(sender, header, body)`, deaths recorded
    once, and an end where each worker tells the others it is done (with how many messages it sent them), hears
    every live one say the same, and checks that every message announced arrived. Nobody waits for anybody
    during training, so evaluation is worker 0's alone and each worker ends on its own clock."""

    collective_eval = False
    stops_alone = True
    survives_failures = True
    takes_shards = False
    shards_why = (
        "its workers step at their own pace and survive a lost worker, and a sharded replica's shards "
        "step together and cannot lose one"
    )
    header_size: ClassVar[int] = 2  # a message header's entries, its kind included

    @classmethod
    def check(cls, options: StrategyOptions, config: Config) -> None:
        if isinstance(options, PeerOptions):  # peers chosen on a topology (ad-psgd, push-sum)
            check_peer_options(options, config)

    def open_mailbox(self, senders: Iterable[int], body_numel: int, forget: Callable[[int], None] | None = None,
                     tag: int = 0) -> None:  # fmt: skip
        self.mailbox = Mailbox(self.comm)
        self.deaths = PeerDeaths(self, forget or (lambda peer: None))
        self.tag = tag
        self.listener = Listener(self.mailbox, senders, self.header_size, body_numel, self.arrive, self.deaths.found,
                                 tag)  # fmt: skip
        self.listener.start()

    def arrive(self, sender: int, header: torch.Tensor, body: torch.Tensor | None) -> None:
        """Listener thread: one message from `sender` (body None when it was lost on a lossy link)."""
        raise NotImplementedError

    def before_step(self, step: int) -> None:
        self.listener.check()

    def say_done(self, peers: Iterable[int], header: Callable[[int], list[float]]) -> None:
        """Tell each live peer that no message follows: DONE with `header(peer)` (e.g. how many it was sent)."""
        for peer in peers:
            if peer not in self.dead:
                try:
                    self.mailbox.send_done(peer, header(peer), tag=self.tag)
                except CommError as e:
                    self.deaths.found(peer, str(e))

    def hear_everyone_done(self, what: str = "", received: Callable[[int], int] | None = None) -> None:
        """Wait until every live sender has said DONE and fold in what arrived; with `received`, check that each
        sender's messages arrived, as many as it announced (`what` names them in the error)."""
        self.listener.finish(self.dead, self.deaths.found)
        self.fold_in()
        for sender, header in self.listener.done_headers.items() if received is not None else ():
            announced, arrived = int(header[1].item()), received(sender)
            if announced != arrived:
                raise CommError(f"{self.name}: worker {sender} sent {announced} {what} but {arrived} arrived")

    def fold_in(self) -> None:
        """Apply whatever arrived and is not in the replica yet (called once every sender is done)."""
