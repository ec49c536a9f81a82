"""A worker's part in live membership (`run.membership = "live"`): it forms each generation's group, switches at its
strategy's change points, survives a step a lost peer broke, and heals from a live peer (a part of
fast.runtime.job.Job).

Member 0 is the first of a generation's members, the lowest live id (ids only grow: a joiner's is new): it does
worker 0's duties for that generation (evaluations, the outputs and the summary, the end of the run; `Job.is_main`).
When it dies, the next generation's first member takes them over at that generation's boundary: the changes of
membership it notes are kept by the launcher's store, not in its memory, so nothing of the run's record is lost.

Before each step (in the loader, before its batch is chosen, or at the step's first forward) the members take one
round together: member 0 reads whether the coordinator (fast.runtime.membership) has published a newer generation,
and every member learns it at the same step. They then leave their group, form the new one, and heal: member 0,
the oldest member, sends its whole state (weights, optimizer, step, schedule, data position, strategy state) to
each joiner and to each member whose step is not its own, never through a file. A step whose collective fails (a
peer died in it) is discarded on every survivor: no update is applied, the data cursor does not move, and the step
is taken again over the new group, so no sample is lost or seen twice. Under `sync` the members take the next step's
round after the step's all-reduce, before any applies the step: an all-reduce that a death broke on one survivor
fails that round on all, so no survivor applies a step another discarded (which would leave it to be healed whole);
a death inside that round may end it on some survivors only, and the others apply the step they kept at the heal.

A joiner of `local-sgd` or `diloco` (without a codec) stops nobody: it is sent where the run stands at once (step,
data position, schedule), and its weights, optimizer and strategy state on a line of their own, behind the others'
steps. It sits its first round out, taking the round's steps without data (its share of the round's mean zeros, not
counted, and no batch of the data cursor's), takes that state before the round's mean, and comes out of the mean
level with the others (summary `membership`: `healed_behind`). A state slower than a round waits for nobody: the
joiner keeps what the round's mean gave, sits rounds out until the state is in (the members learn at each round's
start whether one still waits), and then applies the kept means as every member did. A joiner of `sync` (FAST's own
loop, without a codec) likewise takes each step's all-reduce without data until its state is in, keeping the step's
averaged gradients; the members learn at each step's round which still wait. Each enters as soon as its own state
is in: it applies its kept gradients as every member applied them (the same skips, clipping, learning rates), and
takes the step with data: that step is the only one that waits for it. A joiner whose
kept gradients would pass `KEPT_BYTES` stops waiting on the others' steps and takes its state at once. A generation
that only adds members waits for the joiners whose state is under way (a re-form would cut that state's line), for
a round at most (a periodic joiner then takes its state before the round's mean); one that loses a member does
not. A re-form cuts such a line, but what came of the state stays with the joiner, and the source keeps what it
sent: when both are in the new group and the joiner kept exactly what every member applied since (as many steps or
round means), the rest comes on the new group's line, and the joiner goes on sitting out (for the periodic family,
the rest of the round under way, whatever its step); otherwise it is healed again from the start.

The data of a live run is one cursor through each epoch's order, the same on every member: at each step the r-th of
the n members that take data takes the r-th of the next n batches, so a change of membership moves no sample.
"""

from __future__ import annotations

import contextlib
import faulthandler
import hashlib
import os
import signal
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from fast.comm import bootstrap as engine
from fast.comm import timing
from fast.comm.comm import IncomingBytes, limit_for, packed, unpacked
from fast.emulation.deployment import comm_maker, network_for
from fast.errors import CommError, FastError, UsageError, first_line, say
from fast.runtime import control
from fast.runtime.control import Answer, Control
from fast.runtime.membership import FORM_S, Access, Generation, Member, RunEnded, report_left
from fast.runtime.simulated_membership import simulated_member
from fast.shards.local import load_local_optimizer_state, local_optimizer_state, local_tensor
from fast.strategies.base import UNTIL_STATE_COMES

REFORM_PHASES = ("generation", "arrive", "form", "heal")  # where a re-form's seconds go (its `re-formed` record)


class HealRow:
    """The columns of the row each member gives at a heal (`Live._heal`): its id, its step, whether it is new (1),
    holds nothing yet (EMPTY) or holds the run's state (0), a fingerprint of its shared state, whether it kept the
    step a death broke; and of its line the last re-form cut (`Live._line_to_resume`): the source's id, the
    generation that began it, the bytes that came, the steps or round means kept since, the bytes it carries."""

    ID, STEP, NEW, SHARED, UNAGREED, CUT_SOURCE, CUT_GENERATION, CUT_BYTES, CUT_KEPT, CUT_TOTAL = range(10)
    EMPTY = 2


@dataclass
class Snapshot:
    """(A source) the state it sends a joiner behind the steps, kept until the joiner has it (a re-form that cuts the
    line resumes it): the packed holdings, the generation whose heal began it, and what a joiner sitting out had kept
    by then (`Strategy.kept_by_now`)."""

    payload: torch.Tensor
    generation: int
    kept_by_then: int


def sources_for(
    behind: list[int], sources: list[int], cut: dict[int, tuple[int, float]]
) -> tuple[dict[int, int], list[int]]:
    """Which of `sources` sends each member of `behind` its state at a heal, and the members whose cut line goes on
    (`cut`: each such member's source and the share of its state still to come). A source sends one state after
    another (`Comm.isend_bytes_in_turn`), so a member's state is in once its source has sent what comes before it:
    a line goes on at its source, the nearest its end first, unless another source with less to send would have
    the whole state in sooner; every other member goes to the source with least to send (a cut line that lands
    on its own source goes on there). A joiner in then sends at the next heal: the holders double, where states
    sent side by side would all come in at the end."""
    queued = dict.fromkeys(sources, 0.0)  # (states each source has to send)
    source_of = {}
    for member, (source, to_come) in sorted(cut.items(), key=lambda line: line[1][1]):
        least = min(sources, key=queued.__getitem__)
        if queued[source] + to_come <= queued[least] + 1:
            source_of[member] = source
            queued[source] += to_come
    resuming = list(source_of)
    for member in behind:
        if member in source_of:
            continue
        source_of[member] = least = min(sources, key=queued.__getitem__)
        goes_on = member in cut and cut[member][0] == least  # (given back to its own source after all)
        queued[least] += cut[member][1] if goes_on else 1
        resuming += [member] if goes_on else []
    return source_of, resuming


