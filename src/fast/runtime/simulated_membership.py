"""Live membership in the simulated engine: the coordinator, each member's side and `[faults] churn`, in virtual time.

The same generations as fast.runtime.membership, kept in the simulation's memory instead of a TCPStore, so that
fast.runtime.live runs unchanged on them. A member that leaves is out of the next generation at once (as a local
process's exit is seen at once), a joiner once its task is up; members wait by parking their task, and a new
generation wakes them. A generation's group is a simulated group over its members' ids, which are also their
places on the wire. Churn is a task of the simulation: each member, worker 0 included, stays an exponential time (the
lowest live member then does worker 0's duties, as in a real run; the last member stays, drawn again), its tasks
then end as a crashed machine's do, and after an exponential absence a new worker (a new id) joins and is healed
from a live peer, all drawn from `run.seed` as a real run's churn is, from the start of training.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import torch

from fast.comm import timing
from fast.comm.comm import Comm
from fast.comm.scheduler import Simulation, current_task
from fast.emulation.simulated_comm import SimComm
from fast.emulation.simulated_machine import Crashed
from fast.emulation.wire import Wire
from fast.parts import Deployment
from fast.runtime.churn import ChurnDraws
from fast.runtime.membership import Generation, RunEnded, ending_with, why_it_ends

CHURN_POLL_S = 0.05  # virtual seconds between the churn task's looks at the membership


class SimulatedMembership:
    """The run's membership (what the Coordinator is to real processes); `start_worker(id)` starts a joiner."""

    def __init__(self, sim: Simulation, wire: Wire, deployment: Deployment, founders: int,
                 start_worker: Callable[[int], None], form_s: float = 0.0) -> None:  # fmt: skip
        self.sim, self.wire, self.deployment, self.start_worker = sim, wire, deployment, start_worker
        self.form_s = form_s  # (run.form_time) what forming a group costs each member
        self.generations = [Generation(0, list(range(founders)))]
        self.next_id = founders
        self.joiners: set[int] = set()
        self.arrived: dict[int, set[int]] = defaultdict(set)
        self.settled: dict[int, bool] = {}  # generation -> formed (True) or abandoned (False)
        self.ending = False
        self.closed = False  # to joiners and churn (worker 0 out of time while the members re-form)
        self.figures: dict[int, Callable[[], dict[str, Any]]] = {}  # each member's, read at the end
        self.changes: list[dict[str, Any]] = []  # as the summary lists them (fast.runtime.live)
        self.written = False  # a member has written the run's outputs
        self.evicted: set[int] = set()  # the members churn took out (told to go: no failure of the run's)
        self._waiting: list[Any] = []

    @property
    def newest(self) -> Generation:
        return self.generations[-1]

    def publish(self, joined: Sequence[int] = (), left: Sequence[dict[str, Any]] = (), broken: bool = False) -> None:
        gone = {entry["member"] for entry in left}
        members = [m for m in self.newest.members if m not in gone] + list(joined)
        if self.ending:
            last_formed = max((number for number, formed in self.settled.items() if formed), default=0)
            members = ending_with(members, self.generations[last_formed].members)
        failed = why_it_ends(members, self.deployment.min_workers)
        number = len(self.generations)
        self.generations.append(Generation(number, members, list(joined), list(left), timing.wall(), failed, broken))
        self.wake_all()

    def settle(self, number: int, formed: bool) -> None:
        self.settled[number] = formed
        self.wake_all()

    def wake_all(self) -> None:
        waiting, self._waiting = self._waiting, []
        for task in waiting:
            self.sim.wake(task)

    def park(self, timeout_s: float) -> bool:
        """Wait for a change (True) or `timeout_s` virtual seconds (False)."""
        self._waiting.append(current_task())
        return self.sim.park(timeout_s, "a new membership")

    def member(self, rank: int, deadline_s: float) -> SimulatedMember:
        return SimulatedMember(self, rank, rank in self.joiners, deadline_s)

    # -- churn -----------------------------------------------------------------------------------------------
    def evict(self, member: int, how: str) -> None:
        """`member`'s machine goes: its tasks end, its peers learn it at once, the next generation is without it."""
        crash = Crashed(f"worker {member} left the run ([faults] churn)")
        self.evicted.add(member)
        self.wire.leave(member, "left the run")
        for task in self.sim.tasks:
            if task.rank == member and task is not current_task():
                self.sim.kill(task, crash)
        self.publish(left=[{"member": member, "how": "killed" if how == "kill" else "left (SIGTERM)"}])

    def bring_one_in(self) -> None:
        member, self.next_id = self.next_id, self.next_id + 1
        self.joiners.add(member)
        self.wire.add(member)
        self.start_worker(member)

    def churn(self) -> None:
        """The churn task (see the module): until member 0 says the run is ending. The draws are a real run's, in
        the same order (fast.runtime.churn.ChurnDriver); the stays wait in a heap, so that a look costs the changes
        since the last one, not the members (a thousand of them at every look)."""
        draws = ChurnDraws(self.deployment.churn)
        drawn: set[int] = set()  # the members whose stay is drawn
        leaves: list[tuple[float, int]] = []  # (when it leaves, member), a heap
        returns: list[float] = []  # when a new worker comes in
        seen = -1  # the generation whose members were last looked at
        while not any(self.settled.values()):  # times count from the start of training
            timing.sleep(CHURN_POLL_S)
        while not (self.ending or self.closed):
            now = self.sim.now
            if self.newest.number != seen:
                seen = self.newest.number
                for member in self.newest.members:
                    if member not in drawn:
                        drawn.add(member)
                        heapq.heappush(leaves, (now + draws.lifetime(), member))
            due = []
            while leaves and leaves[0][0] <= now:
                due.append(heapq.heappop(leaves)[1])
            for member in sorted(due):  # (in the order of their ids, as a real run's driver takes them)
                if member in self.newest.members and len(self.newest.members) <= 1:  # the last one stays (a real
                    heapq.heappush(leaves, (now + draws.lifetime(), member))  # run's churn's rule), drawn again
                elif member in self.newest.members:
                    self.evict(member, draws.how)
                    returns.append(now + draws.absence())
            for at in [at for at in returns if at <= now]:
                returns.remove(at)
                self.bring_one_in()
            upcoming = [at for at in returns if at > now] + ([leaves[0][0]] if leaves else [])
            timing.sleep(min([CHURN_POLL_S, *(at - now for at in upcoming)]))


