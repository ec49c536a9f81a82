"""`ea-wild`: elastic averaging with lock-free updates of the center (Wongpanich et al. 2020, Algorithm 1).

A master process (rank run.workers) holds the center w̃. Workers are split into groups of `group_size`
consecutive ranks that train synchronously inside the group (their gradients are averaged every step, so the
members' weights stay equal); the first member of each group, its leader, talks to the master. Every `tau`
steps the leader sends the group's weights wʲ and receives the center; the master applies
w̃ ← w̃ + ηρ(wʲ − w̃) for each arriving group without a lock (one handler thread per group updates the same
center tensor in place), and every member applies the elastic pull wʲ ← wʲ − ηρ(wʲ − w̃) on top of its
optimizer's step, so with plain SGD one step is the paper's wʲ ← wʲ − ηρ(wʲ − w̃) − ηΔwʲ. η is the
optimizer's learning rate, ρ is `rho`. The exchange starts before the forward pass and completes after the
optimizer step, so it overlaps the gradient computation. Floating-point buffers travel with the parameters.

Staleness, recorded by the master for each center update (and sent back with the center under
`momentum_compensation`): the updates other groups made to the center since this group's previous exchange.
The reported model is the center (the master's final one, sent to every group); rank 0 evaluates its last one.

On the server protocol (fast.strategies.server) with a line per group: a group whose link closes (or that stays
silent past the deadline) is forgotten, its last exchanges staying in the center, and the others go on. A group
trains synchronously, so a member's death ends its whole group; rank 0's stays fatal. Checkpoints: a worker's
holds the last center it received; the master's (`fast.strategies.elastic.CenterState`) is a consistent snapshot
cut by the CHECKPOINT markers each leader sends on its own link after its checkpoint of a step
(fast.strategies.snapshots). Groups at their own pace may hold no step in common; then each process resumes from
its own newest file (`stops_alone`).
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import Field
from torch import nn

from fast.comm import Comm
from fast.config import Config
from fast.errors import CommError, ConfigError
from fast.perfmodel import Link, StepCost, allreduce_cost
from fast.perfmodel.allreduce import group_sizes
from fast.perfmodel.step import count, server_exchange_s
from fast.strategies.base import CompensationOptions, ModelLayout
from fast.strategies.elastic import CenterState, center_model
from fast.strategies.flat import FlatState, flat_gradients, write_gradients
from fast.strategies.server import DONE as DONE_REQUEST
from fast.strategies.server import MARKER, WORK, Line, Request, ServerStrategy

EXCHANGE, DONE, CHECKPOINT = 1, 2, 3  # a header; CHECKPOINT is followed by the step (int64), EXCHANGE by weights
TAG, FINAL_TAG = 21, 22


class EAWildOptions(CompensationOptions):
    rho: float = Field(2.0, gt=0, description="elastic coefficient ρ; the moving rate is optimizer.lr * rho")
    tau: int = Field(1, ge=1, description="steps between exchanges with the master")
    group_size: int = Field(1, ge=1, description="workers per synchronous group; must divide run.workers")


class EAWild(ServerStrategy):
    name = "ea-wild"
    Options = EAWildOptions
    replicas_differ = False  # every replica ends holding the center
    state_key = "center"
    tags = (TAG, FINAL_TAG)
    cost_options = frozenset({"tau", "group_size", "inner_link"})

    @classmethod
    def check(cls, options: EAWildOptions, config: Config) -> None:
        if config.run.workers % options.group_size:
            raise ConfigError(
                f"`strategy.group_size` = {options.group_size} does not divide run.workers = "
                f"{config.run.workers}: choose a group size that divides the number of workers"
            )
        if config.optimizer.lr * options.rho >= 1:
            raise ConfigError(
                f"`strategy.rho` = {options.rho:g}: the moving rate optimizer.lr * rho = "
                f"{config.optimizer.lr * options.rho:g} must be below 1; lower rho"
            )

    @classmethod
    def cost(cls, n: float, workers: int, link: Link, compute_s: float, options: dict[str, Any]) -> StepCost:
        """Each group ring-all-reduces every step over the inner link (a barrier inside the group), and its leader
        exchanges with the master every tau steps while the group computes."""
        tau = count(options, "tau", None, low=1)
        group_size = count(options, "group_size", 1, low=1, high=workers)
        inner_link = options.get("inner_link") or link
        sizes = group_sizes(workers, group_size)
        in_group_s = allreduce_cost(n, max(sizes), inner_link)[0]
        in_group_bytes = sum(allreduce_cost(n, size, inner_link)[1] * size for size in sizes)
        own, busiest = server_exchange_s(n, len(sizes), 1, link, 1 / tau, 1 / tau)
        total_bytes = in_group_bytes + len(sizes) * 2 * n / tau
        step_s = max(compute_s + in_group_s, own, busiest)
        return StepCost(step_s, compute_s, in_group_s + max(own, busiest), total_bytes / workers)

    # -- shared by workers and the master: the same groups, created in the same order ---------------------------
    def _groups(self, center: torch.Tensor) -> None:
        workers, size = self.ctx.workers, self.options.group_size
        self.master = workers
        self.leaders = list(range(0, workers, size))
        self.alpha = self.ctx.config.optimizer.lr * self.options.rho
        self.group: Comm | None = None
        if size > 1:
            self.group = self.world.subgroups([list(range(r, r + size)) for r in self.leaders])
        links = {leader: self.world.subgroups([[leader, self.master]]) for leader in self.leaders}  # in order
        self.links: dict[int, Comm] = {leader: link for leader, link in links.items() if link is not None}
        self.center = center

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().setup(model, optimizer)
        self.state = FlatState.of_model(model)
        self._groups(self.state.read())
        self.leader = self.ctx.rank - self.ctx.rank % self.options.group_size
        # a member whose gradient was not finite still steps with the group's average, to stay identical
        self.averages_gradients = self.group is not None
        self.link = self.links.get(self.ctx.rank)
        self.received_center = False
        self.pending: list[Any] = []
        self.done_steps = 0
        self.exchange_staleness = torch.zeros(1, dtype=torch.int64)
        if self.ctx.rank == 0:  # the master starts from the workers' common initial weights
            with self.world.unmetered():
                self.link.send(self.center, self.master, tag=TAG)

    def before_step(self, step: int) -> None:
        if step % self.options.tau:
            return
        self.sent = self.state.read()
        if self.link is not None:
            header = torch.tensor([EXCHANGE], dtype=torch.int64)
            self.pending = [
                self.link.isend(header, self.master, tag=TAG),
                self.link.isend(self.sent, self.master, tag=TAG),
                self.link.irecv(self.center, self.master, tag=TAG),
            ]
            if self.options.momentum_compensation:  # and the exchange's staleness, for asynchrony-aware momentum
                self.pending.append(self.link.irecv(self.exchange_staleness, self.master, tag=TAG))

    def after_backward(self, step: int) -> None:
        if self.group is None:
            return
        params = [p for p in self.model.parameters() if p.grad is not None]
        grads = flat_gradients(params)
        try:
            self.group.all_reduce(grads, op="mean")
        except CommError as e:
            raise self._group_broken(e) from None
        write_gradients(params, grads)

    def after_optimizer_step(self, step: int) -> None:
        self.done_steps = step + 1
        if step % self.options.tau:
            return
        for handle in self.pending:
            handle.wait()
        self.pending = []
        if self.group is not None:
            try:
                self.group.broadcast(self.center, src=self.leader)
            except CommError as e:
                raise self._group_broken(e) from None
        self.received_center = True
        self.state.add((self.center - self.sent).mul_(self.alpha))
        if self.options.momentum_compensation:  # the leader's measure holds for its whole group
            if self.group is not None:
                self.group.broadcast(self.exchange_staleness, src=self.leader)
            self.staleness.append(int(self.exchange_staleness))

    def _group_broken(self, cause: CommError) -> CommError:
        why = "a group trains synchronously, so it stops (the others go on, unless it holds worker 0)"
        return CommError(f"ea-wild: group {self.group.ranks} lost a member ({cause}); {why}")

    def end_of_run(self) -> None:
        if self.link is not None:
            self.link.send(torch.tensor([DONE], dtype=torch.int64), self.master, tag=TAG)
            self.link.recv(self.center, self.master, tag=FINAL_TAG)
        if self.group is not None:
            self.group.broadcast(self.center, src=self.leader)
        self.state.write(self.center)

    def state_dict(self) -> dict[str, Any]:
        """A worker's part of a checkpoint: the last center it received. Called at a checkpoint step, when its
        exchanges so far have completed, a leader first sends the master its CHECKPOINT marker for that step."""
        if self.link is not None:
            with self.link.unmetered():
                self.link.send(torch.tensor([CHECKPOINT], dtype=torch.int64), self.master, tag=TAG)
                self.link.send(torch.tensor([self.done_steps], dtype=torch.int64), self.master, tag=TAG)
        return {"center": self.center.clone(), "received_center": self.received_center}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A worker's checkpoint, or the master's snapshot (its own file, written through `ctx.save_checkpoint`)."""
        if self.on_server:
            self.load_server_state(state)
            return
        self.center.copy_(state["center"])
        self.received_center = bool(state["received_center"])

    def eval_model(self) -> nn.Module:
        """Rank 0's view of the center during training: the last center it received."""
        return center_model(self.model, self.center) if self.received_center else self.model

    def senders(self) -> list[int]:
        return self.leaders

    def open(self, layout: ModelLayout) -> CenterState:
        self._groups(torch.zeros(layout.state))
        with self.world.unmetered():
            self.links[0].recv(self.center, 0, tag=TAG)
        return CenterState(self.center, len(self.leaders))

    def lines(self) -> list[Line]:
        """A line per group, each read by a handler thread of its own: they update the center without a lock."""
        return [Line(self.links[leader], leader, self._read) for leader in self.leaders]

    def _read(self, link: Comm, leader: int | None) -> Request:
        head = torch.zeros(1, dtype=torch.int64)
        link.recv(head, leader, tag=TAG)  # its own link: a timeout here closes no other group's connections
        kind = int(head)
        if kind == CHECKPOINT:  # its exchanges of the steps before have been applied
            step = torch.zeros(1, dtype=torch.int64)
            with link.unmetered():
                link.recv(step, leader, tag=TAG)
            return Request(leader, MARKER, int(step))
        if kind == DONE:
            return Request(leader, DONE_REQUEST)
        weights = torch.empty_like(self.center)
        link.recv(weights, leader, tag=TAG)
        return Request(leader, WORK, data=weights)

    def answer(self, request: Request) -> None:
        """The center before this group's update goes back; w̃ ← w̃ + ηρ(wʲ − w̃), racing the other handlers (on
        the live center, and on a snapshot under way)."""
        leader, index = request.sender, self.leaders.index(request.sender)
        link = self.links[leader]
        replies = [link.isend(self.center.clone(), leader, tag=TAG)]
        if self.options.momentum_compensation:  # updates by the other groups since this one's previous exchange
            staleness = torch.tensor([self.live.total() - self.live.seen[index]], dtype=torch.int64)
            replies.append(link.isend(staleness, leader, tag=TAG))
        with self.snapshots.applying(index) as states:
            for state in states:
                state.apply(index, request.data, self.alpha)
        for reply in replies:
            reply.wait()

    def farewell(self, leader: int) -> None:
        self.links[leader].send(self.center, leader, tag=FINAL_TAG)

    def last_step(self, leader: int) -> int:
        """The steps the group had done at its last exchange."""
        return max(self.live.updates[self.leaders.index(leader)] - 1, 0) * self.options.tau

    def summary(self) -> dict[str, Any]:
        return {"center_updates": self.live.total()} if self.on_server else {}
