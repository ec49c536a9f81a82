"""Emulated deployments in `comm`: every message pays for its real size on its link, for every strategy.

`EmulatedComm` is a `Comm` whose messages travel on emulated links (`LinkTable`). A rank has one NIC: its
outgoing messages go on the wire one after another, each taking bytes / bandwidth of its own link (the
message's real payload), and arrive one latency (± jitter) after their last byte left. The NIC takes
messages in one at a time too: one that arrives while another is still coming in waits for it (a server
that N workers push to receives N messages one after another). Sending and receiving do not interfere
(full duplex). All processes share one machine, so `timing.wall()` is a common clock: the sender stamps
each message with the time it becomes deliverable, and the receiver sleeps until then (and until its NIC
has taken the message in). The sender's handle completes when the NIC has finished sending.

Under emulation the collectives are rounds of point-to-point messages, so each message pays its own link:
all-reduce is a ring (reduce-scatter, then all-gather, of N chunks), all-gather a ring, broadcast a
binomial tree and barrier a dissemination barrier (empty messages: latency only, no bytes). They run, in
the order they were called, on one background thread per group, on a tag strategies do not use; so an
`all_reduce(..., async_op=True)` overlaps with the caller's computation as it would on a real network.

Faults: a message sent with `droppable=True` is lost with its link's `loss` probability, or when its link
is down; the receiver then gets `MessageLost` (a marker travels instead of the payload, so nothing hangs).
Other messages wait until a down link is up again; such a waiting message does not hold the NIC for other
links. Traffic inside `unmetered()` (measurement only) bypasses the emulated links.
"""

from __future__ import annotations

import queue
import struct
import threading
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from fast.comm import tags, timeline, timing
from fast.comm.comm import RECV_BYTES, Comm, Handle, MessageLost, check_length, post, sender_of
from fast.comm.seeded import uniform
from fast.comm.waiting import waiting
from fast.emulation.links import LinkTable
from fast.errors import CommError

COLLECTIVE_TAG = tags.COLLECTIVE  # the tag of emulated collectives' rounds
HEADER_BYTES = 32  # deliverable-at time, flags, payload length, padding (keeps payload views aligned)
_HEADER = struct.Struct("<dqq8x")
IDLE_S = 30.0  # a group's thread of emulated collectives ends once idle this long (`_Rounds`)
_LOST, _MEASUREMENT = 1, 2  # header flags


@dataclass(frozen=True)
class Transmission:
    """When a message's last byte leaves the sender (`sent_at`), when the receiver may have it
    (`deliver_at`), both on timing.wall()'s clock, and whether it is lost on the way."""

    sent_at: float
    deliver_at: float
    lost: bool = False
    measurement: bool = False  # unmetered traffic: not on the emulated links


class Stamp(NamedTuple):
    """What a message's header says: when it is deliverable, whether it was lost, the payload length,
    and whether it is measurement traffic."""

    deliver_at: float
    lost: bool
    length: int
    measurement: bool


