"""The simulated engine's launcher: every process of a run is a task of one simulation, here in this process.

`simulate` is to `fast.runtime.launch.launch` what virtual time is to real time: each rank runs the same
function (the `fast train` loop, or the user's script under `fast run`) on its own simulated process, with
its own Comm, replica, optimizer and shard; the data sets and everything else identical across workers are
loaded once and shared. Failures are reported as the launcher reports them.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from fast.comm.scheduler import Deadlock, Simulation, Task
from fast.config import Config
from fast.emulation.deployment import link_table
from fast.emulation.simulated_machine import Crashed
from fast.emulation.wire import ideal_links, start
from fast.parts import Deployment
from fast.runtime.launch import Failure, WorkerFailed, _root_cause, failure_of
from fast.runtime.simulated_membership import SimulatedMembership


def simulate(fn: Callable[..., Any], config: Config, deployment: Deployment, args: tuple = ()) -> dict[int, Any]:
    """Run `fn(*args)` as each process of the `deployment`, simulated; returns each rank's return value, or raises
    WorkerFailed as `launch` does (in a survivable run, a rank other than 0 that crashes or fails is left out). A
    live run (`run.membership = "live"`) keeps its membership in the simulation (fast.runtime.simulated_membership):
    any member may go, worker 0 too, and the run ended well if a member wrote its outputs (a joiner's result is
    returned with the founders'). The emulated links come from `config` ([network]), as a real process's do."""
    sim = Simulation()
    nprocs, workers = deployment.processes, deployment.workers
    links = link_table(config, nprocs) if config.network is not None else ideal_links(nprocs)
    wire = start(sim, nprocs, links, config.run.seed)
    wire.workers = workers

    def failed(task: Task) -> None:  # a process that fails closes its connections: its peers learn it at once
        if task.rank not in wire.gone and not _ended_well(task.error):
            wire.leave(task.rank, "it failed")

    sim.on_failure = failed
    threads = torch.get_num_threads()
    torch.set_num_threads(deployment.threads or os.cpu_count() or 1)  # one process computes at a time
    membership = None
    try:
        tasks = [sim.spawn(lambda: fn(*args), f"worker {r}" if r < workers else f"server {r - workers + 1}",
                           rank=r, main=True) for r in range(nprocs)]  # fmt: skip
        if deployment.live:

            def start_joiner(r: int) -> None:
                tasks.append(sim.spawn(lambda: fn(*args), f"worker {r}", rank=r, main=True))

            membership = SimulatedMembership(sim, wire, deployment, nprocs, start_joiner, config.run.form_time_s)
            sim.shared["membership"] = membership
            if deployment.churn is not None:
                sim.spawn(membership.churn, "churn")
        deadlock = None
        try:
            sim.run()
        except Deadlock as e:
            deadlock = e
    finally:
        torch.set_num_threads(threads)
    outputs: dict[int, Any] = {}
    for task in tasks:
        rank, error = task.rank, task.error
        if _ended_well(error):
            outputs[rank] = task.result
        elif isinstance(error, Crashed):  # (one churn took out is not what failed the run, as in `launch`)
            outputs[rank] = Failure(str(error), 1, secondary=membership is not None and rank in membership.evicted)
        else:
            outputs[rank] = failure_of(error, task.traceback) if not isinstance(error, SystemExit) else Failure(
                f"exited with code {error.code}", error.code if isinstance(error.code, int) else 1)  # fmt: skip
    if membership is not None:  # whoever wrote the outputs
        ended_well = membership.written and deadlock is None
    else:
        ended_well = not isinstance(outputs.get(0), Failure) and tasks[0].done and deadlock is None
    if deployment.survivable and ended_well:
        return {rank: value for rank, value in outputs.items() if not isinstance(value, Failure)}
    failure = _root_cause(outputs, {})
    if failure is not None:
        raise WorkerFailed(failure.message, failure.exit_code, failure.traceback)
    if deadlock is not None:
        raise WorkerFailed(str(deadlock))
    return outputs


def _ended_well(error: BaseException | None) -> bool:
    """No error, or a server's (or a script's) exit with code 0."""
    return error is None or (isinstance(error, SystemExit) and error.code in (None, 0))
