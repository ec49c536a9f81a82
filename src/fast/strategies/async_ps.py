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

On a lossy emulated link (`[network] loss`, or a link that is down) the gradient pushes and the pulled weights
are sent `droppable`, as on a real lossy network; the headers, checkpoint markers, DONE and the final weights are
not (a lost one would break the protocol). A lost push (`fast.comm.MessageLost` at the server) is an update
the server skips: the worker's accumulated gradient is gone (its error feedback, with a codec, has already
counted it as sent). A lost pull leaves the worker's replica as it was for that server's slice. Neither is a
death. The server cannot tell that its answer to a pull was lost, so it takes the worker's pulled version (for
staleness, and DC-ASGD's backup) as if it had arrived. The summary counts `pushes` and `pulls` (one per message,
so one per server) and the `lost_pushes` and `lost_pulls` among them: each server counts what it received and
sent, each worker tells each server at DONE how many of its pulls it lost, and each server hands its figures to
every worker with the final weights (unmetered), so rank 0 reports the totals over the servers (a dead
worker's lost pulls are not among them).

Checkpoints (`run.checkpoint_every = K`): a server's state is its shard, its optimizer's state (momentum),
its version counters and, with delay compensation, the weights each worker last pulled (`ShardState`); a
worker's own checkpoint holds its gradients not pushed yet and its codec's error feedback. The servers
checkpoint themselves, without stopping anyone: after its step-N checkpoint (every K steps) each
worker sends every server a CHECKPOINT marker for step N, behind its pushes (unmetered: it is not training
traffic). A server takes a snapshot of the step-N cut, a Chandy-Lamport snapshot over its channels: when the
first marker for N arrives it copies its state; from then on an update from a worker that has not sent its
marker yet (its steps <= N) goes into both the live state and the snapshot, and an update from a worker that
has goes into the live state only. When every live worker's marker is in, the snapshot holds exactly the
updates of every worker's steps <= N, none of a later step, and the server writes it in a file of its own
(`checkpoints/server<rank>-step<N>.pt`, atomically, loaded with weights_only; `server_checkpoints`). Several
snapshots may be under way at once (a fast worker K steps ahead of a slow one), at a copy of the shard each.
`--resume` (or a restart by `run.max_restarts`) makes every worker and server resume from the newest step that
all of them hold (`fast.checkpoint`: each keeps its last two files): no update is lost or applied twice. A
worker's replica is what it last pulled, which may hold later updates of faster workers, as any pulled copy
may; its next pull replaces it. If the run stops after a fast worker wrote its step-N checkpoint but before the
servers' snapshot of N is complete (the slowest worker had not reached N), everyone resumes from an earlier
common step and the fast worker does its steps since again. Only when the workers are so far apart that no step
is common does each process resume from its own newest file: then a worker ahead of the servers' step loses
its updates since that step, and one behind it has its updates up to that step applied twice. A worker found
dead (or done) holds no snapshot back: later snapshots hold its updates up to its end, so if it is resumed from
its last checkpoint, those it made since are applied twice (at most one interval).
"""

from __future__ import annotations

import copy
import time
from typing import Any

import torch
from pydantic import Field
from torch import nn

from fast.codecs import CODECS
from fast.comm import Handle, MessageLost
from fast.comm.channel import probe
from fast.comm.compressed import isend_encoded, recv_encoded, worker_codec
from fast.config import Config
from fast.errors import CommError, ConfigError
from fast.strategies.base import ModelLayout, Strategy, StrategyOptions
from fast.strategies.snapshots import Snapshots

PUSH, PULL, DONE, CHECKPOINT = 1, 2, 3, 4
HEADER_TAG, PAYLOAD_TAG, FINAL_TAG, STATS_TAG = 11, 12, 13, 15


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


class ShardState:
    """What a server's updates depend on: its shard of the weights, its optimizer, how many updates it has
    applied (from each worker), the version each worker last pulled and (DC-ASGD) the weights it pulled.
    This is what a server checkpoints."""

    def __init__(self, shard: torch.Tensor, options: AsyncPSOptions, lr: float, weight_decay: float, workers: int):
        self.options, self.lr, self.weight_decay, self.workers = options, lr, weight_decay, workers
        self.shard = nn.Parameter(shard)
        momentum = options.server_momentum
        self.optimizer = torch.optim.SGD([self.shard], lr=lr, momentum=momentum, weight_decay=weight_decay)
        self.version = 0  # updates applied to this shard
        self.pulled_version = dict.fromkeys(range(workers), 0)
        self.updates_from = dict.fromkeys(range(workers), 0)
        dc = options.delay_compensation > 0
        self.backup = {w: shard.detach().clone() for w in range(workers)} if dc else {}
        self.staleness: list[int] = []
        self.lost_pushes = 0  # pushes lost on a lossy link: updates not applied
        self.pulls = 0  # pulls answered (whether or not the answer arrived)

    def apply(self, worker: int, gradient: torch.Tensor) -> None:
        """One update from a worker's pushed gradient, with its staleness recorded."""
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
        self.optimizer.step()
        self.shard.grad = None
        self.version += 1
        self.updates_from[worker] += 1

    def skip(self) -> None:
        """A pushed gradient was lost on its link: no update."""
        self.lost_pushes += 1

    def pulled(self, worker: int, weights: torch.Tensor) -> None:
        """`worker` was sent `weights` (the live shard) at this state's current version."""
        self.pulls += 1
        self.pulled_version[worker] = self.version
        if worker in self.backup:
            self.backup[worker].copy_(weights)

    def state_dict(self) -> dict[str, Any]:
        return {
            "shard": self.shard.detach().clone(),
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),
            "version": self.version,
            "pulled_version": dict(self.pulled_version),
            "updates_from": dict(self.updates_from),
            "backup": {w: b.clone() for w, b in self.backup.items()},
            "staleness": torch.tensor(self.staleness, dtype=torch.int64),
            "lost_pushes": self.lost_pushes,
            "pulls": self.pulls,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            self.shard.copy_(state["shard"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.version = int(state["version"])
        self.pulled_version = {int(w): int(v) for w, v in state["pulled_version"].items()}
        self.updates_from = {int(w): int(v) for w, v in state["updates_from"].items()}
        for w, b in state["backup"].items():
            self.backup[int(w)].copy_(b)
        self.staleness[:] = state["staleness"].tolist()
        self.lost_pushes, self.pulls = int(state.get("lost_pushes", 0)), int(state.get("pulls", 0))

    def copy(self) -> ShardState:
        twin = ShardState(self.shard.detach().clone(), self.options, self.lr, self.weight_decay, self.workers)
        twin.load_state_dict(self.state_dict())
        return twin


class AsyncPS(Strategy):
    name = "async-ps"
    Options = AsyncPSOptions
    decentralised = False  # at the end every replica holds the servers' weights
    collective_eval = False
    stops_alone = True
    survives_failures = True
    server_checkpoints = True  # the servers' snapshots (the module docstring)
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

    # -- shared by workers and servers ------------------------------------------------------------------------
    def _layout(self, numel: int) -> None:
        self.numel = numel
        self.servers = list(range(self.ctx.workers, self.ctx.workers + self.options.servers))
        self.bounds = shard_bounds(self.numel, self.options.servers)
        codec = self.ctx.config.codec
        self.codec = worker_codec(codec.name, codec.options(), self.ctx.rank) if codec.name != "none" else None

    # -- worker side ------------------------------------------------------------------------------------------
    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().setup(model, optimizer)
        self._layout(sum(p.numel() for p in model.parameters()))
        self.accumulated = torch.zeros(self.numel, device=self.ctx.device)
        self.pulled = torch.empty(self.numel, device=self.ctx.device)
        self.steps_since_push = 0
        self.done_steps = 0
        self.lost_from = [0] * len(self.servers)  # pulls whose answer was lost, per server
        self.totals: dict[str, int] = {}  # the servers' figures, handed over at the end
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
        done = self.done_steps = step + 1
        pull = done % self.options.pull_every == 0
        if done % self.options.push_every == 0:
            self._exchange(PUSH, pull)
        elif pull:
            self._exchange(PULL, True)

    def _exchange(self, kind: int, pull: bool) -> None:
        """Send a push (or a pull request) to every server at once, then wait for the weights if asked. A pushed
        slice lost on its link is gone; a slice of weights lost on its link leaves the replica's slice as it is."""
        header = torch.tensor([kind, int(pull)], dtype=torch.int64)
        pending, pulls = [], []
        for server, (start, end) in zip(self.servers, self.bounds, strict=True):
            pending.append(self.world.isend(header, server, tag=HEADER_TAG))
            if kind == PUSH:
                pending.append(self._push(self.accumulated[start:end], server))
            if pull:
                pulls.append(self.world.irecv(self.pulled[start:end], server, tag=PAYLOAD_TAG))
        for handle in pending:
            handle.wait()
        lost = []
        for i, handle in enumerate(pulls):
            try:
                handle.wait()
            except MessageLost:  # not a death: that server's answer did not arrive
                lost.append(i)
        if kind == PUSH:
            self.accumulated.zero_()
            self.steps_since_push = 0
        if pull:
            if lost:
                current = self.flat_parameters()
                for i in lost:
                    start, end = self.bounds[i]
                    self.pulled[start:end] = current[start:end]
                    self.lost_from[i] += 1
            load_flat(self.model, self.pulled)

    def _push(self, gradient: torch.Tensor, server: int) -> Handle:
        """A gradient slice, droppable: on a lossy link it may be lost (the server skips that update)."""
        if self.codec is None:
            return self.world.isend(gradient, server, tag=PAYLOAD_TAG, droppable=True)
        key = f"server{server}"
        return isend_encoded(self.world, gradient, server, self.codec, key, tag=PAYLOAD_TAG, droppable=True)

    def end_of_run(self) -> None:
        if self.steps_since_push:
            self._exchange(PUSH, False)
        # the servers answer when every worker is done or taken for dead, which takes them up to a deadline
        patient = copy.copy(self.world)
        patient.deadline_s = 3 * self.world.deadline_s
        pending, figures = [], torch.zeros(len(self.servers), 4, dtype=torch.int64)
        for i, (server, (start, end)) in enumerate(zip(self.servers, self.bounds, strict=True)):
            header = torch.tensor([DONE, self.lost_from[i]], dtype=torch.int64)  # DONE tells the lost pulls
            pending.append(self.world.isend(header, server, tag=HEADER_TAG))
            pending.append(patient.irecv(self.pulled[start:end], server, tag=FINAL_TAG))
        for handle in pending:
            handle.wait()
        with self.world.unmetered():  # each server's figures, right behind its final weights
            for i, server in enumerate(self.servers):
                patient.recv(figures[i], server, tag=STATS_TAG)
        totals = figures.sum(0).tolist()
        self.totals = dict(zip(("pushes", "lost_pushes", "pulls", "lost_pulls"), totals, strict=True))
        # running statistics (batch norm) never reach the servers: the end of the run averages them
        # (fast.survivors, over the workers that are still alive)
        load_flat(self.model, self.pulled)

    # -- server side ------------------------------------------------------------------------------------------
    def setup_server(self, layout: ModelLayout) -> None:
        self._layout(layout.parameters)
        index = self.ctx.rank - self.ctx.workers
        start, end = self.bounds[index]
        shard = torch.empty(end - start, device=self.ctx.device)
        with self.world.unmetered():
            self.world.recv(shard, 0, tag=FINAL_TAG)
        cfg, opts = self.ctx.config.optimizer, self.options
        lr = opts.server_lr if opts.server_lr is not None else cfg.lr
        self.live = ShardState(shard, opts, lr, cfg.weight_decay, self.ctx.workers)
        self.staleness = self.live.staleness
        self.snapshots = Snapshots(self.live, self.ctx.workers)
        self.lost_pulls = 0  # as the workers report them with DONE

    def serve(self) -> None:
        """Answer pushes and pulls from any worker in arrival order until every live worker is done."""
        header = torch.zeros(2, dtype=torch.int64)
        self.gradient = torch.empty_like(self.live.shard)
        done: set[int] = set()
        self.heard = dict.fromkeys(range(self.ctx.workers), time.monotonic())
        self.probed = dict.fromkeys(range(self.ctx.workers), time.monotonic())
        self.probes: list[Handle] = []  # sends nobody receives (`fast.comm.channel.probe`), kept till the end
        while len(done | self.dead) < self.ctx.workers:
            if self._probe(done):
                break  # the workers not done are all dead
            self._save_complete_snapshots(done)  # a worker found dead or done no longer holds a snapshot back
            worker = self.world.recv_from(header, tag=HEADER_TAG)
            if worker in self.dead:  # only slow, not dead: take it back
                self.dead.discard(worker)
                self.failures = [f for f in self.failures if f["worker"] != worker]
            self.heard[worker] = time.monotonic()
            kind, arg = (int(v) for v in header)
            if kind == DONE:
                done.add(worker)
                self.lost_pulls += arg
                self.probed = dict.fromkeys(self.probed, 0.0)  # the others are probed again before waiting
            elif kind == CHECKPOINT:
                self.snapshots.mark(worker, step=arg)
                self._save_complete_snapshots(done)
            else:
                try:
                    self._answer(worker, kind, pull=arg)
                except CommError as e:
                    self.lost(worker, self._last_step(worker), str(e))
        self._save_complete_snapshots(done)
        live = self.live
        figures = torch.tensor([live.version + live.lost_pushes, live.lost_pushes, live.pulls, self.lost_pulls])
        for worker in sorted(done - self.dead):
            try:
                self.world.send(self.live.shard.detach(), worker, tag=FINAL_TAG)
                with self.world.unmetered():
                    self.world.send(figures, worker, tag=STATS_TAG)
            except CommError as e:
                self.lost(worker, self._last_step(worker), str(e))

    def _answer(self, worker: int, kind: int, pull: int) -> None:
        """A push (its update, or a skip if the gradient was lost on its link), then a pull's answer (droppable)."""
        with self.snapshots.applying(worker) as states:
            if kind == PUSH:
                try:
                    if self.codec is None:
                        self.world.recv(self.gradient, worker, tag=PAYLOAD_TAG)
                    else:
                        shape = self.gradient.shape
                        self.gradient = recv_encoded(self.world, self.codec, shape, worker, tag=PAYLOAD_TAG)
                except MessageLost:  # not a death: the update is skipped
                    for state in states:
                        state.skip()
                else:
                    for state in states:
                        state.apply(worker, self.gradient)
            if pull:
                sent = self.live.shard.detach()
                self.world.send(sent, worker, tag=PAYLOAD_TAG, droppable=True)
                for state in states:
                    state.pulled(worker, sent)

    def _save_complete_snapshots(self, done: set[int]) -> None:
        """Write every snapshot that no live worker still holds back (a worker that ended sends no more)."""
        self.snapshots.save_complete(self.dead | done, self._save)

    def _save(self, step: int, state: ShardState) -> None:
        if self.ctx.save_checkpoint is not None:
            self.ctx.save_checkpoint({"step": step, "shard": state.state_dict()})

    def _last_step(self, worker: int) -> int:
        """The last of a worker's steps whose gradient this server has applied."""
        return self.live.updates_from[worker] * self.options.push_every

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
            gone = probe(self.world, worker, self.probes)
            if gone is not None:
                silence = now - self.heard[worker]
                self.lost(worker, self._last_step(worker), f"probed after {silence:.1f}s of silence: {gone}")
        return len(done | self.dead) == self.ctx.workers

    # -- checkpoints ------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """A worker's part of a checkpoint: its gradients not pushed yet and its codec's state. Called at a
        checkpoint step, it first sends every server the worker's CHECKPOINT marker for that step."""
        marker = torch.tensor([CHECKPOINT, self.done_steps], dtype=torch.int64)
        with self.world.unmetered():
            for handle in [self.world.isend(marker, server, tag=HEADER_TAG) for server in self.servers]:
                handle.wait()
        state: dict[str, Any] = {
            "accumulated": self.accumulated.clone(),
            "steps_since_push": self.steps_since_push,
            "lost_from": torch.tensor(self.lost_from, dtype=torch.int64),
        }
        if self.codec is not None:
            state["codec"] = self.codec.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A worker's checkpoint, or a server's snapshot (the server's own file, written by `ctx.save_checkpoint`)."""
        if self.ctx.rank >= self.ctx.workers:
            self.live.load_state_dict(state["shard"])
            self.snapshots = Snapshots(self.live, self.ctx.workers, committed=int(state["step"]))
            return
        self.accumulated.copy_(state["accumulated"])
        self.steps_since_push = int(state["steps_since_push"])
        if "lost_from" in state:
            self.lost_from = [int(n) for n in state["lost_from"].tolist()]
        if self.codec is not None and "codec" in state:
            self.codec.load_state_dict(state["codec"])

    def summary(self) -> dict[str, Any]:
        """A server's updates applied; a worker's totals over the servers (rank 0's are the run's)."""
        if self.ctx.rank < self.ctx.workers:
            return dict(self.totals)
        return {"server_updates": self.live.version}