class Network:
    """One process's side of the emulated network: its NIC, its outgoing links, what happened on them.

    Shared by every group of the process (main group, channels, subgroups), so background threads' messages
    queue behind the main thread's on the same NIC.
    """

    def __init__(self, links: LinkTable, rank: int, seed: int) -> None:
        self.links, self.rank, self.seed = links, rank, seed
        self.origin = timing.wall()
        self._lock = threading.Lock()
        self._nic_free_at = 0.0
        self._ingress_free_at = 0.0
        self._last_delivery: dict[int, float] = defaultdict(float)
        self._streams = 0
        self.messages = 0
        self.lost_to_loss = 0
        self.lost_to_outage = 0
        self.waited_for_outage_s = 0.0

    def start_clock(self, origin: float | None = None) -> None:
        """Fault times count from here: the common start of training."""
        self.origin = timing.wall() if origin is None else origin

    def new_stream(self) -> int:
        """A number for a new group of this process: keys its messages' random draws."""
        with self._lock:
            self._streams += 1
            return self._streams

    def transmit(self, dst: int, nbytes: int, key: tuple[int, ...], droppable: bool) -> Transmission:
        """Book the NIC for a message of `nbytes` to `dst`; `key` names the message for its random draws."""
        link = self.links.link(self.rank, dst)
        draw = (self.seed, self.rank, dst, *key)
        with self._lock:
            self.messages += 1
            start = max(timing.wall(), self._nic_free_at)
            up_at = self.origin + self.links.up_again_at(self.rank, dst, start - self.origin)
            lost = False
            if up_at > start and droppable:
                lost = True
                self.lost_to_outage += 1
            elif up_at > start:  # wait for the link, without holding the NIC for the other links
                self.waited_for_outage_s += up_at - start
                start = up_at
            else:
                self._nic_free_at = start + link.transfer_s(nbytes)
            if not lost and droppable and link.loss > 0 and uniform(*draw, "loss") < link.loss:
                lost = True
                self.lost_to_loss += 1
            sent_at = start + link.transfer_s(nbytes)
            latency = link.latency_s
            if link.jitter_s > 0:
                latency = max(0.0, latency + link.jitter_s * (2 * uniform(*draw, "jitter") - 1))
            deliver_at = max(sent_at + latency, self._last_delivery[dst])  # links keep messages in order
            if not lost:
                self._last_delivery[dst] = deliver_at
        return Transmission(sent_at, deliver_at, lost)

    def arrival(self, src: int, nbytes: int, deliver_at: float) -> float:
        """When a message from `src` is fully in: its bytes come in during the transfer time before
        `deliver_at`, or after the message before it if the NIC is still taking that one in."""
        transfer_s = self.links.link(src, self.rank).transfer_s(nbytes)
        with self._lock:
            arrived = max(deliver_at, self._ingress_free_at + transfer_s)
            self._ingress_free_at = arrived
        return arrived

    def record(self) -> dict[str, Any]:
        with self._lock:
            return {
                "messages": self.messages,
                "lost_to_loss": self.lost_to_loss,
                "lost_to_outage": self.lost_to_outage,
                "waited_for_outage_s": round(self.waited_for_outage_s, 4),
            }


def reduce_into(total: torch.Tensor, part: torch.Tensor, op: str) -> None:
    """total <- total op part, in place: max, min, or a sum (for "sum" and "mean")."""
    if op == "max":
        torch.maximum(total, part, out=total)
    elif op == "min":
        torch.minimum(total, part, out=total)
    else:
        total.add_(part)


def sleep_until(t: float) -> None:
    """Wait (as communication: see `fast.comm.waiting`) until timing.wall() reaches `t`."""
    delay = t - timing.wall()
    if delay > 0:
        with waiting():
            timing.sleep(delay)


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def _header(tx: Transmission, length: int = 0) -> torch.Tensor:
    flags = (_LOST if tx.lost else 0) | (_MEASUREMENT if tx.measurement else 0)
    return torch.frombuffer(bytearray(_HEADER.pack(tx.deliver_at, flags, length)), dtype=torch.uint8)


def _read_header(wire: torch.Tensor) -> Stamp:
    deliver_at, flags, length = _HEADER.unpack(wire[:HEADER_BYTES].numpy().tobytes())
    return Stamp(deliver_at, bool(flags & _LOST), length, bool(flags & _MEASUREMENT))


class TimedHandle(Handle):
    """A pending emulated operation: done once the real transfer is done and its emulated time has come."""

    def __init__(
        self,
        work: Any,
        op: str,
        peer: str,
        deadline_s: float,
        ready_at: Callable[[], float],
        result: Any = None,
        on_ready: Callable[[], Any] | None = None,
    ) -> None:
        def done() -> Any:
            sleep_until(ready_at())
            return on_ready() if on_ready is not None else None

        super().__init__(work, op, peer, deadline_s, result, done)
        self._ready_at = ready_at

    def is_completed(self) -> bool:
        return self._done or (self._work.is_completed() and timing.wall() >= self._ready_at())


