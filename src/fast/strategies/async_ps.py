"""`async-ps`: Downpour-style asynchronous SGD on parameter servers (Wongpanich et al. 2020's "1 S + 16 W").

`servers = k` server processes (ranks run.workers ..) each own a contiguous range of the flat parameters
(fast.strategies.shard) and apply updates with their own SGD (`server_lr`, default the run's lr; `server_momentum`,
default none: asynchrony adds its own, Mitliagkas et al. 2016). Every `push_every` steps a worker sends each
server its slice of the gradients summed since its last push; every `pull_every` steps it fetches the weights.
The workers' optimizer does not step unless `local_steps`. `staleness_lr` divides each update by its staleness
(Zhang et al. 2016); `delay_compensation = λ` applies DC-ASGD (Zheng et al. 2017). A `[codec]` encodes pushes.

In a live run (`run.membership = "live"`) the workers join and leave alone (fast.runtime.detached): each on a line of
its own to the servers (ranks 1.. of it), a joiner catching up with a pull.

On the server protocol (fast.strategies.server): a dead worker is forgotten; at the end each worker pushes what it
has, says DONE (with its lost pulls) and gets the final weights and the servers' figures. On a lossy emulated
link a lost push is an update skipped, a lost pull keeps the replica's slice. A worker's CHECKPOINT marker,
behind its pushes, cuts each server's snapshot, so a resume applies every push once.
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import Field
from torch import nn

from fast.codecs import Codec
from fast.comm import Comm, Handle, MessageLost, timing
from fast.comm.patience import PatientGroup
from fast.config import Config
from fast.errors import ConfigError
from fast.exchange.encoded import isend_encoded, recv_encoded
from fast.perfmodel import Link, StepCost
from fast.perfmodel.step import count, server_exchange_s
from fast.strategies.base import CompensationOptions, ModelLayout
from fast.strategies.flat import FlatState, flat_gradients
from fast.strategies.server import DONE as DONE_REQUEST
from fast.strategies.server import MARKER, WORK, Line, Request, ServerStrategy
from fast.strategies.shard import ShardState, compensated_gradient, shard_bounds

__all__ = ["AsyncPS", "AsyncPSOptions", "ShardState", "compensated_gradient", "shard_bounds"]

PUSH, PULL, DONE, CHECKPOINT = 1, 2, 3, 4
HEADER_TAG, PAYLOAD_TAG, FINAL_TAG, STATS_TAG = 11, 12, 13, 15


class AsyncPSOptions(CompensationOptions):
    servers: int = Field(1, ge=1, description="server processes; the parameters are sharded across them")
    push_every: int = Field(1, ge=1, description="steps between gradient pushes")
    pull_every: int = Field(1, ge=1, description="steps between weight pulls")
    server_lr: float | None = Field(None, gt=0, description="the servers' learning rate; default optimizer.lr")
    server_momentum: float = Field(0.0, ge=0, lt=1, description="the servers' momentum; asynchrony adds its own")
    local_steps: bool = Field(False, description="workers' optimizer also steps the replica between pulls")
    staleness_lr: bool = Field(False, description="divide each server update by its staleness")
    delay_compensation: float = Field(0.0, ge=0, description="DC-ASGD lambda; 0 = off")


class AsyncPS(ServerStrategy):
    name = "async-ps"
    Options = AsyncPSOptions
    replicas_differ = False  # at the end every replica holds the servers' weights
    state_key = "shard"
    tags = (HEADER_TAG, PAYLOAD_TAG, FINAL_TAG, STATS_TAG)
    cost_options = frozenset({"servers", "push_every", "pull_every"})
    joins = True
    joins_alone = True
    joins_when = "any step, each worker alone (its own lines to the servers)"

    @classmethod
    def server_count(cls, options: AsyncPSOptions, workers: int) -> int:
        return options.servers

    @classmethod
    def check(cls, options: AsyncPSOptions, config: Config) -> None:
        if options.servers > config.run.workers:
            raise ConfigError(
                f"`strategy.servers` = {options.servers}: more servers than workers "
                f"({config.run.workers}); use at most run.workers servers"
            )

    @classmethod
    def accepts_codec(cls, codec: Codec) -> bool:
        return codec.fixed_size and not codec.low_rank  # slices in frames of a size the server knows in advance

    @classmethod
    def cost(cls, n: float, workers: int, link: Link, compute_s: float, options: dict[str, Any]) -> StepCost:
        """A worker pushes and pulls through its NIC and waits for its pull; each server's busier direction."""
        servers = count(options, "servers", 1, low=1)
        pushes = 1 / count(options, "push_every", 1, low=1)
        pulls = 1 / count(options, "pull_every", 1, low=1)
        own, busiest = server_exchange_s(n, workers, servers, link, pushes, pulls)
        return StepCost(max(compute_s + own, busiest), compute_s, max(own, busiest), (pushes + pulls) * n)

    def _layout(self, numel: int) -> None:
        self.numel = numel
        first = 1 if self.ctx.config.run.live else self.ctx.workers  # (a detached worker's line: it, then them)
        self.servers = list(range(first, first + self.options.servers))
        self.bounds = shard_bounds(numel, self.options.servers)
        self.codec = self.make_codec()
        self.line = PatientGroup(self.world)  # requests, weights, the end: one line that never times gloo out
        self.lines_of_members: dict[int, PatientGroup] = {}  # a server's, to a live run's detached workers
        self.one_at_a_time = timing.Lock()  # requests read on several lines are answered as one line's are

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().setup(model, optimizer)
        self.params = FlatState.of_parameters(model)
        self._layout(self.params.numel)
        self.accumulated = torch.zeros(self.numel, device=self.ctx.device)
        self.pulled = torch.empty(self.numel, device=self.ctx.device)
        self.steps_since_push = self.done_steps = 0
        self.lost_from = [0] * len(self.servers)  # pulls whose answer was lost, per server
        self.totals: dict[str, int] = {}  # the servers' figures, handed over at the end
        self.compensation = None  # the servers' momentum is compensated (fast.strategies.shard), not the workers'
        if self.ctx.rank == 0:  # the servers start from the workers' common initial weights
            flat = self.params.read()
            with self.line.unmetered():
                for server, (start, end) in zip(self.servers, self.bounds, strict=True):
                    self.line.send(flat[start:end].contiguous(), server, FINAL_TAG)

    def catch_up(self) -> None:
        """The servers' weights (a live run's worker, at its start)."""
        self._exchange(PULL, True)

    def gradients_stay_local(self, step: int) -> bool:
        return True  # until the optimizer steps (below), where FAST's guard has cleared a non-finite one

    def before_optimizer_step(self) -> None:
        # the gradients are taken as the optimizer would see them: after a GradScaler's unscale_ and the loop's
        # clipping (at backward they are still scaled), and not at all when a GradScaler skips the step
        super().before_optimizer_step()
        params = list(self.model.parameters())
        self.accumulated += flat_gradients(params).detach()
        if not self.options.local_steps:  # the local optimizer then skips every parameter
            for p in params:
                p.grad = None
        self.steps_since_push += 1

    def after_optimizer_step(self, step: int) -> None:
        done = self.done_steps = step + 1
        push, pull = done % self.options.push_every == 0, done % self.options.pull_every == 0
        if push or pull:
            self._exchange(PUSH if push else PULL, pull)

    def _exchange(self, kind: int, pull: bool) -> None:
        """A push (or a pull request) to every server at once, then the weights if asked."""
        header = torch.tensor([kind, int(pull)], dtype=torch.int64)
        pending, pulls = [], []
        for server, (start, end) in zip(self.servers, self.bounds, strict=True):
            pending.append(self.line.comm.isend(header, server, tag=HEADER_TAG))
            if kind == PUSH:
                pending.append(self._push(self.accumulated[start:end], server))
            if pull:
                pulls.append(self.line.comm.irecv(self.pulled[start:end], server, tag=PAYLOAD_TAG))
        for handle in pending:
            self.line.wait(handle)
        for i, handle in enumerate(pulls):
            try:
                self.line.wait(handle)
            except MessageLost:  # not a death: that server's answer did not arrive
                start, end = self.bounds[i]
                self.pulled[start:end] = self.params.read()[start:end]
                self.lost_from[i] += 1
        if kind == PUSH:
            self.accumulated.zero_()
            self.steps_since_push = 0
        if pull:
            self.params.write(self.pulled)

    def _push(self, gradient: torch.Tensor, server: int) -> Handle:  # droppable: a lost push is an update skipped
        if self.codec is None:
            return self.line.comm.isend(gradient, server, tag=PAYLOAD_TAG, droppable=True)
        return isend_encoded(self.line.comm, gradient, server, self.codec, f"server{server}", tag=PAYLOAD_TAG,
                             droppable=True)  # fmt: skip

    def end_of_run(self) -> None:
        if self.steps_since_push:
            self._exchange(PUSH, False)
        pending, figures = [], torch.zeros(len(self.servers), 4, dtype=torch.int64)
        for i, (server, (start, end)) in enumerate(zip(self.servers, self.bounds, strict=True)):
            header = torch.tensor([DONE, self.lost_from[i]], dtype=torch.int64)  # DONE tells the lost pulls
            pending.append((self.line.comm.isend(header, server, tag=HEADER_TAG), 1))
            pending.append((self.line.comm.irecv(self.pulled[start:end], server, tag=FINAL_TAG), 3))
        for handle, patience in pending:  # the servers answer when every worker is done or taken for dead
            self.line.wait(handle, patience * self.line.deadline_s)
        with self.line.unmetered():  # each server's figures, right behind its final weights
            for i, server in enumerate(self.servers):
                self.line.recv(figures[i], server, STATS_TAG, 3 * self.line.deadline_s)
        totals = figures.sum(0).tolist()
        self.totals = dict(zip(("pushes", "lost_pushes", "pulls", "lost_pulls"), totals, strict=True))
        # running statistics (batch norm) never reach the servers: the end of the run averages them
        self.params.write(self.pulled)

    def state_dict(self) -> dict[str, Any]:
        """A worker's part of a checkpoint (gradients not pushed yet, its codec); first, its CHECKPOINT marker."""
        marker = torch.tensor([CHECKPOINT, self.done_steps], dtype=torch.int64)
        with self.line.unmetered():
            for server in self.servers:
                self.line.send(marker, server, HEADER_TAG)
        lost = torch.tensor(self.lost_from, dtype=torch.int64)
        state = {"accumulated": self.accumulated.clone(), "steps_since_push": self.steps_since_push, "lost_from": lost}
        return state | ({"codec": self.codec.state_dict()} if self.codec is not None else {})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.on_server:
            return self.load_server_state(state)
        self.accumulated.copy_(state["accumulated"])
        self.steps_since_push = int(state["steps_since_push"])
        self.lost_from = [int(n) for n in state.get("lost_from", torch.zeros(len(self.servers))).tolist()]
        if self.codec is not None and "codec" in state:
            self.codec.load_state_dict(state["codec"])

    def summary(self) -> dict[str, Any]:  # a server's updates applied; a worker's totals over the servers
        return self.live.figures_for_summary() if self.on_server else dict(self.totals)

    def open(self, layout: ModelLayout) -> ShardState:
        self._layout(layout.parameters)
        start, end = self.bounds[self.ctx.rank - self.ctx.workers]
        line, rank = self._to(0)
        with line.unmetered():
            shard = line.recv(torch.empty(end - start, device=self.ctx.device), rank, FINAL_TAG)
        cfg, lr = self.ctx.config.optimizer, self.options.server_lr
        return ShardState(shard, self.options, lr or cfg.lr, cfg.weight_decay, self.ctx.workers, cfg.momentum)

    def lines(self) -> list[Line]:
        return [Line(self.line.comm, None, self._read)]

    def line_of(self, member: int) -> Line:
        return Line(self._to(member)[0].comm, member, self._read)

    def _to(self, worker: int) -> tuple[PatientGroup, int]:
        """A server's line to `worker` and the worker's rank on it: the one line of every worker, or an elastic
        run's detached worker's own (where it is rank 0)."""
        if self.ctx.lines is None:
            return self.line, worker
        if worker not in self.lines_of_members:
            self.lines_of_members[worker] = PatientGroup(self.ctx.lines.line(worker))
            if getattr(self, "live", None) is not None:
                self.live.admit(worker)
        return self.lines_of_members[worker], 0

    def _read(self, comm: Comm, peer: int | None) -> Request:
        head = torch.zeros(2, dtype=torch.int64)
        source = comm.recv_from(head, tag=HEADER_TAG)  # no deadline: a worker may be quiet for long
        worker = source if peer is None else peer
        kind, arg = (int(v) for v in head)
        if kind in (DONE, CHECKPOINT):
            return Request(worker, DONE_REQUEST, data=arg) if kind == DONE else Request(worker, MARKER, arg)
        gradient = None
        if kind == PUSH:
            shape = self.live.shard.shape
            line, rank = self._to(worker)
            try:
                if self.codec is None:
                    gradient = line.recv(torch.empty(shape, device=self.ctx.device), rank, PAYLOAD_TAG)
                else:
                    gradient = recv_encoded(comm, self.codec, shape, rank, tag=PAYLOAD_TAG)
            except MessageLost:  # not a death: the update is skipped
                gradient = MessageLost
        return Request(worker, WORK, data=(kind, bool(arg), gradient))

    def answer(self, request: Request) -> None:
        """A push (its update, or a skip if the gradient was lost on its link), then a pull's answer (droppable)."""
        kind, pull, gradient = request.data
        with self.one_at_a_time, self.snapshots.applying(request.sender) as states:
            for state in states:
                if gradient is MessageLost:
                    state.skip()
                elif gradient is not None:
                    state.apply(request.sender, gradient)
            if pull:
                sent = self.live.shard.detach()
                line, rank = self._to(request.sender)
                line.send(sent, rank, PAYLOAD_TAG, droppable=True)
                for state in states:
                    state.pulled(request.sender, sent)

    def finished(self, request: Request) -> None:
        self.live.lost_pulls += request.data  # as the worker counted them

    def farewell(self, worker: int) -> None:
        line, rank = self._to(worker)
        line.send(self.live.shard.detach(), rank, FINAL_TAG)
        with line.unmetered():
            line.send(self.live.figures(), rank, STATS_TAG)

    def last_step(self, worker: int) -> int:  # the last of its steps whose gradient this server applied
        return self.live.updates_from.get(worker, 0) * self.options.push_every
