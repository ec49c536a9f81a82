"""Local launcher: start N worker processes on this machine, watch them, and stop them all together.

Each child gets the same environment torchrun would give it (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
LOCAL_RANK), so the worker code is the same locally and across machines. If any child fails, the others
are stopped and the first failure's one-line message is raised. Ctrl-C, SIGTERM or SIGHUP to the launcher stops
every child and ends the run with the signal's exit code (130, 143, 129); children die with the launcher however
it ends, SIGKILL included (fast.runtime.lifeline), so no orphan and no scratch file is left. With
`survivable=True` (strategies that survive failures) only rank 0's failure stops the run: the others may die and
the survivors go on. A live run's launcher (`goes_on`, its membership's judgement) lets any process die, rank 0
included: the lowest live member takes over its duties (fast.runtime.live), and the run ends well when the
membership says its outputs were written, by whichever member.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import importlib
import logging
import multiprocessing as mp
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from multiprocessing.connection import wait
from typing import Any

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from fast.comm import bootstrap as engine
from fast.errors import CommError, ConfigError, FastError, first_line, say
from fast.first_import import TORCH_CAME_FIRST
from fast.interrupts import TERMINATION_SIGNALS, Stopped, held_interrupts, how_interrupted
from fast.runtime.lifeline import launcher_environment, new_scratch, remove_scratch, scratch_folder, watch_launcher

PRELOAD_VARIABLE = "FAST_PRELOAD"  # more modules imported once before workers fork ("sklearn.datasets,transformers")
GRACE_S = 5.0  # seconds a stopped worker gets to exit before it is killed
SETTLE_S = 3.0  # seconds the others get to report after a first failure
SURVIVOR_GRACE_S = 10.0  # seconds the survivors get to exit once rank 0 has ended a run that survives failures
LINGER_S = 1.0  # under the elastic agent, seconds a worker that lost a peer waits before it ends (see below)
LOST_PEER = ("Connection closed by peer", "Connection reset by peer")  # gloo's words for a peer gone


def refuse_while_starting_a_worker(call: str) -> None:
    """A worker process that a fork server (or spawn) starts imports the script its launcher ran, as `__mp_main__`:
    a script that calls `fast.train` at its top level would start a run again in every worker (each one's claim on
    the run folder then fails, or each starts a run of its own). The worker says so, with the fix, and exits 2 (a
    fork server's child that raised would exit 1)."""
    if getattr(mp.current_process(), "_inheriting", False):  # (multiprocessing's flag while the import runs)
        say(
            f"fast: error: {call} ran in a worker process that imported your script as it started: call it under "
            '`if __name__ == "__main__":` (each worker process imports the script its launcher ran)'
        )
        os._exit(ConfigError.exit_code)


class WorkerFailed(FastError):
    """A worker process ended with an error; the run was stopped. Its exit code is the failed worker's (2 for a
    configuration error), and `traceback` the user code's traceback when that raised."""

    def __init__(self, message: str, exit_code: int | None = None, traceback: str | None = None) -> None:
        super().__init__(message)
        self.traceback = traceback
        if exit_code is not None:
            self.exit_code = exit_code


class Interrupted(WorkerFailed):
    """Ctrl-C (or a termination signal) stopped the run and every worker; exit code 128 + the signal's number,
    as a shell's (130 for Ctrl-C, 143 for SIGTERM)."""

    exit_code = 130


def interrupted(interrupt: BaseException) -> Interrupted:
    """The error that ends a run `interrupt` (KeyboardInterrupt, Stopped) stopped."""
    how, code = how_interrupted(interrupt)
    error = Interrupted(f"interrupted ({how}): every worker was stopped")
    error.exit_code = code
    return error


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def name_process(title: str) -> None:
    """The process's name in ps and top. (setproctitle must first run before os.environ is replaced: it moves the
    environment out of the way of the longer name then.)"""
    try:
        import setproctitle

        setproctitle.setproctitle(title)
    except ImportError:  # only the name in ps and top is lost
        pass


def _child(fn: Callable[..., Any], rank: int, env: dict[str, str], args: tuple, result: Any, forked_here: bool) -> None:
    """A process of the run: `fn(*args)`, its value or its failure sent through `result` (this process's pipe;
    plain pickle copies tensors, where multiprocessing's own would share them through descriptors that vanish when
    this process exits: a local pipe between our own processes, not the wire). One `forked_here`, from its launcher,
    goes into a process group of its own, as a fork server's are in theirs, and dies with the launcher through its
    lifeline alone (which first removes the run's scratch files); one of a fork server's dies with the server."""
    if forked_here:
        os.setpgid(0, 0)
    else:
        _die_with_parent()
    for number in TERMINATION_SIGNALS:  # a handler of its launcher's (it was forked from it): as a new process has
        if callable(signal.getsignal(number)):  # (one the launcher ignores, under nohup say, stays ignored)
            signal.signal(number, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher handles Ctrl-C and stops everyone
    name_process(f"fast worker {rank}")
    os.environ.clear()
    os.environ.update(env)
    watch_launcher()
    try:
        result.send_bytes(pickle.dumps(fn(*args)))
    except SystemExit as e:  # a server's end (fast.init), or a script's sys.exit
        if e.code in (None, 0):
            result.send_bytes(pickle.dumps(None))
            return
        code = e.code if isinstance(e.code, int) else 1
        result.send_bytes(pickle.dumps(Failure(f"exited with code {code}", code)))
        raise SystemExit(code) from None
    except BaseException as e:  # report every failure as one line to the launcher
        result.send_bytes(pickle.dumps(failure_of(e)))
        raise SystemExit(1) from None


class Failure:
    """How a process failed: one line, the exit code the run should end with, and for an error that is not
    FAST's own (the user's code raised) its traceback, shown once."""

    def __init__(self, message: str, exit_code: int = 1, traceback: str | None = None, secondary: bool = False):
        self.message, self.exit_code, self.traceback, self.secondary = message, exit_code, traceback, secondary


def failure_of(e: BaseException, trace: str | None = None) -> Failure:
    """How `e` failed its process; `trace` is its traceback when it is not the exception being handled."""
    message = first_line(e)
    if isinstance(e, FastError):
        return Failure(message, e.exit_code, None, secondary=isinstance(e, CommError))
    shown = (trace or traceback.format_exc()) if not isinstance(e, KeyboardInterrupt) else None
    # a peer gone in the backend's own collective (FSDP2's, inside a sharded replica): the peer's end explains it
    lost_peer = isinstance(e, RuntimeError) and any(words in message for words in LOST_PEER)
    return Failure(f"{type(e).__name__}: {message}", 1, shown, secondary=lost_peer)


def _context() -> Any:
    """Processes forked from a server that has imported torch once: starting a worker costs milliseconds, not
    the seconds of importing torch (and torch._dynamo, which the first optimizer imports) again. The server (and
    multiprocessing's resource tracker) start in a process group of their own, and so do the workers it forks: the
    terminal's Ctrl-C and Ctrl-Z reach the launcher alone, which stops or pauses its processes itself, so that
    none of them is cut short while it starts (a traceback, a half-made process)."""
    from multiprocessing import forkserver, util

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_preloaded())  # one that does not import is skipped
    spawn = util.spawnv_passfds
    with held_interrupts():
        util.spawnv_passfds = _spawn_in_a_group_of_its_own
        try:
            forkserver.ensure_running()
        finally:
            util.spawnv_passfds = spawn
    _pause_with_the_terminal()
    return ctx


def _preloaded() -> list[str]:
    """The modules a worker's process has imported before it starts: torch and FAST's loop, torch._dynamo (which the
    first optimizer imports), and the user's (PRELOAD_VARIABLE)."""
    more = [name.strip() for name in os.environ.get(PRELOAD_VARIABLE, "").split(",") if name.strip()]
    return ["fast.jobs.loop", "torch._dynamo", *more]


def warm_up() -> None:
    """Import here what a worker's process needs before it starts (`_preloaded`), for a launch that forks its workers
    from this process (`_workers_context`): their one import, where a fork server would make a second (seconds of a
    core per run); a standby joiner's, before it is given its line."""
    global _IMPORTED_THREADS
    before = _threads()
    with held_interrupts():  # a library may swallow a KeyboardInterrupt raised in its import (numpy.random's does)
        for name in _preloaded():
            with contextlib.suppress(ImportError):
                importlib.import_module(name)
    _IMPORTED_THREADS += _threads() - before  # (a library's BLAS pool, say: a fork server's imports start them too)


def _threads() -> int:
    """This process's threads, native ones included (a Python thread count misses those of a library's runtime)."""
    return len(os.listdir("/proc/self/task"))


# this process's threads that imports started: its own and BLAS's pool once torch is in, and those the preloaded
# modules start (`warm_up`), as they do in a fork server; not torch's intra-op pool, which its first parallel op
# starts and which a forked child hangs in (GNU OpenMP)
_IMPORTED_THREADS = _threads()


def may_fork_here() -> bool:
    """Whether this process may fork its workers itself: it runs no thread beyond those its imports started (a
    fork copies the caller's thread alone, and a lock another held stays held in the child: a Rust runtime's,
    torchft's lighthouse, crashed a child forked from a test's process; torch's intra-op pool, once a parallel op has
    started it, hangs a child's first parallel op; a pool torch started before FAST was imported goes uncounted, so
    a process that imported torch first may not), has not started CUDA (which a forked child cannot use) and has
    not imported JAX (whose threads a fork breaks). The command line's launcher of a fixed run, and a joiner's, may;
    a notebook's, or one whose live membership serves the run's store, may not."""
    return (threading.active_count() == 1 and _threads() <= _IMPORTED_THREADS and not TORCH_CAME_FIRST
            and not torch.cuda.is_initialized() and "jax" not in sys.modules)  # fmt: skip


def _workers_context() -> Any:
    """Where a launch's processes come from: this process, forked once it has imported what they need, where it may
    (`may_fork_here`); else a fork server that has (`_context`). Either way Ctrl-Z pauses them with the launcher."""
    if may_fork_here():
        warm_up()
        _pause_with_the_terminal()
        return mp.get_context("fork")
    return _context()


_groups: list[int] = []  # this launcher's process groups: its fork server's (every worker's), or each worker's own


def _spawn_in_a_group_of_its_own(path: str, args: list[str], passfds: tuple[int, ...]) -> int:
    """multiprocessing's start of a helper process (`util.spawnv_passfds`: `path` with `args`, the descriptors
    `passfds` passed on), in a new process group."""
    was = {fd: os.get_inheritable(fd) for fd in passfds}
    for fd in passfds:
        os.set_inheritable(fd, True)
    try:
        pid = os.posix_spawn(path, list(args), dict(os.environ), setpgroup=0)
    finally:
        for fd, inheritable in was.items():
            os.set_inheritable(fd, inheritable)
    _groups.append(pid)
    return pid


def _pause_with_the_terminal() -> None:
    """Ctrl-Z (SIGTSTP) pauses the helpers' groups with the launcher; `fg` (SIGCONT) resumes them."""

    def pause(signum: int, frame: Any) -> None:
        _signal_groups(signal.SIGSTOP)
        os.kill(os.getpid(), signal.SIGSTOP)  # stopped here until continued
        _signal_groups(signal.SIGCONT)

    with contextlib.suppress(ValueError):  # not the main thread: the terminal's signals are not handled here
        if signal.getsignal(signal.SIGTSTP) in (signal.SIG_DFL, None):
            signal.signal(signal.SIGTSTP, pause)


def _signal_groups(signum: int) -> None:
    for group in _groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group, signum)


