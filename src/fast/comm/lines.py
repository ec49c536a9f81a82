"""A line: a small gloo group of its own, made straight from a store, with no default group behind it, so that
one process holds as many as it needs and makes them at any time (a live run's asynchronous workers and
their servers, fast.runtime.detached). Its members are numbered by the line itself (0, 1, ...); it carries
point-to-point traffic only, counted like any `Comm`'s.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from fast.comm.accounting import ByteCounter
from fast.comm.comm import Comm, connect_timeout
from fast.errors import CommError

IDLE_S = 7 * 24 * 3600.0  # gloo's own deadline on a line once made: waits give up through PatientGroup instead


class LineComm(Comm):
    """A `Comm` over a line: peers are the line's own ranks."""

    def _addressed(self, key: str, rank: int | None) -> dict[str, int | None]:
        return {f"group_{key}": rank} if rank is not None else {key: None}

    def _sender(self, work: Any) -> int:
        return work._source_rank()

    def backend(self) -> str:
        return "gloo"

    def separate_group(self) -> Comm:
        """A line is already a group of its own: its channels share it (their messages are told apart by tag)."""
        return self

    def subgroups(self, partition: list[list[int]], **_: Any) -> Comm | None:
        raise CommError("a line carries point-to-point traffic only: it has no subgroups")

    def close(self) -> None:
        """Close the line's connections: what still waits on it (a server's reader) fails now, not at the
        process's exit, where a thread torn down inside gloo aborts the process."""
        self.group.abort()


def form_line(store: Any, name: str, rank: int, size: int, device: torch.device, connect_s: float,
              counter: ByteCounter) -> LineComm:  # fmt: skip
    """Rank `rank` of the line `name` of `size` over `store` (a group store with a prefix of its own,
    RunStore.for_group); every member calls it.
    RuntimeError if one does not come within `connect_s`."""
    group = dist.ProcessGroupGloo(store, rank, size, connect_timeout("gloo", connect_s, connect_s))
    group._set_default_timeout(timedelta(seconds=IDLE_S))
    line = LineComm(group=group, deadline_s=IDLE_S, device=device, counter=counter, ranks=list(range(size)),
                    rank=rank, world_size=size)  # fmt: skip
    line.key = name
    return line
