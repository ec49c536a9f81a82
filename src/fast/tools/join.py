"""`fast join`: a worker that joins a running live job (`run.membership = "live"`), admitted by its membership and
healed from a live peer (fast.runtime.live); it trains with the others to the end of the run. A sharded run's worker
is a replica of `run.shards` processes, admitted as one (K consecutive member ids) and started here together: when
one of them ends badly the others are stopped at once, and the run is told the replica is gone.

    fast join RUN_DIR                                   a run of this machine: its address and secret are in RUN_DIR
    fast join --address HOST:PORT --token-file F --config CONFIG
                                                        another machine's: the run's secret as a file, its config
    fast join --address HOST:PORT --token-file F [--config C] [--set K=V] --script S [-- ARGS]
                                                        another machine's run of `fast run S ARGS`: the script (its copy
                                                        on this machine), with the founders' --config and --set
    fast join RUN_DIR --standby                         warm: ready now, a joiner for each line on its stdin

A joiner's worker processes are forked from it, once it has imported torch and the loop (one import, where a fork
server would make a second). A standby joiner does everything that takes time before it asks to be admitted (the
imports, the config), so that it takes part within a second or two of its line: churn keeps one
(fast.runtime.churn), and so may a user who wants spares. Each line forks a joiner from it, which imports nothing
again (a line that names a file: that joiner's stderr goes there), and it stays ready for the next; where it may not
fork (`may_fork_here`: JAX imported, say) its first line makes it the joiner. End of input: it waits for the joiners
it forked, and leaves; without a line, unadmitted.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

from fast.comm import bootstrap as engine
from fast.errors import ConfigError
from fast.jobs.loop import train_worker
from fast.parts import resolve
from fast.runtime.launch import WorkerFailed, launch, may_fork_here, warm_up
from fast.runtime.membership import ADDRESS_FILE, SECRET_FILE, Access, read_secret, report_left, request_admission
from fast.runtime.run_folder import new_folder
from fast.tools.start import launcher_view, recorded_script, run_script_process, script_settings


def live_run(command: str, folder: Path) -> tuple[str, Path]:
    """The membership address and the secret's file of the live run in `folder` (of this machine)."""
    where = folder / ADDRESS_FILE
    if not where.is_file():
        raise ConfigError(f"{command} {folder}: no live run there (no {ADDRESS_FILE}): start one with "
                          "run.membership = 'live', or give --address and --token-file")  # fmt: skip
    found = json.loads(where.read_text())
    return f"{found['address']}:{found['port']}", folder / SECRET_FILE


