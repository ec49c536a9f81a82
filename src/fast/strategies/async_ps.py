"""`async-ps`: Downpour-style asynchronous SGD on parameter servers (paper 004's "1 S + 16 W").

`servers = k` server processes (ranks run.workers .. run.workers+k-1) each own a contiguous range of the
flat parameter vector and apply updates to it with their own optimizer: SGD with `server_lr` and
`server_momentum` (default: the run's optimizer lr, and no momentum, since asynchronous updates already
behave as if they had momentum, Mitliagkas et al. 2016) and the run's weight decay. Workers never wait for
each other: every `push_every` steps a worker sends each server its slice of the gradients summed since its
last push, and every `pull_every` steps it fetches the servers' current weights.

Optimizer semantics: by default the workers' own optimizer never steps: the gradients leave the replica in
`after_backward`, so only the servers' optimizer updates weights (Downpour applies updates on the server).
With `local_steps = true` the workers' optimizer also steps the local replica between pulls (Downpour's
client); a pull overwrites the replica with the servers' weights.

A server records the staleness of each update it applies: the updates its shard had received since the
pushing worker last pulled. `staleness_lr = true` divides that update by its staleness (Zhang et al. 2016);
`delay_compensation = λ` applies DC-ASGD (Zheng et al. 2017), g + λ g⊙g⊙(w_now − w_pulled), with the weights
the worker last pulled as the backup (the worker's local steps and accumulated pushes are not modelled).

At the end each worker pushes what it has accumulated and says "done"; when every worker is done the servers
send all of them the final weights, so every replica reports the servers' model.

A worker may die: the servers forget a worker whose connection closes or that stays silent past the comm
deadline (a silent worker that speaks again is taken back), finish when every live worker is done, and the
run ends with the survivors (`survives_failures`); a server's death stays fatal.

With a `[codec]`, each pushed slice travels encoded (with the worker's error feedback per slice:
`fast.comm.compressed`); pulled weights stay dense, since compressing weights themselves loses too much.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import torch
from pydantic import Field
from torch import nn

from fast.codecs import CODECS
from fast.comm import Handle
from fast.comm.compressed import isend_encoded, recv_encoded, worker_codec
from fast.config import Config
from fast.errors import CommError, ConfigError
from fast.strategies.base import Strategy, StrategyOptions

PUSH, PULL, DONE = 1, 2, 3
HEADER_TAG, PAYLOAD_TAG, FINAL_TAG, PROBE_TAG = 11, 12, 13, 14


class AsyncPSOptions(StrategyOptions):
    servers: int = Field(1, ge=1, description="server processes; the parameters are sharded across them")
    push_every: int = Field(1, ge=1, description="steps between gradient pushes")
    pull_every: int = Field(1, ge=1, description="steps between weight pulls")
    server_lr: float | None = Field(None, gt=0, description="the servers' learning rate; default optimizer.lr")
    server_momentum: float = Field(0.0, ge=0, lt=1, description="the servers' momentum; asynchrony adds its own")
    local_steps: bool = Field(False, description="workers' optimizer also steps the replica between pulls")
    staleness_lr: bool = Field(False, description="divide each server update by its staleness")
    delay_compensation: float = Field(0.0, ge=0, description="DC-ASGD lambda; 0 = off")


def shard_bounds(numel: int, shards: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) ranges that split `numel` elements into `shards` near-equal parts."""
    cuts = [round(i * numel / shards) for i in range(shards + 1)]
    return list(zip(cuts[:-1], cuts[1:], strict=True))


def load_flat(model: nn.Module, flat: torch.Tensor) -> None:
    """Copy a flat vector into the model's parameters, in `parameters()` order."""
    offset = 0
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()


def compensated_gradient(
    gradient: torch.Tensor,
    weights: torch.Tensor,
    backup: torch.Tensor | None,
    *,
    staleness: int,
    staleness_lr: bool,
    dc_lambda: float,
) -> torch.Tensor:
    """The gradient a server applies: delay-compensated (DC-ASGD) against the weights the worker pulled,
    then divided by its staleness when `staleness_lr` (a staleness of 0 or 1 leaves it as it is)."""
    g = gradient.clone()
    if dc_lambda > 0:
        g += dc_lambda * gradient * gradient * (weights - backup)
    if staleness_lr and staleness > 1:
        g /= staleness
    return g


