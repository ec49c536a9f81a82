"""The tensor-moving interface: point-to-point and collective operations with deadlines and byte accounting.

Strategies move every tensor through a `Comm`; none touches torch.distributed. Peers are always named by
their global rank. Every blocking call waits at most `deadline_s` and then raises `CommTimeout` naming the
operation and the peer. Bytes are counted per peer by the shared `ByteCounter`:

- point-to-point: the exact payload (and, for frames, the 8-byte length prefix);
- native collectives run the backend's ring algorithm, so a worker sends and receives exactly what a ring
  moves: 2(N-1)/N of the tensor for all-reduce, (N-1) chunks for all-gather; a broadcast root sends the
  tensor to each of the N-1 others. (Emulated deployments run collectives as explicit point-to-point
  rounds instead, where each message is counted as it is sent.)

A send may be marked `droppable=True` (gossip, asynchronous pushes: the protocol survives a lost message).
Native links never lose one; an emulated lossy or down link may, and the receive then raises `MessageLost`.

A variable-length payload (`recv_bytes`) is taken only up to the length its caller expects (`limit`, from what it
receives: a codec frame, a state like its own), so that no member makes another allocate whatever it announces.
"""

from __future__ import annotations

import contextlib
import functools
import io
import re
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from fast.comm import timeline, timing
from fast.comm.accounting import ByteCounter
from fast.comm.busy import BusyBoard
from fast.comm.waiting import waiting
from fast.errors import CommError, CommTimeout, first_line


class MessageLost(CommError):
    """A message sent with `droppable=True` was lost on an emulated link (never raised by native links)."""


RECV_BYTES = 1 << 30  # what recv_bytes takes when its caller knows no closer bound on what it receives
PIECE_BYTES = 1 << 18  # the pieces of a payload sent behind the caller's work: a broken line keeps those that came


def check_length(peer: int, n: int, limit: int) -> None:
    """CommError unless a payload of `n` bytes announced by `peer` is one a receive expecting `limit` takes."""
    if n < 0:
        raise CommError(f"recv_bytes from worker {peer}: impossible length {n} (corrupt stream)")
    if n > limit:
        raise CommError(f"recv_bytes from worker {peer}: {n:,} bytes announced, more than the {limit:,} this receive "
                        "expects (a corrupt stream, or a member that is not running this run's code)")  # fmt: skip