class LineVerdict:
    """A source's word on a joiner's line the last re-form cut (`Live._lines_resumed`): it goes on, or why not."""

    NOT_MINE, GOES_ON, NO_SNAPSHOT, OTHER_GENERATION, PAST_ITS_END, KEPT_DIFFERS = range(6)
    WHY = {
        NO_SNAPSHOT: "its source no longer holds what it sent",
        OTHER_GENERATION: "its source sent another state since",
        PAST_ITS_END: "more came than its source sent",
        KEPT_DIFFERS: "it kept other rounds than its source applied",
    }

    @classmethod
    def of(cls, snapshot: Snapshot | None, generation: int, received: int, kept: int, kept_by_now: int) -> int:
        if snapshot is None:
            return cls.NO_SNAPSHOT
        if snapshot.generation != generation:
            return cls.OTHER_GENERATION
        if received > snapshot.payload.numel():
            return cls.PAST_ITS_END
        return cls.GOES_ON if kept_by_now - snapshot.kept_by_then == kept else cls.KEPT_DIFFERS


@dataclass
class Reforming:
    """A member's re-form under way: when it began, the generations it tried (those before the last were superseded
    or did not form), and the seconds of each phase: waiting for a generation, for its members to arrive, forming its
    group, healing."""

    started: float = field(default_factory=timing.now)
    generations: list[int] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(REFORM_PHASES, 0.0))


