"""Checkpoints: each process's training state (a worker's, or a server's snapshot), written atomically, kept per
step, and on resume loaded from the newest step that every process holds; read back with weights_only.

The scheme. Every `run.checkpoint_every` steps each worker writes `checkpoints/worker<rank>-step<N>.pt`; a server
whose strategy checkpoints it (`Strategy.server_checkpoints`: async-ps, ea-wild, async easgd) writes
`server<rank>-step<N>.pt` when its snapshot of step N is complete. A file is written to a temporary name, flushed to
disk and renamed, so it is whole or absent; once it is in place the process deletes its own files older than its
newest `KEEP` (= 2). Processes write and rename one after another, so a crash or Ctrl-C can leave them at different
steps (worker 0 renamed its step-15 file, worker 1 had not): keeping the previous step as well means that the
processes still hold a step in common (for workers in lockstep, which are never more than one interval apart).

On resume (`--resume`, or a restart by `run.max_restarts`) every process of the world takes part in one
all-gather (`gather_steps`, unmetered: not training traffic) of the steps it holds, and all of them pick the
newest step every process holds (`newest_common_step`; a process that writes no checkpoint, such as a
strategy's server that keeps no state, takes no part). Each loads its file of that step and deletes its files of
later steps, which belong to the life that ended, so the run restarts exactly from that step: the data order,
RNG state, optimizer, strategy state and byte counts are in the file. If no step is common, every process starts
from the beginning, except under a strategy whose workers run at their own pace (`Strategy.stops_alone`; they
may be more than one interval apart), where each process resumes from its own newest file, as an asynchronous
run may.

A sharded run's replicas (`run.shards` > 1) write a folder per replica and step instead, `replica<r>-step<N>`, through
torch.distributed.checkpoint (fast.shards.checkpoint; fast.runtime.sharded); an unsharded run reads them too, worker r
replica r's, so that a run resumes at another number of shards.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from fast.comm import Comm
from fast.errors import ConfigError
from fast.runtime import files
from fast.shards import checkpoint as replica_checkpoint

KEEP = 2  # checkpoints kept per process: the newest, and the one before in case another process lacks the newest


def save_atomic(obj: Any, path: Path) -> None:
    """torch.save to a temporary file beside `path`, flushed to disk, then renamed: a reader finds the old file
    or the new one, never half of one (a failed save leaves the old file and no temporary one; fast.runtime.files)."""
    files.save(obj, path)


def _kind(server: bool) -> str:
    return "server" if server else "worker"


def checkpoint_path(run_dir: Path, rank: int, step: int, *, server: bool = False) -> Path:
    """`checkpoints/worker<rank>-step<step>.pt`, or `server<rank>-step<step>.pt` for a server process."""
    return run_dir / "checkpoints" / f"{_kind(server)}{rank}-step{step}.pt"


def saved_steps(run_dir: Path, rank: int, *, server: bool = False) -> list[int]:
    """The steps of this process's checkpoint files, oldest first (temporary files are not checkpoints)."""
    pattern = re.compile(rf"{_kind(server)}{rank}-step(\d+)\.pt")
    folder = run_dir / "checkpoints"
    if not folder.is_dir():
        return []
    return sorted(int(m.group(1)) for p in folder.iterdir() if (m := pattern.fullmatch(p.name)))


def save(state: dict[str, Any], run_dir: Path, rank: int, step: int, *, server: bool = False) -> Path:
    """Write this process's checkpoint of `step` atomically, then delete its files older than the newest KEEP."""
    path = checkpoint_path(run_dir, rank, step, server=server)
    save_atomic(state, path)
    for old in saved_steps(run_dir, rank, server=server)[:-KEEP]:
        checkpoint_path(run_dir, rank, old, server=server).unlink(missing_ok=True)
    return path


def discard_after(run_dir: Path, rank: int, step: int, *, server: bool = False) -> None:
    """Delete this process's checkpoints of steps after `step` (the resumed run writes its own)."""
    for later in saved_steps(run_dir, rank, server=server):
        if later > step:
            checkpoint_path(run_dir, rank, later, server=server).unlink(missing_ok=True)


def gather_steps(comm: Comm, mine: list[int] | None) -> list[list[int] | None]:
    """Collective over `comm`: every member's saved steps (its newest KEEP + 1: a crash between a rename and the
    deletion of older files leaves one more), or None for a member that takes no part (`mine` None)."""
    width = KEEP + 1
    row = torch.full((1 + width,), -1, dtype=torch.int64)
    if mine is not None:
        newest = sorted(mine)[-width:]
        row[0] = 1
        row[1 : 1 + len(newest)] = torch.tensor(newest, dtype=torch.int64)
    with comm.unmetered():
        rows = comm.all_gather(row.to(comm.device))
    return [[int(s) for s in r[1:].tolist() if s >= 0] if int(r[0]) == 1 else None for r in (r.cpu() for r in rows)]


