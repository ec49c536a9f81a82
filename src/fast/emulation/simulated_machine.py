"""The simulated engine's machine under a worker: each step charged its compute in virtual time.

A step costs `run.step_time` (or, when it is "auto", the median of the first steps timed on the host), times a
log-normal draw of mean 1 when `run.step_time_spread` is set (a real host's steps vary, and a worker that waits for
its peers waits for the slowest draw), plus the worker's slowdown and straggler pauses. As on an emulated machine,
the slowdown and pauses come at the top of the step; the compute itself comes once the strategy has posted what it
sends early (gossip's exchange), so that those messages travel while the worker computes, as they do in a real run.
An evaluation holds up its worker for `run.eval_time`, and a server's work on a request holds up its answer for
`run.server_time`. A crash ends the worker's tasks, not the process.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from fast.comm import timeline, timing
from fast.comm.scheduler import current_task
from fast.comm.seeded import uniform
from fast.emulation.compute import EmulatedMachine, MachinePlan
from fast.emulation.wire import Wire

MEASURED_STEPS = 20  # run.step_time = "auto": steps timed on the host before the estimate is frozen


class Crashed(BaseException):
    """A simulated machine failure: ends every task of the worker (BaseException: nothing may catch it)."""


def spread_factor(spread: float, seed: int, rank: int, step: int) -> float:
    """A step's compute factor: log-normal with mean 1 and coefficient of variation `spread`, keyed by
    (seed, rank, step) so that it repeats exactly; 1 when `spread` is 0."""
    if spread <= 0:
        return 1.0
    sigma = math.sqrt(math.log1p(spread * spread))
    u = min(max(uniform(seed, rank, step, "step-time"), 1e-12), 1 - 1e-12)
    return math.exp(sigma * statistics.NormalDist().inv_cdf(u) - sigma * sigma / 2)


def _charged_s(fixed_s: float | None, timed: list[float]) -> float:
    """A time fixed by the config, or the median of the first ones timed on the host (0 before any)."""
    if fixed_s is not None:
        return fixed_s
    return statistics.median(timed) if timed else 0.0


def _time_on_host(fixed_s: float | None, timed: list[float], seconds: float) -> None:
    """Keep one of the first MEASURED_STEPS host timings, when the config fixes no time."""
    if fixed_s is None and len(timed) < MEASURED_STEPS:
        timed.append(seconds)


def _host_seconds() -> float:
    task = current_task()
    return task.host_seconds() if task is not None else 0.0


class SimulatedMachine(EmulatedMachine):
    """A worker's machine in virtual time: each step costs `step_time_s` (timed on the host when None) times a
    draw of spread `step_time_spread`, each evaluation `eval_time_s` (timed on the host when None)."""

    def __init__(
        self, plan: MachinePlan, wire: Wire, step_time_s: float | None, eval_time_s: float | None = 0.0,
        events_file: Any = None, step_time_spread: float = 0.0, server_time_s: float | None = 0.0,
    ) -> None:  # fmt: skip
        super().__init__(plan, events_file)
        self.wire = wire
        self.fixed_s = step_time_s
        self.eval_time_s = eval_time_s
        self.spread = step_time_spread
        self.server_time_s = server_time_s
        self._factor = 1.0
        self._host_started: float | None = None

    def before_step(self, step: int) -> None:
        """Crash, stall, or slow down by (factor - 1) x the mean compute of a step, as an emulated machine does;
        draw this step's own compute. The mean is fixed by the config, or the median of the first steps timed on
        the host (shared by every worker of the simulation)."""
        self.wire.step_begins(self.plan.rank)
        self._compute_s = _charged_s(self.fixed_s, self.wire.host_step_s)
        self._steps_timed += 1
        self._factor = spread_factor(self.spread, self.plan.seed, self.plan.rank, step)
        super().before_step(step)

    @property
    def compute_spread(self) -> float | None:
        """The configured spread of a step's compute (the simulation charges it; it measures nothing)."""
        return self.spread if self._steps_timed else None

    def compute(self) -> None:
        with timeline.span("compute (simulated)", "compute"):
            timing.sleep(self._compute_s * self._factor)
        self._host_started = _host_seconds()

    def after_step(self) -> None:
        if self._host_started is not None:
            _time_on_host(self.fixed_s, self.wire.host_step_s, _host_seconds() - self._host_started)
        self._host_started = None

    @contextmanager
    def evaluating(self) -> Iterator[None]:
        started = _host_seconds()
        yield
        timing.sleep(_host_seconds() - started if self.eval_time_s is None else self.eval_time_s)

    @contextmanager
    def serving(self) -> Iterator[None]:
        """Charged before the answer goes out: `run.server_time`, or the median of the first requests timed on
        the host (shared by every server of the simulation)."""
        charged = _charged_s(self.server_time_s, self.wire.host_request_s)
        timing.sleep(charged)
        self._count_request(charged)
        started = _host_seconds()
        yield
        _time_on_host(self.server_time_s, self.wire.host_request_s, _host_seconds() - started)

    def _crash(self, step: int | None = None) -> None:
        """The worker's tasks end (its machine failed); the other simulated processes go on."""
        crash = Crashed(f"worker {self.plan.rank} crashed {self._report_crash(step)}")
        self.wire.leave(self.plan.rank, "crashed")
        sim, me = self.wire.sim, current_task()
        for task in sim.tasks:
            if task.rank == self.plan.rank and task is not me:
                sim.kill(task, crash)
        if me is not None and me.rank == self.plan.rank:
            raise crash
