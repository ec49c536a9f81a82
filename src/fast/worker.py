"""The worker node (paper 001 Sec. IV): shard, replica, optimizer, step loop, evaluation, metrics, checkpoints.

The user supplies only the per-mini-batch step (default: supervised cross-entropy); the strategy's hooks
decide what is communicated around it. One step, top to bottom:

    strategy.before_step → loss = step_fn(model, x, y) → loss.backward() → strategy.after_backward
    → optimizer.step() → strategy.after_optimizer_step
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fast import checkpoint, engine
from fast.comm import Comm
from fast.config import Config, OptimizerConfig
from fast.data import Dataset, load_dataset, partition
from fast.deployment import machine_for, network_for
from fast.errors import CommError, FastError
from fast.evaluate import evaluate
from fast.models import build_model
from fast.progress import Progress
from fast.strategies import Strategy, StrategyContext, build_strategy, strategy_class, strategy_options

AGREE_TAG = 7_002  # apart from every strategy's tags (and fast.survivors' END_TAG)

ModelFn = Callable[[tuple[int, ...], int], nn.Module]
StepFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def cross_entropy_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The default per-mini-batch step: supervised classification loss."""
    return F.cross_entropy(model(x), y)


@dataclass
class UserCode:
    """What a Python user may replace: the model factory and the per-batch step (both picklable)."""

    model_fn: ModelFn | None = None
    step_fn: StepFn | None = None
    # unpickling the class in a worker process imports its module, which registers a strategy defined
    # outside fast.strategies (e.g. in the user's script) there too
    strategy_class: type[Strategy] | None = None


