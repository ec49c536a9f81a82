"""The emulated machine under a worker: slower compute, random stragglers and crash faults, once per step.

Compute is made slower by sleeping at the top of each step: (factor − 1) × the mean work of a step
measured so far (its time minus its waits on communication), where factor is the worker's slowdown, times
a Pareto-distributed draw when `heavy_tail` is set (capped at `heavy_tail_max`). A straggler pauses
`straggler_pause_s` with probability `straggler_probability` per step. Each draw is keyed by (seed, rank,
step), so it repeats exactly. A crash ends the process abruptly (`os._exit`, no clean-up, as a machine
failure would) before a given step or at a given time from the start of training, after writing one line
to the worker's metrics file. With a step time (`run.step_time` in a run of processes), a step whose own work
took less waits out the rest at its end, as a host waits for a device of that speed: the workers' steps then take
as long however many of them share this machine's cores. The machine also times each step's own work, for the
summary's mean compute of a step and its spread from step to step, and a server's work on each request.
"""

from __future__ import annotations

import json
import math
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fast.comm import timeline, timing
from fast.comm.seeded import uniform
from fast.comm.waiting import waited_s
from fast.errors import say

CRASH_EXIT_CODE = 1
MAX_RECORDED_PAUSES = 1000
SPREAD_WARMUP_STEPS = 5  # a worker's first steps carry one-off costs (allocation, lazy set-up): not in its spread


@dataclass(frozen=True)
class MachinePlan:
    """What the machine of process `rank` does to it (the defaults do nothing). Its draws are `worker`'s (default
    `rank`): a sharded replica's processes draw alike, their worker's."""

    rank: int
    worker: int | None = None
    seed: int = 0
    slowdown: float = 1.0
    straggler_probability: float = 0.0
    straggler_pause_s: float = 0.0
    heavy_tail: float = 0.0
    heavy_tail_max: float = 20.0
    crash_step: int | None = None
    crash_time_s: float | None = None
    step_time_s: float | None = None

    @property
    def drawn_for(self) -> int:
        return self.rank if self.worker is None else self.worker

    def factor(self, step: int) -> float:
        """This step's compute time factor: the slowdown, times a capped Pareto(heavy_tail) draw."""
        if self.heavy_tail <= 0:
            return self.slowdown
        u = uniform(self.seed, self.drawn_for, step, "heavy-tail")
        return self.slowdown * min(self.heavy_tail_max, (1.0 - u) ** (-1.0 / self.heavy_tail))

    def pause_s(self, step: int) -> float:
        """This step's straggler pause: `straggler_pause_s` with probability `straggler_probability`."""
        if self.straggler_probability <= 0:
            return 0.0
        hit = uniform(self.seed, self.drawn_for, step, "straggler") < self.straggler_probability
        return self.straggler_pause_s if hit else 0.0