def newest_common_step(everyone: list[list[int] | None]) -> int | None:
    """The newest step held by every process that takes part (not None); None when there is none."""
    sets = [set(steps) for steps in everyone if steps is not None]
    common = set.intersection(*sets) if sets else set()
    return max(common) if common else None


def load(path: Path) -> dict[str, Any]:
    return torch.load(path, map_location="cpu", weights_only=True)


class Checkpointing:
    """The job's checkpoints: its own state at a step, a server's snapshot, and the restore on resume (a part of
    fast.runtime.job.Job)."""

    def _checkpoint(self) -> None:
        """This worker's state after this step in `checkpoints/worker<rank>-step<step>.pt` (a sharded replica's
        process: its part of its replica's folder)."""
        position = self._position()
        state = {
            "step": self.step,
            "strategy": self.strategy.state_dict(),
            "schedule": self.schedule.state_dict() if self.schedule is not None else {},
            "loader": torch.tensor(position if position is not None else (-1, -1)),
            "time_s": self.clock.now(),
            "counter": self.world.counter.snapshot(),
            "skipped_steps": self.skipped_steps,
            "rng": torch.get_rng_state(),
            **self.records.state(),
        }
        if self.sharded is not None:
            self._save_replica_checkpoint(state)
            return
        state.update(model=self.model.state_dict(), optimizer=self.optimizer.state_dict())
        save(state, self.run_dir, self.rank, self.step)

    def _position(self) -> tuple[int, int] | None:
        """Where the first loader is: (epoch, batches of it done)."""
        if not self.loaders or self.loaders[0].epoch is None:
            return None
        loader = self.loaders[0]
        return loader.epoch, loader.taken

    def _save_server_checkpoint(self, strategy_state: dict[str, Any]) -> None:
        state = {"strategy": strategy_state, "counter": self.world.counter.snapshot()}
        save(state, self.run_dir, self.rank, int(strategy_state["step"]), server=True)

    def _restore(self) -> float:
        """Collective over the world: agree on the step to resume from (fast.runtime.checkpoints), load this process's
        checkpoint of it, delete its later ones. Returns the training time to resume the clock at."""
        server = self.is_server
        takes_part = not server or self.strategy.server_checkpoints
        # an unsharded worker's files, and its replica's folders (written sharded, at any number of shards)
        own = saved_steps(self.run_dir, self.rank, server=server) if self.sharded is None else []
        folders = replica_checkpoint.saved_steps(self.run_dir, self.replica_index) if self.is_worker else []
        mine = sorted({*own, *folders})
        everyone = gather_steps(self.world, mine if takes_part else None)
        if not takes_part:
            return 0.0
        step = newest_common_step(everyone)
        if step is None and any(everyone):  # checkpoints, but no step every process holds
            alone = self.strategy.stops_alone  # workers at their own pace may be more than one interval apart
            if self.is_main:
                how = "each resumes from its own newest" if alone else "every process starts from the beginning"
                self.context.log(f"fast: no checkpoint step is common to every process: {how}")
            step = (mine[-1] if mine else None) if alone else 0
        if step is None:
            return 0.0
        if self.sharded is None:
            discard_after(self.run_dir, self.rank, step, server=server)
        if self.is_worker and self.shard_index == 0:
            replica_checkpoint.remove(self.run_dir, self.replica_index, [s for s in folders if s > step])
        if step not in mine:
            return 0.0
        if step in folders:  # (loads the model and the optimizer)
            state = self._load_replica_checkpoint(replica_checkpoint.replica_folder(self.run_dir, self.replica_index,
                                                                                    step))  # fmt: skip
        elif self.sharded is not None:
            raise ConfigError(f"resuming at run.shards = {self.shards}: the checkpoint of step {step} was written "
                              "unsharded; resume it at run.shards = 1")  # fmt: skip
        else:
            state = load(checkpoint_path(self.run_dir, self.rank, step, server=server))
        self._restore_counter(state["counter"])
        if server:
            self.strategy.load_state_dict(state["strategy"])
            return 0.0
        if "model" in state:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        self.strategy.load_state_dict(state["strategy"])
        self._schedule_state = state.get("schedule") or None
        torch.set_rng_state(state["rng"])
        self.driver.step = int(state["step"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        position = state.get("loader")
        if position is not None and int(position[0]) >= 0:
            self.loader_position = (int(position[0]), int(position[1]))
        self.records.restore(state)
        self._recorded_at = self.step
        return float(state["time_s"])

    def _restore_counter(self, snapshot: dict[str, Any]) -> None:
        counter = self.world.counter
        counter.sent.update({int(k): v for k, v in snapshot["sent_per_peer"].items()})
        counter.received.update({int(k): v for k, v in snapshot["received_per_peer"].items()})
        counter.sent_uncompressed = snapshot["bytes_sent_uncompressed"]