def build_optimizer(cfg: OptimizerConfig, params: Any) -> torch.optim.Optimizer:
    if cfg.name == "sgd":
        return torch.optim.SGD(
            params,
            lr=cfg.lr,
            momentum=cfg.momentum,
            weight_decay=cfg.weight_decay,
            nesterov=cfg.nesterov and cfg.momentum > 0,
        )
    cls = torch.optim.Adam if cfg.name == "adam" else torch.optim.AdamW
    return cls(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def server_count(config: Config) -> int:
    return strategy_class(config.strategy.name).server_count(strategy_options(config), config.run.workers)


def steps_per_epoch(shards: list[torch.Tensor], batch_size: int) -> int:
    """Every worker runs the same number of steps per epoch: the smallest shard decides."""
    return max(1, min(len(s) for s in shards) // batch_size)


class Clock:
    """Training time from the common start barrier, with evaluation time left out."""

    def __init__(self, offset: float = 0.0) -> None:
        self.start = time.perf_counter() - offset
        self.paused = 0.0

    def now(self) -> float:
        return time.perf_counter() - self.start - self.paused

    def pause(self) -> Any:
        clock = self

        class _Paused:
            def __enter__(self) -> None:
                self.t = time.perf_counter()

            def __exit__(self, *exc: Any) -> None:
                clock.paused += time.perf_counter() - self.t

        return _Paused()


class Worker:
    """One process of a run; rank < workers trains, higher ranks serve (parameter servers)."""

    def __init__(
        self, config: Config, run_dir: Path, user: UserCode, world: Comm, rank: int, resume: bool = False
    ) -> None:
        self.config, self.run_dir, self.user, self.world, self.rank = config, run_dir, user, world, rank
        run = config.run
        self.device = world.device
        self.workers = run.workers
        self.is_server = rank >= self.workers
        # workers and servers each get a group of their own when servers exist
        if world.size > self.workers:
            groups = [list(range(self.workers)), list(range(self.workers, world.size))]
            self.comm = world.subgroups(groups)
        else:
            self.comm = world
        torch.manual_seed(run.seed)
        self.data: Dataset = load_dataset(
            config.data.name,
            seed=run.seed,
            data_dir=config.data.dir,
            synthetic_train=config.data.synthetic_train,
            synthetic_test=config.data.synthetic_test,
        )
        shards = partition(
            self.data.y_train, self.workers, config.data.partition, alpha=config.data.alpha, seed=run.seed
        )
        self.steps_per_epoch = steps_per_epoch(shards, run.batch_size)
        self.total_steps = math.ceil(run.epochs * self.steps_per_epoch)
        if run.max_steps is not None:
            self.total_steps = min(self.total_steps, run.max_steps)
        torch.manual_seed(run.seed)  # every replica starts from the same initial weights
        model_fn = user.model_fn or (lambda shape, classes: build_model(config.model.name, shape, classes))
        self.model = model_fn(self.data.input_shape, self.data.num_classes).to(self.device)
        self.step_fn = user.step_fn or cross_entropy_step
        self.optimizer = build_optimizer(config.optimizer, self.model.parameters())
        shard = shards[rank] if not self.is_server else shards[0][:0]
        self.x, self.y = self.data.x_train[shard].to(self.device), self.data.y_train[shard].to(self.device)
        # the test set is split across workers for collective evaluation
        self.x_test, self.y_test = (
            self.data.x_test[rank :: self.workers],
            self.data.y_test[rank :: self.workers],
        )
        validation = (
            self.data.x_train[: min(1000, len(self.data.x_train))],
            self.data.y_train[: min(1000, len(self.data.y_train))],
        )
        generator = torch.Generator().manual_seed(run.seed * 7919 + rank)
        ctx = StrategyContext(
            comm=self.comm,
            world=world,
            config=config,
            device=self.device,
            workers=self.workers,
            rank=rank,
            generator=generator,
            steps_per_epoch=self.steps_per_epoch,
            validation=validation,
            save_checkpoint=self._save_server_checkpoint if self.is_server else None,
        )
        self.strategy: Strategy = build_strategy(config, ctx)
        self.records: list[dict[str, Any]] = []
        self.evals: list[dict[str, float]] = []
        self.start_step = 0
        self.resume = resume
        self.metrics_file = run_dir / "workers" / f"metrics-{rank}.jsonl"
        self.progress: Progress | None = None
        self.skipped_steps, self.bad_in_a_row, self.last_bad = 0, 0, -2
        self.machine = machine_for(config, rank, self.metrics_file)  # emulated slowdown, stragglers, crash

    # -- data order: a function of (seed, epoch, rank) only, so a resumed run sees the same batches ----------
    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        epoch, i = divmod(step, self.steps_per_epoch)
        if getattr(self, "_perm_epoch", None) != epoch:
            g = torch.Generator().manual_seed(self.config.run.seed * 1_000_003 + epoch * 7919 + self.rank)
            self._perm = torch.randperm(len(self.x), generator=g).to(self.device)
            self._perm_epoch = epoch
        b = self.config.run.batch_size
        idx = self._perm[i * b : (i + 1) * b]
        return self.x[idx], self.y[idx]

    def eval_due(self, step: int) -> bool:
        every = round(self.config.run.eval_every * self.steps_per_epoch)
        return every > 0 and step % every == 0 and step < self.total_steps

    # -- the loop ------------------------------------------------------------------------------------------
    def run(self) -> dict[str, Any] | None:
        if self.is_server:
            self.strategy.setup_server(self.model)
            if self.resume:
                self._restore()
            self.world.barrier()
            self.machine.start(self.world)
            self.strategy.serve(self.model)
            if self.strategy.survives_failures:
                from fast.survivors import gather_from_survivors

                return gather_from_survivors(self)
            return self._finish(None)
        self.strategy.setup(self.model, self.optimizer)
        clock_offset = self._restore() if self.resume else 0.0
        self.world.barrier()
        self.machine.start(self.world)
        self.clock = Clock(clock_offset)
        if self.rank == 0 and os.environ.get("FAST_PROGRESS", "1") != "0":
            self.progress = Progress(
                self.config.run.name,
                self.total_steps,
                self.steps_per_epoch,
                self.config.run.batch_size * self.workers,
            )
        log_every = self.config.run.log_every
        loss_sum, loss_count = 0.0, 0
        for step in range(self.start_step, self.total_steps):
            self.machine.before_step(step)  # emulated crash, straggler pause, slowdown
            x, y = self.batch(step)
            self.strategy.before_step(step)
            self.optimizer.zero_grad(set_to_none=True)
            loss = self.step_fn(self.model, x, y)
            loss.backward()
            bad = self._discard_if_not_finite(loss)
            self.strategy.after_backward(step)
            if bad:
                self._bad_step(step)
            if not bad or self.strategy.averages_gradients:
                self.optimizer.step()
            self.strategy.after_optimizer_step(step)
            self.machine.after_step()  # times the step's own work, its communication waits left out
            if not bad:
                loss_sum += float(loss.detach())
                loss_count += 1
            done = step + 1
            if done < self.total_steps and self._out_of_time(done):
                self.total_steps = done  # the last step: recorded, then the run ends as if planned so
            if (done % log_every == 0 or done == self.total_steps) and loss_count:
                self._record(done, loss_sum / loss_count)
                loss_sum, loss_count = 0.0, 0
            if self.eval_due(done):
                self._evaluate(done)
            every = self.config.run.checkpoint_every
            if every and done % every == 0 and done < self.total_steps:
                self._checkpoint(done)
            if done == self.total_steps:
                break  # max_time ended the run at this step
        # training time ends at the last step: the end of the run may wait for other workers (an asynchronous
        # peer still training, rank 0 still evaluating), which is not this worker's training
        self.trained_s = self.clock.now()
        self.strategy.end_of_run()
        if self.strategy.survives_failures:  # nothing collective: a dead worker could not take part
            if self.progress is not None:
                self.progress.close()
            from fast.survivors import gather_from_survivors

            return gather_from_survivors(self)
        self._evaluate(self.total_steps, final=True)
        if self.progress is not None:
            self.progress.close()
        return self._finish(self.final)

    def _out_of_time(self, done: int) -> bool:
        """Whether `run.max_time` of training has passed: each worker's own clock when the strategy lets workers
        end alone, else a decision all workers take together every log_every steps (measurement traffic)."""
        limit = self.config.run.max_time_s
        if limit is None:
            return False
        if self.strategy.stops_alone:
            return self.clock.now() >= limit
        if done % self.config.run.log_every:
            return False
        flag = torch.tensor([float(self.clock.now() >= limit)], device=self.device)
        with self.comm.unmetered():
            if self.strategy.survives_failures:
                return self._agree_through_rank_0(flag, done)
            self.comm.all_reduce(flag, op="max")
        return bool(flag.item())

    def _agree_through_rank_0(self, flag: torch.Tensor, done: int) -> bool:
        """The max of every live worker's flag, point to point through rank 0 (a collective could not finish
        once a worker is dead); a worker that does not answer is recorded as lost."""
        comm, first = self.comm, self.comm.ranks[0]
        if self.rank != first:
            comm.send(flag, first, tag=AGREE_TAG)
            comm.recv(flag, first, tag=AGREE_TAG)
            return bool(flag.item())
        theirs = torch.zeros_like(flag)
        live = [r for r in comm.ranks[1:] if r not in self.strategy.dead]
        for rank in live:
            try:
                flag = torch.maximum(flag, comm.recv(theirs, rank, tag=AGREE_TAG))
            except CommError as e:
                self.strategy.lost(rank, done, f"did not answer the end-of-time check: {e}")
        for rank in live:
            if rank not in self.strategy.dead:
                try:
                    comm.send(flag, rank, tag=AGREE_TAG)
                except CommError as e:
                    self.strategy.lost(rank, done, f"did not take the end-of-time decision: {e}")
        return bool(flag.item())

    def _discard_if_not_finite(self, loss: torch.Tensor) -> bool:
        """A NaN or Inf in the loss or a gradient: zero this worker's gradients so none leaves it."""
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        # min and max are NaN or infinite exactly when some element is: one cheap reduction per gradient and
        # one sync, several times faster on CPU than isfinite(g).all() per gradient
        extremes = [
            loss.detach().float().reshape(-1),
            *(torch.stack(torch.aminmax(g)).float() for g in grads if g.numel()),
        ]
        finite = bool(torch.isfinite(torch.cat(extremes)).all())
        if not finite:
            for g in grads:
                g.zero_()
        return not finite

    def _bad_step(self, step: int) -> None:
        self.skipped_steps += 1
        self.bad_in_a_row = self.bad_in_a_row + 1 if self.last_bad == step - 1 else 1
        self.last_bad = step
        limit = self.config.run.max_bad_steps
        if self.bad_in_a_row >= limit:
            raise FastError(
                f"worker {self.rank}: NaN or Inf in the loss or gradients for {limit} steps in a row "
                f"(run.max_bad_steps); lower optimizer.lr or check the data and the step function"
            )

    def _record(self, step: int, loss: float | None, **extra: Any) -> None:
        counter = self.world.counter
        record = {
            "worker": self.rank,
            "step": step,
            "epoch": round(step / self.steps_per_epoch, 4),
            "time_s": round(self.clock.now(), 4),
            "samples": step * self.config.run.batch_size,
            "bytes_sent": counter.bytes_sent,
            "bytes_received": counter.bytes_received,
            **extra,
        }
        if loss is not None:
            record["loss"] = loss
        self.records.append(record)
        self.metrics_file.parent.mkdir(parents=True, exist_ok=True)
        with self.metrics_file.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.progress is not None:
            self.progress.update(record)

    def _evaluate(self, step: int, final: bool = False) -> None:
        """Test accuracy of the reported model and replica divergence (measurement only).

        Collective (every worker evaluates a slice of the test set) unless the strategy evaluates on rank 0
        alone during training so that asynchronous workers never wait; the final evaluation is collective.
        """
        survivable = self.strategy.survives_failures
        collective = final or (self.strategy.collective_eval and not survivable)
        if not collective and self.rank != 0:
            return
        with self.clock.pause():
            if collective:
                model = self.strategy.final_model() if final else self.strategy.eval_model()
                stats = torch.tensor(evaluate(model, self.x_test, self.y_test, self.device), dtype=torch.float64)
                with self.comm.unmetered():
                    self.comm.all_reduce(stats)
                    divergence = self.strategy.divergence() if self.strategy.decentralised else 0.0
            else:  # a strategy that survives failures evaluates rank 0's own replica while it trains
                model = self.strategy.model if self.strategy.collective_eval else self.strategy.eval_model()
                stats = torch.tensor(evaluate(model, self.data.x_test, self.data.y_test, self.device))
                divergence = None
        self.final = model
        correct, loss, n = stats.tolist()
        result = {
            "step": step,
            "time_s": round(self.clock.now(), 4),
            "test_accuracy": correct / n,
            "test_loss": loss / n,
        }
        if divergence is not None:
            result["divergence"] = divergence
        self.evals.append(result)
        if self.rank == 0:
            extra = {k: v for k, v in result.items() if k not in ("step", "time_s")}
            self._record(step, None, kind="eval", **extra)

    def _checkpoint(self, step: int) -> None:
        """This worker's state after `step` in `checkpoints/worker<rank>-step<step>.pt` (fast.checkpoint)."""
        state = {
            "step": step,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "strategy": self.strategy.state_dict(),
            "time_s": self.clock.now(),
            "counter": self.world.counter.snapshot(),
            "records": json.dumps(self.records),
            "evals": json.dumps(self.evals),
            "rng": torch.get_rng_state(),
        }
        checkpoint.save(state, self.run_dir, self.rank, step)

    def _save_server_checkpoint(self, strategy_state: dict[str, Any]) -> None:
        """A server's checkpoint: its strategy's snapshot of the step `strategy_state["step"]` (async-ps) and its
        byte counts, in `checkpoints/server<rank>-step<step>.pt`."""
        state = {"strategy": strategy_state, "counter": self.world.counter.snapshot()}
        checkpoint.save(state, self.run_dir, self.rank, int(strategy_state["step"]), server=True)

    def _restore(self) -> float:
        """Collective over the world (servers too): agree on the step to resume from (fast.checkpoint), load this
        process's checkpoint of it and delete its later ones. Returns the training time to resume the clock at."""
        server = self.is_server
        takes_part = not server or self.strategy.server_checkpoints
        mine = checkpoint.saved_steps(self.run_dir, self.rank, server=server)
        everyone = checkpoint.gather_steps(self.world, mine if takes_part else None)
        if not takes_part:
            return 0.0
        step = checkpoint.newest_common_step(everyone)
        if step is None and any(everyone):  # checkpoints, but no step every process holds
            alone = self.strategy.stops_alone  # workers at their own pace may be more than one interval apart
            if self.rank == 0:
                how = "each resumes from its own newest" if alone else "every process starts from the beginning"
                self.strategy.ctx.log(f"fast: no checkpoint step is common to every process: {how}")
            step = (mine[-1] if mine else None) if alone else 0
        if step is None:  # no checkpoint anywhere
            return 0.0
        checkpoint.discard_after(self.run_dir, self.rank, step, server=server)
        if step not in mine:  # the beginning: nothing to load
            return 0.0
        state = checkpoint.load(checkpoint.checkpoint_path(self.run_dir, self.rank, step, server=server))
        if server:
            self.strategy.load_state_dict(state["strategy"])
            self._restore_counter(state["counter"])
            return 0.0
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.strategy.load_state_dict(state["strategy"])
        torch.set_rng_state(state["rng"])
        self.start_step = int(state["step"])
        self.records, self.evals = json.loads(state["records"]), json.loads(state["evals"])
        self._restore_counter(state["counter"])
        return float(state["time_s"])

    def _restore_counter(self, snapshot: dict[str, Any]) -> None:
        counter = self.world.counter
        counter.sent.update({int(k): v for k, v in snapshot["sent_per_peer"].items()})
        counter.received.update({int(k): v for k, v in snapshot["received_per_peer"].items()})
        counter.sent_uncompressed = snapshot["bytes_sent_uncompressed"]

    # -- the end: everything goes to rank 0, which writes the outputs --------------------------------------
    def _finish(self, model: nn.Module | None) -> dict[str, Any] | None:
        from fast.results import gather_and_write

        return gather_and_write(self, model)


def worker_main(config: Config, run_dir: Path, user: UserCode, resume: bool = False) -> dict[str, Any] | None:
    """Entry point of one process, started by the local launcher or by torchrun."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    threads = config.run.threads_per_worker or max(1, (os.cpu_count() or 1) // world_size)
    torch.set_num_threads(threads)
    device = engine.device_for(config.run.device)
    world = engine.start(
        rank,
        world_size,
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        device,
        config.run.deadline_s,
        network_for(config, world_size, rank),
    )
    resume = resume or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0  # restarted by the agent
    try:
        return Worker(config, run_dir, user, world, rank, resume).run()
    finally:
        engine.stop()
