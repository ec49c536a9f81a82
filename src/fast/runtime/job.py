"""`fast.init` and the `Job` it returns: the handle through which a training loop becomes a FAST run.

    job = fast.init("job.toml", strategy__name="gossip")      # joins the run (servers serve and exit here)
    model, optimizer = job.prepare(model, optimizer)          # the user's own objects, with the strategy hooked in
    loader = job.loader(train_set, batch_size=64)              # this worker's shard
    for epoch in job.epochs(3):
        for x, y in loader:
            loss = loss_fn(model(x), y); loss.backward(); optimizer.step(); optimizer.zero_grad()
            job.log(loss=loss)
        job.evaluate(eval_fn)                                  # eval_fn(model) -> {"accuracy": ...}
    summary = job.finish()                                     # outputs written; the summary on worker 0

Started by `fast run` or torchrun, the process joins the run those launched; started alone, it is a run of one
worker. Rank 0 writes the run folder; every process streams its own metrics to it.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import math
import os
import shutil
import socket
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fast.comm import Comm, tags, timeline
from fast.comm import bootstrap as engine
from fast.comm.busy import BUSY_LIMIT_S, BusyBoard
from fast.comm.comm import with_deadline
from fast.comm.patience import PatientGroup
from fast.comm.shared_memory import LocalSums
from fast.config import Config
from fast.emulation.deployment import comm_maker, machine_for, network_for
from fast.emulation.simulated_comm import world as simulated_world
from fast.emulation.wire import place
from fast.errors import ConfigError, FastError, UsageError
from fast.factories import add_search_path
from fast.optim import build_schedule
from fast.parts import JobParts, resolve
from fast.runtime import control
from fast.runtime.checkpoints import Checkpointing
from fast.runtime.clock import Clock
from fast.runtime.control import Control
from fast.runtime.detached import Detached
from fast.runtime.ending import Ending
from fast.runtime.evaluation import Evaluating
from fast.runtime.launch import name_process
from fast.runtime.lifeline import LAUNCHER_VARIABLE
from fast.runtime.live import Live
from fast.runtime.loader import ShardedLoader, tensor_dataset
from fast.runtime.membership import ADDRESS_VARIABLE
from fast.runtime.readback import BadSteps, read_together
from fast.runtime.records import Records
from fast.runtime.run_folder import claim, default_run_dir, new_folder, prepare_run_dir, release
from fast.runtime.sharded import Sharded
from fast.runtime.steps import StepDriver
from fast.runtime.throughput import Throughput
from fast.strategies import Strategy, StrategyContext
from fast.strategies.base import ModelLayout

LAYOUT_TAG = tags.LAYOUT
MAX_STEPS_BETWEEN_CHECKS = 10_000
MAX_STEPS_UNCOUNTED = 1_000  # steps whose bad-step flags may wait on the device for a boundary (a read at the latest)
_current: ContextVar[Job | None] = ContextVar("job", default=None)  # the process's (each simulated one's) job
FAST_LOOP: ContextVar[bool] = ContextVar("fast_loop", default=False)  # set by FAST's own loop (fast train)


def current() -> Job:
    """The job `fast.init` started in this process; FastError when there is none."""
    job = _current.get()
    if job is None:
        raise UsageError("fast.init() has not been called in this process: start with job = fast.init(...)")
    return job


def unfinished() -> Job | None:
    """The job of this process if it was prepared and not finished yet."""
    job = _current.get()
    return job if job is not None and not job.finished and job.model is not None else None


def resolve_job(config: Any = None, **overrides: Any) -> JobParts:
    """The run's job, resolved (fast.parts): the script's (`config` and `overrides`), with what `fast run` was given
    on top (its --config replaces the script's, its --set keys win); or the parts FAST's loop was handed."""
    if isinstance(config, JobParts | Config) and not overrides and "FAST_CONFIG" not in os.environ:
        return resolve(config)
    source = os.environ.get("FAST_CONFIG") or config
    launcher = json.loads(os.environ.get("FAST_OVERRIDES", "{}"))
    if isinstance(source, str | Path) and Path(source).is_file():
        add_search_path(str(Path(source).resolve().parent))
    return resolve(source, **{**overrides, **{k.replace(".", "__"): v for k, v in launcher.items()}})


def init(
    config: Any = None, *, out: str | Path | None = None, resume: str | Path | bool | None = None, **overrides: Any
) -> Job:
    """Join the run and return its Job. `config`: a TOML path, a dict, a Config, a job's parts (fast.parts) or None
    (the defaults), with dotted overrides (`strategy__name="gossip"`). `out` is the run folder; `resume` (a run
    folder, or True for `out`) continues it from its last checkpoint. A server process (async-ps, async easgd,
    ea-wild) serves here until the workers are done, then exits: it never returns."""
    existing = _current.get()
    if existing is not None and not existing.finished:
        raise UsageError("fast.init() was already called in this process: use the job it returned")
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0 and not resume:  # restarted by the agent
        resume = True
    if resume is True:
        out = out or os.environ.get("FAST_RUN_DIR")
        if out is None:
            raise ConfigError("fast.init(resume=True) needs the run folder: give out=... or resume=FOLDER")
    resume_dir = os.environ.get("FAST_RESUME") or (str(out) if resume is True else resume)
    if resume_dir and not os.environ.get("FAST_CONFIG"):  # the run's own config, the script's and overrides in it
        config = Path(resume_dir) / "config.toml"
        if not config.is_file():
            raise ConfigError(f"resume {resume_dir}: no config.toml there; give the folder of an earlier run")
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        raise UsageError("fast.init: the default process group is already initialised (the script's "
                         "init_process_group): remove that call and its destroy_process_group; fast.init forms the "
                         "group itself, and job.finish() ends it")  # fmt: skip
    parts = resolve_job(config, **overrides)
    alone = place() is None and not all(v in os.environ for v in engine.TORCHRUN_VARIABLES)
    if not alone and place() is None and LAUNCHER_VARIABLE not in os.environ:
        parts = _torchrun_world(parts)
    if alone:
        parts = _alone(parts)
    name = parts.config.run.name
    run_dir = Path(resume_dir or out or os.environ.get("FAST_RUN_DIR") or
                   (new_folder(Path("runs"), name) if alone else default_run_dir(name)))  # fmt: skip
    if alone:  # no launcher holds the folder for this run: the script itself does
        claim(run_dir)
    job = Job(parts, run_dir, resume=bool(resume_dir), alone=alone)
    _current.set(job)
    if job.is_server:
        job._serve()  # never returns
    return job


def _torchrun_world(parts: JobParts) -> JobParts:
    """Started by torchrun: the world is torchrun's (run.workers follows it), unless the config sets another."""
    config, started, needed = parts.config, int(os.environ["WORLD_SIZE"]), parts.deployment.processes
    if started == needed:
        return parts
    servers, shards = parts.deployment.servers, parts.deployment.shards
    if "workers" in config.run.model_fields_set or started <= servers or (started - servers) % shards:
        of = f" of run.shards = {shards} processes each" if shards > 1 else ""
        raise ConfigError(
            f"torchrun started {started} processes but the config's run.workers = {config.run.workers}{of} needs "
            f"{needed}{f' (with {servers} servers)' if servers else ''}: leave run.workers out to take torchrun's "
            f"world{f' (a multiple of {shards})' if shards > 1 else ''}, or start {needed} (--nproc-per-node/--nnodes)"
        )
    return parts.with_workers((started - servers) // shards)


def _alone(parts: JobParts) -> JobParts:
    """Started without a launcher: a run of one worker (with a note when the config asked for more)."""
    config = parts.config
    if parts.deployment.servers:
        raise ConfigError(
            f"strategy {parts.options.name!r} needs server processes: start the script with "
            f"`fast run --workers {config.run.workers} SCRIPT` (or torchrun)"
        )
    if parts.deployment.shards > 1:
        raise ConfigError(f"run.shards = {parts.deployment.shards}: a replica is that many processes: start the script "
                          f"with `fast run --workers {config.run.workers} SCRIPT` (or torchrun)")  # fmt: skip
    if config.run.workers > 1:
        if "workers" in config.run.model_fields_set:  # (the default's 4 says nothing of the user's intent)
            print(f"fast: not started by `fast run` or torchrun: training as 1 worker (for {config.run.workers}: "
                  f"fast run --workers {config.run.workers} SCRIPT)", file=sys.stderr)  # fmt: skip
        parts = parts.with_workers(1)
    folder = tempfile.mkdtemp(prefix="fast-alone-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
    os.environ["FAST_STORE_FILE"] = str(Path(folder) / "store")
    return parts


class Job(Evaluating, Checkpointing, Ending, Live, Detached, Sharded):
    """One process of a run (see the module docstring). Workers are ranks below `run.workers` (times `run.shards`:
    a sharded replica's processes, fast.runtime.sharded); servers above.

    The job receives its parts resolved once (fast.parts.JobParts) and reads no config of its own. Its concerns
    around the step (evaluations, checkpoints, the end, live membership, detached lines, shards) are mixins rather
    than parts it holds: each reads and writes the step's state (the step, the clock, the records, the groups) at
    every boundary, and as separate objects each would hold the job back to reach it."""

    def __init__(self, parts: JobParts, run_dir: Path, *, resume: bool = False, alone: bool = False) -> None:
        config = parts.config
        self.parts, self.config, self.run_dir, self.resuming, self.alone = parts, config, run_dir, resume, alone
        self.loop_is_fast = FAST_LOOP.get()  # FAST's own loop (fast train), not the user's
        where = place()
        self.simulated = where is not None
        self.rank, self.world_size = where or (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
        run = config.run
        self.workers = run.workers
        self.shards = run.shards  # processes per worker (a replica sharded over them, fast.runtime.sharded)
        # live membership: the rank is the member's id for the run's life, its place in a group changes
        self.live = run.live
        self.detached = self.live and parts.strategy.joins_alone  # (fast.runtime.detached)
        if self.live and not self.simulated and ADDRESS_VARIABLE not in os.environ:
            raise ConfigError("run.membership = 'live': start the run with `fast train` or `fast run`, whose launcher "
                              "keeps its membership (not torchrun, nor the script alone)")  # fmt: skip
        if self.live:
            if not self.simulated and "FAST_MEMBER_ID" in os.environ:  # a joiner's: its replica's first id, + its shard
                self.rank = int(os.environ["FAST_MEMBER_ID"]) + self.rank
            self.world_size = parts.deployment.processes
        expected = parts.deployment.processes
        if self.world_size != expected:
            raise ConfigError(
                f"{self.world_size} processes were started but the config needs {expected} (run.workers times "
                "run.shards, plus the strategy's servers): set --workers (fast run) or --nproc-per-node/--nnodes "
                "(torchrun) to match"
            )
        # a live run's servers are launched with it (joiners' ids come after theirs); only detached ones have any
        founder = os.environ.get("FAST_JOINING") != "1"
        self.is_server = self.rank >= self.worker_processes and (not self.live or (self.detached and founder))
        self.is_worker = not self.is_server
        self.finished = False
        strategy_name = parts.options.name
        servers = self.world_size - self.worker_processes
        role = f"server {self.rank - self.worker_processes + 1}/{servers}" if self.is_server else (
            f"worker {self.rank}/{self.workers}" if self.shards == 1 else
            f"worker {self.rank // self.shards}/{self.workers} "
            f"shard {self.rank % self.shards}/{self.shards}")  # fmt: skip
        self.role = role
        self.timeline = timeline.start(self.rank, keep_events=run.trace)
        if not self.simulated:  # simulated processes share this one's threads, one at a time
            name_process(f"fast {role} {strategy_name} ({run.name})")
            here = int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))  # this machine's processes of the run
            torch.set_num_threads(run.threads_per_worker or max(1, (os.cpu_count() or 1) // here))
        if self.is_main:
            prepare_run_dir(config, run_dir, resume, self.loop_is_fast)
        self.device = engine.device_for(run.device)
        if self.detached:
            self._start_detached()  # the world: this process's line (a server's: worker 0's)
        elif self.live:
            self._start_membership()  # the world, its group and the control group, from the newest generation
        self.world: Comm = (
            self.world
            if self.live
            else simulated_world(self.rank, self.device, run.deadline_s)
            if self.simulated
            else engine.start(
                self.rank,
                self.world_size,
                os.environ["MASTER_ADDR"],
                int(os.environ["MASTER_PORT"]),
                self.device,
                run.deadline_s,
                comm_maker(
                    network_for(config, self.world_size, self.rank, self.worker_processes), run.allreduce_piece_kb
                ),
            )
        )
        partition = [list(range(self.worker_processes))]
        if self.world_size > self.worker_processes:  # workers and servers each get a group of their own
            partition.append(list(range(self.worker_processes, self.world_size)))
        self.comm = self.world.subgroups(partition) if len(partition) > 1 and not self.detached else self.world
        self._form_shard_groups()  # a sharded replica's two groups (run.shards > 1)
        run_shared_memory = run.shared_memory and not self.live
        if run_shared_memory and self.world.shares_memory and self.device.type == "cpu":  # not emulated, nor simulated
            for comm in self._own_groups():
                comm.local_sums = LocalSums(comm)  # made lazily: a sum's memory at the first all-reduce of its size
        self.records = Records(run_dir, self.rank, run.tensorboard)
        # emulated (or simulated) slowdown, stragglers, crash
        self.machine = machine_for(config, self.rank, self.records.file, simulated=self.simulated)
        self.context = StrategyContext(
            comm=self.comm if self.groups is None else self.groups.replicate,  # (shard k of every replica)
            world=self.world,
            config=config,
            device=self.device,
            workers=self.workers,
            rank=self.rank,
            # (a replica's shards draw alike: the same peers, the same choices)
            generator=torch.Generator().manual_seed(
                run.seed * 7919 + (self.rank if self.groups is None else self.replica_index)
            ),  # fmt: skip
            steps_per_epoch=1,
            save_checkpoint=self._save_server_checkpoint if self.is_server else None,
            serving=self.machine.serving,
            lines=self.server_lines if self.detached and self.is_server else None,
        )
        self.strategy: Strategy = parts.strategy(parts.options, self.context)
        self.busy = self._busy_board()
        point_to_point = self.strategy.survives_failures and not self.live  # (membership re-forms the group)
        if not self.live:
            self.control = Control(self.world.subgroups(partition, gloo=True), self.rank, point_to_point, strategy_name)
        # the end of a run that survives failures: a line on which waiting for a silent process breaks nothing
        self.ending_line = PatientGroup(self.world) if point_to_point else None
        if not self.simulated and not self.live:
            # new_group returns on one rank before its peers have connected: a process that ended right after
            # init would break their connecting, so no process leaves init before all are connected
            self.world.barrier()
        self.driver = StepDriver(
            self.strategy,
            self.machine,
            self._step_done,
            clip_norm=parts.optimizer.clip_norm,
            autocast=self._autocast_factory(),
        )
        self.driver.on_begin = self._step_begins
        if self.live and not self.detached:  # (a detached worker's line fails alone: a server is gone)
            self.driver.on_failure = self._step_failed
            if self.strategy.agrees_before_step:
                self.driver.on_exchanged = self._agree_on_the_step
        self._schedule_state: dict[str, Any] | None = None
        self._checkpoint_due = False
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.frontend: Any = None  # a JAX job's (fast.jax.JaxFrontEnd): its batches and its functions of the weights
        self.throughput: Throughput | None = None  # TFLOP/s and MFU on a GPU (made at prepare, on the model's device)
        self.schedule: Any = None
        self.clock = Clock()
        self.trained_s = 0.0
        self.steps_per_epoch: int | None = None
        self.batch_size = run.batch_size
        self.planned_epochs: float | None = None
        self.total_steps: int | None = run.max_steps
        self.loaders: list[ShardedLoader] = []
        self.loader_position: tuple[int, int] | None = None
        self.bad_steps = BadSteps()  # steps whose gradients were not finite: flags on the device, counted at boundaries
        self._stopping = False
        self._ended_at = -1  # the step at which the workers agreed to end (workers in step)
        self._ran_out_at: int | None = None  # the step this worker's loop ended at, before any empty step
        self._last_step_of_all = 0  # the last step any worker took with data, as of the last check
        self._checked_at = -1  # the step of the last check
        self._pace_from = (0, 0.0)  # (step, training time) of the last check, or of the start
        self._next_check = 1  # the step after which the workers check next: the first, then as they agree
        self._owed: int | None = None  # a check due after this step, not taken yet
        self._losses: list[torch.Tensor] = []
        self._values: dict[str, list[float]] = {}
        self._recorded_at = -1
        self._eval_fn: Callable[[nn.Module], dict[str, float]] | None = None
        self._checked_targets = False
        # worker 0's evaluations, each the time its eval function took: during the run, and the final one(s)
        self.eval_seconds: list[float] = []
        self.final_eval_seconds: list[float] = []

    # -- who -------------------------------------------------------------------------------------------------------
    def _busy_board(self) -> BusyBoard | None:
        """A lock-step run's board (fast.comm.busy): its collectives wait on for a peer that computes past the
        deadline (an evaluation on one rank) and give up on one that is frozen or waits itself."""
        if self.live or self.simulated or self.world_size == 1 or not self.lockstep:
            return None
        board = BusyBoard(torch.distributed.distributed_c10d._get_default_store(), self.rank, f"worker {self.rank}")
        with_deadline(None, self.config.run.deadline_s + BUSY_LIMIT_S)  # the backend's own limit, past FAST's
        for comm in self._own_groups():
            comm.busy = board
        return board

    def _own_groups(self) -> list[Comm]:
        """The world and, when it is another, this process's group in it (workers or servers); a sharded replica's
        process, its replica group too (the strategy's)."""
        own = [self.world] if self.comm is self.world else [self.world, self.comm]
        return own if getattr(self, "groups", None) is None else [*own, self.groups.replicate]

    @property
    def is_main(self) -> bool:
        """Whether this process does worker 0's duties: evaluations, the outputs and the summary, the end of the run.
        Worker 0's; in a live run, the first member of the generation this member is in (the lowest live id), so
        that they pass on when worker 0 dies (fast.runtime.live); a detached run's lowest live member, as the store
        says now (fast.runtime.detached)."""
        generation = getattr(self, "generation", None)
        if generation is None or not self.live or self.is_server:
            return self.rank == 0
        return (self._lowest_live() if self.detached else generation.members[0]) == self.rank

    @property
    def worker_processes(self) -> int:
        """The workers' processes: each worker's replica of `run.shards` (a live run's members, as they are now)."""
        return self.workers * self.shards

    @property
    def step(self) -> int:
        """Optimizer steps this worker has done."""
        return self.driver.step

    @property
    def epoch(self) -> float:
        return self.step / self.steps_per_epoch if self.steps_per_epoch else 0.0

    @property
    def stopped(self) -> bool:
        """Training is over: the planned steps are done, or run.max_steps, or run.max_time (agreed)."""
        return self._stopping or (self.total_steps is not None and self.step >= self.total_steps)

    should_stop = stopped

    @property
    def samples_per_step(self) -> int:
        """The samples one step of every worker trains on together (the members', in a live run; a sharded
        replica's batch is the batch size, its shards' slices together; not those of joiners sitting a round out,
        fast.runtime.live)."""
        sitting_out = self._sitting_out
        if sitting_out is not None and self.step < sitting_out[0]:
            return (self.workers - len(sitting_out[1])) * self.batch_size
        return self.workers * self.batch_size

    @property
    def lockstep(self) -> bool:
        """Whether the workers move in step (every worker's collectives need every other worker)."""
        return not self.strategy.stops_alone

    # -- the model and optimizer ----------------------------------------------------------------------------------
    def prepare(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Hook the strategy into the user's model and optimizer (which are returned, the same objects): every
        replica starts from worker 0's weights, and a resumed run from its checkpoint. Collective.

        A JAX job gives a pytree of parameters and an Optax optimizer instead, and gets back the starting weights
        and an optimizer whose step(grads) is a training step (fast.jax)."""
        if type(optimizer).__module__.startswith("optax") and not isinstance(model, nn.Module):
            if self.shards > 1:
                raise ConfigError(f"run.shards = {self.shards} shards a PyTorch model with FSDP2: a JAX job trains a "
                                  "whole replica per worker; set run.shards = 1")  # fmt: skip
            from fast.jax import prepare as prepare_jax  # (the PyTorch path never imports JAX)

            return prepare_jax(self, model, optimizer)
        if self.model is not None:
            raise UsageError("job.prepare() was already called: a job trains one model with one optimizer")
        if not isinstance(model, nn.Module):
            raise UsageError(f"job.prepare: the model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            kind = type(optimizer).__name__
            raise UsageError(f"job.prepare: the optimizer must be a torch.optim.Optimizer, got {kind}")
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            raise UsageError("job.prepare: the model is wrapped in DistributedDataParallel, which would average its "
                             "gradients a second time: give prepare the module itself (drop DDP(...), or pass "
                             "model.module)")  # fmt: skip
        self._place(model)
        view = self._shard(model, optimizer)  # what the strategy runs on: the model, or a sharded one's local shards
        self.model, self.optimizer = model, optimizer
        self.throughput = Throughput(self.device)
        if self.throughput.wanted:
            self.driver.on_first_batch = self.throughput.first_batch
        if self.world_size > self.worker_processes and self.rank == 0:  # (the servers' start: worker 0's)
            layout = ModelLayout.of(model)
            servers = range(1, self.world.size) if self.detached else range(self.workers, self.world_size)
            with self.world.unmetered():
                for server in servers:
                    self.world.send(torch.tensor([layout.parameters, layout.state]), server, tag=LAYOUT_TAG)
        if self.live and not self.detached:
            self._set_up_live(lambda: self.strategy.setup(view, optimizer))
        else:
            self.strategy.setup(view, optimizer)
        self.driver.attach(model, optimizer, self.sharded)
        offset = self._restore() if self.resuming else 0.0
        if self.detached:  # every worker from the servers' weights
            self._catch_up()
        elif self.live:  # the common start: every member from member 0's state
            self._first_heal()
        else:
            self.world.barrier()  # the common start, servers included
        self.machine.start(self.world)
        self.clock = Clock(offset, self.timeline)
        self.timeline.count_from_now()
        self.trained_s = offset
        self._pace_from = (self.step, offset)  # the workers' pace, for the next check, is timed from here
        return model, optimizer

    def _place(self, model: nn.Module) -> None:
        """Put the model on the run's device; but a user's loop that placed its model on a GPU itself (a ported DDP
        script's `model.to(f"cuda:{local_rank}")`) and set no run.device trains there: the job, its buffers and its
        collectives follow the model (the backend made at init, gloo, carries CUDA tensors)."""
        placed = next(model.parameters(), torch.empty(0)).device
        follows = not self.loop_is_fast and "device" not in self.config.run.model_fields_set
        if not (follows and placed.type == "cuda" and self.device.type == "cpu"):
            model.to(self.device)
            return
        self.device = self.context.device = placed
        for comm in self._own_groups():
            comm.device, comm.local_sums = placed, None  # shared-memory sums hold CPU tensors

    def validate_with(self, score: Callable[[nn.Module], float]) -> None:
        """The score of a replica for `final_model = "best"` (higher is better), e.g. validation accuracy."""
        self.context.score = self._on_model(score)

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Backward passes inside only accumulate gradients (gradient accumulation); the strategy communicates at
        the first backward outside. The prepared model's `no_sync()` and `require_backward_grad_sync = False`
        (DDP's) do the same."""
        return self.driver.no_sync()

    def _autocast_factory(self) -> Callable[[], Any] | None:
        if self.config.run.precision != "bf16":
            return None
        return lambda: torch.autocast(self.device.type, dtype=torch.bfloat16)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The run's precision for code outside the model's forward (the loss, say): bf16 autocast or nothing."""
        factory = self._autocast_factory()
        return factory() if factory is not None else contextlib.nullcontext()

    # -- data -------------------------------------------------------------------------------------------------------
    def loader(self, dataset: Any, batch_size: int | None = None, *, shuffle: bool = True, **options: Any) -> Any:
        """This worker's shard of `dataset` (any map-style Dataset, an IterableDataset, or a tuple of equally long
        arrays: tensors, NumPy's, JAX's), batch by batch on the job's device (a JAX job's as NumPy arrays); each pass
        is the next epoch. Options: labels= (dirichlet), num_workers=, collate_fn=."""
        dataset = tensor_dataset(dataset) if isinstance(dataset, tuple) else dataset
        return ShardedLoader(self, dataset, batch_size or self.config.run.batch_size, shuffle=shuffle, **options)

    def _loader_created(self, loader: ShardedLoader) -> None:
        if loader.steps_per_epoch and self.steps_per_epoch is None:
            self.steps_per_epoch = max(1, loader.steps_per_epoch // self.config.run.accumulate)
            self.context.steps_per_epoch = self.steps_per_epoch
            self.batch_size = loader.batch_size * self.config.run.accumulate
            if self.planned_epochs is not None:
                self._plan(self.planned_epochs)
        self.loaders.append(loader)

    def epochs(self, count: float | None = None) -> Iterator[int]:
        """The epochs to run, from where a resumed run stopped: `count` (default run.epochs; may be fractional,
        the last one cut short) unless run.max_steps or run.max_time ends training first."""
        count = self.config.run.epochs if count is None else count
        self._plan(count)
        if self.live:  # the passes of the data cursor, which a joiner takes up where the run stands
            while self.data_epoch < math.ceil(count) and not self.stopped:
                yield self.data_epoch
            return
        first = self.step // self.steps_per_epoch if self.steps_per_epoch else 0
        for epoch in range(first, math.ceil(count)):
            if self.stopped:
                return
            yield epoch

    def _plan(self, epochs: float) -> None:
        self.planned_epochs = epochs
        if self.steps_per_epoch is None:
            return
        total = math.ceil(epochs * self.steps_per_epoch)
        self.total_steps = min(total, self.config.run.max_steps or total)
        if self.config.run.max_samples is not None and not self.live:  # (live: the members count)
            self.total_steps = min(self.total_steps, math.ceil(self.config.run.max_samples / self.samples_per_step))
        if self.detached:  # each worker takes what it can of the work queue, which ends the run
            self.total_steps = self.config.run.max_steps
        self.records.show_progress(self.config.run.name, self.total_steps, self.steps_per_epoch,
                                   self.samples_per_step)  # fmt: skip

    def _all_have(self, has_batch: bool) -> bool:
        """Whether every worker has a next batch of its stream (workers in step only; the others go on alone)."""
        if not self.lockstep:
            return has_batch
        self._settle()
        if self.stopped:
            return False
        answer = self.control.round(control.BATCH, self.step, [int(has_batch)], self.strategy.dead, self._lost)
        if not answer.all(0):
            self._stopping, self._ended_at = True, self.step  # one stream is dry: every worker ends here
        return answer.all(0)

    # -- each step --------------------------------------------------------------------------------------------------
    def _step_begins(self) -> None:
        """Before each step's forward: the checkpoint the last step asked for, and (first step) the schedule, now
        that the run's length may be known."""
        self._flush_checkpoint()
        self._settle()
        if self.live and not self.detached:
            self._membership_boundary()
        schedule = self.parts.optimizer.schedule
        if self.schedule is None and schedule is not None and schedule.name != "constant":
            self.schedule = build_schedule(schedule, self.optimizer, self.total_steps)
            if self._schedule_state:
                self.schedule.load_state_dict(self._schedule_state)
                self._follow_schedule()

    def _follow_schedule(self) -> None:
        """The optimizer's learning rates as the schedule has them now: loading a schedule's state (a resumed run, a
        healed member) does not set them."""
        if self.schedule is not None:
            for group, lr in zip(self.optimizer.param_groups, self.schedule.get_last_lr(), strict=True):
                group["lr"] = lr

    def _step_done(self, bad: bool) -> None:
        """After each optimizer step: bad-step accounting, the schedule, time, stopping, checkpoints."""
        self.bad_steps.note(bad)
        if len(self.bad_steps.noted) >= MAX_STEPS_UNCOUNTED:  # (a loop that never logs, a strategy without checks)
            self._count_bad_steps()
        if self.schedule is not None:
            self.schedule.step()
        done = self.step
        self.trained_s = self.clock.now()
        if self.live and not self.detached:  # the step is taken: the data cursor moves past every member's batch
            self.data_cursor += self.samples_per_step
        elif self.lockstep and self._check_due(done):
            self._owed = done  # taken at the next decision: the next batch, the next step, or job.finish
        elif self.strategy.stops_alone and self.config.run.max_time_s is not None:
            self._stopping = self._stopping or self._run_time(self.trained_s) >= self.config.run.max_time_s
        checkpoints = self.config.run.checkpoint_every
        # written once the step is logged (job.log), or before the next step: so that it holds the step's record
        self._checkpoint_due = bool(checkpoints and done % checkpoints == 0 and not self.stopped)

    def _check_due(self, step: int) -> bool:
        """Whether the workers in step check together after `step`: at the step they agreed on at the last check
        (the first step, for the first), at each epoch's end and at the planned last step (the same steps on every
        worker)."""
        spe = self.steps_per_epoch
        return step >= self._next_check or bool(spe and step % spe == 0) or step == self.total_steps

    def _steps_to_next_check(self) -> int:
        """This worker's proposal for the next check: the steps it takes about `run.check_interval` at its pace
        since the last check, and no more than it takes to reach `run.max_time`."""
        run = self.config.run
        interval = run.check_interval_s
        if run.max_time_s is not None:
            interval = min(interval, run.max_time_s - self.trained_s)
        step, seconds = self._pace_from
        per_step = (self.trained_s - seconds) / max(1, self.step - step)
        return max(1, min(MAX_STEPS_BETWEEN_CHECKS, int(interval / per_step))) if per_step > 0 else 1

    def _settle(self, finishing: bool = False) -> None:
        """Take the check owed at this step, now that this worker knows whether it goes on (`finishing`: no)."""
        if self._owed == self.step:
            self._owed = None
            self._agree(done=finishing or self.stopped)

    def _agree(self, done: bool) -> None:
        """The workers' periodic check: has the time run out, will every worker stop here (`done`: this one will)?
        Either way the workers end here, together (`_ended_at`). They also agree on the next check: the soonest
        any of them proposes."""
        self._checked_at = self.step
        limit = self.config.run.max_time_s
        out_of_time = limit is not None and self.trained_s >= limit
        ran_out_at = self._ran_out_at if self._ran_out_at is not None else -1
        self._count_bad_steps()
        flags = [int(out_of_time), int(done), self._steps_to_next_check(), ran_out_at]
        answer = self.control.round(control.STOP, self.step, flags, self.strategy.dead, self._lost)
        self._pace_from = (self.step, self.trained_s)
        self._next_check = self.step + min(f[2] for f in answer.flags)
        self._last_step_of_all = max(f[3] if f[3] >= 0 else self.step for f in answer.flags)
        if answer.any(0):
            self._stopping = True
        if answer.any(0) or answer.all(1):
            self._ended_at = self.step

    def _throughput(self, seconds: float) -> dict[str, Any]:
        """This worker's achieved TFLOP/s and MFU over `seconds` of training (fast.runtime.throughput), or {}."""
        if self.throughput is None or not self.throughput.wanted or self.model is None:
            return {}
        with self.driver.evaluation():
            self.throughput.count(self.model)
        return self.throughput.figures(self.driver.samples, seconds)

    def _worker_throughput(self) -> dict[str, Any]:
        """For the summary: this worker's figures over its training, with the GPU it ran on (host:index, the same for
        workers that share one) and that GPU's peak; {} without figures."""
        figures = self._throughput(self.trained_s)
        if not figures or self.throughput is None:
            return {}
        gpu = None
        if self.device.type == "cuda":
            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            gpu = f"{socket.gethostname()}:{index}"
        return {**figures, "gpu": gpu, "peak_tflops": self.throughput.peak}

    def _lost(self, rank: int, how: str) -> None:
        self.strategy.lost(rank, self.step, how)

    @property
    def skipped_steps(self) -> int:
        """Steps this worker skipped because its gradients were not finite (counted now: a boundary's read)."""
        self._count_bad_steps()
        return self.bad_steps.total

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self.bad_steps.total = value

    def _count_bad_steps(self, values: list[float] | None = None) -> None:
        """Count the bad steps noted since the last boundary (from `values`, their flags as read, or read now); a
        FastError when run.max_bad_steps of them came in a row."""
        limit = self.config.run.max_bad_steps
        if self.bad_steps.noted and self.bad_steps.count(values) >= limit:
            fix = ("lower optimizer.lr or check the data and the step function" if self.loop_is_fast else
                   "lower your optimizer's learning rate or check the data and the loss (a GradScaler would skip "
                   "such steps and back off)")  # fmt: skip
            raise FastError(f"worker {self.rank}: NaN or Inf in the loss or gradients for {limit} steps in a row "
                            f"(run.max_bad_steps): {fix}")  # fmt: skip

    # -- metrics -----------------------------------------------------------------------------------------------------
    def log(self, loss: Any = None, **values: Any) -> None:
        """Record the step's loss (and any other numbers); a record is written every run.log_every steps."""
        if loss is not None:  # (kept where it is: read back at the next record)
            self._losses.append(loss.detach() if isinstance(loss, torch.Tensor) else torch.tensor(float(loss)))
        for key, value in values.items():
            self._values.setdefault(key, []).append(value.detach() if isinstance(value, torch.Tensor) else value)
        if self.step % self.config.run.log_every == 0 and self.step != self._recorded_at and self.step > 0:
            self._record()
        self._flush_checkpoint()

    def _flush_checkpoint(self) -> None:
        if self._checkpoint_due:
            self._checkpoint_due = False
            self._checkpoint()

    def _record(self, kind: str | None = None, **extra: Any) -> None:
        """A metric record: the training losses logged since the last one, or (kind="eval") an evaluation's."""
        step = self.step
        record: dict[str, Any] = {
            "worker": self.rank,
            "step": step,
            "epoch": round(self.epoch, 4),
            "time_s": round(self.clock.now(), 4),
            "samples": step * self.batch_size,
            "bytes_sent": self.world.counter.bytes_sent,
            "bytes_received": self.world.counter.bytes_received,
        }
        if self.optimizer is not None:
            record["lr"] = self.optimizer.param_groups[0]["lr"]
        if kind is None:  # the losses, the values given as tensors and the bad-step flags: one read for all
            given = [v for values in self._values.values() for v in values if isinstance(v, torch.Tensor)]
            flags = self.bad_steps.flags()
            losses, numbers, bad = read_together(self._losses, given, flags)
            finite = [loss for loss in losses if math.isfinite(loss)]
            if finite:
                record["loss"] = sum(finite) / len(finite)
            read = iter(numbers)
            for key, values in self._values.items():
                if values:
                    given_here = [next(read) if isinstance(v, torch.Tensor) else float(v) for v in values]
                    record[key] = sum(given_here) / len(given_here)
            self._count_bad_steps(bad)
            self._losses, self._values = [], {}
            record.update(self._throughput(record["time_s"]))
            self._recorded_at = step
        else:
            record["kind"] = kind
        record.update(extra)
        self.records.add(record)

    # -- the process's end -------------------------------------------------------------------------------------------
    def _close(self) -> None:
        self.finished = True
        if self.live and not self.is_server:
            self._close_membership()
        if self.detached:
            self._close_lines()
        self.driver.detach()
        self.records.close()
        if self.busy is not None:
            self.busy.close()
        if not self.simulated:
            engine.stop()
        if self.alone:
            release(self.run_dir)
        if _current.get() is self:
            _current.set(None)

    def _serve(self) -> None:
        """A server process: its strategy's loop until the workers are done, its part of the end, then exit."""
        layout = torch.zeros(2, dtype=torch.int64)
        with self.world.unmetered():
            self.world.recv(layout, 0, tag=LAYOUT_TAG)  # when worker 0 prepares its model
        self.strategy.setup_server(ModelLayout(int(layout[0]), int(layout[1])))
        if self.resuming:
            self._restore()
        if not self.detached:
            self.world.barrier()
        self.machine.start(self.world)
        self.clock = Clock()
        self.strategy.serve()
        self._finish_server()
        self._close()
        raise SystemExit(0)