def packed(value: Any) -> torch.Tensor:
    """`value` (tensors, numbers, strings, and dicts, lists and tuples of them) as a `send_bytes` payload."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def unpacked(payload: torch.Tensor) -> Any:
    """What `packed` made, read as weights only: a payload from another process runs no code here."""
    return torch.load(io.BytesIO(payload.numpy().tobytes()), weights_only=True)


def limit_for(state: Any, times: int = 1) -> int:
    """A bound on the bytes of `times` payloads like `state` (nested dicts, lists and tuples of tensors and small
    values) as torch.save writes them: their tensors' bytes, with room for each one's record and the rest."""
    tensors, leaves, stack = 0, 0, [state]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, list | tuple):
            stack.extend(value)
        elif torch.is_tensor(value):
            tensors += value.numel() * value.element_size() + 4096
        else:
            leaves += 1
    return times * (tensors + 1024 * leaves) + (1 << 20)


# how often a collective's wait in an interruptible group asks whether to give up (a point-to-point wait that times
# out cannot be waited on again in gloo: those wait whole, and a peer that is gone closes their connection)
INTERRUPT_POLL_S = 0.25


class Handle:
    """A pending operation. `wait()` enforces the deadline and returns the operation's result. With
    `interrupted` (a live membership's groups), the wait also gives up as soon as `interrupted()` says why; with
    `patience`, a wait past its deadline goes on while `patience(seconds waited)` says so (a peer computing)."""

    def __init__(
        self,
        work: Any,
        op: str,
        peer: str,
        deadline_s: float,
        result: Any = None,
        on_done: Callable[[], Any] | None = None,
        interrupted: Callable[[], str | None] | None = None,
        patience: Callable[[float], bool] | None = None,
        on_stream: bool = False,
    ) -> None:
        self._work, self.op, self.peer, self.deadline_s = work, op, peer, deadline_s
        self._on_stream = on_stream
        self._result, self._on_done, self._done = result, on_done, work is None
        self._interrupted, self._patience = interrupted, patience
        self.ticket: Any = None  # a collective's or a receive's (fast.comm.arrivals): its wait is split

    def is_completed(self) -> bool:
        return self._done or self._work.is_completed()

    def wait(self, deadline_s: float | None = None) -> Any:
        """The operation's result, once done; CommTimeout after `deadline_s` (default the comm's deadline)."""
        deadline_s = self.deadline_s if deadline_s is None else deadline_s
        if not self._done:
            with waiting():  # (the times split into waiting for peers lie inside the trace's wait span)
                started = timing.wall() if self.ticket is not None else 0.0  # (a wait without one is not split)
                try:
                    self._wait(deadline_s)
                except CommError:
                    raise
                except Exception as e:  # the backend's timeout and connection errors both end here
                    raise _comm_error(self.op, self.peer, deadline_s, e) from None
                self._done = True
                if self._on_done is not None:
                    out = self._on_done()
                    self._result = out if out is not None else self._result
                if self.ticket is not None:
                    timeline.waited(self.ticket, started, timing.wall())
        return self._result

    def _wait(self, deadline_s: float) -> None:
        if self._on_stream:
            # NCCL: the wait puts the operation before whatever the caller's CUDA stream does next, and returns; the
            # host waits for nothing (with a timeout it would poll until the GPU is done). NCCL's watchdog holds the
            # deadline: the group's timeout.
            self._work.wait()
            return
        if self._interrupted is None and self._patience is None:
            self._work.wait(timedelta(seconds=deadline_s))
            return
        poll = INTERRUPT_POLL_S if self._interrupted is not None else deadline_s
        start = time.monotonic()
        end = start + deadline_s
        while True:  # a backend's wait that times out can be waited on again (gloo)
            try:
                self._work.wait(timedelta(seconds=max(0.001, min(poll, end - time.monotonic()))))
                return
            except Exception as e:
                if "timed out" not in str(e).lower():
                    raise
                if time.monotonic() >= end:
                    if self._patience is None or not self._patience(time.monotonic() - start):
                        raise
                    end = time.monotonic() + deadline_s
            if self._interrupted is None:
                continue
            reason = self._interrupted()
            if reason is not None:
                raise CommError(f"{self.op} with {self.peer} given up: {reason}")


class _Pieces:
    """The backend's works for one operation's pieces: started together (`at_once`, for an operation that runs
    behind the caller's work), or each once the one before is done, so that one piece at a time is on the wire."""

    def __init__(self, starts: list[Callable[[], Any]], at_once: bool) -> None:
        self.starts = starts
        self.works = [start() for start in starts] if at_once else []

    def is_completed(self) -> bool:
        return len(self.works) == len(self.starts) and all(work.is_completed() for work in self.works)

    def wait(self, timeout: timedelta | None = None) -> bool:
        for i, start in enumerate(self.starts):
            if i == len(self.works):
                self.works.append(start())
            self.works[i].wait() if timeout is None else self.works[i].wait(timeout)
        return True


class IncomingBytes:
    """A payload `isend_bytes_in_turn` sends, received behind the receiver's work on a thread of its own (a backend's
    receive is not seen done until it is waited on): `arrived()` looks without waiting, `take()` waits for it and raises
    what the receive raised (CommError: a peer gone, a length past `limit`). It comes in pieces, and a receive that a
    broken group cuts keeps those that came (`received`): a receive `resuming` it takes only the rest."""

    def __init__(self, comm: Any, src: int, limit: int, resuming: IncomingBytes | None = None) -> None:
        self.payload = None if resuming is None else resuming.payload
        self.received = 0 if resuming is None else resuming.received
        self.error: BaseException | None = None
        self._counting = timing.Lock()  # (what `received` says, and whether it still moves: `cut`)
        self._cut = False
        self.thread = timing.Thread(self._receive, "fast-incoming", args=(comm, src, limit))
        self.thread.start()

    def _receive(self, comm: Any, src: int, limit: int) -> None:
        try:
            header = torch.zeros(2, dtype=torch.int64)
            comm.recv(header, src)
            total, start = (int(v) for v in header.tolist())  # (a thread's, behind the steps)
            check_length(src, total, limit)
            if start and (self.payload is None or self.payload.numel() != total or start != self.received):
                raise CommError(f"worker {src} resumed a payload of {total} bytes at byte {start}, not where it was "
                                f"cut (byte {self.received})")  # fmt: skip
            with self._counting:
                if self._cut:
                    return
                if not start:
                    self.payload, self.received = torch.empty(total, dtype=torch.uint8), 0
            while self.received < total:
                comm.recv(self.payload[self.received : self.received + PIECE_BYTES], src)
                with self._counting:
                    if self._cut:
                        return
                    self.received = min(total, self.received + PIECE_BYTES)
        except BaseException as e:  # (handed to `take`, on the caller's thread)
            self.error = e

    def arrived(self) -> bool:
        return not self.thread.is_alive()

    def cut(self) -> bool:
        """(The group broke) what has come is what a receive `resuming` this one keeps: from now on this one counts
        nothing more, though it may still wait (over emulated links, for a piece's time of arrival; a piece that
        lands meanwhile holds the same bytes as the source sends again). Whether the payload had begun to come."""
        with self._counting:
            self._cut = True
            return self.payload is not None

    def take(self, interrupted: Callable[[], str | None] | None = None) -> torch.Tensor:
        """The payload, once all of it is in; with `interrupted` (a live group's), CommError as soon as it says why
        (the receive itself goes on until its group is aborted: a backend's receive cannot be waited on again once a
        wait of it has timed out)."""
        while self.thread.is_alive():
            self.thread.join(INTERRUPT_POLL_S if interrupted is not None else None)
            reason = interrupted() if interrupted is not None and self.thread.is_alive() else None
            if reason is not None:
                raise CommError(f"receiving a payload given up: {reason}")
        if self.error is not None:
            raise self.error
        return self.payload


def _comm_error(op: str, peer: str, deadline_s: float, cause: BaseException) -> CommError:
    text = first_line(cause)
    # gloo's "[file.cc:553] Connection closed by peer [addr]:port. This is typically caused by ..." -> its gist
    text = re.sub(r"^\[[^\]]*\] ", "", text).split(". This is typically")[0]
    if "timeout" in text.lower() or "timed out" in text.lower():
        return CommTimeout(
            f"{op} with {peer} passed its {deadline_s:g}s deadline: the peer is gone or stuck "
            f"(raise run.deadline_s if it is only slow)"
        )
    return CommError(f"{op} with {peer} failed: {text}")


# gloo gives a peer five times its group's timeout to connect their pair (the initial connect's longer wait, in gloo's
# transport/tcp/pair.h): a member that had published its address and died held its peers five times the connect time
GLOO_CONNECT_WAITS = 5


def connect_timeout(backend: str, deadline_s: float, connect_s: float | None) -> timedelta:
    """The timeout to make a group of `backend` with, for its connecting to give up after `connect_s` (at most the
    deadline; None: the deadline). A group given `connect_s` (a live membership's) forms over a group store
    (RunStore.for_group), whose waits for the members' addresses last their own time whatever torch asks: a gloo
    group's timeout is then the fifth of `connect_s` that bounds its pairs' connecting by `connect_s`."""
    seconds = min(deadline_s, connect_s or deadline_s)
    if connect_s is not None and backend == "gloo":
        seconds /= GLOO_CONNECT_WAITS
    return timedelta(seconds=seconds)


def with_deadline(group: Any, deadline_s: float) -> None:
    """Give `group` (None: the default one) the deadline of its operations, after a shorter one to connect."""
    from torch.distributed.distributed_c10d import _set_pg_timeout

    _set_pg_timeout(timedelta(seconds=deadline_s), group)


def sender_of(work: Any, group: Any) -> int:
    """The global rank whose message a completed receive-from-any took. (torch's own `recv` asks the same of the
    work's group rank; the public `Work.source_rank` is deprecated and prints a C++ warning at every call.)"""
    local = work._source_rank()
    return local if group is None else dist.get_global_rank(group, local)


def post(op: str, peer: str, deadline_s: float, start: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Start a point-to-point operation; a connection already known to be closed fails here, not at wait()."""
    try:
        return start(*args, **kwargs)
    except RuntimeError as e:
        raise _comm_error(op, peer, deadline_s, e) from None


class Comm:
    """One worker's view of a communication group (the main group or a background channel)."""

    shares_memory = True  # members on one machine may sum through shared memory (fast.comm.shared_memory)

    def __init__(
        self,
        *,
        group: Any = None,
        deadline_s: float = 60.0,
        device: torch.device | str = "cpu",
        counter: ByteCounter | None = None,
        ranks: list[int] | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        piece_bytes: int | None = None,
    ) -> None:
        self.group = group
        self.deadline_s = deadline_s
        self.device = torch.device(device)
        self.counter = counter or ByteCounter()
        self._world_size = dist.get_world_size() if world_size is None else world_size
        self.ranks = ranks if ranks is not None else list(range(self._world_size))
        self.rank = dist.get_rank() if rank is None else rank
        self._channels: list[Comm] = []
        # set by the job on its own groups when they share one machine's memory (fast.comm.shared_memory.LocalSums)
        self.local_sums: Any = None
        # a live membership's groups: why a wait should give up now (a newer membership), or None (Handle)
        self.interrupted: Callable[[], str | None] | None = None
        self.busy: BusyBoard | None = None  # a lock-step run's: its collectives wait on for a peer that computes
        # a live membership's groups: how long making a group waits for its members (a member may be gone); set
        # only on a group formed over a group store (RunStore.for_group: connect_timeout)
        self.connect_s: float | None = None
        # an all-reduce of more bytes goes as consecutive pieces of at most this many (Comm._pieces); None: whole
        self.piece_bytes = piece_bytes
        # the group's name on every member (fast.comm.arrivals): its derived groups are named after it
        self.key = "world"
        self._derived_count: dict[tuple[int, ...], int] = {}

    # -- who ---------------------------------------------------------------------------------------------
    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def world_size(self) -> int:
        return self._world_size

    def index(self, rank: int | None = None) -> int:
        """Position of a global rank inside this group."""
        return self.ranks.index(self.rank if rank is None else rank)

    # -- groups ------------------------------------------------------------------------------------------
    def separate_group(self) -> Comm:
        """A separate gloo group over the same ranks, for background threads (collective: all ranks call it)."""
        group = self._connect_group(self.ranks, "gloo", self.connect_s)
        comm = self._derived(group=group, ranks=self.ranks, device="cpu")
        self._channels.append(comm)
        return comm

    def subgroups(
        self, partition: list[list[int]], *, gloo: bool = False, connect_s: float | None = None
    ) -> Comm | None:
        """Split into groups (collective: every rank calls with the same partition); returns this rank's. With
        `gloo`, the groups are gloo groups on the CPU whatever this one's backend (control traffic). Connecting
        gives up after `connect_s` (default this group's own, or the deadline), the groups' operations after the
        deadline."""
        mine = None
        backend = "gloo" if gloo else dist.get_backend(self.group)
        device = "cpu" if gloo else self.device
        for ranks in partition:
            group = self._connect_group(ranks, backend, connect_s or self.connect_s)
            if self.rank in ranks:
                mine = self._derived(group=group, ranks=list(ranks), device=device)
        return mine

    def _connect_group(self, ranks: list[int], backend: str, connect_s: float | None) -> Any:
        """A new process group (collective), whose connecting gives up after `connect_s` (a CommError: a member
        did not come) and whose operations after the deadline."""
        timeout = connect_timeout(backend, self.deadline_s, connect_s)
        try:
            group = dist.new_group(ranks, backend=backend, timeout=timeout)
        except RuntimeError as e:  # the store's wait for a member gave up (DistStoreError), or a pair's connecting
            raise CommError(f"forming a group of workers {ranks}: {str(e).splitlines()[0]}") from None
        if timeout.total_seconds() < self.deadline_s and self.rank in ranks:
            with_deadline(group, self.deadline_s)
        return group

    def _derived(self, *, group: Any, ranks: list[int], device: torch.device | str) -> Comm:
        """A Comm of the same kind over another group, sharing this one's byte counter (and interruption)."""
        comm = Comm(group=group, deadline_s=self.deadline_s, device=device, counter=self.counter, ranks=ranks,
                    rank=self.rank, world_size=self._world_size, piece_bytes=self.piece_bytes)  # fmt: skip
        comm.interrupted, comm.connect_s, comm.busy = self.interrupted, self.connect_s, self.busy
        comm.key = self.child_key(ranks)
        return comm

    def child_key(self, ranks: list[int]) -> str:
        """The name of a group made from this one over `ranks` (made in the same order on every member)."""
        n = self._derived_count.get(tuple(ranks), 0)
        self._derived_count[tuple(ranks)] = n + 1
        return f"{self.key}/{','.join(map(str, ranks))}#{n}"

    def _message(self, src: int, dst: int, tag: int) -> Any:
        """The ticket of the next message from `src` to `dst` on `tag` (fast.comm.arrivals): the sender's issue."""
        return timeline.ticket(f"{self.key}:{src}>{dst}/{tag}", issue=src == self.rank)

    def unmetered(self) -> Any:
        """Context in which traffic is measurement only and is not counted in bytes_sent."""
        return self.counter.unmetered()

    # -- point to point ----------------------------------------------------------------------------------
    def _through_host(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` must cross as a CPU copy: gloo's point-to-point moves host memory only (its collectives
        take CUDA tensors; two workers sharing one GPU have gloo, fast.comm.bootstrap.backend_for)."""
        return tensor.is_cuda and self.backend() == "gloo"

    def backend(self) -> str:
        return dist.get_backend(self.group)

    def _on_stream(self, tensor: torch.Tensor) -> bool:
        """Whether an operation on `tensor` runs on a CUDA stream of the backend's (NCCL), which the caller's stream
        can wait on without the host waiting (`Handle`)."""
        return tensor.is_cuda and self.backend() == "nccl"

    def _addressed(self, key: str, rank: int | None) -> dict[str, int | None]:
        """How torch is told a peer (`key`: "dst" or "src"): by its global rank."""
        return {key: rank}

    def _sender(self, work: Any) -> int:
        """The rank whose message a completed receive-from-any took."""
        return sender_of(work, self.group)

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0, droppable: bool = False) -> Handle:
        tensor = tensor.cpu() if self._through_host(tensor) else tensor
        self._message(self.rank, dst, tag)
        work = post("send", f"worker {dst}", self.deadline_s, dist.isend, tensor, group=self.group, tag=tag,
                    **self._addressed("dst", dst))  # fmt: skip
        self.counter.add_sent(dst, tensor.numel() * tensor.element_size())
        return Handle(work, "send", f"worker {dst}", self.deadline_s, on_stream=self._on_stream(tensor))

    def irecv(self, tensor: torch.Tensor, src: int | None = None, tag: int = 0) -> Handle:
        peer = f"worker {src}" if src is not None else "any worker"
        landing = torch.empty_like(tensor, device="cpu") if self._through_host(tensor) else tensor
        work = post("recv", peer, self.deadline_s, dist.irecv, landing, group=self.group, tag=tag,
                    **self._addressed("src", src))  # fmt: skip

        def done() -> torch.Tensor:
            peer = src if src is not None else self._sender(work)
            self.counter.add_received(peer, tensor.numel() * tensor.element_size())
            return tensor.copy_(landing) if landing is not tensor else tensor

        handle = Handle(work, "recv", peer, self.deadline_s, tensor, done, on_stream=self._on_stream(tensor))
        if src is not None:  # (one from any peer is numbered once it is known: recv_from)
            handle.ticket = self._message(src, self.rank, tag)
        return handle

    @timeline.timed("send")
    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0, droppable: bool = False) -> None:
        self.isend(tensor, dst, tag, droppable).wait()

    @timeline.timed("recv")
    def recv(self, tensor: torch.Tensor, src: int | None = None, tag: int = 0) -> torch.Tensor:
        return self.irecv(tensor, src, tag).wait()

    def recv_from(self, tensor: torch.Tensor, tag: int = 0) -> int:
        """Receive into `tensor` from whichever peer sends first; returns that peer's rank."""
        work = post("recv", "any worker", self.deadline_s, dist.irecv, tensor, src=None, group=self.group, tag=tag)
        Handle(work, "recv", "any worker", self.deadline_s).wait()
        peer = self._sender(work)
        self._message(peer, self.rank, tag)
        self.counter.add_received(peer, tensor.numel() * tensor.element_size())
        return peer

    def send_bytes(self, payload: torch.Tensor, dst: int, tag: int = 0, droppable: bool = False) -> None:
        """Send a variable-length uint8 payload (a codec frame): an 8-byte length, then the bytes."""
        length = torch.tensor([payload.numel()], dtype=torch.int64)
        self.send(length, dst, tag)
        if payload.numel():
            self.send(payload.contiguous(), dst, tag)

    def isend_bytes_in_turn(self, lines: list[tuple[torch.Tensor, int, int]]) -> Any:
        """Send payloads to `irecv_bytes`, behind the caller's work, on one thread (returned): each line is (payload,
        peer, start), `start` 0 or where a cut receive ended. First every line's length and start; then the bytes in
        pieces, one payload after another in the order given, so that the first is in as soon as the link allows
        (sent side by side, all would be in only at the end). A receiver waiting its turn gets a piece at least
        every third of the deadline, so that its receive does not pass the deadline. A peer gone meanwhile ends its
        line quietly, the group left (ValueError) every line: the receiver's side is where the loss counts."""

        def send() -> None:
            at, last = {}, {}  # (of each line under way: its next byte, when a piece of it last went)
            with contextlib.suppress(ValueError):
                for i, (payload, peer, start) in enumerate(lines):
                    with contextlib.suppress(CommError):
                        self.send(torch.tensor([payload.numel(), start], dtype=torch.int64), peer)
                        at[i], last[i] = start, timing.now()
                while at := {i: byte for i, byte in at.items() if byte < lines[i][0].numel()}:
                    now = timing.now()
                    i = next((i for i in at if now - last[i] >= self.deadline_s / 3), min(at))
                    payload, peer, _ = lines[i]
                    try:
                        self.send(payload[at[i] : at[i] + PIECE_BYTES], peer)
                    except CommError:
                        del at[i]
                        continue
                    at[i], last[i] = at[i] + PIECE_BYTES, timing.now()

        thread = timing.Thread(send, "fast-outgoing")
        thread.start()
        return thread

    def irecv_bytes(self, src: int, limit: int, resuming: IncomingBytes | None = None) -> IncomingBytes:
        """Receive what `isend_bytes_in_turn` sends, behind the caller's work (at most `limit` bytes); `resuming`: the
        receive of the same payload that a broken group cut, whose pieces this one does not take again."""
        return IncomingBytes(self, src, limit, resuming)

    def recv_bytes(self, src: int | None = None, tag: int = 0, limit: int = RECV_BYTES) -> tuple[int, torch.Tensor]:
        """Receive a payload sent by `send_bytes`, from `src` or from whichever peer comes first; CommError for
        one longer than `limit` bytes (what the caller expects at most), before anything is allocated for it."""
        length = torch.zeros(1, dtype=torch.int64)
        peer = self.recv_from(length, tag) if src is None else (self.recv(length, src, tag), src)[1]
        n = int(length.item())
        check_length(peer, n, limit)
        payload = torch.empty(n, dtype=torch.uint8)
        if n:
            self.recv(payload, peer, tag)
        return peer, payload

    # -- collectives -------------------------------------------------------------------------------------
    def _ring_neighbours(self) -> tuple[int, int]:
        i = self.index()
        return self.ranks[(i + 1) % self.size], self.ranks[(i - 1) % self.size]

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", async_op: bool = False) -> Handle | torch.Tensor:
        """Sum (or average, op="mean") `tensor` in place across the group."""
        if op not in ("sum", "mean", "max", "min"):
            raise ValueError(f"all_reduce op must be sum, mean, max or min, not {op!r}")
        if self.local_sums is not None and not async_op and op in ("sum", "mean") and self.local_sums.takes(tensor):
            return self.local_sums.all_reduce(tensor, op)
        reduce_op = {
            "sum": dist.ReduceOp.SUM,
            "mean": dist.ReduceOp.SUM,
            "max": dist.ReduceOp.MAX,
            "min": dist.ReduceOp.MIN,
        }[op]
        starts = [functools.partial(dist.all_reduce, piece, op=reduce_op, group=self.group, async_op=True)
                  for piece in self._pieces(tensor)]  # fmt: skip
        handle = self._collective(
            (lambda: _Pieces(starts, at_once=async_op)) if len(starts) > 1 else starts[0],
            "all_reduce",
            tensor,
            2 * (self.size - 1) / self.size,
            on_done=(lambda: tensor.div_(self.size)) if op == "mean" else None,
            result=tensor,
        )
        return handle if async_op else handle.wait()

    def _pieces(self, tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """`tensor` whole, or its consecutive pieces of at most `piece_bytes` (views into it), which go one after
        the other: a message that never outgrows a slow link's queue is not dropped at its tail, where TCP only
        recovers after a retransmission timeout (bench/peers.py: 0 drops instead of ~1,000 a run at 10 Mbit/s)."""
        limit = self.piece_bytes
        if not limit or tensor.numel() * tensor.element_size() <= limit or not tensor.is_contiguous():
            return (tensor,)
        return tensor.view(-1).split(max(1, limit // tensor.element_size()))

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every member's `tensor` (all of the same shape), in group order."""
        if self.size == 1:  # a group of one gathers its own tensor (no backend call)
            return [tensor.clone()]
        out = [torch.empty_like(tensor) for _ in range(self.size)]
        handle = self._collective(
            lambda: dist.all_gather(out, tensor.contiguous(), group=self.group, async_op=True),
            "all_gather",
            tensor,
            self.size - 1,
            result=out,
        )
        return handle.wait()

    def all_gather_bytes(self, payload: torch.Tensor) -> list[torch.Tensor]:
        """Every member's variable-length uint8 payload: lengths first, then padded payloads, trimmed."""
        lengths = self.all_gather(torch.tensor([payload.numel()], dtype=torch.int64, device=self.device))
        longest = int(max(int(n) for n in lengths))
        padded = torch.zeros(longest, dtype=torch.uint8, device=self.device)
        padded[: payload.numel()] = payload
        return [p[: int(n)] for p, n in zip(self.all_gather(padded), lengths, strict=True)]

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """Copy `tensor` from global rank `src` to every member, in place."""
        share = (self.size - 1) if self.rank == src else 0
        handle = self._collective(
            lambda: dist.broadcast(tensor, src=src, group=self.group, async_op=True),
            "broadcast",
            tensor,
            share,
            result=tensor,
            receive_share=0 if self.rank == src else 1,
        )
        return handle.wait()

    def barrier(self) -> None:
        """Wait until every member arrives (control traffic: not counted)."""
        flag = torch.zeros(1, device=self.device)
        with self.unmetered():
            self._collective(lambda: dist.all_reduce(flag, group=self.group, async_op=True), "barrier", flag, 0).wait()

    def _collective(
        self,
        start: Callable[[], Any],
        op: str,
        tensor: torch.Tensor,
        send_share: float,
        *,
        on_done: Callable[[], Any] | None = None,
        result: Any = None,
        receive_share: float | None = None,
    ) -> Handle:
        if self.size == 1:
            if on_done is not None:
                on_done()
            return Handle(None, op, "the group", self.deadline_s, result)
        ticket = timeline.ticket(self.key, issue=True)
        try:
            work = start()
        except Exception as e:
            raise _comm_error(op, f"the group {self.ranks}", self.deadline_s, e) from None
        nbytes = tensor.numel() * tensor.element_size()
        right, left = self._ring_neighbours()
        self.counter.add_sent(right, round(nbytes * send_share))
        self.counter.add_received(left, round(nbytes * (send_share if receive_share is None else receive_share)))
        handle = Handle(work, op, f"the group {self.ranks}", self.deadline_s, result, on_done, self.interrupted,
                        self.patience(), self._on_stream(tensor))  # fmt: skip
        handle.ticket = ticket
        return handle

    def patience(self) -> Callable[[float], bool] | None:
        """What a collective of this group past its deadline asks whether to wait on (`Handle`), if anything."""
        busy = self.busy
        return None if busy is None else lambda waited: busy.patience(self.ranks, self.deadline_s, waited)
