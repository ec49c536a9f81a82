"""`easgd` and `eamsgd` with `variant = "async"`: the round-robin asynchronous EASGD, with a master process.

The master (rank run.workers) holds the center w̃. Every `tau` steps a worker sends it wᵢ and gets the center
back; the master applies w̃ ← w̃ + α(wᵢ − w̃) for each arriving worker, one at a time (in arrival order), and the
worker applies wᵢ ← wᵢ − α(wᵢ − w̃) with the same w̃ (α as in fast.strategies.easgd). Staleness: for each center
update, the updates other workers made to the center since this worker's previous exchange.

It runs on the server protocol (fast.strategies.server): a worker that dies is recorded at the steps it had
done at its last exchange and forgotten, its past pulls staying in the center; one only slow that speaks again
is taken back; the master finishes when every live worker is done and sends each the final center. The run's
end averages the survivors' replicas, so with `final_model = "average"` every worker first loads the center.

Checkpoints: a worker's holds its copy of the center; the master's (`CenterState`) is a consistent snapshot cut
by the CHECKPOINT markers each worker sends behind its exchanges after its own checkpoint of a step.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fast.comm import Comm
from fast.comm.messages import DONE as DONE_HEADER
from fast.comm.messages import MARKER as MARKER_HEADER
from fast.comm.messages import Mailbox
from fast.perfmodel import Link, StepCost
from fast.perfmodel.step import count, server_exchange_s
from fast.strategies.base import ModelLayout
from fast.strategies.easgd import EAMSGD, EASGD, EAMSGDOptions, EASGDOptions, moving_rate, use_nesterov
from fast.strategies.elastic import CenterState, ReportsCenter
from fast.strategies.flat import FlatState
from fast.strategies.server import DONE, MARKER, WORK, Line, Request, ServerStrategy

EXCHANGE_TAG, CENTER_TAG, INIT_TAG, FINAL_TAG = 0, 2, 3, 4  # exchanges and markers on 0 (header) and 1 (weights)


class AsyncEASGD(ReportsCenter, ServerStrategy):
    name = "easgd"
    registered = False
    variant_of = EASGD
    Options = EASGDOptions
    state_key = "center"
    tags = (EXCHANGE_TAG, EXCHANGE_TAG + 1, CENTER_TAG, INIT_TAG, FINAL_TAG)
    cost_options = frozenset({"tau", "variant"})

    @classmethod
    def chosen_when(cls, options: dict[str, Any], codec: str) -> bool:
        return options.get("variant") == "async"

    @classmethod
    def check(cls, options: EASGDOptions, config: Any) -> None:
        EASGD.check(options, config)

    @classmethod
    def cost(cls, n: float, workers: int, link: Link, compute_s: float, options: dict[str, Any]) -> StepCost:
        """Every tau steps a worker sends its weights to the master and waits for the center."""
        tau = count(options, "tau", None, low=1)
        own, busiest = server_exchange_s(n, workers, 1, link, 1 / tau, 1 / tau)
        return StepCost(max(compute_s + own, busiest), compute_s, max(own, busiest), 2 * n / tau)

    def __init__(self, options: EASGDOptions, ctx: Any) -> None:
        super().__init__(options, ctx)
        self.alpha = moving_rate(options, ctx.config)
        self.master = ctx.workers
        self.exchanges = self.done_steps = 0

    # -- workers ---------------------------------------------------------------------------------------------
    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().setup(model, optimizer)
        self.state = FlatState.of_model(model)
        self.center = self.state.read().cpu()
        self.mailbox = Mailbox(self.world)  # the master opens the same group
        if self.comm.rank == self.comm.ranks[0]:  # the starting center (set-up traffic, not counted)
            with self.mailbox.unmetered():
                self.mailbox.send(self.center, self.master, INIT_TAG)

    @torch.no_grad()
    def after_backward(self, step: int) -> None:
        if step > 0 and step % self.options.tau == 0:
            weights = self.state.read()
            self.mailbox.send_message(self.master, [float(step)], weights, tag=EXCHANGE_TAG)
            self.mailbox.recv(self.center, self.master, CENTER_TAG)
            self.state.write(weights - self.alpha * (weights - self.center.to(weights.device)))
            self.exchanges += 1

    def after_optimizer_step(self, step: int) -> None:
        self.done_steps = step + 1

    def end_of_run(self) -> None:
        self.mailbox.send_done(self.master, [0.0], tag=EXCHANGE_TAG)
        # the master answers when every worker is done or taken for dead, which takes it up to a deadline
        self.mailbox.recv(self.center, self.master, FINAL_TAG, deadline_s=3 * self.mailbox.deadline_s)
        if self.options.final_model == "average":  # the end of the run averages replicas: make it the center
            self.state.write(self.center.to(self.state.tensors[0].device))

    def state_dict(self) -> dict[str, Any]:
        """The worker's copy of the center; first, its CHECKPOINT marker for this step, behind its exchanges."""
        with self.mailbox.unmetered():
            self.mailbox.send_marker(self.master, [float(self.done_steps)], tag=EXCHANGE_TAG)
        return {"center": self.center.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.on_server:
            self.load_server_state(state)
        else:
            self.center.copy_(state["center"])

    def summary(self) -> dict[str, Any]:
        if self.on_server:
            return {"center_updates": self.live.total()}
        reported = "center" if self.options.final_model == "average" else self.options.final_model
        return {"final_model": reported, "moving_rate": self.alpha, "elastic_exchanges": self.exchanges}

    # -- the master --------------------------------------------------------------------------------------------
    def open(self, layout: ModelLayout) -> CenterState:
        self.mailbox = Mailbox(self.world)
        self.center = torch.zeros(layout.state)
        with self.mailbox.unmetered():
            self.mailbox.recv(self.center, 0, INIT_TAG)
        self.heard: dict[int, int] = {}
        return CenterState(self.center, self.ctx.workers)

    def lines(self) -> list[Line]:
        return [Line(self.mailbox.comm, None, self._read)]

    def _read(self, comm: Comm, peer: int | None) -> Request:
        head = torch.zeros(2, dtype=torch.float64)
        sender = comm.recv_from(head, tag=EXCHANGE_TAG)
        if head[0].item() == DONE_HEADER:
            return Request(sender, DONE)
        if head[0].item() == MARKER_HEADER:
            return Request(sender, MARKER, int(head[1].item()))
        weights = comm.recv(torch.empty(self.center.numel()), sender, tag=EXCHANGE_TAG + 1)
        return Request(sender, WORK, int(head[1].item()), weights)

    @torch.no_grad()
    def answer(self, request: Request) -> None:
        """The center to the worker, then the center (and every snapshot under way of a step the worker has not
        reached) moved toward it."""
        self.heard[request.sender] = request.step
        self.mailbox.send(self.center, request.sender, CENTER_TAG)
        with self.snapshots.applying(request.sender) as states:
            for state in states:
                state.apply(request.sender, request.data, self.alpha)

    def farewell(self, sender: int) -> None:
        self.mailbox.send(self.center, sender, FINAL_TAG)

    def last_step(self, sender: int) -> int:
        return self.heard.get(sender, 0)


class AsyncEAMSGD(AsyncEASGD):
    name = "eamsgd"
    registered = False
    variant_of = EAMSGD
    Options = EAMSGDOptions

    @classmethod
    def check(cls, options: EAMSGDOptions, config: Any) -> None:
        EAMSGD.check(options, config)

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().setup(model, optimizer)
        use_nesterov(optimizer, self.options.momentum)
