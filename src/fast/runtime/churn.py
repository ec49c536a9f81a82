"""`[faults] churn`: workers of a live run leave and come back at random, driven by its launcher.

Each member, worker 0 included, stays an exponential time of mean `lifetime`, then is told to leave (through the
membership's store: it kills itself, as a crash, or stops on SIGTERM, as a clean leave); the lowest live member
then does worker 0's duties (fast.runtime.live); a detached run's worker 0 gathers its end, and stays. The last
member that holds the run's state stays too (with none, the run could not go on: a joiner holds it only once
healed, as its reports in the store say): its stay is drawn again. After an
exponential absence of mean `absence` a new worker takes its place through `fast join`, healed from a live peer like
any joiner. The new worker is warm: the driver keeps a standby joiner ready (`fast join --standby`: imported, its
config read), and each line it gives it forks a joiner from it, which imports nothing again (on this machine's
cores, a joiner that imported torch and the loop afresh would take seconds of them from the members). The draws are
seeded by `run.seed`; times count from the start of training (the first group formed).
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


STANDBY_GRACE_S = 10.0  # at the run's end: how long the joiners a standby forked have to end before SIGTERM


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
        self.standbys: list[subprocess.Popen] = []  # the standby joiner, and any that died before it
        self.joined = 0  # joiners forked from a standby
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fast-churn", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        """The driver's thread, which starts the standbys (their parent-death signal is tied to the thread that
        started them) and so lets them go itself, once the run is over."""
        try:
            self._churn()
        finally:
            self._let_the_standbys_go()

    def _churn(self) -> None:
        while not self.coordinator.started():  # times count from the start of training
            if self._closing.wait(0.1):
                return
        self._standby()  # (now that the run folder has its config, which a script's first worker writes)
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
        """A joiner that gets ready now, and forks a joiner for each line it is given (`fast join --standby`)."""
        env = {**os.environ, "FAST_PROGRESS": "0"}
        command = [sys.executable, "-m", "fast", "join", str(self.run_dir), "--standby"]
        (self.run_dir / "workers").mkdir(parents=True, exist_ok=True)
        # (what one says, a failure's line included, is kept beside the members' records)
        with open(self.run_dir / "workers" / f"standby-{len(self.standbys) + 1}.err", "wb") as said:
            standby = subprocess.Popen(command, env=env, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=said,
                                       preexec_fn=_die_with_launcher)  # fmt: skip
        self.standbys.append(standby)
        return standby

    def _bring_one_in(self) -> None:
        """A joiner forked from the standby (if the standby died, a new one starts: cold), its stderr kept in
        `workers/joiner-<k>.err`."""
        standby = self.standbys[-1] if self.standbys[-1].poll() is None else self._standby()
        self.joined += 1
        said = self.run_dir / "workers" / f"joiner-{self.joined}.err"
        with contextlib.suppress(BrokenPipeError):  # (it died since the look: lost, as a joiner that fails to start)
            standby.stdin.write(f"{said}\n".encode())
            standby.stdin.flush()

    def _let_the_standbys_go(self) -> None:
        """Their input ends: each waits for the joiners it forked, and leaves (SIGTERM after a grace period)."""
        deadline = time.monotonic() + STANDBY_GRACE_S
        for standby in self.standbys:
            with contextlib.suppress(BrokenPipeError):
                standby.stdin.close()
        for standby in self.standbys:
            try:
                standby.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                standby.terminate()
                standby.wait()

    def close(self) -> None:
        """Stop making changes; the joiners still running end with the run (SIGTERM after a grace period)."""
        self._closing.set()
        self._thread.join(timeout=STANDBY_GRACE_S + 15)  # (a change under way, the standbys' grace, their end)
        workers = self.run_dir / "workers"
        for said in [*workers.glob("standby-*.err"), *workers.glob("joiner-*.err")]:
            if not said.stat().st_size:  # (those that had nothing to say)
                said.unlink()
