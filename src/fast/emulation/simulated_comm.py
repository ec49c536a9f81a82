"""The simulated engine's `Comm`: every process of the run is a task of one `Simulation`, in virtual time.

`SimComm` is an emulated `Comm` whose messages never leave the process: a message is a copy of its payload put
in the receiver's mailbox when it is sent. It becomes deliverable when the link model says (`Network.transmit`:
the sender's NIC, bandwidth, latency, jitter, loss, outages) and the receiver has it once its own NIC has taken
it in (`Network.arrival`), as under emulation, but on the simulation's clock. Without `[network]` the links are
ideal (no latency, no transfer time).

A collective is not run message by message (a ring all-reduce of N workers would cost the host N² messages):
the members meet, the last to arrive computes the result once, and every member has it when the algorithm the
emulated collective runs would have finished: a ring all-reduce 2(N−1) rounds and a ring all-gather N−1
rounds, each as long as its slowest hop (latency plus the chunk over the bandwidth), a binomial broadcast and a
dissemination barrier ⌈log2 N⌉ rounds. A group's collectives run one after another in the order they were
called, as the emulated ones do; each member's bytes are counted exactly as the emulated rounds count them.
Measurement traffic (`unmetered()`) takes no time, as under emulation.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from fast.comm import timeline, timing
from fast.comm.comm import RECV_BYTES, Handle, MessageLost, check_length
from fast.comm.scheduler import current_task
from fast.emulation.network import EmulatedComm, Stamp, Transmission, _as_bytes, reduce_into, sleep_until
from fast.emulation.wire import Meeting, Message, Wire, wire
from fast.errors import CommError


class _Until:
    """The work of a send: done when its last byte has left the sender's NIC."""

    def __init__(self, at: float) -> None:
        self.at = at

    def is_completed(self) -> bool:
        return timing.now() >= self.at

    def wait(self, timeout: timedelta) -> bool:
        sleep_until(self.at)
        return True


class _Receive:
    """The work of a receive: the next message for it from `src` (or anyone) on `tag`, once it is in."""

    def __init__(self, comm: SimComm, src: int | None, tag: int) -> None:
        self.comm, self.src, self.tag = comm, src, tag
        self.message: Message | None = None
        self._arrived_at: float | None = None

    def _key(self) -> tuple[int, int]:
        return self.comm.group_id, self.comm.rank

    def is_completed(self) -> bool:
        wire = self.comm.wire
        if self.message is None:
            self.message = wire.take(*self._key(), self.src, self.tag)
        return self.message is not None and timing.now() >= self._arrival()

    def _arrival(self) -> float:
        message = self.message
        assert message is not None
        if self._arrived_at is None:
            stamp = Stamp(message.deliver_at, message.payload is None, message.length, message.measurement)
            self._arrived_at = self.comm._arrival(message.src, message.length, stamp)
        return self._arrived_at

    def wait(self, timeout: timedelta) -> bool:
        sim, wire = self.comm.sim, self.comm.wire
        deadline = sim.now + timeout.total_seconds()
        while self.message is None:
            self.message = wire.take(*self._key(), self.src, self.tag)
            if self.message is not None:
                break
            if self.src is not None and self.src in wire.gone:
                raise RuntimeError(f"Connection closed by peer: worker {self.src} is gone ({wire.gone[self.src]})")
            if sim.now >= deadline:
                raise RuntimeError("Timed out waiting for a message")
            nxt = wire.next_at(*self._key(), self.src, self.tag)
            until = deadline if nxt is None else min(nxt, deadline)
            waiters = wire.waiters[(*self._key(), self.src)]
            task = current_task()
            waiters.append(task)
            try:
                sim.park(until - sim.now, f"a message from {'anyone' if self.src is None else f'worker {self.src}'}")
            finally:
                waiters.remove(task)
        sleep_until(self._arrival())
        return True


