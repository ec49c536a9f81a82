"""`ssp`: stale-synchronous parallel (Ho et al. 2013; Langer et al. 2020 Sec. 3.3.4) with staleness bound `staleness`.

This file is the `exchange = "broadcast"` form (Statement 1 of Viviani et al.); `exchange = "all-reduce"` sends
`sync`'s bytes instead (fast.strategies.ssp_allreduce).

Every worker keeps a clock, its step count. After backward it sends its gradient of step t to every other
worker and applies, through its own optimizer, the mean (1/N) of its own gradient and of every peer gradient
of step ≤ t that has arrived and was not applied yet; a peer gradient that comes late is folded into the
first step after it arrives. A worker more than s steps ahead of the slowest waits: before its optimizer
step at t it blocks until every peer's gradients up to step t − s are in. So each replica always contains
all updates of steps ≤ t − s and its own, plus whatever arrived of the rest (Langer et al. 2020: the model a worker
reads contains the updates within [t − s, t + s − 1]).

With s = 0 a worker waits for every peer's gradient of step t and applies exactly the mean of the step's N
gradients: the same update as `sync`. With s > 0 the replicas may differ for a while (each applies late
gradients at different steps), so the reported model is chosen by `final_model`. At the end every worker
applies what is still pending, so every replica has applied every gradient exactly once.

Gradients travel over a channel of their own: the training thread sends them (non-blocking), and a listener
thread receives from every peer as messages come, so that late gradients are folded in as soon as possible.
Staleness of a peer gradient applied at step t that was computed at step τ: t − τ.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field
from torch import nn

from fast.comm import Handle, timing
from fast.errors import CommError, CommTimeout
from fast.perfmodel import Link, StepCost
from fast.perfmodel.step import COLLECTIVE_OPTIONS, without_barrier
from fast.strategies.base import CompensationOptions, Strategy
from fast.strategies.flat import flat_gradients, write_gradients

HEADER, BODY = 0, 1  # tags: a header holds the step (END closes the stream), the body the gradient
END = -1


class SSPOptions(CompensationOptions):
    staleness: int = Field(1, ge=0, description="bound s: a worker may run at most s steps ahead of the slowest")
    exchange: Literal["broadcast", "all-reduce"] = Field(
        "broadcast", description='"broadcast": each gradient to every peer; "all-reduce": sync\'s bytes, overlapped'
    )


class Inboxes:
    """Peer gradients received but not applied yet; filled by the listener thread, emptied by the training one."""

    def __init__(self, peers: list[int], deadline_s: float) -> None:
        self.changed = timing.Condition()
        self.pending: dict[int, list[tuple[int, torch.Tensor]]] = {p: [] for p in peers}  # in step order
        self.through = dict.fromkeys(peers, -1)  # every gradient of a peer's steps <= through has arrived
        self.ended: set[int] = set()
        self.error: BaseException | None = None
        self.deadline_s = deadline_s

    def put(self, peer: int, step: int, gradient: torch.Tensor) -> None:
        with self.changed:
            if step != self.through[peer] + 1:
                raise CommError(f"ssp: worker {peer} sent step {step} after step {self.through[peer]}")
            self.pending[peer].append((step, gradient))
            self.through[peer] = step
            self.changed.notify_all()

    def end(self, peer: int) -> None:
        with self.changed:
            self.ended.add(peer)
            self.changed.notify_all()

    def fail(self, error: BaseException) -> None:
        with self.changed:
            self.error = error
            self.changed.notify_all()

    def wait_through(self, step: int) -> int:
        """Block until every peer's gradients up to `step` are in; returns how many peers were waited for."""
        deadline = timing.now() + self.deadline_s
        with self.changed:
            behind = [p for p, through in self.through.items() if through < step]
            while True:
                if self.error is not None:
                    raise self.error
                late = [p for p, through in self.through.items() if through < step]
                if not late:
                    return len(behind)
                gone = [p for p in late if p in self.ended]
                if gone:
                    raise CommError(f"ssp: worker {gone[0]} ended its stream before step {step}")
                left = deadline - timing.now()
                if left <= 0:
                    raise CommTimeout(
                        f"ssp: waited {self.deadline_s:g}s for worker {late[0]}'s gradient of step {step}: "
                        f"the peer is gone or stuck (raise run.deadline_s if it is only slow)"
                    )
                self.changed.wait(left)

    def take(self, up_to: int) -> list[tuple[int, torch.Tensor]]:
        """Remove and return every pending (step, gradient) of steps <= `up_to`."""
        taken = []
        with self.changed:
            for pending in self.pending.values():
                while pending and pending[0][0] <= up_to:
                    taken.append(pending.pop(0))
        return taken