class _FutureWork:
    """A Future (a collective running on the group's background thread) as the work a `Handle` waits on."""

    def __init__(self, future: Any) -> None:
        self.future = future

    def is_completed(self) -> bool:
        return self.future.done()

    def wait(self, timeout: timedelta) -> bool:
        try:
            self.future.result(timeout.total_seconds())
        except timing.FutureTimeout:
            raise TimeoutError("timed out") from None
        return True


class _Rounds:
    """One daemon thread running a group's emulated collectives in the order they were called. On a real clock it
    ends once the group has been idle for IDLE_S, and the next collective starts another: a live run's groups of
    past generations leave no thread behind."""

    def __init__(self) -> None:
        self._queue = timing.Queue()
        self._thread: Any = None
        self._lock = threading.Lock()
        self._idle_s = IDLE_S if timing.simulation() is None else None

    def submit(self, fn: Callable[[], Any]) -> Any:
        future = timing.Future()
        with self._lock:  # (put under the lock: a thread that finds the queue empty there has ended for good)
            if self._thread is None:
                self._thread = timing.Thread(self._loop, "fast-emulated-collectives")
                self._thread.start()
            self._queue.put((fn, future))
        return future

    def _loop(self) -> None:
        while True:
            try:
                fn, future = self._queue.get(timeout=self._idle_s)
            except queue.Empty:
                with self._lock:
                    if self._queue.empty():
                        self._thread = None
                        return
                continue
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as e:  # handed to whoever waits on the collective
                future.set_exception(e)


