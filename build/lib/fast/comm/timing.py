"""Time and threads for code that runs on either engine: the host's clock and threads in a real process, the
virtual clock and tasks of the simulation in a simulated one (as the calling thread belongs to one or not).

Everything below `fast.runtime` that reads the time, sleeps, starts a thread or waits on a condition does it
here, so that the same strategy code runs unchanged, and deterministically, in virtual time. Objects are of the
world they were made in: a `Condition()` made by a simulated worker is a simulated condition.
"""

from __future__ import annotations

import collections
import contextvars
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future as HostFuture
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from fast.comm.scheduler import Simulation, Task, current_task, simulation

__all__ = ["FutureTimeout", "now", "wall", "sleep", "simulated", "Thread", "Lock", "Condition", "Event", "Queue",
           "Future", "Timer", "shared"]  # fmt: skip


def simulated() -> bool:
    """Whether the calling thread is a task of a simulation (virtual time)."""
    return simulation() is not None


def now() -> float:
    """Seconds on a monotonic clock: the host's (perf_counter) or the simulation's virtual clock."""
    sim = simulation()
    return sim.now if sim is not None else time.perf_counter()


def wall() -> float:
    """Seconds since the epoch: the host's, or in a simulation its virtual time (an epoch of its own, at 0)."""
    sim = simulation()
    return sim.now if sim is not None else time.time()


def sleep(seconds: float) -> None:
    sim = simulation()
    if sim is None:
        time.sleep(max(0.0, seconds))
    else:
        sim.sleep(seconds)


_shared: dict[str, Any] = {}


def shared(key: str, make: Callable[[], Any]) -> Any:
    """One object per process, or per simulation (a pool of helper threads, say), made on first use."""
    sim = simulation()
    store = _shared if sim is None else sim.shared
    if key not in store:
        store[key] = make()
    return store[key]


# -- simulated primitives ---------------------------------------------------------------------------------------
class _SimLock:
    """A reentrant lock whose waiters park in virtual time."""

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim
        self.owner: Task | None = None
        self.depth = 0
        self.waiters: collections.deque[Task] = collections.deque()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        task = current_task()
        if self.owner is task:
            self.depth += 1
            return True
        deadline = None if timeout < 0 else self.sim.now + timeout
        while self.owner is not None:
            if not blocking or (deadline is not None and self.sim.now >= deadline):
                return False
            self.waiters.append(task)  # type: ignore[arg-type]
            try:
                self.sim.park(None if deadline is None else deadline - self.sim.now, "a lock")
            finally:
                if task in self.waiters:
                    self.waiters.remove(task)  # type: ignore[arg-type]
        self.owner, self.depth = task, 1
        return True

    def release(self) -> None:
        self.depth -= 1
        if self.depth == 0:
            self.owner = None
            if self.waiters:
                self.sim.wake(self.waiters.popleft())

    def locked(self) -> bool:
        return self.owner is not None

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


class _SimCondition:
    def __init__(self, sim: Simulation, lock: _SimLock | None = None) -> None:
        self.sim, self.lock = sim, lock or _SimLock(sim)
        self.waiters: list[Task] = []

    def acquire(self, *args: Any) -> bool:
        return self.lock.acquire(*args)

    def release(self) -> None:
        self.lock.release()

    __enter__ = acquire

    def __exit__(self, *exc: Any) -> None:
        self.lock.release()

    def wait(self, timeout: float | None = None) -> bool:
        task = current_task()
        assert task is not None and self.lock.owner is task, "Condition.wait without its lock"
        depth, self.lock.depth = self.lock.depth, 1
        self.lock.release()
        self.waiters.append(task)
        try:
            return self.sim.park(timeout, "a condition")
        finally:
            if task in self.waiters:
                self.waiters.remove(task)
            self.lock.acquire()
            self.lock.depth = depth

    def wait_for(self, predicate: Callable[[], Any], timeout: float | None = None) -> Any:
        deadline = None if timeout is None else self.sim.now + timeout
        result = predicate()
        while not result:
            left = None if deadline is None else deadline - self.sim.now
            if left is not None and left <= 0:
                break
            self.wait(left)
            result = predicate()
        return result

    def notify(self, n: int = 1) -> None:
        for task in self.waiters[:n]:
            self.waiters.remove(task)
            self.sim.wake(task)

    def notify_all(self) -> None:
        self.notify(len(self.waiters))