def launch(
    fn: Callable[..., Any],
    nprocs: int,
    args: tuple = (),
    *,
    addr: str = "127.0.0.1",
    port: int,
    threads: int = 1,
    extra_env: dict[str, str] | None = None,
    survivable: bool = False,
    on_exit: Callable[[int, int | None], None] | None = None,
    goes_on: Callable[[], bool] | None = None,
    together: int = 1,
) -> dict[int, Any]:
    """Run `fn(*args)` in `nprocs` processes; returns each rank's return value, or raises WorkerFailed.

    With `survivable`, a rank other than 0 that dies or fails is left out of the returned values and the
    others are not stopped; rank 0 (which writes the outputs) must end well. `on_exit(rank, exit code)` is told
    of each process as it ends (a live membership's coordinator); it returns True for a process that was told to
    go (churn), which is then never named as the run's failure. With `goes_on` (a live run's), no rank is needed:
    once every process has ended, `goes_on()` waits while the run goes on without them (members another launcher
    started) and says whether its outputs were written; if so the run ended well, whoever died. With `together` = K,
    the processes are replicas of K consecutive ranks (a sharded live run's, fast.runtime.sharded): when one of them
    ends badly, the others of its replica, which cannot go on without it, are stopped at once. The processes are
    forked from this one where it may, else from a fork server (`_workers_context`)."""
    scratch = new_scratch()
    procs: list[Any] = []
    results: dict[Any, int] = {}  # each process's pipe, the launcher's end: its rank
    outputs: dict[int, Any] = {}
    exited: dict[int, int] = {}  # processes that ended by themselves, with their exit codes
    told_to_go: set[int] = set()
    interrupt: KeyboardInterrupt | None = None
    written: bool | None = None
    bad_input = False
    try:
        ctx = _workers_context()
        store = scratch_folder(scratch)
        store.mkdir(mode=0o700)
        local = addr.startswith("127.") or addr == "localhost"
        gloo = engine.gloo_interface(addr)
        for rank in range(nprocs):
            env = {
                "RANK": str(rank),
                "WORLD_SIZE": str(nprocs),
                "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(nprocs),
                "MASTER_ADDR": addr,
                "MASTER_PORT": str(port),
                "OMP_NUM_THREADS": str(threads),
                **gloo,
                "FAST_STORE_FILE": str(store / "store") if local else "",
                **launcher_environment(scratch),
                **(extra_env or {}),
            }
            # the whole environment travels: a forked worker would otherwise see the fork server's, not ours
            env = {**os.environ, **{k: v for k, v in env.items() if v}}
            reader, writer = ctx.Pipe(duplex=False)  # a pipe per process: no lock, nothing in /dev/shm
            results[reader] = rank
            forked_here = ctx.get_start_method() == "fork"
            proc = ctx.Process(target=_child, args=(fn, rank, env, args, writer, forked_here),
                               name=f"fast-worker-{rank}")  # fmt: skip
            try:
                with held_interrupts():  # a process half started could be neither stopped nor left to run
                    proc.start()
                    procs.append(proc)
                    if forked_here:  # (its group made here too: the terminal's next signal may come before its own)
                        with contextlib.suppress(OSError):
                            os.setpgid(proc.pid, proc.pid)
                        _groups.append(proc.pid)
            finally:
                writer.close()  # the process has its own copy
        pending = {p.sentinel: (rank, p) for rank, p in enumerate(procs)}
        settle_until: float | None = None
        while pending:
            timeout = None if settle_until is None else max(0.0, settle_until - time.monotonic())
            # read results as they come: a child blocks on a full pipe until its result is read
            ready_list = wait([*pending, *results], timeout)
            if not ready_list:
                break
            for ready in ready_list:
                if ready in results:
                    outputs.update(_receive(results, ready))
                if ready not in pending:  # a pipe, read now or by a drain earlier in this round
                    continue
                rank, proc = pending.pop(ready)
                proc.join()
                exited[rank] = proc.exitcode
                if together > 1 and proc.exitcode != 0:
                    first = rank - rank % together
                    _stop([procs[r] for r in range(first, min(first + together, len(procs))) if r != rank], 0.0)
                if on_exit is not None and on_exit(rank, proc.exitcode):
                    told_to_go.add(rank)
                fatal = not survivable or (rank == 0 and goes_on is None)
                said = _receive_now(results, outputs).get(rank)
                if isinstance(said, Failure) and said.exit_code == 2 and not bad_input:
                    # a config or usage error is the script's, every process's: nothing to survive, nobody to wait for
                    bad_input, fatal, settle_until = True, True, time.monotonic()
                if proc.exitcode != 0 and not fatal and rank not in told_to_go:
                    _going_on_without(rank, said)
                # the process that wrote the outputs: rank 0; a live run's, the member that did its duties
                wrote = rank == 0 if goes_on is None else isinstance(said, dict)
                if proc.exitcode != 0 and fatal and settle_until is None:
                    settle_until = time.monotonic() + SETTLE_S  # let the others say what they saw
                elif survivable and wrote and proc.exitcode == 0 and settle_until is None:
                    # rank 0 (a live run's: the member that wrote its outputs) released the survivors; those it gave
                    # up (dead, or frozen: alive but not answering) are stopped now, any other after the grace period
                    outputs.update(_drain(results))
                    for lost in _given_up(outputs.get(rank), len(procs)):
                        _stop([procs[lost]], grace_s=0.0)
                    settle_until = time.monotonic() + SURVIVOR_GRACE_S
        outputs.update(_drain(results))
        written = goes_on() if goes_on is not None and not bad_input else None  # (pending once the outputs are in)
    except KeyboardInterrupt as e:  # Ctrl-C, or Stopped: SIGTERM or SIGHUP
        interrupt = e
    finally:
        _stop(procs)
        _groups[:] = [group for group in _groups if group not in {proc.pid for proc in procs}]
        remove_scratch(scratch)
        outputs.update(_drain(results))  # what the last ones said while they were stopped
        for reader in results:
            reader.close()
    if interrupt is not None:
        raise interrupted(interrupt) from None
    ended_well = written if goes_on is not None else not isinstance(outputs.get(0), Failure) and exited.get(0) == 0
    if survivable and ended_well and not bad_input:
        return {rank: value for rank, value in outputs.items() if not isinstance(value, Failure)}
    failure = _root_cause(outputs, {rank: code for rank, code in exited.items() if rank not in told_to_go})
    if failure is not None:
        raise WorkerFailed(failure.message, failure.exit_code, failure.traceback)
    if goes_on is not None:  # every member went (as told) before one wrote the outputs
        raise WorkerFailed("no member was left to write the run's outputs: the run cannot go on")
    return outputs


