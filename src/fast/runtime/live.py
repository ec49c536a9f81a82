"""A worker's part in live membership (`run.elastic`): it forms each generation's group, switches at its strategy's
change points, survives a step a lost peer broke, and heals from a live peer (a part of fast.runtime.job.Job).

Before each step (in the loader, before its batch is chosen, or at the step's first forward) the members take one
round together: member 0 reads whether the coordinator (fast.runtime.membership) has published a newer generation,
and every member learns it at the same step. They then leave their group, form the new one, and heal: member 0,
the oldest member, sends its whole state (weights, optimizer, step, schedule, data position, strategy state) to
each joiner and to each member whose step is not its own, never through a file. A step whose collective fails (a
peer died in it) is discarded on every survivor: no update is applied, the data cursor does not move, and the step
is taken again over the new group, so no sample is lost or seen twice.

The data of an elastic run is one cursor through each epoch's order, the same on every member: at each step the
member of rank r of n takes the r-th of the next n batches, so a change of membership moves no sample.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import signal
import time
from typing import Any

import torch

from fast.comm import bootstrap as engine
from fast.emulation.deployment import comm_maker, network_for
from fast.errors import CommError, FastError
from fast.runtime import control
from fast.runtime.control import Control
from fast.runtime.membership import FORM_S, Generation, Member, RunEnded


def fingerprint(state: dict[str, Any]) -> str:
    """A hash of every tensor of a model's and an optimizer's state, in order: equal exactly when they are."""
    digest = hashlib.sha256()

    def add(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            digest.update(value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
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


class Live:
    """The live-membership part of a Job (only used when `run.elastic`)."""

    def _start_membership(self) -> None:
        """Join the membership (a founder, or a joiner `fast join` had admitted) and form the first group."""
        self.member = Member(os.environ["FAST_MEMBERSHIP"], self.rank, self.config.run.deadline_s)
        self.joining = os.environ.get("FAST_JOINING") == "1"
        self.generation: Generation | None = None
        self.membership: list[dict[str, Any]] = []  # member 0's record of each change (summary.json)
        self._boundary_at = -1  # the step whose membership round is done
        self.data_epoch, self.data_cursor = 0, 0
        if self.joining:
            self.member.ready()
        self._connect_newest(dropped_if_absent=False)
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
            newest = self.member.newest()
            if newest > after or self.generation is None:
                generation = self.member.generation(newest)
            else:
                generation = self.member.wait_for(after)
            if generation.failed:
                raise RunEnded(generation.failed)
            if self.rank not in generation.members:
                if dropped_if_absent:
                    raise FastError(f"worker {self.rank} was dropped from the run's membership (its peers found it "
                                    "gone): join it again with fast join")  # fmt: skip
                generation = self.member.wait_for(newest, including=self.rank)
            after = generation.number
            if not self.member.arrive(generation):
                continue
            try:
                self._form(generation)
                return
            except CommError:
                self.member.suspect(generation.number)

    def _form(self, generation: Generation) -> None:
        """Leave the old group and form `generation`'s: the world, the control group, the strategy's groups."""
        counter = self.world.counter if getattr(self, "world", None) is not None else None
        engine.abort()  # what is left of a group formed before, or half formed
        n, rank = len(generation.members), generation.members.index(self.rank)
        network = network_for(self.config, n, rank)  # emulated links: the same between any two members
        self.generation = generation
        try:
            world = engine.start_group(self.member.group_store(generation), rank, n, self.device,
                                       self.config.run.deadline_s, counter, comm_maker(network), FORM_S)  # fmt: skip
            world.interrupted = self._superseded
            control = world.subgroups([list(range(n))], gloo=True, connect_s=FORM_S)
        except RuntimeError as e:  # a member went between arriving and forming (the store's wait gave up)
            raise CommError(f"forming generation {generation.number}: {str(e).splitlines()[0]}") from None
        if network is not None:
            network.start_clock()
        self.world = self.comm = world
        self.world_size = self.workers = n
        self.control = Control(control, rank, False, self.config.strategy.name)
        world.barrier()
        self._boundary_at = -1
        context = getattr(self, "context", None)
        if context is not None:
            context.comm = context.world = world
            context.workers = n
            self.strategy.comm = self.strategy.world = world
            if getattr(self.strategy, "model", None) is not None:
                self.strategy.regroup()

    def _superseded(self) -> str | None:
        """Why a wait in this generation's group should give up: the coordinator has published a newer one (a peer
        is gone, or one of them found a collective broken), which the members re-form without waiting any longer."""
        newest = self.member.newest()
        return f"the membership changed (generation {newest})" if newest > self.generation.number else None

    # -- at each step ----------------------------------------------------------------------------------------------
    def _membership_boundary(self) -> None:
        """The members' round before a step: switch to a newer generation, all at this step (and heal)."""
        if self._boundary_at == self.step or not self.strategy.change_point(self.step):
            return
        while True:
            limit = self.config.run.max_time_s
            newer = int(self.member.newest() > self.generation.number) if self.world.rank == 0 else 0
            out_of_time = int(limit is not None and self.trained_s >= limit)
            try:
                answer = self.control.round(control.MEMBERSHIP, self.step, [newer, out_of_time], set())
            except CommError:
                self._regroup(failed=True)
                continue
            if answer.any(1):
                self._stopping = True
            if not answer.any(0):
                self._boundary_at = self.step
                return
            self._regroup(failed=False)

    def _step_failed(self) -> None:
        """A collective of this step failed: the step is discarded here and on every survivor; re-form and heal."""
        self._regroup(failed=True)

    def _regroup(self, failed: bool) -> None:
        if failed:
            self.member.suspect(self.generation.number)
        engine.abort()  # a peer still waiting in a collective of the old group fails now
        self.strategy.abandon()
        while True:
            self._connect_newest()
            try:
                self._heal(fresh=False)
                return
            except CommError:
                self.member.suspect(self.generation.number)

    # -- healing ---------------------------------------------------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        schedule = self.schedule.state_dict() if self.schedule is not None else self._schedule_state
        return {
            "model": {k: v.detach().cpu() for k, v in self.model.state_dict().items()},
            "optimizer": self.optimizer.state_dict(),
            "step": self.step,
            "data": [self.data_epoch, self.data_cursor],
            "schedule": schedule,
            "strategy": self.strategy.state_dict(),
        }

    def _load_state(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.driver.step = state["step"]
        self.data_epoch, self.data_cursor = state["data"]
        if self.schedule is not None and state["schedule"] is not None:
            self.schedule.load_state_dict(state["schedule"])
        self._schedule_state = state["schedule"]
        self.strategy.load_state_dict(state["strategy"])

    def _model_state(self) -> dict[str, Any]:
        """What a healed member must hold exactly as its source: weights, optimizer, the strategy's shared state."""
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "strategy": self.strategy.shared_state()}  # fmt: skip

    def _heal(self, fresh: bool) -> None:
        """Collective over the new group: member 0 sends its state to each member that is new (`fresh`) or whose
        step or shared state differs from its own (summary `membership`: the catch-up's bytes and seconds)."""
        world, started = self.world, time.monotonic()
        shared = int(fingerprint(self.strategy.shared_state())[:15], 16)
        with world.unmetered():
            rows = world.all_gather(torch.tensor([self.rank, self.step, int(fresh), shared], dtype=torch.int64))
        source = rows[0]
        behind = [i for i, row in enumerate(rows) if i and (int(row[2]) or not torch.equal(row[1::2], source[1::2]))]
        sent = 0
        # the founders' first weights are the run's start, as a broadcast of them is elsewhere: not metered; every
        # later catch-up is real traffic that churn costs (over emulated links, it takes their time)
        metered = world.unmetered() if self.generation.number == 0 else contextlib.nullcontext()
        if world.rank == 0 and behind:
            buffer = io.BytesIO()
            state = self._state()
            torch.save({**state, "fingerprint": fingerprint(self._model_state())}, buffer)
            payload = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
            with metered:
                for i in behind:
                    world.send_bytes(payload, i)
            sent = payload.numel() * len(behind)
        elif world.rank in behind:
            with metered:
                _, payload = world.recv_bytes(0)
            state = torch.load(io.BytesIO(payload.numpy().tobytes()), weights_only=True)
            self._load_state(state)
            if self.generation.number:  # (generation 0: the founders' first weights)
                self.records.add({"worker": self.rank, "kind": "healed", "step": self.step,
                                  "time_s": round(self.clock.now(), 4), "from": int(rows[0][0]),
                                  "generation": self.generation.number, "fingerprint": fingerprint(self._model_state()),
                                  "source_fingerprint": state["fingerprint"]})  # fmt: skip
        if world.rank == 0 and self.is_main:
            generation = self.generation
            before = self.membership[-1] if self.membership else {"generation": -1, "members": []}
            # what changed since the last generation that formed (those in between were superseded)
            skipped = [self.member.generation(n) for n in range(before["generation"] + 1, generation.number + 1)]
            gone = [m for m in before["members"] if m not in generation.members]
            self.membership.append({
                "generation": generation.number,
                "step": self.step,
                "unix_time": time.time(),
                "members": generation.members,
                "joined": [m for m in generation.members if m not in before["members"]] if before["members"] else [],
                "left": [entry for g in skipped for entry in g.left if entry["member"] in gone],
                "healed": [int(rows[i][0]) for i in behind],
                "healed_from": self.rank,
                "catch_up_bytes": sent,
                "catch_up_s": round(time.monotonic() - started, 4),
            })  # fmt: skip
        if fresh:
            self._boundary_at = -1

    def _membership_ends(self) -> None:
        """The run is ending: member 0 closes the membership to joiners; every member stops its heartbeats."""
        if self.is_main:
            self.member.ending()

    def _close_membership(self) -> None:
        self.member.close()
