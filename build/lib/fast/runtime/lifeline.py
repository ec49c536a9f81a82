"""Every process of a run dies with its launcher, whatever ends the launcher (SIGKILL included).

The launcher names itself in its processes' environment (`FAST_LAUNCHER`: its pid and start time) together with
the run's scratch name (`FAST_SCRATCH`: the prefix of its rendezvous folder in /tmp and its files in /dev/shm).
Each process watches the launcher from a daemon thread through a pidfd, which becomes readable when the launcher
has exited; it then removes the run's scratch files, as the launcher would have, and kills itself. The launcher's
start time guards against its pid being reused. Processes forked from multiprocessing's fork server are the fork
server's children, not the launcher's: the parent-death signal alone would tie them to the wrong process.
"""

from __future__ import annotations

import contextlib
import glob
import os
import select
import shutil
import signal
import tempfile
import threading
import time
import uuid
from pathlib import Path

from fast.comm.shared_memory import SCRATCH_VARIABLE, SHARED_DIR

LAUNCHER_VARIABLE = "FAST_LAUNCHER"
LAUNCHER_TEMP_VARIABLE = "FAST_LAUNCHER_TEMP"  # multiprocessing's folder of the launcher (its fork server's socket)
POLL_S = 0.5  # where pidfds do not exist: how often the launcher is looked for


def _start_time(pid: int) -> str | None:
    """When process `pid` started (clock ticks after boot), or None when there is no such process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def new_scratch() -> str:
    """A name for a run's scratch files, unique on this machine."""
    return f"fast-run-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def scratch_folder(scratch: str) -> Path:
    return Path(tempfile.gettempdir()) / scratch


def remove_scratch(scratch: str) -> None:
    """The run's rendezvous folder and its files in /dev/shm, gone."""
    shutil.rmtree(scratch_folder(scratch), ignore_errors=True)
    for path in glob.glob(str(SHARED_DIR / f"{glob.escape(scratch)}-*")):
        with contextlib.suppress(OSError):
            os.unlink(path)


def launcher_environment(scratch: str) -> dict[str, str]:
    """What the launcher gives each of its processes, so that they die with it (once its fork server runs)."""
    from multiprocessing import util

    pid = os.getpid()
    return {LAUNCHER_VARIABLE: f"{pid}:{_start_time(pid)}", SCRATCH_VARIABLE: scratch,
            LAUNCHER_TEMP_VARIABLE: util.get_temp_dir()}  # fmt: skip


def watch_launcher() -> None:
    """In a process of a run: end it (and remove the run's scratch files) as soon as its launcher is gone. Nothing
    happens in a process that no FAST launcher started (under torchrun)."""
    named = os.environ.get(LAUNCHER_VARIABLE)
    if not named:
        return
    pid_text, _, started = named.partition(":")
    pid = int(pid_text)
    threading.Thread(target=_watch, args=(pid, started), name="fast-lifeline", daemon=True).start()


def _watch(pid: int, started: str) -> None:
    try:
        handle: int | None = os.pidfd_open(pid)
    except ProcessLookupError:
        _die()
    except (AttributeError, OSError):  # no pidfds here (an old kernel): look for the launcher now and then
        handle = None
    if _start_time(pid) == started:  # the launcher, not a process that took its pid since
        if handle is not None:
            select.select([handle], [], [])
        else:
            while _start_time(pid) == started:
                time.sleep(POLL_S)
    _die()


def _die() -> None:
    scratch, temp = os.environ.get(SCRATCH_VARIABLE), os.environ.get(LAUNCHER_TEMP_VARIABLE)
    if scratch:
        remove_scratch(scratch)
    if temp and Path(temp).name.startswith("pymp-"):
        shutil.rmtree(temp, ignore_errors=True)
    os.kill(os.getpid(), signal.SIGKILL)
