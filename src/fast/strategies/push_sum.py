"""`push-sum`: GoSGD, sum-weighted gossip (Blot et al. 2016; paper 002 Sec. 3.4.2, Fig. 17).

Each worker keeps a weight alpha_i, 1/N at the start. After its step, with probability `send_probability`,
it picks a random neighbour (or the `schedule`'s peer, which with "exponential-one-peer" is stochastic
gradient push), halves alpha_i and pushes (x_i, alpha_i) to it; with `peers_per_round = k` it splits alpha_i
into k + 1 equal shares and pushes one to each of k neighbours. Pushes are asynchronous: a listener thread
queues what arrives, and before each step the worker merges it, as the paper's loop does:

    x_j <- (alpha_j x_j + alpha_i x_i) / (alpha_j + alpha_i),    alpha_j <- alpha_j + alpha_i

The exchanges conserve the sum of the weights (one, once the pushes in flight are counted) and the
weighted sum of the replicas, sum_i alpha_i x_i, the consensus that the replicas approach (with lr = 0 they
all converge to it). At the end every worker tells each neighbour how many pushes it sent and merges theirs
until all neighbours have done so, so nothing is left in flight; the summary lists the final weights
(`push_sum_weights`). A worker that has finished is pushed to no more: it would keep the weight and never
pass it on. The reported "average" model is the plain mean of the replicas, as for other decentralised
strategies.
"""

from __future__ import annotations

import queue
from typing import Any

import torch
from pydantic import Field
from torch import nn

from fast.config import Config
from fast.errors import CommError
from fast.strategies.base import Strategy
from fast.strategies.flat import FlatState
from fast.strategies.gossip import (
    Listener,
    PeerOptions,
    RandomPeers,
    check_peer_options,
    send_done,
    send_message,
)


class PushSumOptions(PeerOptions):
    send_probability: float = Field(1.0, ge=0, le=1, description="probability of a push after each step (p)")
    peers_per_round: int = Field(1, ge=1, description="neighbours pushed to at once, each with a share")


class PushSum(Strategy):
    name = "push-sum"
    Options = PushSumOptions
    collective_eval = False

    @classmethod
    def check(cls, options: PushSumOptions, config: Config) -> None:
        check_peer_options(options, config)

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().setup(model, optimizer)
        self.state = FlatState.of_replica(model)
        self.peers = RandomPeers(self.options, self.ctx)
        self.alpha = 1.0 / self.comm.size
        self.sent = dict.fromkeys(self.peers.targets_ever, 0)
        self.arrived: queue.SimpleQueue[tuple[float, torch.Tensor]] = queue.SimpleQueue()
        self.channel = self.comm.channel()
        self.listener = Listener(self.channel, self.peers.sources_ever, 3, self.state.numel, self._arrive)
        self.listener.start()
        self.weights: list[float] = []
        self.pushes = 0

    def _arrive(self, sender: int, header: torch.Tensor, theirs: torch.Tensor) -> None:
        self.arrived.put((header[1].item(), theirs))

    def _merge_arrivals(self) -> None:
        while not self.arrived.empty():
            weight, theirs = self.arrived.get()
            total = self.alpha + weight
            merged = self.state.read() * (self.alpha / total)
            merged.add_(theirs.to(merged.device), alpha=weight / total)
            self.state.write(merged)
            self.alpha = total

    def before_step(self, step: int) -> None:
        self.listener.check()
        self._merge_arrivals()

    def after_optimizer_step(self, step: int) -> None:
        # a neighbour that has finished would keep the weight and never pass it on: push to the others
        targets = [peer for peer in self.peers.targets(step) if peer not in self.listener.done_headers]
        if not targets:
            return
        self.alpha /= len(targets) + 1
        mine = self.state.read()
        for peer in targets:
            send_message(self.channel, peer, [self.alpha, float(step)], mine)
            self.sent[peer] += 1

    def end_of_run(self) -> None:
        """Drain: announce each neighbour's push count, merge everything until all neighbours did the same."""
        for peer, count in self.sent.items():
            send_done(self.channel, [peer], [float(count), 0.0])
        self.listener.finish()
        self._merge_arrivals()
        for sender, header in self.listener.done_headers.items():
            announced, received = int(header[1].item()), self.listener.received[sender]
            if announced != received:
                raise CommError(f"push-sum: worker {sender} sent {announced} pushes but {received} arrived")
        mine = torch.tensor([self.alpha, float(sum(self.sent.values()))], dtype=torch.float64)
        with self.comm.unmetered():
            gathered = self.comm.all_gather(mine)
        self.weights = [float(w[0]) for w in gathered]
        self.pushes = int(sum(w[1] for w in gathered))

    def state_dict(self) -> dict[str, Any]:
        return {"alpha": self.alpha}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.alpha = float(state["alpha"])

    def summary(self) -> dict[str, object]:
        return {
            "topology": self.peers.describe(),
            "pushes": self.pushes,
            "push_sum_weights": self.weights,
            "push_sum_weight_total": sum(self.weights) if self.weights else None,
        }