AGENT_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_NAME",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_WORLD_SIZE",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)


@record
def _joined(fn: Callable[..., Any], deadline_s: float, args: tuple) -> Any:
    torch.set_num_threads(1)
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    comm = engine.start(rank, size, "127.0.0.1", int(os.environ["MASTER_PORT"]), torch.device("cpu"), deadline_s)
    try:
        return fn(comm, *args)
    finally:
        engine.stop()


def launch_group(
    fn: Callable[..., Any], nprocs: int, *args: Any, deadline_s: float = 60.0, survivable: bool = False
) -> dict[int, Any]:
    """`fn(comm, *args)` in each of `nprocs` local processes (one torch thread each) joined in one gloo group on
    the CPU; returns {rank: result}, or raises WorkerFailed (see `launch` for `survivable`). For tests and
    benchmarks of `comm` itself."""
    return launch(_joined, nprocs, (fn, deadline_s, args), port=engine.free_port(), threads=1, survivable=survivable)


def _elastic_child(fn: Callable[..., Any], threads: int, args: tuple, env: dict[str, str]) -> bytes:
    _die_with_parent()
    name_process("fast worker")
    agent = {k: v for k, v in os.environ.items() if k in AGENT_VARIABLES or k.startswith("TORCHELASTIC_")}
    os.environ.clear()  # the launcher's environment, not the fork server's, plus what the agent set
    os.environ.update({**env, **agent, "OMP_NUM_THREADS": str(threads)})
    watch_launcher()
    # the terminal's Ctrl-C reaches the launcher alone (see _context), whose agent stops the workers; a worker
    # given SIGINT anyway ends at once and quietly (no traceback), and the agent reports it
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    restart = int(agent.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if restart and agent.get("RANK") == "0":
        print(
            f"fast: a worker failed; restart {restart} of {agent.get('TORCHELASTIC_MAX_RESTARTS', '?')}: "
            "every worker resumes from its last checkpoint",
            file=sys.stderr,
        )
    try:
        return pickle.dumps(fn(*args))
    except SystemExit as e:  # a server's end (fast.init)
        if e.code in (None, 0):
            return pickle.dumps(None)
        raise
    except CommError:
        # a lost connection is most often a peer's death: the agent reports only the first process it finds
        # ended, so linger for it to find the peer first (a real deadline is still reported, a second later)
        time.sleep(LINGER_S)
        raise


AGENT_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT")  # the signals torch's agent takes over


@contextlib.contextmanager
def variables_set(variables: dict[str, str]) -> Iterator[None]:
    """Environment variables set in this process meanwhile (torch's agent reads some, and passes them all on)."""
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def _under_agent() -> Iterator[None]:
    """While torch's agent runs in this process: its logs quiet (it logs every failure with tracebacks on stderr;
    FAST says it in one line; FAST_DEBUG=1 shows all), and afterwards the signal handlers it installed undone."""
    handlers = {name: signal.getsignal(getattr(signal, name)) for name in AGENT_SIGNALS if hasattr(signal, name)}
    prefixes = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")
    names = [] if os.environ.get("FAST_DEBUG") else list(logging.Logger.manager.loggerDict)
    loggers = [logging.getLogger(name) for name in names if name.startswith(prefixes)]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)
        for name, handler in handlers.items():
            if handler is not None:
                with contextlib.suppress(ValueError):  # only the main thread sets handlers (as the agent)
                    signal.signal(getattr(signal, name), handler)