class SimulatedMember:
    """A simulated worker's side of the membership: `fast.runtime.membership.Member`'s methods, in virtual time."""

    def __init__(self, membership: SimulatedMembership, member: int, joining: bool, deadline_s: float) -> None:
        self.membership, self.id, self.joining, self.deadline_s = membership, member, joining, deadline_s
        self.in_the_run = False  # a group of this member's has formed (not a joiner still on its way in)

    def ready(self) -> None:
        if not (self.membership.closed or self.membership.ending):
            self.membership.publish(joined=[self.id])

    def newest(self) -> int:
        return self.membership.newest.number

    def generation(self, number: int) -> Generation:
        return self.membership.generations[number]

    def wait_for(self, after: int, *, including: int | None = None) -> Generation:
        while True:
            generation = self.membership.newest
            if generation.number > after:
                if generation.failed:
                    raise RunEnded(generation.failed)
                if including is None or including in generation.members:
                    return generation
                after = generation.number
            if self.membership.ending and (including is not None or not self.in_the_run):  # (as a real member's)
                raise RunEnded("the run ended before this worker could take part again")
            if not self.membership.park(self.deadline_s):
                raise RunEnded(f"no new membership within run.deadline_s = {self.deadline_s:g}s")

    def arrive(self, generation: Generation) -> bool:
        membership, number = self.membership, generation.number
        if number not in membership.settled:
            membership.arrived[number].add(self.id)
            if len(membership.arrived[number]) >= len(generation.members):
                membership.settle(number, formed=True)
        while number not in membership.settled:
            ended_without = membership.ending and not self.in_the_run  # (a joiner)
            if self.newest() > number or ended_without or not membership.park(self.deadline_s):
                membership.settle(number, formed=False)
        self.in_the_run = self.in_the_run or membership.settled[number]
        return membership.settled[number]

    def form(self, generation: Generation, device: torch.device, deadline_s: float, counter: Any, make_comm: Any,
             interrupted: Callable[[], str | None] | None = None) -> Comm:  # fmt: skip
        """A generation's group, formed in `run.form_time` (a real one's meeting and connections); RuntimeError, as
        a real one's, when a newer generation came meanwhile (`interrupted()` says why)."""
        if self.membership.form_s:
            timing.sleep(self.membership.form_s)
            why = interrupted() if interrupted is not None else None
            if why is not None:
                raise RuntimeError(why)
        wire = self.membership.wire
        return SimComm(wire=wire, group_id=wire.group(("generation", generation.number)), deadline_s=deadline_s,
                       device=device, counter=counter, ranks=list(generation.members), rank=self.id)  # fmt: skip

    def suspect(self, generation: int) -> None:
        """A collective failed in `generation`: if it is still the newest, form it again without whoever is gone."""
        membership = self.membership
        if generation == membership.newest.number:
            gone = [{"member": m, "how": "gone"} for m in membership.newest.members if m in membership.wire.gone]
            membership.publish(left=gone, broken=True)

    def stopping(self) -> bool:
        return False  # a simulated run is one process: nothing outside it asks it to stop

    def report(self, figures: Callable[[], dict[str, Any]]) -> None:
        self.membership.figures[self.id] = figures

    def figures_of(self, member: int) -> dict[str, Any] | None:
        figures = self.membership.figures.get(member)
        return figures() if figures is not None else None  # (a gone member's task stopped where it died)

    def leave(self, how: str) -> None:
        self.membership.publish(left=[{"member": self.id, "how": how}])

    def note_change(self, change: dict[str, Any]) -> None:
        self.membership.changes.append(change)

    def changes(self, last: bool = False) -> list[dict[str, Any]]:
        return self.membership.changes[-1:] if last else list(self.membership.changes)

    def wrote(self) -> None:
        self.membership.written = True

    def close_to_joiners(self) -> None:
        self.membership.closed = True

    def ending(self) -> None:
        self.membership.ending = True
        self.membership.wake_all()

    def done(self) -> None:
        pass  # (a simulated member's end is no exit the membership could take for a departure)

    def close(self) -> None:
        pass


def simulated_member(rank: int, deadline_s: float) -> SimulatedMember:
    """The calling task's member of its simulation's membership."""
    from fast.comm.scheduler import simulation

    sim = simulation()
    assert sim is not None
    return sim.shared["membership"].member(rank, deadline_s)
