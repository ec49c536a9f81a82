"""`fast join`: a worker that joins a running live job (`run.membership = "live"`), admitted by its membership and
healed from a live peer (fast.runtime.live); it trains with the others to the end of the run. A sharded run's worker
is a replica of `run.shards` processes, admitted as one (K consecutive member ids) and started here together: when
one of them ends badly the others are stopped at once, and the run is told the replica is gone.

    fast join RUN_DIR                                   a run of this machine: its address and secret are in RUN_DIR
    fast join --address HOST:PORT --token-file F CONFIG another machine's: the run's secret as a file, its config
    fast join RUN_DIR --standby                         warm: ready now, it joins when a line comes on its stdin

A joiner's worker processes are forked from it, once it has imported torch and the loop (one import, where a fork
server would make a second). A standby joiner does everything that takes time before it asks to be admitted (the
imports, the config), so that it takes part within a second or two of its line: churn keeps one
(fast.runtime.churn), and so may a user who wants a spare. End of input without a line: it leaves, unadmitted.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from fast.comm import bootstrap as engine
from fast.errors import ConfigError
from fast.jobs.loop import train_worker
from fast.parts import resolve
from fast.runtime.launch import launch, warm_up
from fast.runtime.membership import ADDRESS_FILE, SECRET_FILE, Access, read_secret, report_left, request_admission
from fast.runtime.run_folder import new_folder


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
    **overrides: Any,
) -> int | None:
    """Join a running job and train with it to its end; returns this worker's member id (a sharded replica's: its
    shard 0's; None: a standby joiner whose input ended without a line, which never joined)."""
    if run_dir is not None:
        folder = Path(run_dir)
        found, secret_file = live_run("fast join", folder)
        address, token_file = address or found, token_file or secret_file
        config = config or folder / "config.toml"
        out = out or folder
    if address is None or token_file is None or config is None:
        raise ConfigError("fast join: give the run's folder, or --address HOST:PORT, --token-file F and its config")
    parts = resolve(config, **overrides)
    job = parts.config
    if not job.run.live:
        raise ConfigError("fast join: the config is not a live run's (run.membership = 'fixed'): nothing can join it")
    access = Access.parse(address, read_secret("fast join", Path(token_file)))
    warm_up()
    if standby:
        print("fast: standby joiner ready: a line on stdin joins the run", flush=True)
        if not sys.stdin.readline():
            return None
    member = request_admission(access, job, job.run.deadline_s)
    out = Path(out) if out is not None else new_folder(Path("runs"), f"{job.run.name}-joined")
    environment = {**access.environment(Path(token_file).resolve()), "FAST_MEMBER_ID": str(member), "FAST_JOINING": "1"}

    def ended(rank: int, exit_code: int | None) -> None:
        if exit_code:  # tell the run at once, rather than at the end of this worker's heartbeats
            report_left(access, member + rank, "killed" if exit_code < 0 else f"exited with code {exit_code}")

    addr, shards = access.host, job.run.shards
    threads = job.run.threads_per_worker or 1
    launch(train_worker, shards, (parts, out, False), addr=addr, port=engine.free_port(), threads=threads,
           extra_env=environment, on_exit=ended, together=shards)  # fmt: skip
    return member