def launch_elastic(
    fn: Callable[..., Any],
    nprocs: int,
    args: tuple = (),
    *,
    addr: str = "127.0.0.1",
    port: int,
    threads: int = 1,
    max_restarts: int = 1,
) -> dict[int, Any]:
    """Like `launch`, under torch's elastic agent: if any worker fails, all are restarted (up to `max_restarts`
    times) with TORCHELASTIC_RESTART_COUNT set, so that they resume from their last checkpoint."""
    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    scratch = new_scratch()
    folder = scratch_folder(scratch)
    local = addr.startswith("127.") or addr == "localhost"
    # one machine: on it, the rendezvous and the workers' store are files, and gloo listens on loopback only
    rendezvous = {"rdzv_endpoint": str(folder / "rendezvous"), "rdzv_configs": {"store_type": "file"}} if local else {
        "rdzv_endpoint": f"{addr}:{port}"}  # fmt: skip
    try:
        folder.mkdir(mode=0o700)
        config = LaunchConfig(
            min_nodes=1,
            max_nodes=1,
            nproc_per_node=nprocs,
            run_id=scratch,
            rdzv_backend="c10d",
            max_restarts=max_restarts,
            monitor_interval=0.2,
            start_method="forkserver",
            local_addr=addr,
            logs_specs=DefaultLogsSpecs(log_dir=str(folder / "agent")),
            **rendezvous,
        )
        _context()  # the agent's workers come from the same preloaded fork server
        env = {**os.environ, **launcher_environment(scratch)}
        if local:
            env.update({"FAST_STORE_FILE": str(folder / "store"), "GLOO_SOCKET_IFNAME": "lo"})
        with _under_agent(), variables_set({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} if local else {}):
            outputs = elastic_launch(config, _elastic_child)(fn, threads, args, env)
    except KeyboardInterrupt as e:  # the agent has stopped every worker
        raise interrupted(e) from None
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
        raise ConfigError("run.max_restarts: torch's elastic agent keeps its locks in /dev/shm, which is full: free "
                          "some, give the machine or container more shared memory (docker run --shm-size), or "
                          "leave run.max_restarts at 0") from None  # fmt: skip
    except SignalException as e:
        raise interrupted(Stopped(e.sigval) if e.sigval != signal.SIGINT else KeyboardInterrupt()) from None
    except ChildFailedError as e:
        causes = []
        for rank, failure in e.failures.items():
            data = failure.error_file_data or {}
            message = data.get("message")
            text = str(message.get("message", "") if isinstance(message, dict) else message or "").strip()
            text = "" if text == "<NONE>" else text  # no error file: the process died without a word
            code = failure.exitcode
            reason = (
                text.splitlines()[0]
                if text
                else (f"killed by signal {-code}" if code < 0 else f"exited with code {code}")
            )
            causes.append((reason.startswith(("CommError", "CommTimeout")), rank, reason))
        _, rank, reason = min(causes)  # a worker's own death or error explains its peers' lost connections
        raise WorkerFailed(f"worker {rank} failed and {max_restarts} restart(s) are used up: {reason}") from None
    finally:
        remove_scratch(scratch)
    return {rank: pickle.loads(value) for rank, value in outputs.items()}


