"""`[faults] churn`: workers of a live run leave and come back at random, driven by its launcher.

Each member, worker 0 included, stays an exponential time of mean `lifetime`, then is told to leave (through the
membership's store: it kills itself, as a crash, or stops on SIGTERM, as a clean leave); the lowest live member
then does worker 0's duties (fast.runtime.live); a detached run's worker 0 gathers its end, and stays. The last
member that holds the run's state stays too (with none, the run could not go on: a joiner holds it only once
healed, as its reports in the store say): its stay is drawn again. After an
exponential absence of mean `absence` a new worker takes its place through `fast join`, healed from a live peer like
any joiner. The new worker is warm: the driver keeps a standby joiner ready (`fast join --standby`: imported, its
config read) and gives it its line; a new standby gets ready meanwhile. The draws are seeded by
`run.seed`; times count from the start of training (the first group formed).
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from fast.parts import ChurnPlan
from fast.runtime.membership import Coordinator


def _die_with_launcher() -> None:
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: its worker stops too


class ChurnDraws:
    """The seeded draws of `[faults] churn`: each member's stay and each absence (exponential), and how one leaves."""

    def __init__(self, plan: ChurnPlan) -> None:
        self.how = plan.leave
        self.mean_lifetime, self.mean_absence = plan.lifetime_s, plan.absence_s
        self.random = random.Random(plan.seed * 7919 + 17)

    def lifetime(self) -> float:
        return self.random.expovariate(1 / self.mean_lifetime)

    def absence(self) -> float:
        return self.random.expovariate(1 / self.mean_absence)


class ChurnDriver:
    """The launcher's thread that makes members leave and brings new ones in (see the module)."""

    def __init__(self, run_dir: Path, plan: ChurnPlan, coordinator: Coordinator) -> None:
        self.run_dir, self.coordinator, self.draws = run_dir, coordinator, ChurnDraws(plan)
        self.leaves: dict[int, float] = {}  # member -> when it is told to leave
        self.returns: list[float] = []  # when a new worker comes in
        self.joiners: list[subprocess.Popen] = []
        self.standby: subprocess.Popen | None = None
        self.standbys = 0  # standby joiners started
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fast-churn", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self.standby = self._standby()
        while not self.coordinator.started():  # times count from the start of training
            if self._closing.wait(0.1):
                return
        while not self._closing.wait(0.1):
            now = time.monotonic()
            for member in self.coordinator.members:
                if member not in self.leaves:
                    self.leaves[member] = now + self.draws.lifetime()
            for member, at in list(self.leaves.items()):
                if at <= now and at != float("inf") and member in self.coordinator.members:
                    staying = [m for m in self.coordinator.members if self.leaves.get(m) != float("inf")]
                    holding = [m for m in staying if m != member and self.coordinator.holds_state(m)]
                    if not holding:  # the last member that holds the run's state stays, drawn again (a joiner
                        # holds it once healed: a periodic joiner only at the end of the round it sits out)
                        self.leaves[member] = now + self.draws.lifetime()
                        continue
                    self.coordinator.evict(member, self.draws.how)
                    self.leaves[member] = float("inf")
                    self.returns.append(now + self.draws.absence())
            for at in [at for at in self.returns if at <= now]:
                self.returns.remove(at)
                self._bring_one_in()

    def _standby(self) -> subprocess.Popen:
        """A joiner that gets ready now and joins when it is given a line (`fast join --standby`)."""
        env = {**os.environ, "FAST_PROGRESS": "0"}
        command = [sys.executable, "-m", "fast", "join", str(self.run_dir), "--standby"]
        self.standbys += 1  # (what one says, a failure's line included, is kept beside the members' records)
        (self.run_dir / "workers").mkdir(parents=True, exist_ok=True)
        with open(self.run_dir / "workers" / f"standby-{self.standbys}.err", "wb") as said:
            return subprocess.Popen(command, env=env, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=said,
                                    preexec_fn=_die_with_launcher)  # fmt: skip

    def _bring_one_in(self) -> None:
        """The standby joins (if it died getting ready, a new one does: cold), and a new standby gets ready."""
        joiner = self.standby if self.standby is not None and self.standby.poll() is None else self._standby()
        self.standby = self._standby()
        with contextlib.suppress(BrokenPipeError):  # (it died since the look: lost, as a joiner that fails to start)
            joiner.stdin.write(b"join\n")
            joiner.stdin.close()
        self.joiners.append(joiner)

    def close(self) -> None:
        """Stop making changes; the joiners still running end with the run (SIGTERM after a grace period)."""
        self._closing.set()
        self._thread.join(timeout=5)
        if self.standby is not None:  # its input ends: it leaves without joining
            self.standby.stdin.close()
            self.joiners.append(self.standby)
        deadline = time.monotonic() + 10
        for joiner in self.joiners:
            try:
                joiner.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                joiner.terminate()
                joiner.wait()
        for said in (self.run_dir / "workers").glob("standby-*.err"):
            if not said.stat().st_size:  # (those that had nothing to say)
                said.unlink()
