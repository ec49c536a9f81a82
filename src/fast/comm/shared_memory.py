"""Summing one buffer, again and again, across the processes of one machine through shared memory.

The group's first member creates a file in /dev/shm that every member maps: a slot of the buffer's size per
member, one slot for the sum, and two progress counters per member. A member's buffer is its own slot, so its
values are in place as soon as it writes them; `start()` only marks them ready and returns. `wait()` sums the
member's chunk (1/N of the buffer) over every slot into the sum, marks its chunk done, and once every chunk is
done copies the whole sum back into its slot: a reduce-scatter and an all-gather, on the calling thread, with
no socket and no helper thread between the processes. The chunks are summed in member order, once, so every
replica gets the same bits. The file is unlinked as soon as every member has mapped it.

Each member reads from and writes to each peer exactly what the ring algorithm would send over a socket (its
chunk of the peer's slot, the peer's chunk of the sum), and those are the bytes counted. A wait spins for a
moment, then naps; it raises when the deadline passes, or as soon as a peer's process is gone.

`sum_buffer` makes one when every member maps the file and runs on the same kernel (one machine, CPU tensors);
otherwise, as across machines under torchrun, the backend's all-reduce does the same job (`BackendSum`).
"""

from __future__ import annotations

import os
import tempfile
import threading
import uuid
from datetime import timedelta
from pathlib import Path

import torch

from fast.comm import timeline, timing
from fast.comm.comm import Comm, Handle

TMPFS = Path("/dev/shm")  # memory only, and only this machine's: the one place a sum may be shared
SHARED_DIR = TMPFS if TMPFS.is_dir() else Path(tempfile.gettempdir())
SCRATCH_VARIABLE = "FAST_SCRATCH"  # the launcher's prefix for its run's files (fast.runtime.lifeline removes them)
NAME_BYTES = 1024
READY, SUMMED = 0, 1  # the two progress counters of a member: the round whose values are in, whose chunk is summed
SPINS = 200  # yields before a wait starts to nap: a peer that is nearly there costs no sleep
NAP_S, LONGEST_NAP_S = 20e-6, 1e-3
PEER_CHECK_S = 0.2  # how often a long wait looks whether the peers it waits for still exist
MAX_SIZES = 16  # tensor sizes a group's LocalSums keeps a shared sum for
_fence = threading.Lock()  # taking and releasing a lock orders memory: values are written before the counter


class BackendSum:
    """The same job done by the backend's all-reduce (another machine, a GPU, emulated links)."""

    transport = "backend"

    def __init__(self, comm: Comm, numel: int) -> None:
        self.comm = comm
        self.tensor = torch.zeros(numel, device=comm.device)

    def start(self) -> Handle:
        return self.comm.all_reduce(self.tensor, async_op=True)  # type: ignore[return-value]