def fingerprint(state: dict[str, Any]) -> str:
    """A hash of every tensor of a model's and an optimizer's state, in order: equal exactly when they are (a
    sharded replica's: its local shards')."""
    digest = hashlib.sha256()

    def add(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            digest.update(
                local_tensor(value).detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            )
        elif isinstance(value, dict):
            for key in sorted(value, key=str):
                digest.update(str(key).encode())
                add(value[key])
        elif isinstance(value, list | tuple):
            for item in value:
                add(item)
        else:
            digest.update(repr(value).encode())

    add(state)
    return digest.hexdigest()[:16]


# a re-form still under way after this many run.deadline_s is stuck: each of its waits has a deadline, and a new
# generation (churn faster than re-forms) restarts only the waits; the member says so and leaves (`_watched`)
REFORM_PATIENCE = 10
STUCK_EXIT_CODE = 3
# collectives that fail this many times in a row with the same members, none gone and none come, and no change point
# passed without a failure in between, fail for a cause that re-forming does not mend (a member's step longer than
# run.deadline_s, say)
UNEXPLAINED_FAILURES = 5
PROGRESS_BYTES = 1 << 20  # the most a state without its tensors (step, data position, schedule) may be
KEPT_BYTES = 1 << 30  # the most a joiner keeps of the averages of the steps or rounds it sits out


class Live:
    """The live-membership part of a Job (only used when `run.membership = "live"`)."""

    # the steps sat out by the joiners whose state comes behind the others' steps: (the step they end before, or
    # UNTIL_STATE_COMES for sync's, their places in the group)
    _sitting_out: tuple[int, tuple[int, ...]] | None = None
    # (a joiner's) that state under way, its source's id, and the generation whose heal began it
    _coming: tuple[IncomingBytes, int, int] | None = None
    # (a joiner's) that line as a re-form cut it, and what it had kept: the next heal may resume it
    _cut: tuple[tuple[IncomingBytes, int, int], list[Callable[[], None]], int] | None = None
    _resumed_at: list[int]  # (a joiner's) the bytes of its state already in each time a cut line was resumed
    _sat_out_since: float  # (a joiner's) when it began to sit out while its state came behind the steps
    _snapshots: dict[int, Snapshot]  # (a source's) the states it sends behind the steps, by joiner
    # (a joiner sitting out) what every member applied at the steps (sync) or rounds (the periodic family) it sat out
    # before its state was in, each to be applied as they did once it is; None on a member that takes the steps
    _kept: list[Callable[[], None]] | None = None
    _kept_bytes = 0
    _sending: list[Any]  # (a source's) the sends of that state under way
    _epoch_samples = 0  # the samples of an epoch's order (the loader's), where the data cursor turns over
    _run_time_offset = 0.0  # the run's training time before this member's clock began (a joiner's, healed)
    # (a strategy that `agrees_before_step`) the next step's membership round, taken after this step's exchange:
    # (that step, the answer, this member's samples when it answered)
    _answered: tuple[int, Answer, int] | None = None
    # (such a strategy) this step, kept when a peer died inside that round: its exchange went through on every member
    # (each took part in the round), so a survivor may have applied it, and at the heal this one does too (`_heal`)
    _unagreed: Callable[[], None] | None = None
    _switch_waits = False  # a newer generation that only adds members waits for the state of joiners sitting out
    _reforming: Reforming  # (a re-form under way) its time so far, for its record
    # the members of the last failed collective, and how many failed in a row with them (`_failed_again`)
    _failures_in_a_row: tuple[tuple[int, ...], int] = ((), 0)
    _failed_since_boundary = False  # a collective failed since the last change point began

    def _start_membership(self) -> None:
        """Join the membership (a founder, or a joiner `fast join` had admitted) and form the first group."""
        deadline_s = self.config.run.deadline_s
        if self.simulated:
            self.member = simulated_member(self.rank, deadline_s)
            self.joining = self.member.joining
        else:
            self.member = Member(Access.from_environment(), self.rank, deadline_s)
            self.joining = os.environ.get("FAST_JOINING") == "1"
        self.generation: Generation | None = None
        self._boundary_at = -1  # the step whose membership round is done
        self._closed = False  # (the member that does worker 0's duties) closed to joiners
        self._holds_state = not self.joining  # a founder's first weights are the run's; a joiner's are nothing yet
        self.data_epoch, self.data_cursor = 0, 0
        # what the members trained on, as each reported it at the next boundary (run.max_samples, the summary's)
        self.samples_trained, self._samples_reported = 0, 0
        self.member.report(self._reported_figures)
        if not self.simulated:  # (a generation waits for it while its step stands still: where is it held)
            self.member.on_late(partial(self._stacks_to, "late"))
        if self.joining:
            self.member.ready()
        self._reforming = Reforming()
        self._resumed_at, self._snapshots = [], {}
        with self._watched():
            self._connect_newest(dropped_if_absent=False)
        if not self.simulated:
            signal.signal(signal.SIGTERM, self._leave_on_sigterm)

    def _leave_on_sigterm(self, signum: int, frame: Any) -> None:
        """SIGTERM: say so to the coordinator and go; the others re-form at once, without waiting for a deadline."""
        self.member.leave("left (SIGTERM)")
        self.records.close()
        os._exit(0)

    def _connect_newest(self, dropped_if_absent: bool = True) -> None:
        """Form the group of the newest generation this member is in (retrying while generations change)."""
        after = -1 if self.generation is None else self.generation.number
        while True:
            with self._phase("generation"):
                newest = self.member.newest()
                if newest > after:
                    generation = self.member.generation(newest)
                else:
                    generation = self.member.wait_for(after)
                self._close_if_ending(generation)
                if generation.failed:
                    raise RunEnded(generation.failed)
                if self.rank not in generation.members:
                    if dropped_if_absent:
                        raise FastError(f"worker {self.rank} was dropped from the run's membership (its peers found "
                                        "it gone): join it again with fast join")  # fmt: skip
                    generation = self.member.wait_for(newest, including=self.rank)
            after = generation.number
            self._reforming.generations.append(after)
            with self._phase("arrive"):
                arrived = self.member.arrive(generation)
            if not arrived:
                continue
            try:
                with self._phase("form"):
                    self._form(generation)
                return
            except CommError:
                self.member.suspect(generation.number)

    def _close_if_ending(self, newest: Generation) -> None:
        """The lowest member of the newest generation (who does worker 0's duties), its run.max_time spent (or `fast
        stop` asked) while the members re-form (churn faster than they can take it): no more joiners nor churn, so
        that a last generation forms and the run ends at its boundary."""
        if self._closed or not newest.members or newest.members[0] != self.rank:
            return
        clock = getattr(self, "clock", None)
        if (clock is not None and self._budget_spent(self._run_time(clock.now()))) or self.member.stopping():
            self.member.close_to_joiners()
            self._closed = True

    def _form(self, generation: Generation) -> None:
        """Leave the old group and form `generation`'s: the world, the control group, the strategy's groups."""
        counter = self.world.counter if getattr(self, "world", None) is not None else None
        engine.abort()  # what is left of a group formed before, or half formed
        n, rank = len(generation.members), generation.members.index(self.rank)
        # emulated links, the same between any two members (a simulated group's are on the simulation's wire)
        network = None if self.simulated else network_for(self.config, n, rank)
        self.generation, self._answered, self._switch_waits = generation, None, False
        try:
            make_comm = comm_maker(network, self.config.run.allreduce_piece_kb)
            world = self.member.form(generation, self.device, self.config.run.deadline_s, counter, make_comm,
                                     self._superseded)  # fmt: skip
            world.interrupted, world.connect_s = self._superseded, FORM_S
            world.key = f"generation{generation.number}"  # (fast.comm.arrivals: the same on every member)
            control = world.subgroups([world.ranks], gloo=True)
        except RuntimeError as e:  # a member went between arriving and forming (the store's wait gave up)
            raise CommError(f"forming generation {generation.number}: {str(e).splitlines()[0]}") from None
        if network is not None:
            network.start_clock()
        self.world = self.comm = world
        self.world_size, self.workers = n, n // self.shards  # (a replica is K members: fast.runtime.membership)
        self.control = Control(control, rank, False, self.parts.options.name)
        if self.shards > 1:
            self._reform_shard_groups()  # the replica's groups, and its sharded model moved onto them
        world.barrier()
        self._boundary_at = -1
        context = getattr(self, "context", None)
        if context is not None:
            strategy_comm = world if self.shards == 1 else self.groups.replicate  # (shard k of every replica)
            context.world, context.comm, context.workers = world, strategy_comm, self.workers
            self.strategy.world, self.strategy.comm = world, strategy_comm
            if getattr(self.strategy, "model", None) is not None:
                self.strategy.regroup()

    def _superseded(self) -> str | None:
        """Why a wait in this generation's group should give up: the coordinator has published a newer one without a
        member of this one (a peer is gone), or because a member found this one broken (a collective of its failed:
        it has left this group), which the members re-form without waiting any longer. One that only adds joiners
        stops no wait: the group ends what it began (a round whose mean waits for a joiner's state, say) and takes
        them at its next boundary."""
        mine = set(self.generation.members)
        for number in range(self.generation.number + 1, self.member.newest() + 1):
            newer = self.member.generation(number)
            if newer.broken or not mine <= set(newer.members):
                return f"the membership changed (generation {number})"
        return None

    # -- at each step ----------------------------------------------------------------------------------------------
    def _membership_boundary(self) -> None:
        """The members' round before a step: switch to a newer generation, all at this step (and heal)."""
        if self._boundary_at == self.step or not self.strategy.change_point(self.step):
            return
        if not self._failed_since_boundary:  # (a step, or a round, has gone through)
            self._failures_in_a_row = ((), 0)
        self._failed_since_boundary = False
        while True:
            answered, self._answered = self._answered, None
            try:
                if answered is not None and answered[0] == self.step:
                    answer, samples = answered[1:]
                else:
                    answer, samples = self._membership_round(self.step), self.driver.samples
            except CommError as e:
                self._regroup(failure=e)
                continue
            # (a member gone since the last boundary takes what it trained since with it: a round it did not end)
            self.samples_trained += answer.total(2)
            self._samples_reported = samples
            if answer.any(1) or self._samples_spent():
                self._stopping = True
            if not answer.total(3):
                self._snapshots = {}  # (a source's: every state sent behind the steps is in, none to resume)
            # a generation that only adds members waits for the joiners whose state is under way (a re-form would cut
            # its line): for a round at most (`_sat_out`)
            if not answer.any(0) or (answer.total(3) and not answer.any(4)):
                self._switch_waits = answer.any(0)
                self._boundary_at = self.step
                if self._takes_the_step(answer):
                    return
                continue  # a step sat out, or a re-form (a peer went meanwhile, healed): the boundary again
            if self._coming is not None and not answer.any(4) and not self._take_state_behind():
                continue  # (a joiner whose state came since its last step takes it first) a peer went meanwhile
            self._regroup(failure=None)

    def _membership_round(self, step: int) -> Answer:
        """The members' round before `step`: whether member 0 sees a newer generation, whether the run ends, the
        samples each trained since its last round, whether each (a joiner sitting out) still waits for its state,
        whether member 0 sees a newer generation without one of this one's members."""
        first = self.world.index() == 0
        newer = int(first and self.member.newest() > self.generation.number)
        ending = int(self._budget_spent(self._run_time(self.trained_s)) or (first and self.member.stopping()))
        fresh = self.driver.samples - self._samples_reported
        waiting = int(self._waiting_for_state())
        departed = int(newer and self._superseded() is not None)
        return self.control.round(control.MEMBERSHIP, step, [newer, ending, fresh, waiting, departed], set())

    def _agree_on_the_step(self) -> None:
        """(A strategy that `agrees_before_step`) after the step's exchange, before any member applies it: the next
        step's membership round, taken now (the boundary before that step reads its answer). A member whose
        exchange failed (a peer died in it) takes no part, so the round fails on every member and every member
        discards the step (CommError): a kill inside an all-reduce that completed on some survivors and not on
        others no longer leaves them unlike, to be healed whole at the re-form."""
        step = self.step + 1
        if not self.strategy.change_point(step):
            return
        try:
            self._answered = (step, self._membership_round(step), self.driver.samples)
        except CommError:
            if self.shards == 1 and self.loop_is_fast:  # (a user's loop may do at its step what no replay does)
                self._unagreed = self._as_applied()[0]
            raise

    def _takes_the_step(self, answer: Answer) -> bool:
        """After the boundary's round: whether this member takes the step now, not a joiner sitting out (a round of
        the periodic family; a step of sync while its own state is not in: each sync joiner enters when its state is,
        and the round's `answer` says every member which still wait)."""
        if self._sitting_out is None or self._sitting_out[0] != UNTIL_STATE_COMES:
            return self._between_rounds(answer.total(3))
        waiting = tuple(place for place, flags in enumerate(answer.flags) if flags[3])
        self._sitting_out = (UNTIL_STATE_COMES, waiting) if waiting else None
        if self._kept is None:
            return True
        ending = self.world.index() not in waiting or self.stopped
        if self._coming is not None and (ending or self._kept_bytes >= KEPT_BYTES) and not self._take_state_behind():
            return False  # a peer went meanwhile: re-formed and healed
        if not ending:
            self._sit_out_a_step()
            return False
        self._kept = None
        return True

    @property
    def data_place(self) -> int:
        """This member's place among the members that take data at this step (the r-th takes the r-th of the step's
        batches): joiners sitting out take none, wherever they stand in the group."""
        place = self.world.index() // self.shards
        sitting = self._sitting_out
        if sitting is None or self.step >= sitting[0]:
            return place
        return place - sum(1 for other in sitting[1] if other < place)

    def _between_rounds(self, waiting_members: int) -> bool:
        """(The periodic family) after a round's boundary round: joiners that sat a round out sit the next one out
        too while one of them still waits for its state (`waiting_members`: every member learns it, and takes one
        batch fewer per step for each), else they enter together. Whether this member takes the step now."""
        if self._sitting_out is not None and self.step >= self._sitting_out[0]:
            until = self.strategy.sits_out_from(self.step) if waiting_members else None
            self._sitting_out = None if until is None else (until, self._sitting_out[1])
        if self._kept is None:
            return True
        if self._sitting_out is None:  # in: the state taken (if it came after a round's mean, that mean applied)
            entered = self._coming is None or self._take_state_behind()
            if entered:
                self._kept = None
            return entered
        if not self._sat_out():
            return False  # a peer went meanwhile: re-formed and healed
        return self.stopped  # (else the next round's boundary)

    def _sat_out(self) -> bool:
        """A joiner whose state comes behind the others' steps takes the round's steps without data (its share
        of the round's mean zeros, not counted). It takes that state before the round's mean if it is in, and comes
        out of the mean level with the others; else it keeps what the mean gave, to apply once the state is in.
        False when a peer went meanwhile (re-formed and healed)."""
        until = self._sitting_out[0]
        while self.step < until and not self.stopped:
            # (the round's mean comes at the end of its last step; a newer generation that waited a round waits no more)
            last = self.step == until - 1 and self._coming is not None
            if last and (not self._waiting_for_state() or self._switch_waits) and not self._take_state_behind():
                return False
            try:
                self._step_without_data()
            except CommError as e:
                self._regroup(failure=e)
                return False
            self._keep_round()
        # (the run ended within the round: its last mean needs the state too)
        return not self.stopped or self._coming is None or self._take_state_behind()

    def _keep_round(self) -> None:
        """(A periodic joiner whose state was not in at its round's mean) what the mean gave, applied to the state
        once it is in, as every member applied it then."""
        mean, self.strategy.sat_out_mean = self.strategy.sat_out_mean, None
        if mean is not None and self._coming is not None:
            self._kept.append(partial(self.strategy.replay_round, mean, self.step - 1))
            self._kept_bytes += mean.numel() * mean.element_size()

    def _waiting_for_state(self) -> bool:
        """(A joiner sitting out) its state is not in yet, and it may keep another step's or round's averages
        meanwhile."""
        if self._coming is None or self._kept is None:
            return False
        return self._kept_bytes < KEPT_BYTES and not self._coming[0].arrived()

    def _sit_out_a_step(self) -> None:
        """(A sync joiner) one step without data, its averaged gradients kept (unless a peer went: re-formed and
        healed)."""
        try:
            self._step_without_data(keep=True)
        except CommError as e:
            self._regroup(failure=e)

    def _keep_step(self) -> None:
        """(A sync joiner) what every member applied at the step it sat out: applied at once if its state is in,
        else kept (the step's averaged gradients, its skip flag, the optimizer's settings such as learning rates)."""
        if self._coming is None:
            self.driver.replay([p.grad for p in self.driver.params], self.strategy.skips_step)
            return
        replay, nbytes = self._as_applied()
        self._kept.append(replay)
        self._kept_bytes += nbytes

    def _as_applied(self) -> tuple[Callable[[], None], int]:
        """This step as the members that take it apply it (its averaged gradients, its skip flag, the optimizer's
        settings such as learning rates), to apply later; and the bytes it holds."""
        grads = [None if p.grad is None else p.grad.detach().clone() for p in self.driver.params]
        skip = self.strategy.skips_step
        skip = skip.clone() if torch.is_tensor(skip) else skip
        nbytes = sum(g.numel() * g.element_size() for g in grads if g is not None)
        return partial(self._replay_step, grads, skip, self._optimizer_settings()), nbytes

    def _replay_step(self, grads: list[torch.Tensor | None], skip: Any, settings: list[dict[str, Any]]) -> None:
        """(A sync joiner whose state is in) a step it sat out, applied as every member applied it."""
        self._optimizer_settings(settings)
        self.driver.replay(grads, skip)

    def _optimizer_settings(self, settings: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
        """The optimizer's settings of each group (learning rate, ...) as they are; `settings`: set to these."""
        if settings is not None:
            for group, values in zip(self.optimizer.param_groups, settings, strict=True):
                group.update(values)
        return [{k: v for k, v in group.items() if k != "params"} for group in self.optimizer.param_groups]

    def _step_without_data(self, keep: bool = False) -> None:
        """One step sat out: the strategy's exchanges with zeros of this member's, the schedule and the data cursor
        moved as on the members that train (they take the batches); `keep`: the step's averages kept. A round whose
        exchange failed leaves the step standing, as it does on those members (CommError: the caller re-forms), so
        that the heal finds this one at their step."""
        step = self.driver.step
        try:
            self.driver.null_step()
            if keep:
                self._keep_step()
        finally:
            if self.driver.step > step:
                if self._epoch_samples:
                    self._epoch_over(self._epoch_samples)
                self._moved_past_a_step()

    def _moved_past_a_step(self) -> None:
        """The schedule and the data cursor moved past a step, as on the members that took its batches."""
        if self.schedule is not None:
            self.schedule.step()
        self.data_cursor += self.samples_per_step

    def _epoch_over(self, epoch_samples: int) -> bool:
        """Whether the next step's batches would run past the epoch's `epoch_samples` (the same on every member):
        then the cursor turns over to the next epoch."""
        if self.data_cursor + self.samples_per_step <= epoch_samples:
            return False
        self.data_epoch, self.data_cursor = self.data_epoch + 1, 0
        return True

    def _run_time(self, trained_s: float) -> float:
        """The run's training time when this member's clock reads `trained_s`: a joiner's clock starts at its
        start, and the run's time goes on from where its healer's stood (so churn that replaces every founder does
        not push run.max_time back)."""
        return self._run_time_offset + trained_s

    def _budget_spent(self, run_time_s: float) -> bool:
        """Whether run.max_time (on the run's clock) or run.max_samples is reached."""
        limit = self.config.run.max_time_s
        return (limit is not None and run_time_s >= limit) or self._samples_spent()

    def _samples_spent(self) -> bool:
        """Whether run.max_samples is reached (the same on every member after a boundary's round)."""
        limit = self.config.run.max_samples
        return limit is not None and self.samples_trained >= limit

    def _set_up_live(self, set_up: Any) -> None:
        """Set the strategy up over the first group (`set_up`); if a member went meanwhile (a group of the setup
        did not form), re-form without it (which re-makes the strategy's groups: the setup has set its model)."""
        try:
            set_up()
        except CommError as e:
            self._regroup(failure=e, heal=False)

    def _first_heal(self) -> None:
        """Every member from member 0's state: a founder its first weights, a joiner all of it."""
        try:
            self._heal(fresh=True)
        except CommError as e:
            self._regroup(failure=e, fresh=True)

    def _step_failed(self, failure: CommError) -> None:
        """A collective of this step failed: the step is discarded here and on every survivor; re-form and heal."""
        self._regroup(failure=failure)

    def _regroup(self, failure: CommError | None, fresh: bool = False, heal: bool = True) -> None:
        """Form the newest generation's group and heal: after `failure` (a collective of this member's failed:
        the members re-form without whoever is gone), or to switch to a newer generation all at one step (None)."""
        self._reforming = Reforming()
        if failure is not None:
            self._failed_again(failure)
            self.member.suspect(self.generation.number)
        engine.abort()  # a peer still waiting in a collective of the old group fails now
        self.strategy.abandon()
        with self._watched():
            while True:
                self._connect_newest()
                if not heal:
                    break
                try:
                    with self._phase("heal"):
                        self._heal(fresh=fresh)
                    break
                except CommError as e:
                    self._failed_again(e)
                    self.member.suspect(self.generation.number)
        self._reformed_record(failure is not None)

    def _failed_again(self, failure: CommError) -> None:
        """Count `failure`; the UNEXPLAINED_FAILURES-th in a row over the same members (none gone, none come, and
        no step or round gone through in between: re-forming has mended nothing) ends this member's part in one
        line, rather than take the step (or the round, or the run's end) again and again. Its peers count the same
        failures and end too."""
        members = tuple(self.generation.members)
        last_members, count = self._failures_in_a_row
        count = count + 1 if members == last_members else 1
        self._failures_in_a_row, self._failed_since_boundary = (members, count), True
        if count >= UNEXPLAINED_FAILURES:
            raise FastError(f"the run's collectives failed {count} times in a row (the last at step {self.step}), "
                            "re-formed each time with every member still in the run, so re-forming does not mend it; "
                            f"the last time: {first_line(failure)}")  # fmt: skip

    @contextlib.contextmanager
    def _watched(self) -> Iterator[None]:
        """Watch a re-form (or a member's first group): one still under way after REFORM_PATIENCE deadlines is
        stuck (a bug: a wait without a deadline, or attempts that can never meet), and rather than hang the run, this
        member writes its threads' stacks beside its records, says so in one line, leaves the membership (the others
        re-form without it) and exits."""
        if self.simulated:  # (a simulated member is a thread of the simulation's process)
            yield
            return
        patience_s = REFORM_PATIENCE * self.config.run.deadline_s
        watchdog = threading.Timer(patience_s, self._stuck, args=(patience_s,))
        watchdog.daemon = True
        watchdog.start()
        try:
            yield
        finally:
            watchdog.cancel()

    def _stacks_to(self, kind: str) -> Path:
        """This member's threads' stacks, written beside its records (`workers/<kind>-<id>.txt`)."""
        stacks = self.run_dir / "workers" / f"{kind}-{self.rank}.txt"
        with open(stacks, "w") as out:
            faulthandler.dump_traceback(out, all_threads=True)
        return stacks

    def _stuck(self, patience_s: float) -> None:
        stacks = self._stacks_to("stuck")
        say(
            f"fast: worker {self.rank} has been re-forming for {patience_s:g}s ({REFORM_PATIENCE} x run.deadline_s) "
            f"and left the run: it is stuck (a bug; its threads' stacks are in {stacks})"
        )
        report_left(self.member.access, self.rank, f"stuck re-forming for {patience_s:g}s")  # (a connection of its own)
        os._exit(STUCK_EXIT_CODE)

    @contextlib.contextmanager
    def _phase(self, name: str) -> Iterator[None]:
        """Time a phase of re-forming (`_reformed_record`): waiting for a generation, for its members to arrive,
        forming its group, healing."""
        started = timing.now()
        try:
            yield
        finally:
            self._reforming.seconds[name] += timing.now() - started

    def _reformed_record(self, failed: bool) -> None:
        """This member's record of a re-form: its seconds, and where they went (the generations it tried, in order:
        those before the last were superseded or did not form)."""
        reforming, clock = self._reforming, getattr(self, "clock", None)
        if clock is None or self.simulated:  # (the founders' set-up; a simulated member's would cost its host a write)
            return
        record = {"worker": self.rank, "kind": "re-formed", "step": self.step, "time_s": round(clock.now(), 4),
                  "generation": self.generation.number, "failed": failed, "generations": reforming.generations,
                  "reform_s": round(timing.now() - reforming.started, 4)}  # fmt: skip
        self.records.add(record | {f"{name}_s": round(s, 4) for name, s in reforming.seconds.items()})

    # -- healing ---------------------------------------------------------------------------------------------------
    def _own_model(self) -> torch.nn.Module:
        """The model whose state a heal moves: the model, or a sharded replica's local shards (shard k's to shard k)."""
        return self.model if self.sharded is None else self.sharded.view

    def _optimizer_state(self) -> dict[str, Any]:
        return self.optimizer.state_dict() if self.sharded is None else local_optimizer_state(self.optimizer)

    def _progress(self) -> dict[str, Any]:
        """Where the run stands: what a member needs to take the next step with the others."""
        schedule = self.schedule.state_dict() if self.schedule is not None else self._schedule_state
        return {"step": self.step, "data": [self.data_epoch, self.data_cursor], "samples": self.samples_trained,
                "run_time_s": self._run_time(self.clock.now()), "schedule": schedule}  # fmt: skip

    def _holdings(self) -> dict[str, Any]:
        """What a member holds: its weights, its optimizer's state, its strategy's state, and their fingerprint."""
        return {"model": {k: v.detach().cpu() for k, v in self._own_model().state_dict().items()},
                "optimizer": self._optimizer_state(), "strategy": self.strategy.state_dict(),
                "fingerprint": fingerprint(self._model_state())}  # fmt: skip

    def _load_progress(self, state: dict[str, Any]) -> None:
        self.driver.step = state["step"]
        self.data_epoch, self.data_cursor = state["data"]
        self.samples_trained = state["samples"]
        # (trained_s: this member's clock at its last step; a joiner's clock starts from 0 once it is healed)
        self._run_time_offset = state["run_time_s"] - self.trained_s
        if self.schedule is not None and state["schedule"] is not None:
            self.schedule.load_state_dict(state["schedule"])
            self._follow_schedule()
        self._schedule_state = state["schedule"]

    def _load_holdings(self, state: dict[str, Any]) -> None:
        unlike = _unlike(state["model"], self._own_model().state_dict())
        if unlike is not None:  # (a joiner given another script, or other settings, than the founders')
            raise UsageError(f"the run's model is not this worker's: {unlike}: a joiner builds the founders' model, "
                             "so give it their script and their --config and --set")  # fmt: skip
        self._own_model().load_state_dict(state["model"])  # (a view's: into the local shards' own memory)
        if self.sharded is None:
            self.optimizer.load_state_dict(state["optimizer"])
        else:
            load_local_optimizer_state(self.optimizer, state["optimizer"])
        self.strategy.load_state_dict(state["strategy"])
        self._holds_state = True

    def _healed_record(self, source: int, fingerprint_of_source: str, **more: Any) -> None:
        if self.generation.number:  # (generation 0: the founders' first weights)
            self.records.add({"worker": self.rank, "kind": "healed", "step": self.step,
                              "time_s": round(self.clock.now(), 4), "from": source,
                              "generation": self.generation.number, "fingerprint": fingerprint(self._model_state()),
                              "source_fingerprint": fingerprint_of_source, **more})  # fmt: skip

    def _take_state_behind(self) -> bool:
        """(A joiner sitting out) the state its source sent when it came in, behind the steps since; a sync joiner
        then applies the steps it kept, as every member applied them. False when a peer went meanwhile (re-formed
        and healed)."""
        incoming, source_id, _ = self._coming
        started = timing.now()
        try:
            state = unpacked(incoming.take(self._superseded))
        except CommError as e:
            self._regroup(failure=e)  # (the heal may resume the line where it broke)
            return False
        self._coming = None
        self._load_holdings(state)
        kept, self._kept_bytes = self._kept or [], 0
        replayed = {"replayed": len(kept)} if self._kept is not None else {}
        if self._resumed_at:
            replayed["resumed_at"] = self._resumed_at
        self._healed_record(source_id, state["fingerprint"], behind=True, waited_s=round(timing.now() - started, 4),
                            sat_out_s=round(timing.now() - self._sat_out_since, 4), **replayed)  # fmt: skip
        self._follow_schedule()  # (the optimizer's state carries its learning rates of when it was sent)
        now = self._optimizer_settings()
        for replay in kept:
            replay()
        self.strategy.sat_out_to(self.step)
        self._optimizer_settings(now)
        if self._kept is not None:
            self._kept = []
        return True

    def _apply_unagreed(self, step: Callable[[], None]) -> None:
        """The step kept when its round broke (`_agree_on_the_step`), applied as the members that took it did: the
        update, then the step's count, the schedule and the data cursor moved (`Job._step_done`)."""
        now = self._optimizer_settings()
        step()
        self._optimizer_settings(now)
        self.driver.step += 1
        self._moved_past_a_step()

    def _sits_out_from(self, step: int, resuming: bool = False) -> int | None:
        """The step up to which a joiner entering at `step` sits out while its state comes behind the steps
        (`Strategy.sits_out_from`); None: it is healed whole (a sharded replica's, a simulated member's, and under a
        user's loop sync's, which may do at its step what no replay does: its own scheduler, a GradScaler)."""
        if self.shards > 1 or self.simulated:
            return None
        until = self.strategy.sits_out_from(step, resuming=resuming)
        return None if until == UNTIL_STATE_COMES and not self.loop_is_fast else until

    def _line_to_resume(self) -> list[int]:
        """(A joiner whose line the last re-form cut) its source's id, the generation that began it, the bytes that
        came (-1: nothing had, so the line starts again), the steps or round means it kept since, and
        the bytes the line carries; -1s when there is none."""
        if self._cut is None:
            return [-1, -1, 0, 0, 0]
        (incoming, source_id, began), kept, _ = self._cut
        if not incoming.cut():
            self._cut = None
            return [source_id, began, -1, len(kept), 0]  # (-1: nothing of it had come: the line starts again)
        return [source_id, began, incoming.received, len(kept), incoming.payload.numel()]

    def _lines_resumed(self, world: Any, rows: torch.Tensor, ids: list[int], behind: list[int], sources: list[int],
                       step: int) -> tuple[dict[int, int], dict[int, str]]:  # fmt: skip
        """The joiners (of `behind`) whose cut line goes on where it was cut, and the source of each: they stand at
        `step` as the others, the source that sent it is one of `sources`, still holds what it sent, and has applied
        since exactly as many steps or round means as the joiner kept (a round that went through on one and not on
        the other would leave them unlike). Collective: a source says which of its lines it can go on with. Beside
        them, the joiners whose cut line starts again, and why (the change's record says)."""
        cut = rows[:, HealRow.CUT_SOURCE :].tolist()  # (a line's source id, generation, bytes in, kept, its bytes)
        sources_by_id = {ids[s]: s for s in sources}
        refused, candidates = {}, []
        for m in behind:
            if cut[m][0] < 0 or int(rows[m, HealRow.NEW]) != HealRow.EMPTY:
                continue
            if cut[m][2] < 0:
                refused[m] = "nothing of it had come"
            elif cut[m][0] not in sources_by_id:
                refused[m] = "its source is gone" if cut[m][0] not in ids else "its source is behind"
            elif int(rows[m, HealRow.STEP]) != step:
                refused[m] = f"at step {int(rows[m, HealRow.STEP])}, the others at {step}"
            else:
                candidates.append(m)
        if not candidates:
            return {}, refused
        me, kept_by_now = world.index(), self.strategy.kept_by_now(self.step)
        verdicts = []  # (the source's, of each candidate: 0 = not its line; else a LineVerdict)
        for m in candidates:
            source, generation, received, kept, _ = cut[m]
            snapshot = self._snapshots.get(ids[m]) if sources_by_id[source] == me else None
            verdict = LineVerdict.NOT_MINE if sources_by_id[source] != me else LineVerdict.of(snapshot, generation,
                      received, kept, kept_by_now)  # fmt: skip
            verdicts.append(verdict)
        with world.unmetered():
            said = control.gathered(world, torch.tensor(verdicts, dtype=torch.int64)).sum(dim=0).tolist()
        said_of = dict(zip(candidates, said, strict=True))
        refused |= {m: LineVerdict.WHY[v] for m, v in said_of.items() if v != LineVerdict.GOES_ON}
        return {m: sources_by_id[cut[m][0]] for m, v in said_of.items() if v == LineVerdict.GOES_ON}, refused

    def _model_state(self) -> dict[str, Any]:
        """What a healed member must hold exactly as its source: weights, optimizer, the strategy's shared state."""
        return {"model": self._own_model().state_dict(), "optimizer": self._optimizer_state(),
                "strategy": self.strategy.shared_state()}  # fmt: skip

    def _heal(self, fresh: bool) -> None:
        """Collective over the new group: each member that is new (`fresh`) or whose step or shared state differs
        from the first member that holds the run's state (member 0, unless it is a joiner not healed yet: when
        worker 0 died, the next may be one) is sent a whole state by one that is not: the first by that member, the
        next by the next such member, and so on, so that several catch-ups go at once, from as many live peers
        (summary `membership`: the catch-ups' bytes and seconds). Where no member holds the state any more (every
        one that did died before the joiners were healed), the run cannot go on."""
        # a sharded replica heals shard for shard: shard k of every replica together, over their own group
        world = self.world if self.shards == 1 else self.groups.replicate
        started, me = timing.now(), world.index()
        # (what the last generation had under way: a joiner's line it cut may be resumed)
        if self._coming is not None and self._kept is not None:
            self._cut = (self._coming, self._kept, self._kept_bytes)
        self._sitting_out, self._coming, self._sending, self._kept, self._kept_bytes = None, None, [], None, 0
        shared = int(fingerprint(self.strategy.shared_state())[:15], 16)
        new = HealRow.EMPTY if not self._holds_state else int(fresh)
        row = [self.rank, self.step, new, shared, int(self._unagreed is not None), *self._line_to_resume()]
        with world.unmetered():
            rows = control.gathered(world, torch.tensor(row, dtype=torch.int64))
        unagreed, self._unagreed = self._unagreed, None
        # (the table is on the host, read once: each member's id, and whether it is new, holds the state or is a joiner)
        ids, news = rows[:, [HealRow.ID, HealRow.NEW]].T.tolist()
        holders = (rows[:, HealRow.NEW] != HealRow.EMPTY).nonzero().flatten()
        if not len(holders):
            members = ", ".join(map(str, ids))
            raise RunEnded("every member that held the run's state is gone, and its joiners were not healed yet "
                           f"(generation {self.generation.number}: {members}): the run cannot go on")  # fmt: skip
        # a member that kept the step whose round a death broke, where a holder applied it, applies it too
        steps = rows[:, HealRow.STEP]
        applies = (rows[:, HealRow.NEW] == 0) & (rows[:, HealRow.UNAGREED] == 1) & (steps + 1 == steps[holders].max())
        rows[applies, HealRow.STEP] += 1
        if applies[me]:
            self._apply_unagreed(unagreed)
        if applies.any():  # their shared state as it is now, the step applied (not as they gathered it before)
            shared = int(fingerprint(self.strategy.shared_state())[:15], 16)
            with world.unmetered():
                rows[:, HealRow.SHARED] = control.gathered(world, torch.tensor([shared], dtype=torch.int64))[:, 0]
        first = int(holders[0])
        # behind: fresh, or at another step or with other shared state than the first holder (a look at the rows at
        # once: a member each, a thousand times over, would cost a simulated run a million looks)
        alike = [HealRow.STEP, HealRow.SHARED]
        late = (rows[:, HealRow.NEW] != 0) | (rows[:, alike] != rows[first, alike]).any(dim=1)
        late[first] = False
        behind = late.nonzero().flatten().tolist()
        sources = (~late).nonzero().flatten().tolist()
        # joiners that sit out the round starting here, their state sent behind the others' steps; and those whose
        # line the last re-form cut, which go on with it, from the source that sent it, for the rest of the round
        step = int(rows[first, HealRow.STEP])
        until, until_resumed = self._sits_out_from(step), self._sits_out_from(step, resuming=True)
        resumable, restarted = {}, {}
        if until_resumed is not None:
            resumable, restarted = self._lines_resumed(world, rows, ids, behind, sources, step)
        to_come = {m: 1 - int(rows[m, HealRow.CUT_BYTES]) / int(rows[m, HealRow.CUT_TOTAL]) for m in resumable}
        source_of, resuming = sources_for(behind, sources, {m: (s, to_come[m]) for m, s in resumable.items()})
        restarted |= {m: "another source had it in sooner" for m in resumable if m not in resuming}
        others = [m for m in behind if m not in resuming]
        joiners = [m for m in others if news[m] == HealRow.EMPTY]
        behind_steps = resuming + (joiners if until is not None else [])
        if behind_steps:
            self._sitting_out = (until_resumed if resuming else until, tuple(behind_steps))
            channel = world.separate_group()  # (collective) the states' own line, beside the round's exchanges
        sent = 0
        # a founder's first weights are the run's start, as a broadcast of them is elsewhere: not metered, in whichever
        # generation first forms (a departure may overtake the first, a joiner come with it); every other catch-up is
        # real traffic that churn costs (over emulated links, it takes their time)
        first_weights = [new == 1 for new in news]

        def metered(member: int) -> Any:
            return world.unmetered() if first_weights[member] else contextlib.nullcontext()

        mine = [member for member, source in source_of.items() if source == me]
        if not mine:
            self._snapshots = {}
        # a whole state: the weights, the optimizer's moments, the strategy's anchors and memories
        limit = limit_for(self._own_model().state_dict(), times=8)
        if mine:
            later = [member for member in mine if member in behind_steps]
            going_on = {ids[m]: self._snapshots[ids[m]] for m in later if m in resuming}
            progress = self._progress()
            holdings = self._holdings() if len(going_on) < len(mine) else None
            whole = packed({**progress, **holdings}) if set(mine) - set(behind_steps) else None
            if len(going_on) < len(later):
                snapshot = Snapshot(packed(holdings), self.generation.number, self.strategy.kept_by_now(self.step))
            # (what this member keeps sending: a snapshot until its joiner has it, the next heal's otherwise)
            self._snapshots = {ids[m]: going_on.get(ids[m]) or snapshot for m in later}
            # in the order the others wait for them: where the run stands, to each joiner that takes its weights
            # behind the next steps; the whole states; then those weights, in the background (on this member's one
            # link, whatever is sent after a state waits for all of it), from where a cut line of theirs ended
            note = packed(progress)
            for member in later:  # (joiners: metered)
                world.send_bytes(note, world.ranks[member])
                sent += note.numel()
            for member in mine:
                if member not in later:
                    with metered(member):
                        world.send_bytes(whole, world.ranks[member])
                    sent += 0 if first_weights[member] else whole.numel()
            lines = []  # (one after another, the lines nearest their end first: `sources_for`)
            for member in later:
                payload = self._snapshots[ids[member]].payload
                cut_at = int(rows[member, HealRow.CUT_BYTES]) if member in resuming else 0
                lines.append((payload, world.ranks[member], cut_at))
                sent += payload.numel() - cut_at
            if lines:
                self._sending.append(channel.isend_bytes_in_turn(lines))
        elif me in source_of:
            source, source_id = world.ranks[source_of[me]], ids[source_of[me]]
            cut, self._cut = self._cut, None
            with metered(me):
                if me in behind_steps:  # its weights taken before the round's mean, as the others step (`_sat_out`)
                    _, progress = world.recv_bytes(source, limit=PROGRESS_BYTES)
                    self._load_progress(unpacked(progress))
                    if me in resuming:  # the rest of the state, on top of what came; and what it kept meanwhile
                        (incoming, _, began), self._kept, self._kept_bytes = cut
                        self._coming = (channel.irecv_bytes(source, limit, incoming), source_id, began)
                        self._resumed_at.append(incoming.received)
                    else:
                        self._coming = (channel.irecv_bytes(source, limit), source_id, self.generation.number)
                        self._kept, self._resumed_at, self._sat_out_since = [], [], timing.now()
                else:
                    _, payload = world.recv_bytes(source, limit=limit)
                    state = unpacked(payload)
                    self._load_progress(state)
                    self._load_holdings(state)
                    self._healed_record(source_id, state["fingerprint"])
        if behind:  # every catch-up is done: what each source sent
            with world.unmetered():
                sent = int(control.gathered(world, torch.tensor([sent], dtype=torch.int64)).sum())
        if self.shards > 1:  # every shard's catch-ups, the replica's
            with self.groups.shard.unmetered():
                sent = int(control.gathered(self.groups.shard, torch.tensor([sent], dtype=torch.int64)).sum())
        if self.is_main:  # (who does worker 0's duties) notes the change where the next one to do them finds it
            generation = self.generation
            founders = {"generation": -1, "members": self.member.generation(0).members}
            before = next(iter(self.member.changes(last=True)), founders)
            # what changed since the last generation that formed (those in between were superseded)
            skipped = [self.member.generation(n) for n in range(before["generation"] + 1, generation.number + 1)]
            now, then = set(generation.members), set(before["members"])
            gone = [m for m in before["members"] if m not in now]
            self.member.note_change({
                "generation": generation.number,
                "step": self.step,
                "unix_time": timing.wall(),
                "members": generation.members,
                "joined": [m for m in generation.members if m not in then],
                "left": [entry for g in skipped for entry in g.left if entry["member"] in gone],
                "healed": [ids[i] for i in behind],
                "healed_from": [ids[source_of[i]] for i in behind],
                "healed_behind": [ids[i] for i in behind_steps],  # (their state came behind the steps)
                "resumed": [ids[i] for i in resuming],  # (on a line the last re-form cut, where it was cut)
                "restarted": {str(ids[i]): why for i, why in restarted.items()},  # (a cut line not resumed)
                "catch_up_bytes": sent,
                "catch_up_s": round(timing.now() - started, 4),
            })  # fmt: skip
        if fresh:
            self._boundary_at = -1

    def _membership_ends(self) -> None:
        """The run is ending: the membership takes nobody in any more. Members in step all end at the same step, and
        the first there says so (member 0 may have died meanwhile); a detached run is ended by its member 0 alone."""
        if self.is_main or not self.detached:
            self.member.ending()

    def _close_membership(self) -> None:
        self.member.close()


def _unlike(theirs: dict[str, Any], mine: dict[str, Any]) -> str | None:
    """The first difference in names or shapes between two models' states, said in words; None when alike."""
    if only_theirs := sorted(theirs.keys() - mine.keys()):
        return f"the run's has {only_theirs[0]}, which this one has not"
    if only_mine := sorted(mine.keys() - theirs.keys()):
        return f"this one has {only_mine[0]}, which the run's has not"
    for name, tensor in mine.items():
        if tuple(theirs[name].shape) != tuple(tensor.shape):
            return f"{name} is {list(theirs[name].shape)} in the run and {list(tensor.shape)} here"
    return None