def _receive(results: dict[Any, int], reader: Any) -> dict[int, Any]:
    """{rank: value} of the process whose pipe `reader` is, or {} when it closed without a word (then forgotten)."""
    rank = results.pop(reader)
    try:
        return {rank: pickle.loads(reader.recv_bytes())}
    except (EOFError, OSError):
        return {}
    finally:
        reader.close()


def _receive_now(results: dict[Any, int], outputs: dict[int, Any]) -> dict[int, Any]:
    """`outputs`, with what the processes have sent since added to it."""
    outputs.update(_drain(results))
    return outputs


def _drain(results: dict[Any, int]) -> dict[int, Any]:
    """What the processes have sent and not yet been read."""
    out: dict[int, Any] = {}
    for reader in [r for r in results if r.poll()]:
        out.update(_receive(results, reader))
    return out


def _going_on_without(rank: int, value: Any) -> None:
    """(A run that survives a failure) a process's own error, said at once: else it would show only at the run's
    end, or never once the run ends well. Its traceback is shown here, once."""
    if isinstance(value, Failure) and not value.secondary:
        print(f"fast: worker {rank} failed: {value.message}; the others go on without it", file=sys.stderr, flush=True)
        if value.traceback:
            print(value.traceback, file=sys.stderr, end="", flush=True)
            value.traceback = None


def _root_cause(outputs: dict[int, Any], exited: dict[int, int]) -> Failure | None:
    """The failure that explains the others: a worker's own error or death before a peer's lost connection."""
    causes = []
    for rank, value in outputs.items():
        if isinstance(value, Failure):
            named = Failure(f"worker {rank} failed: {value.message}", value.exit_code, value.traceback)
            causes.append((value.secondary, rank, named))
    for rank, code in exited.items():
        if code != 0 and rank not in outputs:
            how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
            causes.append((False, rank, Failure(f"worker {rank} {how}; the run was stopped", max(code, 1))))
    return min(causes, key=lambda c: (c[0], c[1]))[2] if causes else None


def _given_up(summary: Any, processes: int) -> list[int]:
    """The ranks a run's summary records as lost."""
    failures = summary.get("failures", []) if isinstance(summary, dict) else []
    return sorted({f["worker"] for f in failures if isinstance(f, dict) and 0 < f.get("worker", 0) < processes})


def _stop(procs: list[Any], grace_s: float = GRACE_S) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGCONT)  # a stopped (frozen) process handles SIGTERM only once continued
    for p in procs:
        p.join(grace_s)
        if p.is_alive():
            p.kill()
            p.join()
