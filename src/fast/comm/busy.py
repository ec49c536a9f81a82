"""Who is busy: each process of a lock-step run says on the store, every second, whether it is waiting on
communication or computing, so that a worker whose collective passes its deadline waits on for a peer that is
alive and computing (an evaluation on rank 0 alone, as DDP scripts do) and gives up on one that is frozen or
that waits itself. The deadline then counts communication, not a peer's own work."""

from __future__ import annotations

import threading
import time
from typing import Any

from fast.comm.waiting import waiting_now
from fast.errors import say

BEAT_S = 1.0
BUSY_LIMIT_S = 1800.0  # the longest a peer's own work is waited for: torch's own default for a gloo collective
KEY = "fast/busy/{}"


class BusyBoard:
    """This process's beat on `store` (a daemon thread), and what the beats of the others say."""

    def __init__(self, store: Any, rank: int, role: str) -> None:
        self.store, self.rank, self.role = store, rank, role
        self.beats = 0
        self.told = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="fast-busy-board", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.is_set():
            self.beats += 1
            try:  # the store is shared with the training thread: its operations are thread-safe
                self.store.set(KEY.format(self.rank), f"{self.beats} {int(waiting_now())}")
            except Exception:  # the run is ending and its store going: the beats end with it
                return
            self._stop.wait(BEAT_S)

    def close(self) -> None:
        self._stop.set()

    def _read(self, peers: list[int]) -> dict[int, tuple[int, bool]]:
        beats = {}
        for peer in peers:
            try:
                if self.store.check([KEY.format(peer)]):
                    count, waits = self.store.get(KEY.format(peer)).decode().split()
                    beats[peer] = (int(count), waits == "1")
            except Exception:
                pass
        return beats

    def computing(self, ranks: list[int]) -> list[int]:
        """The peers among `ranks` that are alive and computing, none of them frozen; [] when one is frozen (its
        beats stopped) or none computes (all wait: on each other, or on one that is gone). Takes ~3 beats."""
        peers = [r for r in ranks if r != self.rank]
        before = self._read(peers)
        time.sleep(2.5 * BEAT_S)
        after = self._read(peers)
        if any(peer not in before or peer not in after or after[peer][0] == before[peer][0] for peer in peers):
            return []
        return [peer for peer in peers if not after[peer][1]]

    def patience(self, ranks: list[int], deadline_s: float, waited_s: float) -> bool:
        """Whether a wait on the group `ranks`, `waited_s` long past its `deadline_s`, goes on: a peer computes and
        the longest wait for a peer's work is not spent. Says so once per run."""
        busy = self.computing(ranks) if waited_s < BUSY_LIMIT_S else []
        if busy and not self.told:
            self.told = True
            names = ", ".join(f"worker {r}" for r in busy)
            said = (f"fast: {self.role}: {names} computed past run.deadline_s ({deadline_s:g}s) while this one "
                    f"waited (an evaluation on one rank?): waiting on, up to {BUSY_LIMIT_S:g}s")  # fmt: skip
            say(said)
        return bool(busy)