class EmulatedComm(Comm):
    """A `Comm` whose traffic crosses the emulated links of `network` (see the module docstring)."""

    shares_memory = False  # every byte crosses an emulated link

    def __init__(self, *, network: Network, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if self.device.type != "cpu":
            raise CommError("emulated links carry CPU tensors only: set run.device = 'cpu' with [network]")
        self.network = network
        self.stream = network.new_stream()
        self._rounds = _Rounds()
        self._sequence: dict[tuple[int, int], int] = defaultdict(int)
        self._sequence_lock = threading.Lock()

    def _derived(self, *, group: Any, ranks: list[int], device: torch.device | str) -> Comm:
        comm = EmulatedComm(
            network=self.network,
            group=group,
            deadline_s=self.deadline_s,
            device=device,
            counter=self.counter,
            ranks=ranks,
            rank=self.rank,
            world_size=self._world_size,
        )
        comm.interrupted, comm.connect_s = self.interrupted, self.connect_s
        comm.key = self.child_key(ranks)
        return comm

    def _transmit(self, dst: int, nbytes: int, tag: int, droppable: bool) -> Transmission:
        if not self.counter.metered:  # measurement traffic is not part of the deployment
            now = timing.wall()
            return Transmission(now, now, measurement=True)
        with self._sequence_lock:
            self._sequence[(dst, tag)] += 1
            number = self._sequence[(dst, tag)]
        return self.network.transmit(dst, nbytes, (self.stream, tag, number), droppable)

    # -- point to point ----------------------------------------------------------------------------------
    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0, droppable: bool = False) -> Handle:
        payload = _as_bytes(tensor)
        self._message(self.rank, dst, tag)
        tx = self._transmit(dst, payload.numel(), tag, droppable)
        wire = _header(tx) if tx.lost else torch.cat([_header(tx), payload])
        work = post("send", f"worker {dst}", self.deadline_s, dist.isend, wire, dst=dst, group=self.group, tag=tag)
        self.counter.add_sent(dst, payload.numel())  # a lost message still left the sender
        return TimedHandle(work, "send", f"worker {dst}", self.deadline_s, lambda: tx.sent_at, wire)

    def irecv(self, tensor: torch.Tensor, src: int | None = None, tag: int = 0) -> Handle:
        handle = self._irecv(tensor, src, tag)[0]
        if src is not None:
            handle.ticket = self._message(src, self.rank, tag)
        return handle

    def _irecv(self, tensor: torch.Tensor, src: int | None, tag: int) -> tuple[Handle, Callable[[], int]]:
        nbytes = tensor.numel() * tensor.element_size()
        wire = torch.empty(HEADER_BYTES + nbytes, dtype=torch.uint8)
        name = f"worker {src}" if src is not None else "any worker"
        work = post("recv", name, self.deadline_s, dist.irecv, wire, src=src, group=self.group, tag=tag)

        def peer() -> int:
            return src if src is not None else sender_of(work, self.group)

        ready: list[float] = []

        def ready_at() -> float:  # once the real transfer is done; the NIC takes the message in once
            if not ready:
                ready.append(self._arrival(peer(), nbytes, _read_header(wire)))
            return ready[0]

        def arrived() -> torch.Tensor:
            if _read_header(wire).lost:
                raise MessageLost(f"a droppable message from worker {peer()} (tag {tag}) was lost on its link")
            tensor.copy_(wire[HEADER_BYTES:].view(tensor.dtype).view(tensor.shape))
            self.counter.add_received(peer(), nbytes)
            return tensor

        return TimedHandle(work, "recv", name, self.deadline_s, ready_at, tensor, arrived), peer

    def _arrival(self, src: int, nbytes: int, stamp: Stamp) -> float:
        if stamp.lost or stamp.measurement:
            return stamp.deliver_at
        return self.network.arrival(src, nbytes, stamp.deliver_at)

    def recv_from(self, tensor: torch.Tensor, tag: int = 0) -> int:
        handle, peer = self._irecv(tensor, None, tag)
        handle.wait()
        self._message(peer(), self.rank, tag)
        return peer()

    def send_bytes(self, payload: torch.Tensor, dst: int, tag: int = 0, droppable: bool = False) -> None:
        """One emulated message of 8 + n bytes: a header with the length, then (unless lost) the payload."""
        n = payload.numel()
        tx = self._transmit(dst, 8 + n, tag, droppable)
        parts = [_header(tx, n)] + ([payload.contiguous()] if n and not tx.lost else [])
        name = f"worker {dst}"
        for _ in parts:
            self._message(self.rank, dst, tag)
        works = [post("send", name, self.deadline_s, dist.isend, p, dst=dst, group=self.group, tag=tag) for p in parts]
        self.counter.add_sent(dst, 8 + n)
        for work in works:
            Handle(work, "send", f"worker {dst}", self.deadline_s).wait()
        sleep_until(tx.sent_at)

    def recv_bytes(self, src: int | None = None, tag: int = 0, limit: int = RECV_BYTES) -> tuple[int, torch.Tensor]:
        header = torch.empty(HEADER_BYTES, dtype=torch.uint8)
        name = f"worker {src}" if src is not None else "any worker"
        work = post("recv", name, self.deadline_s, dist.irecv, header, src=src, group=self.group, tag=tag)
        Handle(work, "recv", name, self.deadline_s).wait()
        peer = src if src is not None else sender_of(work, self.group)
        self._message(peer, self.rank, tag)
        stamp = _read_header(header)
        lost, n = stamp.lost, stamp.length
        check_length(peer, n, limit)
        payload = torch.empty(n, dtype=torch.uint8)
        if n and not lost:
            name = f"worker {peer}"
            self._message(peer, self.rank, tag)
            work = post("recv", name, self.deadline_s, dist.irecv, payload, src=peer, group=self.group, tag=tag)
            Handle(work, "recv", name, self.deadline_s).wait()
        sleep_until(self._arrival(peer, 8 + n, stamp))
        if lost:
            raise MessageLost(f"a droppable message from worker {peer} (tag {tag}) was lost on its link")
        self.counter.add_received(peer, 8 + n)
        return peer, payload

    # -- collectives as rounds of point-to-point messages --------------------------------------------------
    def _in_rounds(self, op: str, rounds: Callable[[], None], result: Any) -> Handle:
        if self.size == 1:
            rounds()
            return Handle(None, op, "the group", self.deadline_s, result)
        context = self.counter.context()  # the background thread counts as the caller (metering, compression)

        def run() -> None:
            with self.counter.entered(context):
                rounds()

        # the rounds' own receives time out first, with the peer's name; this is a backstop
        ticket = timeline.ticket(self.key, issue=True)
        work = _FutureWork(self._rounds.submit(run))
        handle = Handle(work, op, f"the group {self.ranks}", 2 * self.deadline_s, result, interrupted=self.interrupted)
        handle.ticket = ticket
        return handle

    def _exchange(self, out: torch.Tensor, dst: int, into: torch.Tensor, src: int) -> None:
        sent = self.isend(out, dst, COLLECTIVE_TAG)
        self.irecv(into, src, COLLECTIVE_TAG).wait()
        sent.wait()

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", async_op: bool = False) -> Handle | torch.Tensor:
        """Sum (or average, op="mean", or max, min) `tensor` in place: a ring of 2(N-1) chunk messages."""
        if op not in ("sum", "mean", "max", "min"):
            raise ValueError(f"all_reduce op must be sum, mean, max or min, not {op!r}")
        handle = self._in_rounds("all_reduce", lambda: self._ring_all_reduce(tensor, op), tensor)
        return handle if async_op else handle.wait()

    def _ring_all_reduce(self, tensor: torch.Tensor, op: str) -> None:
        n, i = self.size, self.index()
        right, left = self._ring_neighbours()
        flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1).clone()
        chunks = list(flat.tensor_split(n))
        for step in range(n - 1):  # reduce-scatter: afterwards chunk i+1 holds everyone's contribution
            mine, theirs = chunks[(i - step) % n], chunks[(i - step - 1) % n]
            incoming = torch.empty_like(theirs)
            self._exchange(mine, right, incoming, left)
            reduce_into(theirs, incoming, op)
        for step in range(n - 1):  # all-gather of the reduced chunks
            self._exchange(chunks[(i + 1 - step) % n], right, chunks[(i - step) % n], left)
        if op == "mean":
            flat.div_(n)
        if flat.data_ptr() != tensor.data_ptr():
            tensor.copy_(flat.view_as(tensor))

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every member's `tensor`, in group order: a ring of N-1 messages per member."""
        n, i = self.size, self.index()
        out = [torch.empty_like(tensor) for _ in range(n)]
        out[i].copy_(tensor)
        right, left = self._ring_neighbours()

        def rounds() -> None:
            for step in range(n - 1):
                self._exchange(out[(i - step) % n], right, out[(i - step - 1) % n], left)

        return self._in_rounds("all_gather", rounds, out).wait()

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """Copy `tensor` from global rank `src` to every member along a binomial tree."""
        n = self.size
        root = self.index(src)
        relative = (self.index() - root) % n

        def member(r: int) -> int:
            return self.ranks[(r + root) % n]

        def rounds() -> None:
            mask = 1
            while mask < n:
                if relative & mask:
                    self.irecv(tensor, member(relative - mask), COLLECTIVE_TAG).wait()
                    break
                mask <<= 1
            sends = []
            mask >>= 1
            while mask > 0:
                if relative + mask < n:
                    sends.append(self.isend(tensor, member(relative + mask), COLLECTIVE_TAG))
                mask >>= 1
            for handle in sends:
                handle.wait()

        return self._in_rounds("broadcast", rounds, tensor).wait()

    def barrier(self) -> None:
        """A dissemination barrier: ⌈log2 N⌉ rounds of empty messages, each paying its link's latency."""
        n, i = self.size, self.index()
        empty = torch.empty(0)

        def rounds() -> None:
            distance = 1
            while distance < n:
                self._exchange(empty, self.ranks[(i + distance) % n], empty, self.ranks[(i - distance) % n])
                distance <<= 1

        self._in_rounds("barrier", rounds, None).wait()
