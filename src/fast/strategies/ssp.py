"""`ssp`: stale-synchronous parallel (Ho et al. 2013; paper 002 Sec. 3.3.4) with staleness bound `staleness`.

Every worker keeps a clock, its step count. After backward it sends its gradient of step t to every other
worker and applies, through its own optimizer, the mean (1/N) of its own gradient and of every peer gradient
of step ≤ t that has arrived and was not applied yet; a peer gradient that comes late is folded into the
first step after it arrives. A worker more than s steps ahead of the slowest waits: before its optimizer
step at t it blocks until every peer's gradients up to step t − s are in. So each replica always contains
all updates of steps ≤ t − s and its own, plus whatever arrived of the rest (paper 002: the model a worker
reads contains the updates within [t − s, t + s − 1]).

With s = 0 a worker waits for every peer's gradient of step t and applies exactly the mean of the step's N
gradients: the same update as `sync`. With s > 0 the replicas may differ for a while (each applies late
gradients at different steps), so the reported model is chosen by `final_model`. At the end every worker
applies what is still pending, so every replica has applied every gradient exactly once.

Gradients travel over a channel of their own with non-blocking sends and one posted receive per peer; it is
driven from the training thread only (no background thread), since gloo moves the bytes by itself.
Staleness of a peer gradient applied at step t that was computed at step τ: t − τ.
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import Field
from torch import nn

from fast.comm import Handle
from fast.errors import CommError
from fast.strategies.base import Strategy, StrategyOptions
from fast.strategies.local_sgd import flat_gradients, write_gradients

END = -1.0  # the step field of the last message a worker sends a peer


class SSPOptions(StrategyOptions):
    staleness: int = Field(1, ge=0, description="bound s: a worker may run at most s steps ahead of the slowest")


class Inbox:
    """What one peer has sent: gradients received but not applied yet, and how far that peer has got."""

    def __init__(self) -> None:
        self.pending: list[tuple[int, torch.Tensor]] = []  # (step, gradient), in step order
        self.through = -1  # every gradient of this peer's steps <= through has arrived
        self.ended = False
        self.receive: Handle | None = None


class StaleSynchronous(Strategy):
    name = "ssp"
    Options = SSPOptions
    collective_eval = False  # rank 0 evaluates its replica during training; nobody waits for it

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().setup(model, optimizer)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.numel = sum(p.numel() for p in self.params)
        self.channel = self.comm.channel()
        self.inboxes = {peer: Inbox() for peer in self.comm.ranks if peer != self.comm.rank}
        self.sends: list[tuple[Handle, torch.Tensor]] = []
        self.waits = 0
        self.last_step = -1
        for peer in self.inboxes:
            self._post_receive(peer)

    # -- the channel ---------------------------------------------------------------------------------------
    def _post_receive(self, peer: int) -> None:
        self.inboxes[peer].receive = self.channel.irecv(torch.empty(self.numel + 1), peer)

    def _take(self, peer: int) -> None:
        """Complete the posted receive from `peer` (waiting if needed), file the message, post the next."""
        inbox = self.inboxes[peer]
        if inbox.receive is None:
            raise CommError(f"ssp: worker {peer} ended its stream after step {inbox.through}, earlier than this one")
        message = inbox.receive.wait()
        step = float(message[-1])
        if step == END:
            inbox.ended, inbox.receive = True, None
            return
        if int(step) != inbox.through + 1:
            raise CommError(f"ssp: worker {peer} sent step {int(step)} after step {inbox.through} (stream broken)")
        inbox.pending.append((int(step), message[:-1]))
        inbox.through = int(step)
        self._post_receive(peer)

    def _collect(self) -> None:
        """File every message that has already arrived, without waiting."""
        for peer, inbox in self.inboxes.items():
            while inbox.receive is not None and inbox.receive.is_completed():
                self._take(peer)

    def _wait_for(self, step: int) -> None:
        """Block until every peer's gradients up to `step` have arrived (the staleness bound)."""
        for peer, inbox in self.inboxes.items():
            if inbox.through < step:
                self.waits += 1
            while inbox.through < step:
                self._take(peer)

    def _send(self, step: float, payload: torch.Tensor) -> None:
        message = torch.cat([payload.cpu(), torch.tensor([step])])
        for peer in self.inboxes:
            self.sends.append((self.channel.isend(message, peer), message))
        self.sends = [(h, m) for h, m in self.sends if not h.is_completed()]

    def _fold(self, up_to: int, applied_at: int) -> torch.Tensor:
        """The sum of pending peer gradients of steps <= `up_to`, removed from the inboxes."""
        total = torch.zeros(self.numel)
        for inbox in self.inboxes.values():
            while inbox.pending and inbox.pending[0][0] <= up_to:
                step, gradient = inbox.pending.pop(0)
                total += gradient
                self.staleness.append(applied_at - step)
        return total

    # -- the step --------------------------------------------------------------------------------------------
    def after_backward(self, step: int) -> None:
        own = flat_gradients(self.params)
        self._send(float(step), own)
        self._collect()
        self._wait_for(step - self.options.staleness)
        total = own + self._fold(up_to=step, applied_at=step).to(own.device)
        write_gradients(self.params, total / self.comm.size)
        self.last_step = step

    def end_of_run(self) -> None:
        """Apply every gradient still pending, then close each stream with an END message."""
        self._wait_for(self.last_step)
        if any(inbox.pending for inbox in self.inboxes.values()):
            late = self._fold(up_to=self.last_step, applied_at=self.last_step + 1)
            self.optimizer.zero_grad(set_to_none=True)
            write_gradients(self.params, late.to(self.params[0].device) / self.comm.size)
            self.optimizer.step()
        with self.channel.unmetered():  # control traffic: the payload is only the END mark
            self._send(END, torch.zeros(self.numel))
            for peer, inbox in self.inboxes.items():
                while not inbox.ended:
                    self._take(peer)
        for handle, _ in self.sends:
            handle.wait()
        self.sends = []

    # -- checkpoints ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Late peer gradients of steps up to now (waited for), so a resumed run still applies them once."""
        self._wait_for(self.last_step)
        late = {
            peer: [(s, g.clone()) for s, g in inbox.pending if s <= self.last_step]
            for peer, inbox in self.inboxes.items()
        }
        return {"late": late, "through": self.last_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for peer, inbox in self.inboxes.items():
            inbox.pending = list(state["late"].get(peer, []))
            inbox.through = state["through"]
        self.last_step = state["through"]

    def summary(self) -> dict[str, Any]:
        return {"staleness_bound": self.options.staleness, "bound_waits": self.waits}
