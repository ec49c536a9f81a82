"""`push-sum`: GoSGD, sum-weighted gossip (Blot et al. 2016; Langer et al. 2020 Sec. 3.4.2, Fig. 17).

Each worker keeps a weight alpha_i, 1/N at the start. After its step, with probability `send_probability`,
it picks a random neighbour (or the `schedule`'s peer, which with "exponential-one-peer" is stochastic
gradient push), halves alpha_i and pushes (x_i, alpha_i) to it; with `peers_per_round = k` it splits alpha_i
into k + 1 equal shares and pushes one to each of k neighbours. Pushes are asynchronous: a listener thread
queues what arrives, and before each step the worker merges it, as the paper's loop does:

    x_j <- (alpha_j x_j + alpha_i x_i) / (alpha_j + alpha_i),    alpha_j <- alpha_j + alpha_i

The exchanges conserve the sum of the weights (one, once the pushes in flight are counted) and the
weighted sum of the replicas, sum_i alpha_i x_i, the consensus that the replicas approach (with lr = 0 they
all converge to it). At the end every worker tells each neighbour how many pushes it sent and merges theirs
until all neighbours have done so, so nothing is left in flight; rank 0 then collects the final weights
(`push_sum_weights`, point to point). A worker that has finished is pushed to no more: it would keep the
weight and never pass it on. The reported "average" model is the plain mean of the replicas, as for other
decentralised strategies.

A worker may die (`survives_failures`). The weight it held, and that of the pushes on their way to it, is
lost with it; a push to a peer found dead stays with the pusher. The survivors' weights then sum to less
than one and keep that sum (`push_sum_weights` has None for the dead, `push_sum_weight_total` is the
survivors' sum). Nothing needs rescaling: each replica holds the estimate x_i itself (z_i / alpha_i in
push-sum's usual terms) and a merge is a weighted average, so the estimates stay unbiased and approach
sum_i alpha_i x_i / sum_i alpha_i over the survivors. A peer is found dead when a push to it (or the final
"done") fails, or when it neither finishes nor answers a probe within the deadline
(`fast.comm.messages`); it is then never chosen again.

On a lossy emulated link a push's values (sent `droppable`) may be lost; its header, with the weight, always
arrives. The receiver then takes the weight with its own values, alpha_j <- alpha_j + alpha_i and x_j
unchanged: the weights still sum to exactly one, and the consensus moves by alpha_i (x_j - x_i) / sum alpha,
which shrinks as the replicas agree. `lost_messages` counts such pushes (rank 0's).
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import Field
from torch import nn

from fast.comm import timing
from fast.errors import CommError, CommTimeout
from fast.perfmodel import Link, StepCost
from fast.perfmodel.step import PEER_OPTIONS, peer_messages, without_barrier
from fast.strategies.flat import FlatState
from fast.strategies.peers import AsyncPeers, PeerChoice, PeerOptions

PUSH_TAG, WEIGHTS_TAG = 0, 2  # pushes use tags 0 (header) and 1 (values); the final weights go to rank 0 on 2


class PushSumOptions(PeerOptions):
    send_probability: float = Field(1.0, ge=0, le=1, description="probability of a push after each step (p)")
    peers_per_round: int = Field(1, ge=1, description="neighbours pushed to at once, each with a share")


class PushSum(AsyncPeers):
    name = "push-sum"
    Options = PushSumOptions
    header_size = 3  # [kind, share, step]
    tags = (PUSH_TAG, PUSH_TAG + 1, WEIGHTS_TAG)
    cost_options = PEER_OPTIONS

    @classmethod
    def cost(cls, n: float, workers: int, link: Link, compute_s: float, options: dict[str, Any]) -> StepCost:
        """With probability p, the model (and its weight) to peers_per_round random peers; no barrier."""
        messages = peer_messages(workers, options, default_peers=1)
        return without_barrier(compute_s, messages * link.message_time(n), messages * n)

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().setup(model, optimizer)
        self.state = FlatState.of_replica(model)
        self.peers = PeerChoice(self.options, self.ctx)
        self.alpha = 1.0 / self.comm.size
        self.sent = dict.fromkeys(self.peers.ever, 0)
        self.arrived: Any = timing.Queue()
        self.open_mailbox(self.peers.ever, self.state.numel, self.peers.forget, tag=PUSH_TAG)
        self.weights: list[float | None] = []
        self.pushes = 0

    def arrive(self, sender: int, header: torch.Tensor, theirs: torch.Tensor | None) -> None:
        self.deaths.heard[sender] = int(header[2].item()) + 1
        self.arrived.put((header[1].item(), theirs))

    def fold_in(self) -> None:
        while not self.arrived.empty():
            weight, theirs = self.arrived.get()
            total = self.alpha + weight
            if theirs is not None:
                merged = self.state.read() * (self.alpha / total)
                merged.add_(theirs.to(merged.device), alpha=weight / total)
                self.state.write(merged)
            self.alpha = total  # a lost push's weight is taken with this replica's own values

    def before_step(self, step: int) -> None:
        super().before_step(step)
        self.fold_in()

    def after_optimizer_step(self, step: int) -> None:
        self.deaths.own_step = step + 1
        # a neighbour that has finished would keep the weight and never pass it on: push to the others
        targets = [peer for peer in self.peers.targets(step) if peer not in self.listener.done_headers]
        if not targets:
            return
        self.alpha /= len(targets) + 1
        share = self.alpha
        mine = self.state.read()
        for peer in targets:
            try:
                self.mailbox.send_message(peer, [share, float(step)], mine, tag=PUSH_TAG, droppable=True)
            except CommTimeout as e:  # it may be only slow and still take the push: the share is gone
                self.deaths.found(peer, str(e))
            except CommError as e:  # it is gone, with whatever it got: the share stays with the survivors
                self.alpha += share
                self.deaths.found(peer, str(e))
            else:
                self.sent[peer] += 1

    def end_of_run(self) -> None:
        """Drain: announce each neighbour's push count, merge everything until all neighbours did the same."""
        self.say_done(self.sent, lambda peer: [float(self.sent[peer]), 0.0])
        self.hear_everyone_done("pushes", lambda sender: self.listener.received[sender])
        self._gather_weights()

    def _gather_weights(self) -> None:
        """Rank 0 collects every live worker's weight and push count, point to point (measurement only)."""
        mine = torch.tensor([self.alpha, float(sum(self.sent.values()))], dtype=torch.float64)
        first = self.comm.ranks[0]
        with self.mailbox.unmetered():
            if self.comm.rank != first:
                try:
                    self.mailbox.send(mine, first, WEIGHTS_TAG)
                except CommError:
                    pass  # rank 0 took this worker for dead: the end of the run goes on without it
                return
            gathered = {first: mine}
            for rank in self.comm.ranks[1:]:
                if rank not in self.dead:
                    try:
                        gathered[rank] = self.mailbox.recv(torch.zeros(2, dtype=torch.float64), rank, WEIGHTS_TAG)
                    except CommError as e:
                        self.deaths.found(rank, f"did not report its push-sum weight: {e}")
        self.weights = [float(gathered[r][0]) if r in gathered else None for r in self.comm.ranks]
        self.pushes = int(sum(float(g[1]) for g in gathered.values()))

    def state_dict(self) -> dict[str, Any]:
        return {"alpha": self.alpha}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.alpha = float(state["alpha"])

    def summary(self) -> dict[str, object]:
        live = [w for w in self.weights if w is not None]
        return {
            "topology": self.peers.describe(),
            "pushes": self.pushes,
            "push_sum_weights": self.weights,
            "push_sum_weight_total": sum(live) if live else None,
            "lost_messages": sum(self.listener.lost.values()),
        }
