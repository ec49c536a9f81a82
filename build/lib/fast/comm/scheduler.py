"""Virtual time for the simulated engine: a discrete-event scheduler that runs every task, one at a time.

Each task (a worker, a server, a thread one of them starts) runs on an OS thread of its own, but only the task
holding the baton runs; the others are parked. A parked task is resumed by an event in the scheduler's queue:
a wake-up (a message arrived, a condition was notified) or a timeout, each at a virtual time. The scheduler
always resumes the earliest event (ties in the order they were queued), so the interleaving, and with it every
result, depends on the seed alone, never on the host's load. Real work (forward, backward) takes no virtual
time: a task's compute is charged by sleeping in virtual time (`sleep`).

A run whose remaining tasks all wait for something nobody can send any more is a deadlock: the scheduler ends
it with an error naming what each task waited for, instead of hanging.
"""

from __future__ import annotations

import contextvars
import heapq
import itertools
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from fast.errors import FastError

_local = threading.local()
HOST_PATIENCE_S = 1800.0  # host seconds a task may run without parking before the run is declared stuck


class Aborted(BaseException):
    """Raised in a parked task when the simulation ends it (its run is over, or it was killed)."""


class Deadlock(FastError):
    """Every remaining task waits for something that cannot come."""


class Task:
    """One simulated thread of control: its OS thread, its baton and what it is doing."""

    def __init__(self, sim: Simulation, name: str, rank: int | None, main: bool) -> None:
        self.sim, self.name, self.rank, self.main = sim, name, rank, main
        self.baton = _held()
        self.token = 0  # events queued for an earlier park are stale once this moves on
        self.timed_out = False
        self.done = False
        self.result: Any = None
        self.error: BaseException | None = None
        self.traceback: str | None = None
        self.kill: BaseException | None = None  # raised at the task's next resumption
        self.waiting_for = "its start"
        self.host_s = 0.0  # host seconds it has run (held the baton) before its latest resumption
        self.resumed_at = 0.0  # perf_counter at its latest resumption
        self.joiners: list[Task] = []

    def host_seconds(self) -> float:
        """Host seconds it has run so far, the stretch under way included when it is the one running."""
        running = self.sim.running is self and not self.done
        return self.host_s + (time.perf_counter() - self.resumed_at if running else 0.0)


def _held() -> threading.Lock:
    """A lock taken from the start: one thread's release() lets the other's acquire() go (a fast semaphore)."""
    lock = threading.Lock()
    lock.acquire()
    return lock


def simulation() -> Simulation | None:
    """The simulation the calling thread is a task of, or None (a real process)."""
    return getattr(_local, "sim", None)


def current_task() -> Task | None:
    return getattr(_local, "task", None)


class Simulation:
    """The scheduler: a virtual clock `now` (seconds from the start) and the queue of events."""

    def __init__(self) -> None:
        self.now = 0.0
        self.tasks: list[Task] = []
        self._events: list[tuple[float, int, Task, int, bool]] = []
        self._order = itertools.count()
        self._back = _held()  # the baton's way back to the scheduler
        self.running: Task | None = None
        self.mains_left = 0  # main tasks not done yet
        self.shared: dict[str, Any] = {}  # one object per simulation (its wire, a pool of helpers, data sets)
        self.on_failure: Callable[[Task], None] | None = None  # told of a main task that ended with an error

    # -- tasks ---------------------------------------------------------------------------------------------
    def spawn(self, fn: Callable[[], Any], name: str, *, rank: int | None = None, main: bool = False) -> Task:
        """A new task that runs `fn` in a copy of the caller's context (from the current virtual time)."""
        parent = current_task()
        task = Task(self, name, rank if rank is not None or parent is None else parent.rank, main)
        context = contextvars.copy_context()
        threading.Thread(target=self._body, args=(task, context, fn), name=name, daemon=True).start()
        self.tasks.append(task)
        self.mains_left += main
        self._queue(task, self.now, timeout=False)
        return task

    def _body(self, task: Task, context: contextvars.Context, fn: Callable[[], Any]) -> None:
        _local.sim, _local.task = self, task
        task.baton.acquire()
        try:
            if task.kill is not None:
                raise task.kill
            task.result = context.run(fn)
        except Aborted:
            pass
        except BaseException as e:  # the runner reports it
            task.error, task.traceback = e, traceback.format_exc()
        finally:
            task.done = True
            self.mains_left -= task.main
            if task.main and task.error is not None and self.on_failure is not None:
                self.on_failure(task)
            for joiner in task.joiners:
                self.wake(joiner)
            self.running = None
            self._back.release()

    # -- parking and waking ----------------------------------------------------------------------------------
    def park(self, timeout: float | None = None, waiting_for: str = "something") -> bool:
        """Hand the baton back until woken (True) or until `timeout` virtual seconds have passed (False)."""
        task = self.running
        if task is None or current_task() is not task:
            raise FastError("a simulated wait outside the simulation's running task (a thread not started by FAST?)")
        if task.kill is not None:  # a killed task that caught the error and waits again
            raise task.kill
        if timeout is not None:
            self._queue(task, self.now + max(0.0, timeout), timeout=True)
        task.waiting_for = waiting_for
        self.running = None
        self._back.release()
        task.baton.acquire()
        if task.kill is not None:
            raise task.kill
        return not task.timed_out

    def wake(self, task: Task, at: float | None = None) -> None:
        """Resume a parked `task` at virtual time `at` (default now)."""
        self._queue(task, self.now if at is None else max(self.now, at), timeout=False)

    def sleep(self, seconds: float) -> None:
        """Let `seconds` of virtual time pass for the running task."""
        task = self.running
        assert task is not None
        self._queue(task, self.now + max(0.0, seconds), timeout=False)
        self.park(None, "its own compute or a pause")

    def kill(self, task: Task, error: BaseException) -> None:
        """End `task` at its next resumption with `error` (a crash of its machine, say); resumed now."""
        if not task.done:
            task.kill = error
            self.wake(task)

    def _queue(self, task: Task, at: float, *, timeout: bool) -> None:
        heapq.heappush(self._events, (at, next(self._order), task, task.token, timeout))

    # -- the loop ---------------------------------------------------------------------------------------------
    def run(self) -> None:
        """Run until every main task is done; then end the others (daemon threads). Raises Deadlock when no
        task can run while main tasks still wait (after ending them all)."""
        while self.mains_left:
            if not self._step():
                stuck = [t for t in self.tasks if not t.done]
                what = "; ".join(f"{t.name} waits for {t.waiting_for}" for t in stuck[:8])
                self._end_all(Aborted())
                raise Deadlock(f"the simulation can go no further: {what} (and nothing more can arrive)")
        self._end_all(Aborted())

    def _step(self) -> bool:
        while self._events:
            at, _, task, token, timeout = heapq.heappop(self._events)
            if task.done or token != task.token:
                continue
            self.now = max(self.now, at)
            task.token += 1
            task.timed_out = timeout
            self.running = task
            started = task.resumed_at = time.perf_counter()
            task.baton.release()
            if not self._back.acquire(timeout=HOST_PATIENCE_S):
                raise FastError(f"simulated {task.name} ran {HOST_PATIENCE_S:g} host seconds without waiting once")
            task.host_s += time.perf_counter() - started
            return True
        return False

    def _end_all(self, error: BaseException) -> None:
        for task in self.tasks:
            if not task.done:
                task.kill = error
                self._queue(task, self.now, timeout=False)
        while self._step():
            pass