class AsyncPS(Strategy):
    name = "async-ps"
    Options = AsyncPSOptions
    decentralised = False  # at the end every replica holds the servers' weights
    collective_eval = False
    survives_failures = True
    # slices of the flat gradient, in frames of a size the server knows in advance: no low rank, no threshold
    codecs = tuple(name for name in CODECS if name not in ("powersgd", "threshold", "dgc"))

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
        if config.run.checkpoint_every:
            raise ConfigError(
                "`run.checkpoint_every` cannot be used with async-ps: the servers' weights are not "
                "checkpointed, so a resumed run would lose them; set it to 0"
            )

    # -- shared by workers and servers ------------------------------------------------------------------------
    def _layout(self, model: nn.Module) -> None:
        self.numel = sum(p.numel() for p in model.parameters())
        self.servers = list(range(self.ctx.workers, self.ctx.workers + self.options.servers))
        self.bounds = shard_bounds(self.numel, self.options.servers)
        codec = self.ctx.config.codec
        self.codec = worker_codec(codec.name, codec.options(), self.ctx.rank) if codec.name != "none" else None

    # -- worker side ------------------------------------------------------------------------------------------
    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().setup(model, optimizer)
        self._layout(model)
        self.accumulated = torch.zeros(self.numel, device=self.ctx.device)
        self.pulled = torch.empty(self.numel, device=self.ctx.device)
        self.steps_since_push = 0
        if self.comm.index() == 0:  # the servers start from the workers' common initial weights
            flat = self.flat_parameters()
            with self.world.unmetered():
                for server, (start, end) in zip(self.servers, self.bounds, strict=True):
                    self.world.send(flat[start:end].contiguous(), server, tag=FINAL_TAG)

    def after_backward(self, step: int) -> None:
        offset = 0
        with torch.no_grad():
            for p in self.model.parameters():
                if p.grad is not None:
                    self.accumulated[offset : offset + p.numel()] += p.grad.reshape(-1)
                    if not self.options.local_steps:
                        p.grad = None  # the local optimizer then skips this parameter
                offset += p.numel()
        self.steps_since_push += 1

    def after_optimizer_step(self, step: int) -> None:
        done = step + 1
        pull = done % self.options.pull_every == 0
        if done % self.options.push_every == 0:
            self._exchange(PUSH, pull)
        elif pull:
            self._exchange(PULL, True)

    def _exchange(self, kind: int, pull: bool) -> None:
        """Send a push (or a pull request) to every server at once, then wait for the weights if asked."""
        header = torch.tensor([kind, int(pull)], dtype=torch.int64)
        pending = []
        for server, (start, end) in zip(self.servers, self.bounds, strict=True):
            pending.append(self.world.isend(header, server, tag=HEADER_TAG))
            if kind == PUSH:
                pending.append(self._push(self.accumulated[start:end], server))
            if pull:
                pending.append(self.world.irecv(self.pulled[start:end], server, tag=PAYLOAD_TAG))
        for handle in pending:
            handle.wait()
        if kind == PUSH:
            self.accumulated.zero_()
            self.steps_since_push = 0
        if pull:
            load_flat(self.model, self.pulled)

    def _push(self, gradient: torch.Tensor, server: int) -> Handle:
        if self.codec is None:
            return self.world.isend(gradient, server, tag=PAYLOAD_TAG)
        return isend_encoded(self.world, gradient, server, self.codec, f"server{server}", tag=PAYLOAD_TAG)

    def end_of_run(self) -> None:
        if self.steps_since_push:
            self._exchange(PUSH, False)
        header = torch.tensor([DONE, 0], dtype=torch.int64)
        # the servers answer when every worker is done or taken for dead, which takes them up to a deadline
        patient = copy.copy(self.world)
        patient.deadline_s = 3 * self.world.deadline_s
        pending = []
        for server, (start, end) in zip(self.servers, self.bounds, strict=True):
            pending.append(self.world.isend(header, server, tag=HEADER_TAG))
            pending.append(patient.irecv(self.pulled[start:end], server, tag=FINAL_TAG))
        for handle in pending:
            handle.wait()
        # running statistics (batch norm) never reach the servers: the end of the run averages them
        # (fast.survivors, over the workers that are still alive)
        load_flat(self.model, self.pulled)

    # -- server side ------------------------------------------------------------------------------------------
    def setup_server(self, model: nn.Module) -> None:
        self._layout(model)
        index = self.ctx.rank - self.ctx.workers
        start, end = self.bounds[index]
        shard = torch.empty(end - start, device=self.ctx.device)
        with self.world.unmetered():
            self.world.recv(shard, 0, tag=FINAL_TAG)
        self.shard = nn.Parameter(shard)
        cfg = self.ctx.config.optimizer
        opts = self.options
        self.server_optimizer = torch.optim.SGD(
            [self.shard],
            lr=opts.server_lr if opts.server_lr is not None else cfg.lr,
            momentum=opts.server_momentum,
            weight_decay=cfg.weight_decay,
        )
        self.version = 0  # updates applied to this shard
        self.pulled_version = dict.fromkeys(range(self.ctx.workers), 0)
        self.updates_from = dict.fromkeys(range(self.ctx.workers), 0)
        self.backup = {w: shard.clone() for w in range(self.ctx.workers)} if opts.delay_compensation > 0 else {}

    def serve(self, model: nn.Module) -> None:
        """Answer pushes and pulls from any worker in arrival order until every live worker is done."""
        header = torch.zeros(2, dtype=torch.int64)
        self.gradient = torch.empty_like(self.shard)
        done: set[int] = set()
        self.heard = dict.fromkeys(range(self.ctx.workers), time.monotonic())
        self.probed = dict.fromkeys(range(self.ctx.workers), time.monotonic())
        self.probes: list[Handle] = []  # never received (nobody listens on PROBE_TAG), kept till the end
        while len(done | self.dead) < self.ctx.workers:
            if self._probe(done):
                break  # the workers not done are all dead
            worker = self.world.recv_from(header, tag=HEADER_TAG)
            if worker in self.dead:  # only slow, not dead: take it back
                self.dead.discard(worker)
                self.failures = [f for f in self.failures if f["worker"] != worker]
            self.heard[worker] = time.monotonic()
            kind, pull = (int(v) for v in header)
            if kind == DONE:
                done.add(worker)
                self.probed = dict.fromkeys(self.probed, 0.0)  # the others are probed again before waiting
            else:
                try:
                    self._answer(worker, kind, pull)
                except CommError as e:
                    self.lost(worker, self._last_step(worker), str(e))
        for worker in sorted(done - self.dead):
            try:
                self.world.send(self.shard.detach(), worker, tag=FINAL_TAG)
            except CommError as e:
                self.lost(worker, self._last_step(worker), str(e))

    def _answer(self, worker: int, kind: int, pull: int) -> None:
        if kind == PUSH:
            if self.codec is None:
                self.world.recv(self.gradient, worker, tag=PAYLOAD_TAG)
            else:
                self.gradient = recv_encoded(self.world, self.codec, self.gradient.shape, worker, tag=PAYLOAD_TAG)
            self.apply(worker, self.gradient)
        if pull:
            self.world.send(self.shard.detach(), worker, tag=PAYLOAD_TAG)
            self.pulled_version[worker] = self.version
            if worker in self.backup:
                self.backup[worker].copy_(self.shard.detach())

    def _last_step(self, worker: int) -> int:
        """The last of a worker's steps whose gradient this server has applied."""
        return self.updates_from[worker] * self.options.push_every

    def _probe(self, done: set[int]) -> bool:
        """Find dead workers without waiting: a send to a process that is gone fails at once (its connection
        is closed), while one to a live worker stays pending, unread. Probe each worker not done after
        another worker said DONE, and any worker silent past the deadline at most once per deadline (so few
        probes pile up). A receive cannot be used: gloo is unusable after a missed deadline. Returns True
        when every worker is done or dead."""
        now, deadline = time.monotonic(), self.world.deadline_s
        for worker in range(self.ctx.workers):
            silent = now - self.heard[worker] > deadline and now - self.probed[worker] > deadline
            if worker in done or worker in self.dead or not (self.probed[worker] == 0.0 or silent):
                continue
            self.probed[worker] = now
            try:
                with self.world.unmetered():
                    self.probes.append(self.world.isend(torch.zeros(1), worker, tag=PROBE_TAG))
            except CommError as e:
                self.lost(
                    worker, self._last_step(worker), f"probed after {now - self.heard[worker]:.1f}s of silence: {e}"
                )
        return len(done | self.dead) == self.ctx.workers

    def apply(self, worker: int, gradient: torch.Tensor) -> None:
        """One server update from a worker's pushed gradient, with its staleness recorded."""
        staleness = self.version - self.pulled_version[worker]
        self.staleness.append(staleness)
        self.shard.grad = compensated_gradient(
            gradient,
            self.shard.detach(),
            self.backup.get(worker),
            staleness=staleness,
            staleness_lr=self.options.staleness_lr,
            dc_lambda=self.options.delay_compensation,
        )
        self.server_optimizer.step()
        self.version += 1
        self.updates_from[worker] += 1

    def summary(self) -> dict[str, Any]:
        if self.ctx.rank < self.ctx.workers:
            return {}
        return {"server_updates": self.version}
