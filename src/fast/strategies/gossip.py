"""`gossip`: D-PSGD (Lian et al. 2017; Langer et al. 2020 Sec. 3.4.2).

Each step every worker mixes its replica with its neighbours' through the mixing matrix W of the topology,
x_i <- sum_j W_ij x_j, and the optimizer then applies the gradient computed at the unmixed replica (the
paper's Algorithm 1). The exchange is posted before the forward pass and waited for after backward, so
communication overlaps the computation.

Each round is a neighbour all-reduce (fast.exchange.neighbours) planned by fast.topology.rounds: partial and
probabilistic communication, peers per round and time-varying schedules (the family's options:
fast.strategies.peers). With a `[codec]`, gossip is CHOCO-SGD (fast.strategies.choco).

A worker that dies is noticed by its neighbours when their exchange with it fails
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

from typing import Any, Literal

import torch
from pydantic import Field
from torch import nn

from fast.codecs import Codec
from fast.comm.landing import Landing
from fast.comm.patience import PatientGroup
from fast.config import Config
from fast.errors import CommError, ConfigError
from fast.exchange.neighbours import NeighbourRound, combine
from fast.perfmodel import Link, StepCost
from fast.perfmodel.step import PEER_OPTIONS, peer_messages, with_barrier
from fast.strategies.base import Strategy
from fast.strategies.flat import FlatState
from fast.strategies.peers import PeerOptions, check_peer_options, rounds_for


class GossipOptions(PeerOptions):
    weights: Literal["metropolis", "uniform"] = Field("metropolis", description="the mixing rule for W")
    consensus_lr: float = Field(0.5, gt=0, le=1, description="CHOCO-SGD's consensus step size (with a codec)")


class Gossip(Strategy):
    name = "gossip"
    Options = GossipOptions
    tags = (0,)
    survives_failures = True  # with a codec (CHOCO-SGD) a death stays fatal
    takes_shards = False
    shards_why = (
        "it survives a lost worker, and a sharded replica cannot lose a process: FSDP2's collectives inside "
        "it need every shard (gossip with a [codec], CHOCO-SGD, takes shards)"
    )
    joins = True  # at any step (run.membership = "live"): the topology is re-made over the members
    cost_options = PEER_OPTIONS | {"overlap"}
    cost_defaults = {
        "overlap": 1.0
    }  # posted before the forward pass, awaited after backward (Langer et al. 2020 Fig. 15)
    waits_every_step = True
    fallback: str | None = None  # the topology a live membership fell back to, when the configured one did not fit

    @classmethod
    def accepts_codec(cls, codec: Codec) -> bool:
        return codec.contractive  # compressed differences (CHOCO-SGD) converge for codecs that shrink them

    @classmethod
    def check(cls, options: GossipOptions, config: Config) -> None:
        check_peer_options(options, config)
        if options.schedule == "exponential-one-peer" and options.send_probability < 1:
            raise ConfigError(
                "`strategy.send_probability` < 1 with schedule exponential-one-peer: a dropped one-way "
                "message makes the mixing not doubly stochastic; use schedule random-matchings or a topology"
            )

    @classmethod
    def cost(cls, n: float, workers: int, link: Link, compute_s: float, options: dict[str, Any]) -> StepCost:
        """The model goes to every neighbour (or peers_per_round of them) each step, one NIC."""
        messages = peer_messages(workers, options, default_peers=None)
        return with_barrier(compute_s, messages * link.message_time(n), messages * n, options)

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().setup(model, optimizer)
        self.state = FlatState.of_replica(model)
        self.exchanges = self.steps = self.lost_messages = 0
        self.regroup()

    def regroup(self) -> None:
        """The plan of rounds over the group's members (a live membership: the new group's); a topology that
        does not fit their number (a torus of 3) falls back to a ring, and the summary says so."""
        size, seed = self.comm.size, self.ctx.config.run.seed
        try:
            self.rounds = rounds_for(self.options, size, seed)
        except ConfigError as e:
            self.rounds = rounds_for(self.options.model_copy(update={"topology": "ring"}), size, seed)
            self.fallback = f"ring over {size} workers ({e})"
        # waits give up at the deadline without letting gloo time out, which would cut this worker off from
        # every neighbour, not just the silent one
        self.patient = PatientGroup(self.comm)
        self.dead_flags: torch.Tensor | None = None  # this worker's list of the dead, on the device (made on news)
        self.flagged: frozenset[int] = frozenset()  # the dead it holds
        self.heard: torch.Tensor | None = None  # row j: the dead that worker j's messages named, on the device
        self.news: Landing | None = None  # `heard` on its way to the host (never waited for)

    # -- the exchange, overlapped with forward and backward ----------------------------------------------
    def before_step(self, step: int) -> None:
        self.round = self.rounds.plan(self.comm.index(), step)
        # the message: the replica, then one flag per worker this one knows to be dead
        tensors = self.state.tensors
        if self.dead_flags is None or self.flagged != self.rounds.dead:  # (a tensor made once per change)
            self.flagged = frozenset(self.rounds.dead)
            dead = torch.zeros(self.comm.size, dtype=tensors[0].dtype)
            dead[sorted(self.flagged)] = 1.0
            self.dead_flags = dead.to(tensors[0].device)
        message = torch.cat([*(t.detach().reshape(-1) for t in tensors), self.dead_flags])
        self.mine = message[: self.state.numel]
        ranks = self.comm.ranks
        self.exchange = NeighbourRound(
            self.patient, message, [ranks[j] for j in self.round.sends], [ranks[j] for j in self.round.takes]
        )

    def gradients_stay_local(self, step: int) -> bool:
        return True  # the replicas travel, not their gradients

    def after_backward(self, step: int) -> None:
        arrived, lost, gone = self.exchange.finish()
        if gone and self.ctx.config.run.live:  # the membership drops the peer: this step is taken again
            raise CommError(f"the exchange with workers {sorted(gone)} failed: the membership re-forms")
        index = self.comm.index
        newly_dead = {index(peer) for peer in gone}
        for peer, how in gone.items():
            self.lost(peer, step, how)
        self.lost_messages += len(lost)
        numel = self.state.numel
        theirs = {index(peer): message[:numel] for peer, message in arrived.items()}
        self.state.write(combine(self.mine, theirs, self.round.takes, self.round.keep))
        for k, j in self._news(arrived):  # the news of deaths travels with the messages
            if k not in self.rounds.dead and k not in newly_dead and k != index():
                self.lost(self.comm.ranks[k], step, f"told by worker {self.comm.ranks[j]}")
                newly_dead.add(k)
        self.exchanges += len(theirs)
        self.steps += 1
        if newly_dead:
            self.rounds.forget(newly_dead)

    def _news(self, arrived: dict[int, torch.Tensor]) -> list[tuple[int, int]]:
        """(dead k, worker j that named it) from the messages so far: the flags are gathered on the device and come
        to the host behind the step (fast.comm.landing), so a death is learnt a step late at most, with no wait."""
        numel, size = self.state.numel, self.comm.size
        for peer, message in arrived.items():
            if self.heard is None:
                self.heard = torch.zeros(size, size, dtype=message.dtype, device=message.device)
                self.news = Landing(self.heard)
            row = self.heard[self.comm.index(peer)]
            torch.maximum(row, message[numel:], out=row)
        if self.news is None:
            return []
        self.news.send(self.heard)
        heard = self.news.landed()
        if heard is None or not heard.any():
            return []
        return [(int(k), int(j)) for j, k in zip(*heard.nonzero(), strict=True)]

    def summary(self) -> dict[str, object]:
        figures: dict[str, object] = {
            "topology": self.rounds.describe(),
            "mean_peers_per_step": self.exchanges / self.steps if self.steps else 0.0,
            "lost_messages": self.lost_messages,
        }
        if self.rounds.topology is not None:
            figures["spectral_gap"] = self.rounds.topology.spectral_gap()
        if self.fallback is not None:
            figures["topology_fallback"] = self.fallback
        return figures
