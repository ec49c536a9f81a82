"""`ea-wild`: elastic averaging with lock-free updates of the center (paper 004, Algorithm 1).

A master process (rank run.workers) holds the center w̃. Workers are split into groups of `group_size`
consecutive ranks that train synchronously inside the group (their gradients are averaged every step, so the
members' weights stay equal); the first member of each group, its leader, talks to the master. Every `tau`
steps the leader sends the group's weights wʲ and receives the center; the master applies
w̃ ← w̃ + ηρ(wʲ − w̃) for each arriving group without a lock (one handler thread per group updates the same
center tensor in place), and every member applies the elastic pull wʲ ← wʲ − ηρ(wʲ − w̃) on top of its
optimizer's step, so with plain SGD one step is the paper's wʲ ← wʲ − ηρ(wʲ − w̃) − ηΔwʲ. η is the
optimizer's learning rate, ρ is `rho`. The exchange starts before the forward pass and completes after the
optimizer step, so it overlaps the gradient computation. Floating-point buffers (batch-norm statistics)
travel and are averaged with the parameters.

Staleness, recorded by the master for each center update: the updates other groups made to the center since
this group's previous exchange. The reported model is the center: at the end the master sends its final
center to every group and every replica loads it. During training rank 0 evaluates the last center it got.

A worker may die (`survives_failures`): the master's handler for its group finds the connection closed
(or the group silent past the deadline), records it and forgets the group, whose last exchanges stay in the
center; the other groups go on, and the run ends with the survivors. A group trains synchronously, so a
member's death ends its whole group (the others' all-reduce fails and they stop); the group holding rank 0
cannot go on, since rank 0's death stays fatal. The step recorded is the steps the group had done at its
last exchange.
"""

from __future__ import annotations

import copy
import threading
from typing import Any

import torch
from pydantic import Field
from torch import nn

from fast.comm import Comm
from fast.config import Config
from fast.errors import CommError, ConfigError
from fast.strategies.base import Strategy, StrategyOptions

EXCHANGE, DONE = 1, 2
TAG, FINAL_TAG = 21, 22


class EAWildOptions(StrategyOptions):
    rho: float = Field(2.0, gt=0, description="elastic coefficient ρ; the moving rate is optimizer.lr * rho")
    tau: int = Field(1, ge=1, description="steps between exchanges with the master")
    group_size: int = Field(1, ge=1, description="workers per synchronous group; must divide run.workers")


def model_tensors(model: nn.Module) -> list[torch.Tensor]:
    """What elastic averaging moves: the parameters and floating-point buffers, in state_dict order."""
    return [t for t in model.state_dict(keep_vars=True).values() if t.is_floating_point()]


def flatten(model: nn.Module) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in model_tensors(model)])


def load_flat(model: nn.Module, flat: torch.Tensor) -> None:
    offset = 0
    with torch.no_grad():
        for t in model_tensors(model):
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()


