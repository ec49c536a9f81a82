"""`async-broadcast`: complete communication with unbounded delay, decentralised (Statement 1 of Viviani et al. 2019).

Every worker sends each update it applies (the change of its replica over its optimizer step, w_after -
w_before) to every other worker, and adds what it receives to its own replica when it arrives: a listener
thread queues incoming updates and the training thread adds the due ones before each step. Nobody waits
for anybody. At the end every worker tells the others how many updates it sent and takes in every update
still on its way, so, as Statement 1 says, all replicas then hold the same weights: each is the initial
model plus the sum of every update ever made (up to the order of floating-point additions).

Because the update itself travels, not the gradient, this holds for any local optimizer; with momentum or
Adam each worker's optimizer state follows its own gradients only. `scale = "mean"` (the default) shrinks
each update to 1/N of the local step before it is applied and sent, so that with no delay the replicas move
by the mean of the workers' steps, like synchronous SGD (the paper's large mini-batch); `scale = "sum"`
applies every worker's full step, as Downpour does (the effective learning rate grows with N).

`max_delay_ms` emulates slow links: each update is applied a random 0..max_delay_ms (seeded) after it
arrives, in order per sender. `staleness` records, for every update applied, how many updates the replica
held that the sender's replica did not when it made the update (from a vector clock sent with each update).

A worker may die (`survives_failures`): the others find out when an update (or the final count) sent to it
fails, or when it neither finishes nor answers a probe within the deadline (`fast.comm.messages`),
and send it nothing more. Its updates that reached a survivor are kept there. So the survivors' replicas
still agree at the end up to the dead worker's last updates: those on their way when it died may have
reached some survivors and not others.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Literal

import torch
from pydantic import Field
from torch import nn

from fast.comm import timing
from fast.errors import CommError
from fast.perfmodel import Link, StepCost
from fast.perfmodel.step import without_barrier
from fast.strategies.base import CompensationOptions
from fast.strategies.flat import FlatState
from fast.strategies.peers import AsyncPeers


class AsyncBroadcastOptions(CompensationOptions):
    max_delay_ms: float = Field(0.0, ge=0, description="emulated delay: updates wait a random 0..max_delay_ms")
    scale: Literal["mean", "sum"] = Field("mean", description="apply and send 1/N of each step, or all of it")


@dataclass
class Delivery:
    due: float
    sender: int
    clock: torch.Tensor  # how many updates of each worker the sender's replica held when it made this one
    update: torch.Tensor


class AsyncBroadcast(AsyncPeers):
    name = "async-broadcast"
    Options = AsyncBroadcastOptions
    tags = (0, 1)  # the mailbox's header and body

    @classmethod
    def cost(cls, n: float, workers: int, link: Link, compute_s: float, options: dict[str, Any]) -> StepCost:
        """Every update to the N−1 other workers through one NIC; no barrier."""
        return without_barrier(compute_s, (workers - 1) * link.message_time(n), (workers - 1) * n)

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().setup(model, optimizer)
        self.state = FlatState.of_replica(model)
        self.others = [rank for rank in self.comm.ranks if rank != self.comm.rank]
        self.applied = torch.zeros(self.comm.size, dtype=torch.int64)  # this replica's vector clock
        self.sent = 0
        self.lock = timing.Lock()  # guards the inbox between the listener and the training thread
        self.inbox: list[Delivery] = []
        self.delays = random.Random(f"fast.async-broadcast:{self.ctx.config.run.seed}:{self.comm.rank}")
        self.last_due = dict.fromkeys(self.others, 0.0)
        self.header_size = 1 + self.comm.size  # the kind, then the sender's vector clock
        self.open_mailbox(self.others, self.state.numel)

    def arrive(self, sender: int, header: torch.Tensor, update: torch.Tensor | None) -> None:
        """Listener thread: queue the update, due after its emulated delay (not before the sender's last)."""
        self.deaths.heard[sender] = int(header[1 + self.comm.index(sender)].item()) + 1
        delay = self.delays.uniform(0.0, self.options.max_delay_ms) / 1000
        due = max(self.last_due[sender], timing.now() + delay)
        self.last_due[sender] = due
        with self.lock:
            self.inbox.append(Delivery(due, sender, header[1:].to(torch.int64), update))

    def _apply_arrived(self, everything: bool = False) -> None:
        now = timing.now()
        with self.lock:
            ready = [d for d in self.inbox if everything or d.due <= now]
            self.inbox = [d for d in self.inbox if not (everything or d.due <= now)]
        for delivery in ready:
            self.staleness.append(int((self.applied - delivery.clock).clamp_min(0).sum()))
            self.state.add(delivery.update)
            self.applied[self.comm.index(delivery.sender)] += 1

    def before_step(self, step: int) -> None:
        super().before_step(step)
        self._apply_arrived()
        self.before = self.state.read()
        self.clock_at_read = self.applied.clone()

    def after_optimizer_step(self, step: int) -> None:
        update = self.state.read() - self.before
        if self.options.scale == "mean":
            update /= self.comm.size
            self.state.write(self.before + update)
        self.applied[self.comm.index()] += 1
        self.deaths.own_step = step + 1
        posted = []
        for peer in self.others:  # to everyone at once, then wait
            if peer not in self.dead:
                try:
                    posted.append((peer, self.mailbox.post_message(peer, self.clock_at_read.tolist(), update)))
                except CommError as e:
                    self.deaths.found(peer, str(e))
        for peer, handles in posted:
            try:
                for handle in handles:
                    self.mailbox.wait(handle)
            except CommError as e:
                self.deaths.found(peer, str(e))
        self.sent += 1

    def end_of_run(self) -> None:
        """Tell everyone how many updates we sent, take in every update still on its way (no delay now)."""
        self.say_done(self.others, lambda peer: [float(self.sent)] + [0.0] * (self.comm.size - 1))
        self.hear_everyone_done("updates", lambda sender: int(self.applied[self.comm.index(sender)]))

    def fold_in(self) -> None:
        self._apply_arrived(everything=True)

    def summary(self) -> dict[str, object]:
        return {"updates_per_replica": int(self.applied.sum())}