class StaleSynchronous(Strategy):
    name = "ssp"
    Options = SSPOptions
    tags = (HEADER, BODY)
    collective_eval = False  # rank 0 evaluates its replica during training; nobody waits for it
    takes_shards = False
    shards_why = (
        "worker 0 evaluates its replica alone while the others train on, and a sharded replica's forward "
        "needs all of its shards"
    )
    cost_options = COLLECTIVE_OPTIONS | {"staleness", "exchange"}

    @classmethod
    def cost(cls, n: float, workers: int, link: Link, compute_s: float, options: dict[str, Any]) -> StepCost:
        """Every gradient goes to every peer, one message after another on the sender's link, but the staleness
        bound removes the barrier's waits."""
        messages = workers - 1
        return without_barrier(compute_s, messages * link.message_time(n), messages * n)

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().setup(model, optimizer)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.numel = sum(p.numel() for p in self.params)
        self.peers = [r for r in self.comm.ranks if r != self.comm.rank]
        self.channel = self.comm.separate_group()
        self.inboxes = Inboxes(self.peers, self.channel.deadline_s)
        self.sends: list[tuple[Handle, torch.Tensor]] = []
        self.waits = 0
        self.last_step = -1
        self.listener = timing.Thread(self._listen, "fast-ssp-listener")
        self.listener.start()

    # -- the channel ---------------------------------------------------------------------------------------
    def _listen(self) -> None:
        """The listener thread: receive headers and gradients from any peer until every peer has sent END."""
        try:
            while len(self.inboxes.ended) < len(self.peers):
                header = torch.zeros(1, dtype=torch.int64)
                peer = self.channel.recv_from(header, tag=HEADER)
                step = int(header.item())
                if step == END:
                    self.inboxes.end(peer)
                else:
                    gradient = self.channel.recv(torch.empty(self.numel), peer, tag=BODY)
                    self.inboxes.put(peer, step, gradient)
        except BaseException as e:  # raised in the training thread by the next wait
            self.inboxes.fail(e)

    def _send(self, step: int, gradient: torch.Tensor | None) -> None:
        for handle, _ in self.sends:  # the previous step's messages: long received by the peers' listeners
            handle.wait()
        self.sends = []
        header = torch.tensor([step], dtype=torch.int64)
        for peer in self.peers:
            self.sends.append((self.channel.isend(header, peer, tag=HEADER), header))
            if gradient is not None:
                self.sends.append((self.channel.isend(gradient, peer, tag=BODY), gradient))

    def _late_sum(self, up_to: int, applied_at: int) -> tuple[torch.Tensor, int]:
        """The sum and count of pending peer gradients of steps <= `up_to`, recording each one's staleness."""
        total, taken = torch.zeros(self.numel), self.inboxes.take(up_to)
        for step, gradient in taken:
            total += gradient
            self.staleness.append(applied_at - step)
        return total, len(taken)

    # -- the step --------------------------------------------------------------------------------------------
    def after_backward(self, step: int) -> None:
        own = flat_gradients(self.params)
        self._send(step, own.detach().to("cpu", torch.float32).contiguous())
        self.waits += self.inboxes.wait_through(step - self.options.staleness)
        late, _ = self._late_sum(up_to=step, applied_at=step)
        write_gradients(self.params, (own + late.to(own.device)) / self.comm.size)
        self.last_step = step

    def end_of_run(self) -> None:
        """Apply every gradient still pending, close the streams, and stop the listener."""
        self.waits += self.inboxes.wait_through(self.last_step)
        late, count = self._late_sum(up_to=self.last_step, applied_at=self.last_step + 1)
        if count:  # one more optimizer step, with only the peers' late gradients in it
            self.optimizer.zero_grad(set_to_none=True)
            write_gradients(self.params, late.to(self.params[0].device) / self.comm.size)
            self.optimizer.step()
        self._send(END, None)
        for handle, _ in self.sends:
            handle.wait()
        self.sends = []
        self.listener.join(self.channel.deadline_s)
        if self.inboxes.error is not None:
            raise self.inboxes.error
        if self.listener.is_alive():
            raise CommTimeout(f"ssp: a peer did not close its stream within {self.channel.deadline_s:g}s")

    # -- checkpoints ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Late peer gradients of steps up to now (waited for), so that a resumed run applies them once."""
        self.inboxes.wait_through(self.last_step)
        with self.inboxes.changed:
            late = {
                peer: [(s, g.clone()) for s, g in pending if s <= self.last_step]
                for peer, pending in self.inboxes.pending.items()
            }
        return {"late": late, "through": self.last_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self.inboxes.changed:
            for peer in self.peers:
                self.inboxes.pending[peer] = list(state["late"].get(peer, []))
                self.inboxes.through[peer] = state["through"]
        self.last_step = state["through"]

    def summary(self) -> dict[str, Any]:
        return {"staleness_bound": self.options.staleness, "bound_waits": self.waits}