class _SimEvent:
    def __init__(self, sim: Simulation) -> None:
        self.changed, self.flag = _SimCondition(sim), False

    def is_set(self) -> bool:
        return self.flag

    def set(self) -> None:
        with self.changed:
            self.flag = True
            self.changed.notify_all()

    def clear(self) -> None:
        self.flag = False

    def wait(self, timeout: float | None = None) -> bool:
        with self.changed:
            return self.changed.wait_for(lambda: self.flag, timeout)


class _SimQueue:
    def __init__(self, sim: Simulation) -> None:
        self.changed, self.items = _SimCondition(sim), collections.deque()

    def put(self, item: Any, *args: Any) -> None:
        with self.changed:
            self.items.append(item)
            self.changed.notify()

    put_nowait = put

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        with self.changed:
            if not self.changed.wait_for(lambda: self.items, timeout if block else 0):
                raise queue.Empty
            return self.items.popleft()

    def get_nowait(self) -> Any:
        return self.get(False)

    def empty(self) -> bool:
        return not self.items

    def qsize(self) -> int:
        return len(self.items)


class _SimFuture:
    def __init__(self, sim: Simulation) -> None:
        self.ready = _SimEvent(sim)
        self._result: Any = None
        self._error: BaseException | None = None

    def set_result(self, value: Any) -> None:
        self._result = value
        self.ready.set()

    def set_exception(self, error: BaseException) -> None:
        self._error = error
        self.ready.set()

    def done(self) -> bool:
        return self.ready.is_set()

    def set_running_or_notify_cancel(self) -> bool:
        return True

    def result(self, timeout: float | None = None) -> Any:
        if not self.ready.wait(timeout):
            raise FutureTimeout()
        if self._error is not None:
            raise self._error
        return self._result


class _SimThread:
    def __init__(self, sim: Simulation, target: Callable[..., Any], name: str | None, args: tuple) -> None:
        self.sim, self.target, self.args = sim, target, args
        self.name = name or "thread"
        self.daemon = True
        self.task: Task | None = None

    def start(self) -> None:
        self.task = self.sim.spawn(lambda: self.target(*self.args), self.name)

    def is_alive(self) -> bool:
        return self.task is not None and not self.task.done

    def join(self, timeout: float | None = None) -> None:
        task, me = self.task, current_task()
        if task is None or task.done or me is None:
            return
        task.joiners.append(me)
        try:
            self.sim.park(timeout, f"{self.name} to end")
        finally:
            if me in task.joiners:
                task.joiners.remove(me)


class _SimTimer(_SimThread):
    def __init__(self, sim: Simulation, interval: float, function: Callable[[], Any]) -> None:
        super().__init__(sim, self._fire, "timer", ())
        self.interval, self.function, self.cancelled = interval, function, False

    def _fire(self) -> None:
        self.sim.sleep(self.interval)
        if not self.cancelled:
            self.function()

    def cancel(self) -> None:
        self.cancelled = True


# -- the facade -------------------------------------------------------------------------------------------------
def Thread(target: Callable[..., Any], name: str | None = None, args: tuple = (), daemon: bool = True) -> Any:  # noqa: N802
    """A thread that runs in a copy of its starter's context (it sees the worker's timeline)."""
    sim = simulation()
    if sim is None:
        context = contextvars.copy_context()
        return threading.Thread(target=context.run, name=name, args=(target, *args), daemon=daemon)
    return _SimThread(sim, target, name, args)


def Lock() -> Any:  # noqa: N802
    """A lock that may be held across waits (for one that never is, threading.Lock is enough)."""
    sim = simulation()
    return threading.RLock() if sim is None else _SimLock(sim)


def Condition(lock: Any = None) -> Any:  # noqa: N802
    sim = simulation()
    return threading.Condition(lock) if sim is None else _SimCondition(sim, lock)


def Event() -> Any:  # noqa: N802
    sim = simulation()
    return threading.Event() if sim is None else _SimEvent(sim)


def Queue() -> Any:  # noqa: N802
    sim = simulation()
    return queue.SimpleQueue() if sim is None else _SimQueue(sim)


def Future() -> Any:  # noqa: N802
    sim = simulation()
    return HostFuture() if sim is None else _SimFuture(sim)


def Timer(interval: float, function: Callable[[], Any]) -> Any:  # noqa: N802
    """`function` after `interval` seconds, on a daemon thread (cancel() before it fires to skip it)."""
    sim = simulation()
    if sim is None:
        timer = threading.Timer(interval, function)
        timer.daemon = True
        return timer
    return _SimTimer(sim, interval, function)
