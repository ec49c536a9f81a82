"""`async-broadcast`: complete communication with unbounded delay, decentralised (Statement 1, paper 000).

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
fails, or when it neither finishes nor answers a probe within the deadline (`fast.strategies.messages`),
and send it nothing more. Its updates that reached a survivor are kept there. So the survivors' replicas
still agree at the end up to the dead worker's last updates: those on their way when it died may have
reached some survivors and not others.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import Field
from torch import nn

from fast.errors import CommError
from fast.strategies.base import Strategy, StrategyOptions
from fast.strategies.flat import FlatState
from fast.strategies.messages import Channel, Listener, PeerDeaths


class AsyncBroadcastOptions(StrategyOptions):
    max_delay_ms: float = Field(0.0, ge=0, description="emulated delay: updates wait a random 0..max_delay_ms")
    scale: Literal["mean", "sum"] = Field("mean", description="apply and send 1/N of each step, or all of it")


@dataclass
class Delivery:
    due: float
    sender: int
    clock: torch.Tensor  # how many updates of each worker the sender's replica held when it made this one
    update: torch.Tensor


class AsyncBroadcast(Strategy):
    name = "async-broadcast"
    Options = AsyncBroadcastOptions
    collective_eval = False
    stops_alone = True
    survives_failures = True

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().setup(model, optimizer)
        self.state = FlatState.of_replica(model)
        self.others = [rank for rank in self.comm.ranks if rank != self.comm.rank]
        self.applied = torch.zeros(self.comm.size, dtype=torch.int64)  # this replica's vector clock
        self.sent = 0
        self.lock = threading.Lock()  # guards the inbox between the listener and the training thread
        self.inbox: list[Delivery] = []
        self.delays = random.Random(f"fast.async-broadcast:{self.ctx.config.run.seed}:{self.comm.rank}")
        self.last_due = dict.fromkeys(self.others, 0.0)
        self.channel = Channel(self.comm)
        self.deaths = PeerDeaths(self)
        header_size = 1 + self.comm.size
        self.listener = Listener(
            self.channel, self.others, header_size, self.state.numel, self._arrive, self.deaths.found
        )
        self.listener.start()

    def _arrive(self, sender: int, header: torch.Tensor, update: torch.Tensor | None) -> None:
        """Listener thread: queue the update, due after its emulated delay (not before the sender's last)."""
        self.deaths.heard[sender] = int(header[1 + self.comm.index(sender)].item()) + 1
        delay = self.delays.uniform(0.0, self.options.max_delay_ms) / 1000
        due = max(self.last_due[sender], time.monotonic() + delay)
        self.last_due[sender] = due
        with self.lock:
            self.inbox.append(Delivery(due, sender, header[1:].to(torch.int64), update))

    def _apply_arrived(self, everything: bool = False) -> None:
        now = time.monotonic()
        with self.lock:
            ready = [d for d in self.inbox if everything or d.due <= now]
            self.inbox = [d for d in self.inbox if not (everything or d.due <= now)]
        for delivery in ready:
            self.staleness.append(int((self.applied - delivery.clock).clamp_min(0).sum()))
            self.state.add(delivery.update)
            self.applied[self.comm.index(delivery.sender)] += 1

    def before_step(self, step: int) -> None:
        self.listener.check()
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
                    posted.append((peer, self.channel.post_message(peer, self.clock_at_read.tolist(), update)))
                except CommError as e:
                    self.deaths.found(peer, str(e))
        for peer, handles in posted:
            try:
                for handle in handles:
                    self.channel.wait(handle)
            except CommError as e:
                self.deaths.found(peer, str(e))
        self.sent += 1

    def end_of_run(self) -> None:
        """Tell everyone how many updates we sent, take in every update still on its way (no delay now)."""
        for peer in self.others:
            if peer not in self.dead:
                try:
                    self.channel.send_done(peer, [float(self.sent)] + [0.0] * (self.comm.size - 1))
                except CommError as e:
                    self.deaths.found(peer, str(e))
        self.listener.finish(self.dead, self.deaths.found)
        self._apply_arrived(everything=True)
        for sender, header in self.listener.done_headers.items():
            announced, applied = int(header[1].item()), int(self.applied[self.comm.index(sender)])
            if announced != applied:
                raise CommError(f"async-broadcast: worker {sender} sent {announced} updates but {applied} arrived")

    def summary(self) -> dict[str, object]:
        return {"updates_per_replica": int(self.applied.sum())}
