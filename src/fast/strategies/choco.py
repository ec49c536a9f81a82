"""`gossip` with a `[codec]`: CHOCO-SGD (Koloskova, Stich and Jaggi 2019, Algorithm 2), compressed gossip.

Every worker keeps a public estimate x̂_j of each neighbour's model, known alike to j and to all of j's
neighbours because it only ever moves by what j sent. Each round, after the local SGD step:

    q_i = Q(x_i - x̂_i)                              send q_i to the neighbours, receive their q_j
    x̂_j += q_j  for j in N(i) and i itself
    x_i += γ Σ_j w_ij (x̂_j - x̂_i)                   γ: the consensus step size (`consensus_lr`)

Naively compressed weights do not converge; compressed differences to the estimates do, for codecs that shrink
what they compress (`contractive`: top-k, random-k, sign, low rank, casts). As in the paper's memory-efficient
form, only x̂_i and s_i = Σ_j w_ij x̂_j (j in N(i) and i) are kept, so W must stay fixed (a topology, every
channel up every round), and the codec needs no error feedback (the estimates keep what was not sent). The
estimates start at the initial model, which every worker has. It keeps estimates of fixed neighbours, so a
worker's death stays fatal.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fast.codecs import ErrorFeedback, build_codec
from fast.config import Config
from fast.errors import ConfigError
from fast.exchange.neighbours import compressed_allreduce
from fast.strategies.flat import FlatState
from fast.strategies.gossip import Gossip, GossipOptions
from fast.strategies.peers import rounds_for


def check_choco(options: GossipOptions, config: Config) -> None:
    """ConfigError for what CHOCO-SGD cannot do: a changing W, or error feedback."""
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


class Choco(Gossip):
    registered = False
    variant_of = Gossip
    survives_failures = False
    takes_shards = True

    @classmethod
    def chosen_when(cls, options: dict[str, Any], codec: str) -> bool:
        return codec != "none"

    @classmethod
    def check(cls, options: GossipOptions, config: Config) -> None:
        super().check(options, config)
        check_choco(options, config)

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super(Gossip, self).setup(model, optimizer)
        self.state = FlatState.of_replica(model)
        self.rounds = rounds_for(self.options, self.comm.size, self.ctx.config.run.seed)
        self.exchanges = self.steps = self.lost_messages = 0
        i, topology, ranks = self.comm.index(), self.rounds.topology, self.comm.ranks
        self.weights = {ranks[j]: topology.weight(i, j) for j in topology.neighbors(i)}
        self.self_weight = topology.weight(i, i)
        self.codec = self.make_codec()
        initial = self.state.read()
        self.estimate = initial.detach().clone()  # x̂_i
        self.mixed = initial.detach().clone()  # s_i (rows of W sum to 1)

    def before_step(self, step: int) -> None:
        pass  # CHOCO exchanges after the optimizer step

    def after_backward(self, step: int) -> None:
        pass

    def after_optimizer_step(self, step: int) -> None:
        x = self.state.read()
        shapes = [t.shape for t in self.state.tensors]
        mine, mixed = compressed_allreduce(
            self.comm, x - self.estimate, self.codec, "choco", self.weights, self.self_weight, shapes=shapes
        )
        self.estimate += mine
        self.mixed += mixed
        self.state.write(x + self.options.consensus_lr * (self.mixed - self.estimate))
        self.exchanges += len(self.weights)
        self.steps += 1

    def state_dict(self) -> dict[str, Any]:
        return {"choco": {"estimate": self.estimate.clone(), "mixed": self.mixed.clone(),
                          "codec": self.codec.state_dict()}}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "choco" in state:
            self.estimate.copy_(state["choco"]["estimate"])
            self.mixed.copy_(state["choco"]["mixed"])
            self.codec.load_state_dict(state["choco"]["codec"])