class EAWild(Strategy):
    name = "ea-wild"
    Options = EAWildOptions
    decentralised = False  # every replica ends holding the center
    collective_eval = False
    stops_alone = True
    survives_failures = True

    @classmethod
    def server_count(cls, options: EAWildOptions, workers: int) -> int:
        return 1

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
        if config.run.checkpoint_every:
            raise ConfigError(
                "`run.checkpoint_every` cannot be used with ea-wild: the master's center is not "
                "checkpointed, so a resumed run would lose it; set it to 0"
            )

    # -- shared by workers and the master: the same groups, created in the same order ---------------------------
    def _groups(self, model: nn.Module) -> None:
        workers, size = self.ctx.workers, self.options.group_size
        self.master = workers
        self.leaders = list(range(0, workers, size))
        self.alpha = self.ctx.config.optimizer.lr * self.options.rho
        self.group: Comm | None = None
        if size > 1:
            self.group = self.world.subgroups([list(range(r, r + size)) for r in self.leaders])
        self.links: dict[int, Comm] = {}  # leader -> its own channel with the master
        for leader in self.leaders:
            link = self.world.subgroups([[leader, self.master]])
            if link is not None:
                self.links[leader] = link
        self.center = flatten(model)

    # -- worker side ------------------------------------------------------------------------------------------
    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().setup(model, optimizer)
        self._groups(model)
        self.leader = self.ctx.rank - self.ctx.rank % self.options.group_size
        # a member whose gradient was not finite still steps with the group's average, to stay identical
        self.averages_gradients = self.group is not None
        self.link = self.links.get(self.ctx.rank)
        self.received_center = False
        self.pending: list[Any] = []
        if self.ctx.rank == 0:  # the master starts from the workers' common initial weights
            with self.world.unmetered():
                self.link.send(self.center, self.master, tag=TAG)

    def before_step(self, step: int) -> None:
        if step % self.options.tau:
            return
        self.sent = flatten(self.model)
        if self.link is not None:
            header = torch.tensor([EXCHANGE], dtype=torch.int64)
            self.pending = [
                self.link.isend(header, self.master, tag=TAG),
                self.link.isend(self.sent, self.master, tag=TAG),
                self.link.irecv(self.center, self.master, tag=TAG),
            ]

    def after_backward(self, step: int) -> None:
        if self.group is None:
            return
        params = [p for p in self.model.parameters() if p.grad is not None]
        grads = torch.cat([p.grad.reshape(-1) for p in params])
        try:
            self.group.all_reduce(grads, op="mean")
        except CommError as e:
            raise self._group_broken(e) from None
        offset = 0
        for p in params:
            p.grad.copy_(grads[offset : offset + p.numel()].view_as(p))
            offset += p.numel()

    def after_optimizer_step(self, step: int) -> None:
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
        pull = (self.sent - self.center).mul_(self.alpha)
        offset = 0
        with torch.no_grad():
            for t in model_tensors(self.model):
                t.sub_(pull[offset : offset + t.numel()].view_as(t))
                offset += t.numel()

    def _group_broken(self, cause: CommError) -> CommError:
        return CommError(
            f"ea-wild: group {self.group.ranks} lost a member ({cause}); a group trains synchronously, so the "
            "whole group stops (the other groups go on, unless this one holds worker 0)"
        )

    def end_of_run(self) -> None:
        if self.link is not None:
            self.link.send(torch.tensor([DONE], dtype=torch.int64), self.master, tag=TAG)
            self.link.recv(self.center, self.master, tag=FINAL_TAG)
        if self.group is not None:
            self.group.broadcast(self.center, src=self.leader)
        load_flat(self.model, self.center)

    def eval_model(self) -> nn.Module:
        """Rank 0's view of the center during training: the last center it received."""
        if not self.received_center:
            return self.model
        model = copy.deepcopy(self.model)
        load_flat(model, self.center)
        return model

    # -- master side ------------------------------------------------------------------------------------------
    def setup_server(self, model: nn.Module) -> None:
        self._groups(model)
        with self.world.unmetered():
            self.links[0].recv(self.center, 0, tag=TAG)
        self.updates = [0] * len(self.leaders)  # one slot per handler thread: counting needs no lock
        self.failure_lock = threading.Lock()  # handler threads may record deaths at the same time

    def serve(self, model: nn.Module) -> None:
        """One handler thread per group, all updating `self.center` in place without a lock."""
        errors: list[BaseException] = []
        threads = [
            threading.Thread(target=self._handle, args=(i, leader, errors), name=f"ea-wild-{leader}", daemon=True)
            for i, leader in enumerate(self.leaders)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        for i, leader in enumerate(self.leaders):
            if leader not in self.dead:
                try:
                    self.links[leader].send(self.center, leader, tag=FINAL_TAG)
                except CommError as e:
                    self._lost_group(i, leader, f"did not take the final center: {e}")
        load_flat(model, self.center)

    def _lost_group(self, index: int, leader: int, how: str) -> None:
        """Forget a group whose leader is gone; the step given is the steps it had done at its last exchange."""
        with self.failure_lock:
            self.lost(leader, max(self.updates[index] - 1, 0) * self.options.tau, how)

    def _handle(self, index: int, leader: int, errors: list[BaseException]) -> None:
        link = self.links[leader]
        header = torch.zeros(1, dtype=torch.int64)
        weights = torch.empty_like(self.center)
        seen = 0  # center updates when this group last exchanged
        try:
            while True:
                try:
                    link.recv(header, leader, tag=TAG)
                    if int(header) == DONE:
                        return
                    link.recv(weights, leader, tag=TAG)
                except CommError as e:  # its own link: a timeout here closes no other group's connections
                    self._lost_group(index, leader, str(e))
                    return
                snapshot = self.center.clone()  # what this group pulls toward, before its own update
                reply = link.isend(snapshot, leader, tag=TAG)
                self.staleness.append(sum(self.updates) - seen)
                self.center.lerp_(weights, self.alpha)  # w̃ ← w̃ + ηρ(wʲ − w̃), racing the other handlers
                self.updates[index] += 1
                seen = sum(self.updates)
                try:
                    reply.wait()
                except CommError as e:
                    self._lost_group(index, leader, str(e))
                    return
        except BaseException as e:  # noqa: BLE001 - handed to the main thread, which raises it
            errors.append(e)

    def summary(self) -> dict[str, Any]:
        if self.ctx.rank < self.ctx.workers:
            return {}
        return {"center_updates": sum(self.updates)}