class EmulatedMachine:
    """Applies a `MachinePlan` around each step of the worker's loop; records what it did."""

    def __init__(self, plan: MachinePlan, events_file: Path | None = None) -> None:
        self.plan = plan
        self.events_file = events_file
        self.origin = timing.wall()
        self._compute_s = 0.0
        self._steps_timed = 0
        self._started: float | None = None
        self._waited = 0.0
        self._spread_steps, self._spread_mean, self._spread_m2 = 0, 0.0, 0.0
        self._requests, self._request_s = 0, 0.0
        self._requests_lock = threading.Lock()  # a server's lines answer in threads of their own
        self._served = threading.local()  # per serving thread: (time, waited_s) when it last answered
        self.slowdown_s = 0.0
        self.step_time_waited_s = 0.0
        self.pauses: list[list[float]] = []
        self.paused_s = 0.0

    def start(self, world: Any = None) -> None:
        """Training starts now (faults count from here): also for the process's emulated network, if any."""
        self.origin = timing.wall()
        network = getattr(world, "network", None)
        if network is not None:
            network.start_clock(self.origin)
        if self.plan.crash_time_s is not None:
            timing.Timer(self.plan.crash_time_s, self._crash).start()

    def before_step(self, step: int) -> None:
        """At the top of a step: crash, stall, or slow down in proportion to the step's own work."""
        plan = self.plan
        if plan.crash_step is not None and step >= plan.crash_step:
            self._crash(step)
        extra = (plan.factor(step) - 1.0) * self._compute_s
        pause = plan.pause_s(step)
        if pause > 0:
            self.paused_s += pause
            if len(self.pauses) < MAX_RECORDED_PAUSES:
                self.pauses.append([step, pause])
        if extra + pause > 0:
            self.slowdown_s += extra
            timing.sleep(extra + pause)
        self._started, self._waited = timing.now(), waited_s()

    def compute(self) -> None:
        """The step's own compute, once the strategy has posted what it sends early: a real machine does it."""

    @contextmanager
    def evaluating(self) -> Iterator[None]:
        """An evaluation on this machine, which takes the time it takes."""
        yield

    @contextmanager
    def serving(self) -> Iterator[None]:
        """A server's work on one request, which takes the time it takes: timed for the summary as all that its
        serving thread did since its previous request was answered (reading this one included), but wait on
        communication."""
        started, waited = getattr(self._served, "mark", None) or (timing.now(), waited_s())
        yield
        ended, waited_by_then = timing.now(), waited_s()
        self._served.mark = (ended, waited_by_then)
        self._count_request((ended - started) - (waited_by_then - waited))

    def _count_request(self, seconds: float) -> None:
        with self._requests_lock:
            self._requests += 1
            self._request_s += (seconds - self._request_s) / self._requests

    @property
    def request_s(self) -> float | None:
        """A server's mean work on a request; None before any."""
        return self._request_s if self._requests else None

    def after_step(self) -> None:
        """At the end of a step: time its own work, which is everything but its waits on communication; with a step
        time, wait out what the work left of it."""
        if self._started is None:
            return
        work = (timing.now() - self._started) - (waited_s() - self._waited)
        self._started = None
        rest = (self.plan.step_time_s or 0.0) - work
        if rest > 0:
            self.step_time_waited_s += rest
            with timeline.span("emulated step time", "compute"):  # the emulated device's compute
                timing.sleep(rest)
        self._steps_timed += 1
        self._compute_s += (work - self._compute_s) / self._steps_timed
        if self._steps_timed > SPREAD_WARMUP_STEPS:  # Welford's running variance
            self._spread_steps += 1
            delta = work - self._spread_mean
            self._spread_mean += delta / self._spread_steps
            self._spread_m2 += delta * (work - self._spread_mean)

    @property
    def compute_s(self) -> float | None:
        """Mean measured work of a step (all but its communication waits, before any slowdown); None before
        any step."""
        return self._compute_s if self._steps_timed else None

    @property
    def compute_spread(self) -> float | None:
        """The coefficient of variation of a step's work from step to step, after the first steps; None before
        two such steps."""
        if self._spread_steps < 2 or self._spread_mean <= 0:
            return None
        return math.sqrt(self._spread_m2 / (self._spread_steps - 1)) / self._spread_mean

    def _crash(self, step: int | None = None) -> None:
        self._report_crash(step)
        os._exit(CRASH_EXIT_CODE)

    def _report_crash(self, step: int | None) -> str:
        """One line to the worker's metrics file and one to stderr; returns when it crashed, in words."""
        elapsed = round(timing.wall() - self.origin, 4)
        where = f"before step {step}" if step is not None else f"{elapsed:g} s after the start"
        if self.events_file is not None:
            event = {"worker": self.plan.rank, "kind": "fault", "fault": "crash", "time_s": elapsed}
            if step is not None:
                event["step"] = step
            self.events_file.parent.mkdir(parents=True, exist_ok=True)
            with self.events_file.open("a") as f:
                f.write(json.dumps(event) + "\n")
        plan = self.plan
        who = f"worker {plan.rank}" if plan.drawn_for == plan.rank else f"process {plan.rank} of worker {plan.worker}"
        say(f"fast: {who} crashed {where} (fault injected by [faults] crash)")
        return where

    def record(self) -> dict[str, Any]:
        """What this machine did, for summary.json."""
        return {
            "rank": self.plan.rank,
            "slowdown": self.plan.slowdown,
            "slowdown_s": round(self.slowdown_s, 4),
            "straggler_pauses": self.pauses,
            "straggler_paused_s": round(self.paused_s, 4),
            "step_time_waited_s": round(self.step_time_waited_s, 4),
        }
