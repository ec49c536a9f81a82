"""A new strategy with a server process, written outside FAST on its server protocol: asynchronous model averaging.

Every `period` steps a worker sends its weights to the server and takes back the server's model, which the
server first moves toward the worker's: w̃ ← w̃ + β (w − w̃), β = `mixing` (FedAsync's rule, Xie et al. 2019).
Nobody waits for anybody but the server. The protocol (fast.strategies.server) does the rest: the server's
loop, a worker lost or only slow, checkpoint snapshots, the final model to every worker.

    python examples/server_average.py      # trains digits on 3 workers and a server, prints the accuracy
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import Field

import fast
from fast.comm import Comm
from fast.comm.messages import DONE, MARKER, Mailbox
from fast.strategies import StrategyOptions
from fast.strategies.base import ModelLayout
from fast.strategies.elastic import CenterState
from fast.strategies.flat import FlatState
from fast.strategies.server import Line, Request, ServerStrategy

SEND, REPLY, START, LAST = 0, 2, 3, 4  # tags: weights on SEND (header) and SEND + 1 (body)


class ServerAverageOptions(StrategyOptions):
    period: int = Field(4, ge=1, description="steps between two exchanges with the server")
    mixing: float = Field(0.5, gt=0, le=1, description="β: how far the server moves toward each worker")


class ServerAverage(ServerStrategy):
    name = "server-average"
    Options = ServerAverageOptions
    state_key = "center"
    tags = (SEND, SEND + 1, REPLY, START, LAST)

    # -- workers -----------------------------------------------------------------------------------------------
    def setup(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().setup(model, optimizer)
        self.state, self.server, self.done_steps = FlatState.of_model(model), self.ctx.workers, 0
        self.center = self.state.read()
        self.mailbox = Mailbox(self.world)  # the server opens the same group
        if self.ctx.rank == 0:
            with self.mailbox.unmetered():
                self.mailbox.send(self.center, self.server, START)

    def after_optimizer_step(self, step: int) -> None:
        self.done_steps = step + 1
        if self.done_steps % self.options.period == 0:
            self.mailbox.send_message(self.server, [float(self.done_steps)], self.state.read(), tag=SEND)
            self.state.write(self.mailbox.recv(self.center, self.server, REPLY))

    def end_of_run(self) -> None:
        self.mailbox.send_done(self.server, [0.0], tag=SEND)
        self.state.write(self.mailbox.recv(self.center, self.server, LAST, deadline_s=3 * self.mailbox.deadline_s))

    def state_dict(self) -> dict[str, Any]:
        with self.mailbox.unmetered():  # the checkpoint marker, behind this worker's exchanges
            self.mailbox.send_marker(self.server, [float(self.done_steps)], tag=SEND)
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.ctx.rank >= self.ctx.workers:
            self.load_server_state(state)

    # -- the server --------------------------------------------------------------------------------------------
    def open(self, layout: ModelLayout) -> CenterState:
        self.mailbox = Mailbox(self.world)
        self.center = torch.zeros(layout.state)
        with self.mailbox.unmetered():
            self.mailbox.recv(self.center, 0, START)
        return CenterState(self.center, self.ctx.workers)

    def lines(self) -> list[Line]:
        return [Line(self.mailbox.comm, None, self.read)]

    def read(self, comm: Comm, peer: int | None) -> Request:
        header = torch.zeros(2, dtype=torch.float64)
        worker = comm.recv_from(header, tag=SEND)
        if header[0] == DONE:
            return Request(worker, "done")
        if header[0] == MARKER:
            return Request(worker, "marker", int(header[1]))
        return Request(worker, "work", int(header[1]), comm.recv(torch.empty_like(self.center), worker, SEND + 1))

    def answer(self, request: Request) -> None:
        with self.snapshots.applying(request.sender) as states:
            for state in states:
                state.apply(request.sender, request.data, self.options.mixing)
        self.mailbox.send(self.center, request.sender, REPLY)

    def farewell(self, worker: int) -> None:
        self.mailbox.send(self.center, worker, LAST)

    def summary(self) -> dict[str, Any]:
        return {"server_updates": self.live.total()} if self.ctx.rank >= self.ctx.workers else {}


if __name__ == "__main__":
    summary = fast.train(
        data__name="digits",
        model__name="mlp",
        run__workers=3,
        run__epochs=4,
        run__batch_size=16,
        strategy__name="server-average",
        out="runs/server-average",
    )
    print(f"server-average: test accuracy {summary['final_test_accuracy']:.3f}, {summary['bytes_sent']} bytes sent")
