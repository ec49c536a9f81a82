"""Decisions the workers take together, on a group of their own: when to stop (time up, or every worker out of
data), whether every worker of a stream has a batch, and that a collective evaluation happens at the same step.

Each decision is one round in which every live worker says what it is doing (`kind`), at which step, and its
flags; every worker learns everyone's answer. The rounds are measurement traffic (not counted in bytes). A round
is an all-gather over the workers, or, under a strategy that survives failures (a collective could not finish
once a worker is dead), point to point through worker 0, which answers for the dead. Workers that call a round
for different purposes, or at different steps where they must agree, get one clear error instead of a hang.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from fast.comm import Comm, tags
from fast.errors import CommError, FastError

AGREE_TAG = tags.AGREE
STOP, EVALUATE, BATCH, MEMBERSHIP = 1, 2, 3, 4
KINDS = {STOP: "the periodic check on the end of training", EVALUATE: "job.evaluate", BATCH: "the next batch",
         MEMBERSHIP: "the membership round before a step"}  # fmt: skip


@dataclass(frozen=True)
class Answer:
    """What every live worker said in a round (in a simulation, one Answer that every member reads: its figures are
    worked out once, not once by each of a thousand members)."""

    steps: list[int]
    flags: list[list[int]]
    _figures: dict[tuple[str, int], Any] = field(default_factory=dict, compare=False, repr=False)

    def _figure(self, name: str, flag: int, of: Any) -> Any:
        key = (name, flag)
        if key not in self._figures:
            self._figures[key] = of(f[flag] for f in self.flags)
        return self._figures[key]

    def any(self, flag: int) -> bool:
        return self._figure("any", flag, any)

    def all(self, flag: int) -> bool:
        return self._figure("all", flag, all)

    def total(self, flag: int) -> int:
        return self._figure("total", flag, sum)


def gathered(comm: Comm, row: torch.Tensor) -> torch.Tensor:
    """Every member's `row`, stacked in group order (an all-gather); in a simulation one table that every member
    reads (SimComm.all_gather_once), not a copy each: do not write it."""
    shared = getattr(comm, "all_gather_once", None)
    return shared(row, lambda table: table) if shared is not None else torch.stack(comm.all_gather(row))


class Control:
    def __init__(self, comm: Comm, rank: int, point_to_point: bool, strategy_name: str) -> None:
        self.comm, self.rank, self.point_to_point, self.strategy_name = comm, rank, point_to_point, strategy_name

    def round(self, kind: int, step: int, flags: list[int], dead: set[int], lost: object = None) -> Answer:
        """This worker's (kind, step, flags); returns every live worker's. `dead` are ranks known gone (point to
        point only); `lost(rank, how)` records one that does not answer."""
        row = torch.tensor([kind, step, *flags], dtype=torch.int64)
        shared = getattr(self.comm, "all_gather_once", None)  # a simulated group's: one answer read by every member
        with self.comm.unmetered():
            if self.point_to_point or shared is None:
                gathered = self._through_rank_0(row, dead, lost) if self.point_to_point else self.comm.all_gather(row)
                answer = self._answer(torch.stack(gathered))
            else:
                answer = shared(row, self._answer)
        if isinstance(answer, str):
            raise FastError(answer)
        return answer

    def _answer(self, rows: torch.Tensor) -> Answer | str:
        """The answer of a round from every worker's row, or why the workers are out of step."""
        listed = rows.tolist()  # (host tensors: one read, which waits on no device)
        kinds, steps = {r[0] for r in listed}, {r[1] for r in listed}
        if len(kinds) > 1 or len(steps) > 1:
            where = ", ".join(f"worker {self.comm.ranks[i]}: {KINDS[r[0]]} after step {r[1]}"
                              for i, r in enumerate(listed))  # fmt: skip
            return (
                f"the workers are out of step ({where}): under {self.strategy_name} every worker must run the same "
                "steps and call job.evaluate at the same step (job.loader gives every worker as many batches)"
            )
        return Answer([r[1] for r in listed], [r[2:] for r in listed])

    def _through_rank_0(self, row: torch.Tensor, dead: set[int], lost: object) -> list[torch.Tensor]:
        comm, first = self.comm, self.comm.ranks[0]
        if self.rank != first:
            comm.send(row, first, tag=AGREE_TAG)
            size = torch.zeros(1, dtype=torch.int64)
            comm.recv(size, first, tag=AGREE_TAG)
            everyone = torch.zeros(int(size), row.numel(), dtype=torch.int64)
            comm.recv(everyone, first, tag=AGREE_TAG)
            return list(everyone)
        rows = [row]
        live = [r for r in comm.ranks[1:] if r not in dead]
        for rank in live:
            theirs = torch.zeros_like(row)
            try:
                rows.append(comm.recv(theirs, rank, tag=AGREE_TAG))
            except CommError as e:
                if lost is not None:
                    lost(rank, f"did not answer the workers' check: {e}")  # type: ignore[operator]
        everyone = torch.stack(rows)
        for rank in live:
            if rank in dead:
                continue
            try:
                comm.send(torch.tensor([len(rows)], dtype=torch.int64), rank, tag=AGREE_TAG)
                comm.send(everyone, rank, tag=AGREE_TAG)
            except CommError as e:
                if lost is not None:
                    lost(rank, f"did not take the workers' decision: {e}")  # type: ignore[operator]
        return rows
