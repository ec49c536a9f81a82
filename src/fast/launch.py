"""Local launcher: start N worker processes on this machine, watch them, and stop them all together.

Each child gets the same environment torchrun would give it (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
LOCAL_RANK), so the worker code is the same locally and across machines. If any child fails, the others
are stopped and the first failure's one-line message is raised; children die with their parent
(PR_SET_PDEATHSIG), so Ctrl-C or a killed launcher leaves no orphan.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import signal
import traceback
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import Any

from fast.errors import FastError

GRACE_S = 5.0


class WorkerFailed(FastError):
    """A worker process ended with an error; the run was stopped."""


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _child(fn: Callable[..., Any], rank: int, env: dict[str, str], args: tuple, results: Any) -> None:
    _die_with_parent()
    os.environ.update(env)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher handles Ctrl-C and stops everyone
    try:
        out = fn(*args)
        results.put((rank, "ok", out))
    except BaseException as e:  # report every failure as one line to the launcher
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if not isinstance(e, FastError):
            message = f"{type(e).__name__}: {message}"
            if os.environ.get("FAST_DEBUG"):
                traceback.print_exc()
        results.put((rank, "error", message))
        raise SystemExit(1) from None


def launch(
    fn: Callable[..., Any],
    nprocs: int,
    args: tuple = (),
    *,
    addr: str = "127.0.0.1",
    port: int,
    threads: int = 1,
    extra_env: dict[str, str] | None = None,
) -> dict[int, Any]:
    """Run `fn(*args)` in `nprocs` processes; returns each rank's return value, or raises WorkerFailed."""
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    procs = []
    for rank in range(nprocs):
        env = {
            "RANK": str(rank),
            "WORLD_SIZE": str(nprocs),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(nprocs),
            "MASTER_ADDR": addr,
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": str(threads),
            "GLOO_SOCKET_IFNAME": "lo"
            if addr.startswith("127.")
            else os.environ.get("GLOO_SOCKET_IFNAME", ""),
            **(extra_env or {}),
        }
        env = {k: v for k, v in env.items() if v}
        proc = ctx.Process(target=_child, args=(fn, rank, env, args, results), name=f"fast-worker-{rank}")
        proc.start()
        procs.append(proc)
    outputs: dict[int, Any] = {}
    failure: str | None = None
    try:
        pending = {p.sentinel: (rank, p) for rank, p in enumerate(procs)}
        while pending and failure is None:
            for sentinel in wait(list(pending)):
                rank, proc = pending.pop(sentinel)
                proc.join()
                outputs.update(_drain(results))
                if proc.exitcode != 0:
                    failure = _first_error(outputs, rank, proc.exitcode)
                    break
        if failure is None:
            outputs.update(_drain(results))
    except KeyboardInterrupt:
        failure = "interrupted (Ctrl-C): every worker was stopped"
    finally:
        _stop(procs)
    outputs.update(_drain(results))
    errors = {r: v for r, v in outputs.items() if isinstance(v, _Error)}
    if failure is None and errors:
        rank = min(errors)
        failure = f"worker {rank} failed: {errors[rank].message}"
    if failure is not None:
        raise WorkerFailed(failure)
    return outputs


class _Error:
    def __init__(self, message: str) -> None:
        self.message = message


def _drain(results: Any) -> dict[int, Any]:
    out = {}
    while not results.empty():
        rank, status, value = results.get()
        out[rank] = value if status == "ok" else _Error(value)
    return out


def _first_error(outputs: dict[int, Any], rank: int, exitcode: int | None) -> str:
    errors = {r: v for r, v in outputs.items() if isinstance(v, _Error)}
    if errors:
        first = min(errors)
        return f"worker {first} failed: {errors[first].message}"
    how = f"was killed by signal {-exitcode}" if exitcode and exitcode < 0 else f"exited with code {exitcode}"
    return f"worker {rank} {how}; the run was stopped"


def _stop(procs: list[Any]) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(GRACE_S)
        if p.is_alive():
            p.kill()
            p.join()
