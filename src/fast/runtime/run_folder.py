"""A run folder belongs to one run: a default name that no other run takes, a lock the live run holds, and a fresh
start (config.toml written, an earlier run's records cleared) unless the run resumes.

A default folder is made under runs/ with the run's name and the time, and a suffix (-2, -3, ...) when a run started
in the same second has that name already: the folder is created atomically, so two runs cannot both get it. The
process that starts a run (its launcher, or a script run alone) holds an advisory lock (flock) on the folder's
`.lock` file while the run lives; the kernel drops it when that process ends, however it ends. A second run given
a folder a live run holds is refused in one line.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from fast.comm import bootstrap as engine
from fast.errors import ConfigError
from fast.runtime import files

if TYPE_CHECKING:
    from fast.config import Config

LOCK = ".lock"
_held: dict[Path, int] = {}  # folders this process holds: their lock files' descriptors


def new_folder(parent: Path, name: str) -> Path:
    """`parent/name-TIME`, or with -2, -3, ... when taken: made now, so that no other run can take it."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    parent.mkdir(parents=True, exist_ok=True)
    for n in range(1, 10_000):
        folder = parent / (f"{name}-{stamp}" if n == 1 else f"{name}-{stamp}-{n}")
        try:
            folder.mkdir()
            return folder
        except FileExistsError:
            continue
    raise ConfigError(f"{parent} has no free name for {name}-{stamp}: give the run folder with --out")


def default_run_dir(name: str) -> Path:
    """runs/NAME-TIME, made now and no other run's; under torchrun, runs/NAME-RUN_ID, the same on every rank."""
    if engine.under_torchrun():
        return Path("runs") / f"{name}-{os.environ.get('TORCHELASTIC_RUN_ID', 'torchrun')}"
    return new_folder(Path("runs"), name)


def check_folder(run_dir: Path) -> None:
    """ConfigError when `run_dir` cannot be a run folder (a file is there, or it cannot be made)."""
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"run folder {run_dir} is a file: give --out a folder's path (new or an earlier run's)")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        why = f"run folder {run_dir} cannot be made ({e.strerror})"
        raise ConfigError(f"{why}: give --out a folder you can write") from None


def claim(run_dir: Path) -> None:
    """Hold `run_dir` for this process's run; ConfigError when a live run holds it. Held until `release`, or until
    this process ends."""
    run_dir = run_dir.resolve()
    if run_dir in _held:
        return
    check_folder(run_dir)
    descriptor = os.open(run_dir / LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(descriptor, 32).decode(errors="replace").strip()
        os.close(descriptor)
        who = f" (process {holder})" if holder.isdigit() else ""
        raise ConfigError(f"run folder {run_dir} belongs to a run that is still going{who}: give another --out, or "
                          "wait until it ends") from None  # fmt: skip
    os.ftruncate(descriptor, 0)
    os.write(descriptor, str(os.getpid()).encode())
    _held[run_dir] = descriptor


def release(run_dir: Path) -> None:
    descriptor = _held.pop(run_dir.resolve(), None)
    if descriptor is not None:
        os.close(descriptor)  # the lock goes with it; the file stays (removing it would race a new claimant)


@contextlib.contextmanager
def claimed(run_dir: Path) -> Iterator[None]:
    """`run_dir` held meanwhile (see `claim`); a folder this process already held stays held."""
    already = run_dir.resolve() in _held
    claim(run_dir)
    try:
        yield
    finally:
        if not already:
            release(run_dir)


def prepare_run_dir(config: Config, run_dir: Path, resume: bool, fast_loop: bool) -> None:
    """The run folder with config.toml (what the run uses: see Config.as_used); a fresh run in a used folder
    starts clean (rank 0, before the others)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if not resume:
        for stale in [*run_dir.glob("workers/metrics-*.jsonl"), *run_dir.glob("checkpoints/*.pt")]:
            stale.unlink(missing_ok=True)
        for stale in run_dir.glob("checkpoints/replica*-step*"):  # a sharded run's (fast.shards.checkpoint)
            shutil.rmtree(stale, ignore_errors=True)
    files.write_text(run_dir / "config.toml", config.as_used_toml(fast_loop))
