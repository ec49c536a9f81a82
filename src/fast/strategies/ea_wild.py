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

Checkpoints (`run.checkpoint_every = K`). The master checkpoints its state (`fast.strategies.easgd.CenterState`:
the center, each group's updates, the updates each group knew of at its last exchange, the staleness records)
without stopping anyone: after its step-N checkpoint (by then every exchange of its first N steps has
completed), each leader sends the master a CHECKPOINT marker for step N on its own link, behind its exchanges
(unmetered: not training traffic), and that group's handler reads it after applying those exchanges. The
first marker for N makes the master copy its state; from then on an exchange from a group that has not sent
its marker yet goes into both the live state and the copy, one from a group that has goes into the live state
only (`fast.strategies.snapshots`; the handlers still update the live center, and a copy, without a
lock among themselves, but a copy is only taken while no update is under way, so it never holds part of one).
When every live group's marker is in, the copy holds exactly every group's exchanges of its first N steps and
none later, and the master writes it (`server<rank>-step<N>.pt`, `server_checkpoints`). On resume every process
resumes from the newest step all of them hold (`fast.checkpoint`), the master from its copy of that step, so
the center goes on as it was at that step. Groups at their own pace may hold no step in common; then each
process resumes from its own newest file (`stops_alone`): the center lacks the exchanges of a group ahead of
the master's step since that step, and holds twice those of a group behind it up to that step. A group found
dead (or done) holds no snapshot back: later ones hold its exchanges up to its end.
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
from fast.strategies.base import ModelLayout, Strategy, StrategyOptions
from fast.strategies.easgd import CenterState
from fast.strategies.snapshots import Snapshots

EXCHANGE, DONE, CHECKPOINT = 1, 2, 3  # a header; CHECKPOINT is followed by the step (int64), EXCHANGE by weights
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
    server_checkpoints = True  # the master's snapshots (the module docstring)

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

    # -- shared by workers and the master: the same groups, created in the same order ---------------------------
    def _groups(self, center: torch.Tensor) -> None:
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
        self.center = center

    # -- worker side ------------------------------------------------------------------------------------------
    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().setup(model, optimizer)
        self._groups(flatten(model))
        self.leader = self.ctx.rank - self.ctx.rank % self.options.group_size
        # a member whose gradient was not finite still steps with the group's average, to stay identical
        self.averages_gradients = self.group is not None
        self.link = self.links.get(self.ctx.rank)
        self.received_center = False
        self.pending: list[Any] = []
        self.done_steps = 0
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
        if self.ctx.rank >= self.ctx.workers:
            self.live.load_state_dict(state["center"])
            self.snapshots = Snapshots(self.live, len(self.leaders), committed=int(state["step"]))
            return
        self.center.copy_(state["center"])
        self.received_center = bool(state["received_center"])

    def eval_model(self) -> nn.Module:
        """Rank 0's view of the center during training: the last center it received."""
        if not self.received_center:
            return self.model
        model = copy.deepcopy(self.model)
        load_flat(model, self.center)
        return model

    # -- master side ------------------------------------------------------------------------------------------
    def setup_server(self, layout: ModelLayout) -> None:
        self._groups(torch.zeros(layout.state))
        with self.world.unmetered():
            self.links[0].recv(self.center, 0, tag=TAG)
        self.live = CenterState(self.center, len(self.leaders))  # a resumed master loads its snapshot into it
        self.staleness = self.live.staleness
        self.snapshots = Snapshots(self.live, len(self.leaders))
        self.finished: set[int] = set()  # the groups (indices) that said DONE
        self.failure_lock = threading.Lock()  # handler threads may record deaths at the same time

    def serve(self) -> None:
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
        self._save_snapshots()  # every group is done or dead: none holds a snapshot back
        for i, leader in enumerate(self.leaders):
            if leader not in self.dead:
                try:
                    self.links[leader].send(self.center, leader, tag=FINAL_TAG)
                except CommError as e:
                    self._lost_group(i, leader, f"did not take the final center: {e}")

    def _lost_group(self, index: int, leader: int, how: str) -> None:
        """Forget a group whose leader is gone; the step given is the steps it had done at its last exchange. It
        holds no snapshot back."""
        with self.failure_lock:
            self.lost(leader, max(self.live.updates[index] - 1, 0) * self.options.tau, how)
        self._save_snapshots()

    def _save_snapshots(self) -> None:
        """Write every snapshot that no live group still holds back (a group done or dead sends no more)."""
        with self.failure_lock:
            gone = self.finished | {i for i, leader in enumerate(self.leaders) if leader in self.dead}
        self.snapshots.save_complete(gone, self._save)

    def _save(self, step: int, state: CenterState) -> None:
        if self.ctx.save_checkpoint is not None:
            self.ctx.save_checkpoint({"step": step, "center": state.state_dict()})

    def _handle(self, index: int, leader: int, errors: list[BaseException]) -> None:
        link = self.links[leader]
        header = torch.zeros(1, dtype=torch.int64)
        step = torch.zeros(1, dtype=torch.int64)
        weights = torch.empty_like(self.center)
        try:
            while True:
                try:
                    link.recv(header, leader, tag=TAG)
                    kind = int(header)
                    if kind == CHECKPOINT:
                        with link.unmetered():
                            link.recv(step, leader, tag=TAG)
                    elif kind == EXCHANGE:
                        link.recv(weights, leader, tag=TAG)
                except CommError as e:  # its own link: a timeout here closes no other group's connections
                    self._lost_group(index, leader, str(e))
                    return
                if kind == DONE:
                    with self.failure_lock:
                        self.finished.add(index)
                    self._save_snapshots()
                    return
                if kind == CHECKPOINT:  # its exchanges of the steps before have been applied
                    self.snapshots.mark(index, int(step))
                    self._save_snapshots()
                    continue
                pulled_toward = self.center.clone()  # the center before this group's own update
                reply = link.isend(pulled_toward, leader, tag=TAG)
                # w̃ ← w̃ + ηρ(wʲ − w̃), racing the other handlers (on the live center, and on a snapshot under way)
                with self.snapshots.applying(index) as states:
                    for state in states:
                        state.apply(index, weights, self.alpha)
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
        return {"center_updates": self.live.total()}
