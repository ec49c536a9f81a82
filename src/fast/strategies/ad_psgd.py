"""`ad-psgd`: asynchronous decentralised parallel SGD (Lian et al. 2018): pairwise averaging, no global wait.

After its step a worker averages its replica with one random neighbour (the `topology`, or the peer the
`schedule` gives for its step; `send_probability` and `peers_per_round` as in gossip.py): it sends its
weights x_i, the neighbour answers with its own x_j, and both take (x_i + x_j) / 2. Every worker has a
listener thread that answers such requests while its training thread keeps computing, so the active side
waits only for one neighbour's reply and there is no deadlock whatever the graph (no bipartite split is
needed): the training thread never holds the replica's lock while it communicates, and the listener never
waits for a training thread.

Averaging is applied as a correction, x_i += (x_j - x_i) / 2 on one side and x_j += (x_i - x_j) / 2 on the
other, computed from the two values that crossed the wire, so the sum of the replicas is conserved exactly
even when averagings overlap. A correction answered while the training thread is computing a gradient is
folded in before the next step: the gradient of step k is computed at the replica read before it and
applied after the averagings that arrived meanwhile, as in the paper. `staleness` records, per step, how
many such averagings the replica had taken between the read and the gradient's application.
"""

from __future__ import annotations

import threading

import torch
from pydantic import Field
from torch import nn

from fast.config import Config
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

REQUEST, REPLY = 0, 2  # the listener uses tags REQUEST (header) and REQUEST + 1 (weights)


class ADPSGDOptions(PeerOptions):
    peers_per_round: int = Field(1, ge=1, description="neighbours averaged with, one after another, per step")


class ADPSGD(Strategy):
    name = "ad-psgd"
    Options = ADPSGDOptions
    collective_eval = False

    @classmethod
    def check(cls, options: ADPSGDOptions, config: Config) -> None:
        check_peer_options(options, config)

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().setup(model, optimizer)
        self.state = FlatState.of_replica(model)
        self.peers = RandomPeers(self.options, self.ctx)
        self.channel = self.comm.channel()
        self.lock = threading.Lock()  # guards the replica and `pending` between the two threads
        # corrections from averagings the listener answered, folded into the replica before each step
        self.pending = torch.zeros(self.state.numel)
        self.answered = self.started = 0
        self.listener = Listener(
            self.channel, self.peers.sources_ever, 2, self.state.numel, self._answer, REQUEST
        )
        self.listener.start()

    def _current(self) -> torch.Tensor:
        """The replica as it stands with every answered averaging included (call with the lock held)."""
        return self.state.read().cpu() + self.pending

    def _answer(self, sender: int, header: torch.Tensor, theirs: torch.Tensor) -> None:
        """Listener thread: reply with our weights and take half the difference."""
        with self.lock:
            mine = self._current()
            self.pending.add_(theirs - mine, alpha=0.5)
            self.answered += 1
        self.channel.send(mine, sender, tag=REPLY)

    def before_step(self, step: int) -> None:
        self.listener.check()
        with self.lock:
            self.state.add(self.pending)
            self.pending.zero_()
            self.answered_at_read = self.answered

    def after_backward(self, step: int) -> None:
        self.lock.acquire()  # the optimizer writes the replica now; released in after_optimizer_step
        self.staleness.append(self.answered - self.answered_at_read)

    def after_optimizer_step(self, step: int) -> None:
        self.lock.release()
        for peer in self.peers.targets(step):
            self._average_with(peer, step)

    def _average_with(self, peer: int, step: int) -> None:
        with self.lock:
            mine = self._current()
        theirs = torch.empty_like(mine)
        reply = self.channel.irecv(theirs, peer, tag=REPLY)  # posted first: the peer's reply never waits
        send_message(self.channel, peer, [float(step)], mine, tag=REQUEST)
        reply.wait()
        with self.lock:
            self.pending.add_(theirs - mine, alpha=0.5)
        self.started += 1

    def end_of_run(self) -> None:
        """Tell the neighbours no request follows, answer theirs until they say the same, fold in the rest."""
        send_done(self.channel, self.peers.targets_ever, [0.0], tag=REQUEST)
        self.listener.finish()
        self.state.add(self.pending)
        self.pending.zero_()

    def summary(self) -> dict[str, object]:
        return {
            "topology": self.peers.describe(),
            "averagings_started": self.started,
            "averagings_answered": self.answered,
        }