def join(
    run_dir: str | Path | None = None,
    *,
    address: str | None = None,
    token_file: str | Path | None = None,
    config: str | Path | None = None,
    out: str | Path | None = None,
    standby: bool = False,
    script: str | None = None,
    script_args: list[str] | None = None,
    **overrides: Any,
) -> int | None:
    """Join a running job and train with it to its end; returns this worker's member id (a sharded replica's: its
    shard 0's; None: a standby joiner whose input ended, which said so, and whose forked joiners have ended). A run of
    `fast run SCRIPT` is joined with its script: of this machine, the one its folder records; of another, `script`
    with `script_args`, started as `fast run` starts it, with `config` and `overrides` as the founders' launcher had."""
    started = None  # (a run of `fast run SCRIPT`: its joiners run the script, as its founders do)
    if run_dir is not None:
        folder = Path(run_dir)
        found, secret_file = live_run("fast join", folder)
        address, token_file = address or found, token_file or secret_file
        if script is not None:
            raise ConfigError(
                f"fast join {folder} --script: a joiner of a run of this machine runs what its folder "
                "records; --script is for another machine's run (with --address and --token-file)"
            )
        started = recorded_script(folder)
        if started is not None and (config is not None or overrides):
            raise ConfigError("fast join: the run's workers run a script, with the founders' config and settings, "
                              "which a joiner takes too: drop --config and --set")  # fmt: skip
        config = config or folder / "config.toml"
        out = out or folder
    elif script is not None:
        if not Path(script).is_file():
            raise ConfigError(f"fast join --script {script}: no such file: give the path of the run's script")
        if config is not None and not Path(config).is_file():
            raise ConfigError(f"fast join --config {config}: no such file: give the founders' --config, if any")
    if address is None or token_file is None or (config is None and script is None):
        raise ConfigError("fast join: give the run's folder, or --address HOST:PORT, --token-file F and its config "
                          "(--config, or --script for a run of `fast run SCRIPT`)")  # fmt: skip
    if started is None and script is not None:
        config_path = None if config is None else str(config)
        launcher, job = script_settings(script, config_path, overrides), launcher_view(config_path, overrides)
        started = str(Path(script).resolve()), list(script_args or []), os.getcwd(), launcher
    else:
        parts = resolve(config, **overrides)
        job = parts.config
    if not job.run.live and script is not None:
        raise ConfigError("fast join --script: the settings are not a live run's (run.membership = 'fixed'): give "
                          "the --config and --set that the founders' `fast run` had")  # fmt: skip
    if not job.run.live:
        raise ConfigError("fast join: the config is not a live run's (run.membership = 'fixed'): nothing can join it")
    access = Access.parse(address, read_secret("fast join", Path(token_file)))
    warm_up()
    if standby and not _joins_on_a_line():
        return None
    member = request_admission(access, job, job.run.deadline_s, "fast" if started is None else "script")
    out = Path(out) if out is not None else new_folder(Path("runs"), f"{job.run.name}-joined")
    environment = {**access.environment(Path(token_file).resolve()), "FAST_MEMBER_ID": str(member), "FAST_JOINING": "1"}

    def ended(rank: int, exit_code: int | None) -> None:
        if exit_code:  # tell the run at once, rather than at the end of this worker's heartbeats
            report_left(access, member + rank, "killed" if exit_code < 0 else f"exited with code {exit_code}")

    if started is None:
        fn, args = train_worker, (parts, out, False)
    else:
        path, argv, cwd, launcher = started
        fn, args = run_script_process, (path, argv, cwd)
        environment.update({**launcher, "FAST_RUN_DIR": str(out.resolve())})
    addr, shards = access.host, job.run.shards
    threads = job.run.threads_per_worker or 1
    launch(fn, shards, args, addr=addr, port=engine.free_port(), threads=threads, extra_env=environment,
           on_exit=ended, together=shards)  # fmt: skip
    return member


def _joins_on_a_line() -> bool:
    """(A standby joiner, ready) wait for lines on stdin: each forks a joiner from this process, which returns True
    and joins; this one, once its input has ended and the joiners it forked have, returns False (or raises the first
    one's failure). Where this process may not fork, its first line makes it the joiner (True)."""
    print("fast: standby joiner ready: a line on stdin joins the run", flush=True)
    forked: list[int] = []
    codes: list[int] = []  # (those of the joiners that have ended)
    try:
        while line := sys.stdin.readline():
            if not may_fork_here():
                return True
            pid = os.fork()
            if pid == 0:
                forked = []  # (the standby's, not this joiner's)
                _on_its_own(line.strip())
                return True
            forked.append(pid)
            codes += _ended(forked, wait=False)  # (those that ended since the last line: no zombie piles up)
        codes += _ended(forked, wait=True)
    except BaseException:  # Ctrl-C, SIGTERM or SIGHUP: its joiners are stopped as their own would stop them
        for pid in forked:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        _ended(forked, wait=True)
        raise
    failed = [code if code > 0 else 128 - code for code in codes if code != 0]  # (killed by signal N: 128 + N)
    if failed:
        raise WorkerFailed(f"{len(failed)} of the {len(codes)} joiners this standby forked failed (the first with exit "
                           f"code {failed[0]}): what each said is on its stderr", failed[0])  # fmt: skip
    ended = f"{len(codes)} joiner{'s' if len(codes) > 1 else ''} forked from it, ended" if codes else "it never joined"
    print(f"fast: the standby joiner's input ended: {ended}", flush=True)
    return False


def _ended(forked: list[int], wait: bool) -> list[int]:
    """The exit codes of the processes of `forked` that have ended (all of them, once ended, with `wait`), which are
    taken out of it."""
    codes = []
    for pid in list(forked):
        done, status = os.waitpid(pid, 0 if wait else os.WNOHANG)
        if done:
            forked.remove(pid)
            codes.append(os.waitstatus_to_exitcode(status))
    return codes


def _on_its_own(stderr_to: str) -> None:
    """(A joiner forked from a standby) its input is not the standby's; its stderr goes to the file `stderr_to` names,
    if any."""
    sys.stdin = open(os.devnull)  # noqa: SIM115 (the process's own, for its life)
    os.dup2(sys.stdin.fileno(), 0)
    if stderr_to:
        sys.stderr.flush()
        said = os.open(stderr_to, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(said, 2)
        os.close(said)