class SimComm(EmulatedComm):
    """One simulated process's view of a group (see the module docstring)."""

    def __init__(self, *, wire: Wire, group_id: int, **kwargs: Any) -> None:
        self.wire, self.group_id = wire, group_id
        self.sim = wire.sim
        self._made = 0  # groups this process made from this one (every member makes them in the same order)
        self._collectives = 0  # collectives this process called on this group (the same order on every member)
        self._name: str | None = None  # (_group_name)
        super().__init__(network=wire.networks[kwargs["rank"]], world_size=wire.world_size, **kwargs)

    def _group_name(self) -> str:
        """The group, as errors and waits name it (made once: a thousand ranks written out at every collective would
        cost each member a thousand)."""
        if self._name is None:
            ranks = self.ranks
            listed = f"{ranks}" if len(ranks) <= 16 else f"[{ranks[0]}, {ranks[1]}, ..., {ranks[-1]}] ({len(ranks)})"
            self._name = f"the group {listed}"
        return self._name

    def _derived(self, *, group: Any, ranks: list[int], device: torch.device | str) -> SimComm:
        comm = SimComm(wire=self.wire, group_id=group, deadline_s=self.deadline_s, device=device,
                       counter=self.counter, ranks=ranks, rank=self.rank)  # fmt: skip
        comm.key = self.child_key(ranks)
        return comm

    def _new_group(self, ranks: list[int]) -> int:
        self._made += 1
        return self.wire.group((self.group_id, tuple(ranks), self._made))

    def separate_group(self) -> SimComm:
        comm = self._derived(group=self._new_group(self.ranks), ranks=self.ranks, device="cpu")
        self._channels.append(comm)
        return comm

    def subgroups(self, partition: list[list[int]], *, gloo: bool = False) -> SimComm | None:
        mine = None
        for ranks in partition:
            group = self._new_group(list(ranks))
            if self.rank in ranks:
                mine = self._derived(group=group, ranks=list(ranks), device="cpu")
        return mine

    # -- point to point -------------------------------------------------------------------------------------
    def _transmit(self, dst: int, nbytes: int, tag: int, droppable: bool) -> Transmission:
        if dst in self.wire.gone:
            raise CommError(f"send with worker {dst} failed: worker {dst} is gone ({self.wire.gone[dst]})")
        return super()._transmit(dst, nbytes, tag, droppable)

    def _post(self, dst: int, tag: int, payload: torch.Tensor, tx: Transmission, length: int) -> None:
        kept = None if tx.lost else payload.clone()
        self.wire.post(self.group_id, dst, Message(self.rank, tag, kept, length, tx.deliver_at, 0, tx.measurement))

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0, droppable: bool = False) -> Handle:
        payload = _as_bytes(tensor)
        self._message(self.rank, dst, tag)
        tx = self._transmit(dst, payload.numel(), tag, droppable)
        self._post(dst, tag, payload, tx, payload.numel())
        self.counter.add_sent(dst, payload.numel())
        return Handle(_Until(tx.sent_at), "send", f"worker {dst}", self.deadline_s)

    def _irecv(self, tensor: torch.Tensor, src: int | None, tag: int) -> tuple[Handle, Any]:
        work = _Receive(self, src, tag)
        nbytes = tensor.numel() * tensor.element_size()

        def peer() -> int:
            assert work.message is not None
            return work.message.src

        def arrived() -> torch.Tensor:
            message = work.message
            assert message is not None
            if message.payload is None:
                raise MessageLost(f"a droppable message from worker {message.src} (tag {tag}) was lost on its link")
            if message.length != nbytes:
                raise CommError(f"recv from worker {message.src}: {message.length} bytes came, {nbytes} expected")
            tensor.copy_(message.payload.view(tensor.dtype).view(tensor.shape))
            self.counter.add_received(message.src, nbytes)
            return tensor

        name = f"worker {src}" if src is not None else "any worker"
        return Handle(work, "recv", name, self.deadline_s, tensor, arrived), peer

    def send_bytes(self, payload: torch.Tensor, dst: int, tag: int = 0, droppable: bool = False) -> None:
        n = payload.numel()
        self._message(self.rank, dst, tag)
        tx = self._transmit(dst, 8 + n, tag, droppable)
        self._post(dst, tag, payload.contiguous(), tx, 8 + n)
        self.counter.add_sent(dst, 8 + n)
        sleep_until(tx.sent_at)

    def recv_bytes(self, src: int | None = None, tag: int = 0, limit: int = RECV_BYTES) -> tuple[int, torch.Tensor]:
        work = _Receive(self, src, tag)
        Handle(work, "recv", f"worker {src}" if src is not None else "any worker", self.deadline_s).wait()
        message = work.message
        assert message is not None
        self._message(message.src, self.rank, tag)
        if message.payload is None:
            raise MessageLost(f"a droppable message from worker {message.src} (tag {tag}) was lost on its link")
        check_length(message.src, message.payload.numel(), limit)
        self.counter.add_received(message.src, message.length)
        return message.src, message.payload

    # -- collectives: priced, not run message by message (see the module docstring) --------------------------------
    def _meet(self, op: str, brought: Any, combine: Any, rounds_s: Any, result: Any, on_done: Any = None) -> Handle:
        """Join this group's next collective with `brought`; the last member to join computes `combine(brought by
        rank)` and the time the rounds take (`rounds_s()`, 0 for measurement traffic). Returns the Handle whose
        wait ends when the collective has."""
        self._collectives += 1
        wire, key = self.wire, (self.group_id, self._collectives)
        meeting = wire.meetings.get(key)
        if meeting is None:
            meeting = wire.meetings[key] = Meeting(list(self.ranks), {}, waiting=[])
        meeting.brought[self.rank] = brought
        if len(meeting.brought) == len(meeting.members):
            meeting.result = combine(meeting.brought)
            start = max(self.sim.now, wire.busy_until[self.group_id])
            meeting.done_at = start + (rounds_s() if self.counter.metered else 0.0)
            wire.busy_until[self.group_id] = meeting.done_at
            for task in meeting.waiting or []:
                self.sim.wake(task, meeting.done_at)
        handle = Handle(_Attend(self, key, meeting), op, self._group_name(), self.deadline_s, result, on_done)
        handle.ticket = timeline.ticket(self.key, issue=True)
        return handle

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", async_op: bool = False) -> Handle | torch.Tensor:
        if op not in ("sum", "mean", "max", "min"):
            raise ValueError(f"all_reduce op must be sum, mean, max or min, not {op!r}")
        n, i = self.size, self.index()
        numel, size = tensor.numel(), tensor.element_size()

        def chunk(k: int) -> int:  # the bytes of chunk k of the ring (as tensor_split cuts the tensor in n)
            return (numel // n + (k % n < numel % n)) * size

        # the reduce-scatter sends every chunk but (i + 1)'s and the all-gather every one but (i + 2)'s; each member
        # receives every chunk but its own, then every one but (i + 1)'s (a sum over the 2(N - 1) rounds, in O(1))
        total = numel * size
        self._count(2 * total - chunk(i + 1) - chunk(i + 2), 2 * total - chunk(i) - chunk(i + 1))

        def combine(brought: dict[int, torch.Tensor]) -> torch.Tensor:
            parts = [brought[r] for r in self.ranks]
            total = parts[0].clone()
            for part in parts[1:]:
                reduce_into(total, part, op)
            return total.div_(n) if op == "mean" else total

        def rounds_s() -> float:
            return 2 * (n - 1) * self.wire.hop_s(self.ranks, chunk(0))

        handle = self._meet("all_reduce", tensor.detach().clone(), combine, rounds_s, tensor,
                            lambda: tensor.copy_(handle._work.meeting.result))  # fmt: skip
        return handle if async_op else handle.wait()

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        n = self.size
        nbytes = tensor.numel() * tensor.element_size()
        self._count((n - 1) * nbytes, (n - 1) * nbytes)
        handle = self._meet("all_gather", tensor.detach().clone(), lambda brought: _stacked(brought, self.ranks),
                            lambda: (n - 1) * self.wire.hop_s(self.ranks, nbytes), None)  # fmt: skip
        handle.wait()
        result = handle._work.meeting.result
        # one copy of the stack each, in rows (a copy of each row each would be N² copies)
        return list(result.clone().unbind(0)) if isinstance(result, torch.Tensor) else [t.clone() for t in result]

    def all_gather_once(self, tensor: torch.Tensor, make: Callable[[torch.Tensor], Any]) -> Any:
        """`make(every member's tensor, stacked in group order)`, made once by the last member to arrive and returned
        to every member (to read: one object for all), timed and counted as `all_gather` is. What the members work
        out alike from an all-gather (the workers' checks) costs the run N rows, not N² (fast.runtime.control)."""
        n = self.size
        nbytes = tensor.numel() * tensor.element_size()
        self._count((n - 1) * nbytes, (n - 1) * nbytes)
        handle = self._meet("all_gather", tensor.detach().clone(), lambda brought: make(_stacked(brought, self.ranks)),
                            lambda: (n - 1) * self.wire.hop_s(self.ranks, nbytes), None)  # fmt: skip
        handle.wait()
        return handle._work.meeting.result

    def all_gather_bytes(self, payload: torch.Tensor) -> list[torch.Tensor]:
        """Every member's payload, timed and counted as `Comm.all_gather_bytes`'s two all-gathers are (the lengths,
        then the payloads padded to the longest). Every member gets the same tensors, to read: a copy each would
        cost N² copies (a million at 1,024 workers, at the end of every run)."""
        n = self.size
        if n == 1:
            return [payload.clone()]
        self._count((n - 1) * 8, (n - 1) * 8)
        lengths = self._meet("all_gather", payload.numel(), lambda brought: [brought[r] for r in self.ranks],
                             lambda: (n - 1) * self.wire.hop_s(self.ranks, 8), None)  # fmt: skip
        lengths.wait()
        longest = max(lengths._work.meeting.result)
        self._count((n - 1) * longest, (n - 1) * longest)
        handle = self._meet("all_gather", payload.detach().clone(), lambda brought: [brought[r] for r in self.ranks],
                            lambda: (n - 1) * self.wire.hop_s(self.ranks, longest), None)  # fmt: skip
        handle.wait()
        return list(handle._work.meeting.result)

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        n, nbytes = self.size, tensor.numel() * tensor.element_size()
        relative = (self.index() - self.index(src)) % n
        lowest = relative & -relative if relative else 1 << (n - 1).bit_length()
        children = sum(1 for mask in _powers_below(lowest) if relative + mask < n)
        self._count(children * nbytes, nbytes if relative else 0)
        handle = self._meet("broadcast", tensor.detach().clone() if self.rank == src else None,
                            lambda brought: brought[src], lambda: (n - 1).bit_length() * self.wire.tree_round_s(
                                self.ranks, nbytes), tensor)  # fmt: skip
        handle.wait()
        if self.rank != src:
            tensor.copy_(handle._work.meeting.result)
        return tensor

    def barrier(self) -> None:
        n = self.size
        with self.unmetered():
            self._meet("barrier", None, lambda brought: None,
                       lambda: (n - 1).bit_length() * self.wire.tree_round_s(self.ranks, 0), None).wait()  # fmt: skip

    def _count(self, sent: int, received: int) -> None:
        if self.size > 1:
            right, left = self._ring_neighbours()
            self.counter.add_sent(right, sent)
            self.counter.add_received(left, received)


def _stacked(brought: dict[int, torch.Tensor], ranks: list[int]) -> torch.Tensor | list[torch.Tensor]:
    """The members' tensors in group order, stacked where they agree in shape and type (as an all-gather's must)."""
    parts = [brought[r] for r in ranks]
    first = parts[0]
    if all(p.shape == first.shape and p.dtype == first.dtype for p in parts):
        return torch.stack(parts)
    return parts


def _powers_below(limit: int) -> list[int]:
    """1, 2, 4, ... below `limit`: the masks of a binomial tree under a member whose lowest set bit is `limit`."""
    return [1 << k for k in range(max(0, limit.bit_length() - 1))]


class _Attend:
    """The work of a collective: done once every member has joined and its rounds' time has passed."""

    def __init__(self, comm: SimComm, key: tuple[int, int], meeting: Meeting) -> None:
        self.comm, self.key, self.meeting = comm, key, meeting

    def is_completed(self) -> bool:
        return self.meeting.done_at is not None and timing.now() >= self.meeting.done_at

    def wait(self, timeout: timedelta) -> bool:
        sim, wire, meeting = self.comm.sim, self.comm.wire, self.meeting
        deadline = sim.now + timeout.total_seconds()
        while meeting.done_at is None:
            gone = [r for r in wire.gone if r in meeting.member_set and r not in meeting.brought]
            if gone:  # (it can never complete)
                self._done()
                raise RuntimeError(f"Connection closed by peer: worker {gone[0]} is gone ({wire.gone[gone[0]]})")
            if sim.now >= deadline:
                raise RuntimeError("Timed out waiting for the other members of a collective")
            task = current_task()
            assert meeting.waiting is not None
            meeting.waiting.append(task)
            try:
                sim.park(deadline - sim.now, f"the others in a collective of {self.comm._group_name()}")
            finally:
                meeting.waiting.remove(task)
        sleep_until(meeting.done_at)
        self._done()
        return True

    def _done(self) -> None:
        """This member is done with the collective, completed or broken by a member gone: once every part left in it
        is a gone member's, it is dropped (a broken generation's parts, a member's gradients or weights each, would
        otherwise stay to the end of the run)."""
        wire, meeting = self.comm.wire, self.meeting
        meeting.brought.pop(self.comm.rank, None)
        if wire.meetings.get(self.key) is meeting and all(rank in wire.gone for rank in meeting.brought):
            del wire.meetings[self.key]


def world(rank: int, device: torch.device, deadline_s: float) -> SimComm:
    """Simulated process `rank`'s Comm over every process of the run (what `bootstrap.start` is to a real one)."""
    if device.type != "cpu":
        raise CommError('the simulated engine runs on the CPU: set run.device = "cpu" with run.engine = "simulated"')
    the_wire = wire()
    return SimComm(wire=the_wire, group_id=the_wire.group(("world",)), deadline_s=deadline_s, device=device,
                   rank=rank)  # fmt: skip
