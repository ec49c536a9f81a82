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

The wire: a request is a header [step] and the weights; the answer is a header [ANSWERED or MISSED] and,
if ANSWERED, the answering side's weights. Headers are sent reliably, weights `droppable`.

A worker may die (`survives_failures`). Its neighbours find out when a request to it (or its answer, or the
final "done") fails, or when it neither finishes nor answers a probe within the deadline
(`fast.comm.messages`), and never choose it again (a `schedule` is re-made over the live workers).
An averaging cut short by the death is not applied on the survivor's side, and an answer that could not
be delivered is taken back, so every averaging among survivors stays pairwise and the survivors' sum of
replicas is conserved by them.

On a lossy emulated link: if a request's weights are lost, the neighbour answers MISSED and neither side
averages (the exchange did not happen). If the answer's weights are lost, the neighbour has averaged and
the requester has not: that one exchange is one-sided, and the sum of the replicas moves by half their
difference, as for gossip's lost messages; the replicas still reach consensus. `lost_messages` counts both
(rank 0's).
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import Field
from torch import nn

from fast.comm import MessageLost, timing
from fast.errors import CommError
from fast.perfmodel import Link, StepCost
from fast.perfmodel.step import PEER_OPTIONS, peer_messages
from fast.strategies.base import CompensationOptions
from fast.strategies.flat import FlatState
from fast.strategies.peers import AsyncPeers, PeerChoice, PeerOptions

# requests: tags 0 (header) and 1 (weights), to the listener; answers: tags 2 (header) and 3 (weights)
REQUEST, ANSWER = 0, 2
MISSED, ANSWERED = 0.0, 1.0


class ADPSGDOptions(PeerOptions, CompensationOptions):
    peers_per_round: int = Field(1, ge=1, description="neighbours averaged with, one after another, per step")


class ADPSGD(AsyncPeers):
    name = "ad-psgd"
    Options = ADPSGDOptions
    tags = (REQUEST, REQUEST + 1, ANSWER, ANSWER + 1)
    cost_options = PEER_OPTIONS

    @classmethod
    def cost(cls, n: float, workers: int, link: Link, compute_s: float, options: dict[str, Any]) -> StepCost:
        """A worker starts `exchanges` averagings a step and waits for each: its weights out through its NIC, the
        neighbour's back through the neighbour's (α + n/β each). Each NIC also sends, on average, as many answers
        as requests, so it is busy 2·exchanges·n/β of every step, and a message that finds it busy waits
        ρ·(n/β) / (2(1 − ρ)) on average (M/D/1, ρ its busy share) at each of the two NICs it leaves from."""
        exchanges = peer_messages(workers, options, default_peers=1)
        if exchanges == 0:
            return StepCost(compute_s, compute_s, 0.0, 0.0)
        sending = n / link.bandwidth_Bps
        unqueued = compute_s + exchanges * 2 * link.message_time(n)

        def step_given(step_s: float) -> float:
            busy = 2 * exchanges * sending / step_s
            return unqueued + exchanges * 2 * busy * sending / (2 * (1 - busy))

        low, high = unqueued, 2 * unqueued  # step_given falls as the step grows: its fixed point lies in between
        while step_given(high) > high:
            high *= 2
        for _ in range(60):
            middle = (low + high) / 2
            low, high = (middle, high) if step_given(middle) > middle else (low, middle)
        return StepCost(high, compute_s, high - compute_s, 2 * exchanges * n)

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().setup(model, optimizer)
        self.state = FlatState.of_replica(model)
        self.peers = PeerChoice(self.options, self.ctx)
        self.lock = timing.Lock()  # guards the replica, `pending` and the counts between the two threads
        # corrections from averagings the listener answered, folded into the replica before each step
        self.pending = torch.zeros(self.state.numel)
        self.answered = self.started = self.lost_messages = 0
        self.writing = False
        self.open_mailbox(self.peers.ever, self.state.numel, self.peers.forget, tag=REQUEST)

    def _current(self) -> torch.Tensor:
        """The replica as it stands with every answered averaging included (call with the lock held)."""
        return self.state.read().cpu() + self.pending

    def arrive(self, sender: int, header: torch.Tensor, theirs: torch.Tensor | None) -> None:
        """Listener thread: reply with our weights and take half the difference (MISSED if theirs were lost)."""
        self.deaths.heard[sender] = int(header[1].item()) + 1
        if theirs is None:
            with self.lock:
                self.lost_messages += 1
            self._reply(sender, MISSED)
            return
        with self.lock:
            mine = self._current()
            correction = (theirs - mine).mul_(0.5)
            self.pending.add_(correction)
            self.answered += 1
        if not self._reply(sender, ANSWERED, mine):
            with self.lock:  # it never got our weights: it does not average, so neither do we
                self.pending.sub_(correction)
                self.answered -= 1

    def _reply(self, requester: int, kind: float, mine: torch.Tensor | None = None) -> bool:
        try:
            self.mailbox.send(torch.tensor([kind], dtype=torch.float64), requester, ANSWER)
            if mine is not None:
                self.mailbox.send(mine, requester, ANSWER + 1, droppable=True)
        except CommError as e:
            self.deaths.found(requester, str(e))
            return False
        return True

    def before_step(self, step: int) -> None:
        super().before_step(step)
        with self.lock:
            self.state.add(self.pending)
            self.pending.zero_()
            self.answered_at_read = self.answered

    def after_backward(self, step: int) -> None:
        self.staleness.append(self.answered - self.answered_at_read)

    def before_optimizer_step(self) -> None:
        super().before_optimizer_step()
        # the optimizer writes the replica now; released in after_optimizer_step. Taken here, in the loop's own
        # thread, not in after_backward: on a GPU that runs in autograd's device thread, which cannot release it
        self.lock.acquire()
        self.writing = True

    def after_optimizer_step(self, step: int) -> None:
        if self.writing:  # (a step without data has no optimizer step)
            self.writing = False
            self.lock.release()
        self.deaths.own_step = step + 1
        for peer in self.peers.targets(step):
            self._average_with(peer, step)

    def _average_with(self, peer: int, step: int) -> None:
        with self.lock:
            mine = self._current()
        kind = torch.zeros(1, dtype=torch.float64)
        try:
            answer = self.mailbox.comm.irecv(kind, peer, tag=ANSWER)  # posted first: the peer's answer never waits
            self.mailbox.send_message(peer, [float(step)], mine, tag=REQUEST, droppable=True)
            self.mailbox.wait(answer)
            if kind.item() == MISSED:  # our weights were lost on the way: the exchange did not happen
                return
            theirs = self.mailbox.recv(torch.empty_like(mine), peer, ANSWER + 1)
        except MessageLost:  # its weights were lost on the way: it averaged, this side does not
            with self.lock:
                self.lost_messages += 1
            return
        except CommError as e:
            self.deaths.found(peer, str(e))
            return
        with self.lock:
            self.pending.add_(theirs - mine, alpha=0.5)
            self.started += 1

    def end_of_run(self) -> None:
        """Tell the neighbours no request follows, answer theirs until they say the same, fold in the rest."""
        self.say_done(self.peers.ever, lambda peer: [0.0])
        self.hear_everyone_done()

    def fold_in(self) -> None:
        with self.lock:
            self.state.add(self.pending)
            self.pending.zero_()

    def summary(self) -> dict[str, object]:
        return {
            "topology": self.peers.describe(),
            "averagings_started": self.started,
            "averagings_answered": self.answered,
            "lost_messages": self.lost_messages,
        }
