"""`ssp` with `exchange = "all-reduce"`: stale-synchronous parallel over an all-reduce, at `sync`'s bytes.

The all-reduce of step t's gradients starts at once, in the background, and its sum G_t is needed only at step
t + s, so up to s steps of compute hide its latency. At step t a worker gives its optimizer
(g_t + G_{t−s} − g_{t−s}) / N: its own gradient at once, and the others' of step t − s as soon as the bound asks
for them. As with the broadcast exchange, each replica then holds every update of steps ≤ t − s and its own; with
s = 0 the update is `sync`'s mean. At the end every worker waits for the sums still in flight and applies the
others' part of them in one more optimizer step, so every replica applies every gradient exactly once. A worker
whose gradient is not finite sends zeros and still applies the others' part. Staleness of the others' part
applied at step t: s (or less, at the end).
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch
from torch import nn

from fast.comm import Handle
from fast.perfmodel import Link, StepCost
from fast.perfmodel.step import collective, count
from fast.strategies.base import Strategy
from fast.strategies.flat import flat_gradients, write_gradients
from fast.strategies.ssp import StaleSynchronous


class SSPAllReduce(StaleSynchronous):
    variant_of = StaleSynchronous
    tags = ()
    averages_gradients = True  # a step whose own gradient was not finite still applies the others' part

    @classmethod
    def chosen_when(cls, options: dict[str, Any], codec: str) -> bool:
        return options.get("exchange") == "all-reduce"

    @classmethod
    def cost(cls, n: float, workers: int, link: Link, compute_s: float, options: dict[str, Any]) -> StepCost:
        """One all-reduce a step, as `sync`; with s >= 1 it runs behind the next steps' compute, so a step takes
        the longer of the two (the all-reduces queue on the links one after another)."""
        seconds, nbytes = collective(n, workers, link, options)
        overlapped = count(options, "staleness", 1, low=0) >= 1
        return StepCost(max(compute_s, seconds) if overlapped else compute_s + seconds, compute_s, seconds, nbytes)

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        Strategy.setup(self, model, optimizer)  # no listener: nothing arrives but the sums
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.channel = self.comm.separate_group()  # the sums in flight never wait behind another collective
        self.in_flight: deque[tuple[int, torch.Tensor, torch.Tensor, Handle]] = deque()
        self.waits = 0
        self.last_step = -1

    def _others(self, applied_at: int) -> torch.Tensor:
        """The others' part of the oldest sum in flight (waited for), recording its staleness."""
        step, own, total, handle = self.in_flight.popleft()
        if not handle.is_completed():
            self.waits += 1
        handle.wait()
        self.staleness.append(applied_at - step)
        return total.to(own.device) - own

    def after_backward(self, step: int) -> None:
        own = flat_gradients(self.params) if self.contributing else torch.zeros(sum(p.numel() for p in self.params))
        total = own.detach().to(self.channel.device, torch.float32, copy=True)
        self.in_flight.append((step, own, total, self.channel.all_reduce(total, async_op=True)))
        update = own.clone()
        while self.in_flight and self.in_flight[0][0] <= step - self.options.staleness:
            update += self._others(applied_at=step)
        write_gradients(self.params, update / self.comm.size)
        self.last_step = step

    def end_of_run(self) -> None:
        if not self.in_flight:
            return
        late = sum(self._others(applied_at=self.last_step + 1) for _ in range(len(self.in_flight)))
        self.optimizer.zero_grad(set_to_none=True)
        write_gradients(self.params, late / self.comm.size)
        self.optimizer.step()

    def state_dict(self) -> dict[str, Any]:
        """The sums still in flight (waited for) with this worker's part, so a resumed run applies them once."""
        for _, _, _, handle in self.in_flight:
            handle.wait()
        return {"in_flight": [(step, own.clone(), total.clone()) for step, own, total, _ in self.in_flight]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        done = Handle(None, "all_reduce", "the group", self.channel.deadline_s)
        self.in_flight = deque((step, own, total, done) for step, own, total in state.get("in_flight", []))
        if self.in_flight:
            self.last_step = self.in_flight[-1][0]

    def summary(self) -> dict[str, Any]:
        return {"staleness_bound": self.options.staleness, "bound_waits": self.waits, "exchange": "all-reduce"}