class SharedMemorySum:
    """A buffer (`tensor`, this member's slot) that `start()` sums in place across the group; see the module."""

    transport = "shared memory"

    def __init__(self, comm: Comm, numel: int, storage: torch.UntypedStorage, peers: list[tuple[int, int]]) -> None:
        n, me = comm.size, comm.index()
        self.comm, self.me, self.peers = comm, me, peers
        self.progress = torch.empty(0, dtype=torch.int64).set_(storage, 0, (2, n))
        self.slots = torch.empty(0, dtype=torch.float32).set_(storage, 4 * n, (n + 1, numel))
        self.tensor, self.sum = self.slots[me], self.slots[n]
        self.bounds = [(i * numel // n, (i + 1) * numel // n) for i in range(n + 1)]
        chunk = slice(*self.bounds[me])
        self.chunk_of_each, self.chunk_of_sum = self.slots[:n, chunk], self.sum[chunk]  # what this member sums
        self.round = 0
        sizes = [(hi - lo) * 4 for lo, hi in self.bounds[:n]]
        self.bytes_with = {rank: sizes[i] + sizes[me] for i, rank in enumerate(comm.ranks) if i != me}

    def start(self) -> Handle:
        self.round += 1
        with _fence:
            self.progress[READY, self.me] = self.round
        for rank, nbytes in self.bytes_with.items():
            self.comm.counter.add_sent(rank, nbytes)
            self.comm.counter.add_received(rank, nbytes)
        group = f"the group {self.comm.ranks}"
        handle = Handle(_Round(self, self.round), "all_reduce", group, self.comm.deadline_s, result=self.tensor,
                        patience=self.comm.patience())  # fmt: skip
        handle.ticket = timeline.ticket(self.comm.key, issue=True)
        return handle

    def finish(self, round_: int, deadline: float) -> None:
        """Sum this member's chunk once every member's values are in, then take the whole sum once it is done."""
        self._wait_for(READY, round_, deadline)
        with _fence:
            torch.sum(self.chunk_of_each, dim=0, out=self.chunk_of_sum)
            self.progress[SUMMED, self.me] = round_
        self._wait_for(SUMMED, round_, deadline)
        with _fence:
            self.tensor.copy_(self.sum)

    def _wait_for(self, counter: int, round_: int, deadline: float) -> None:
        progress = self.progress[counter]
        spins, nap, next_check = 0, NAP_S, timing.now() + PEER_CHECK_S
        while int(progress.min()) < round_:
            if spins < SPINS:
                spins += 1
                os.sched_yield()
                continue
            now = timing.now()
            if now >= deadline:
                raise TimeoutError("shared-memory all_reduce timed out")
            if now >= next_check:
                self._check_peers(progress, round_)
                next_check = now + PEER_CHECK_S
            timing.sleep(nap)
            nap = min(LONGEST_NAP_S, 2 * nap)

    def _check_peers(self, progress: torch.Tensor, round_: int) -> None:
        """Raise if a member that has not reached `round_` has no process left (one this process can see)."""
        mine = _pid_namespace()
        if not mine:
            return  # no /proc here: a dead peer ends the wait at its deadline
        for i, (pid, namespace) in enumerate(self.peers):
            if i != self.me and int(progress[i]) < round_ and namespace == mine and not _alive(pid):
                raise ConnectionError(f"worker {self.comm.ranks[i]}'s process is gone")


SumBuffer = SharedMemorySum | BackendSum


class LocalSums:
    """A group's blocking all-reduces of float32 CPU tensors, each through a shared-memory sum kept for its size.

    The job sets one on its own groups (`Comm.local_sums`) when `run.shared_memory` holds and nothing is emulated.
    The sum for a size is made at the group's first all-reduce of that size, at the same point on every member, as
    collectives are; after `MAX_SIZES` sizes, new ones go through the backend. One thread per group at a time,
    as for the backend's collectives."""

    def __init__(self, comm: Comm) -> None:
        self.comm = comm
        self.sums: dict[int, SumBuffer] = {}

    def takes(self, tensor: torch.Tensor) -> bool:
        known = tensor.numel() in self.sums or len(self.sums) < MAX_SIZES
        worth = self.comm.size > 1 and tensor.numel() > 0
        return worth and known and tensor.dtype == torch.float32 and tensor.device.type == "cpu"

    def all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        """Sum (op="sum") or average (op="mean") `tensor` in place across the group."""
        summed = self.sums.get(tensor.numel())
        if summed is None:
            summed = self.sums[tensor.numel()] = sum_buffer(self.comm, tensor.numel())
        summed.tensor.copy_(tensor.reshape(-1))
        summed.start().wait()
        tensor.copy_(summed.tensor.view_as(tensor))
        return tensor.div_(self.comm.size) if op == "mean" else tensor


def sum_buffer(comm: Comm, numel: int, shared_memory: bool = True) -> SumBuffer:
    """A buffer of `numel` floats, `.tensor`, that `.start()` sums in place across the group (a Handle to wait on),
    for values summed again and again such as a gradient bucket. Collective. Through shared memory when
    `shared_memory` and every member maps the same memory (one machine, CPU tensors); else the backend's
    all-reduce. Either way the bytes counted are the ring's."""
    if shared_memory and comm.shares_memory and comm.device.type == "cpu" and comm.size > 1:
        shared = open_shared_sum(comm, numel)
        if shared is not None:
            return shared
    return BackendSum(comm, numel)


class _Round:
    """One `start()`'s sum, in the shape of a backend's work object (what `Handle` waits on)."""

    def __init__(self, shared: SharedMemorySum, round_: int) -> None:
        self.shared, self.round, self.done = shared, round_, False

    def is_completed(self) -> bool:
        return self.done

    def wait(self, timeout: timedelta) -> bool:
        self.shared.finish(self.round, timing.now() + timeout.total_seconds())
        self.done = True
        return True


def open_shared_sum(comm: Comm, numel: int) -> SharedMemorySum | None:
    """A `SharedMemorySum` of `numel` floats when every member maps the same file, else None. Collective."""
    n = comm.size
    nbytes = 16 * n + 4 * numel * (n + 1)
    first = comm.index() == 0
    with comm.unmetered():
        path = new_shared_file("sum", nbytes) if first and TMPFS.is_dir() else None
        path = share_path(comm, path)
        storage = None
        if path is not None and path.is_file():  # mapping a missing file would create one of this machine's own
            try:
                storage = torch.UntypedStorage.from_file(str(path), shared=True, nbytes=nbytes)
            except (OSError, RuntimeError):
                storage = None
        # every member has mapped the file (or failed to) once this gather is done: the name can go
        mine = torch.tensor([int(storage is not None), _boot_id(), os.getpid(), _pid_namespace()], dtype=torch.int64)
        everyone = comm.all_gather(mine)
    if path is not None and first:
        path.unlink(missing_ok=True)
    mapped, boots = [int(row[0]) for row in everyone], {int(row[1]) for row in everyone}
    if not all(mapped) or len(boots) != 1 or 0 in boots:  # one machine's memory, seen by every member
        return None
    return SharedMemorySum(comm, numel, storage, [(int(row[2]), int(row[3])) for row in everyone])


def new_shared_file(kind: str, nbytes: int) -> Path | None:
    """A new file of `nbytes` in shared memory, readable by this user only, named for the run (`kind`: "sum",
    "hogwild"); None when there is no room. Its memory is reserved now, so that a full /dev/shm (64 MB in a
    default container) is refused here rather than killing a process with SIGBUS when it is touched."""
    scratch = os.environ.get(SCRATCH_VARIABLE) or f"fast-{os.getpid()}"
    path = SHARED_DIR / f"{scratch}-{kind}-{uuid.uuid4().hex[:12]}"
    try:
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:
        return None
    try:
        os.posix_fallocate(descriptor, 0, nbytes)
    except OSError:
        path.unlink(missing_ok=True)
        return None
    finally:
        os.close(descriptor)
    return path


def share_path(comm: Comm, path: Path | None) -> Path | None:
    """The group's first member's `path` (None: it has none), on every member. Collective."""
    name = torch.zeros(NAME_BYTES, dtype=torch.uint8)
    if comm.index() == 0 and path is not None:
        encoded = str(path).encode()
        name[: len(encoded)] = torch.tensor(list(encoded), dtype=torch.uint8)
    comm.broadcast(name, src=comm.ranks[0])
    text = bytes(name[name != 0].tolist()).decode()
    return Path(text) if text else None


def _boot_id() -> int:
    """This machine's running kernel, as a number (0 where unknown): equal for the processes of one machine."""
    try:
        text = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return 0
    return int(text.replace("-", "")[:15], 16)


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")  # a zombie has exited; only its parent has not collected it yet
