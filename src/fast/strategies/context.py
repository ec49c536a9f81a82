"""What a strategy is given: the options every strategy takes, its context (groups, config, rank, a seeded
generator), the model's layout that server processes know, and which replica `final_model` reports."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from pydantic import Field, field_validator
from torch import nn

from fast.comm import Comm
from fast.config import Config, Section


class StrategyOptions(Section):
    """Keys every strategy accepts; subclasses add their own."""

    name: str
    final_model: str = Field("average", description='"average" | "best" | "worker:K" (where replicas differ)')

    @field_validator("final_model")
    @classmethod
    def _final_model(cls, value: str) -> str:
        if value in ("average", "best") or (value.startswith("worker:") and value[7:].isdigit()):
            return value
        raise ValueError('expected "average", "best" or "worker:K"')


def pick_replica(choice: str, ranks: list[int], workers: int, scores: Callable[[], list[float]]) -> int | None:
    """The rank whose replica `final_model` = `choice` reports among the live `ranks`: worker K's (None, the
    average, when K is gone), the best by `scores()` (one per rank, higher is better), or None for the average."""
    if choice.startswith("worker:"):
        wanted = int(choice[7:]) % workers
        return wanted if wanted in ranks else None
    if choice == "best":
        found = scores()
        return ranks[max(range(len(found)), key=found.__getitem__)]
    return None


@dataclass(frozen=True)
class ModelLayout:
    """What a server process knows of the model, which it never holds: the number of parameter elements and of
    state elements (parameters and floating-point buffers, in state_dict order). Worker 0 sends it."""

    parameters: int
    state: int

    @classmethod
    def of(cls, model: nn.Module) -> ModelLayout:
        state = sum(t.numel() for t in model.state_dict().values() if t.is_floating_point())
        return cls(sum(p.numel() for p in model.parameters()), state)


@dataclass
class StrategyContext:
    """What a strategy may use: its group, the whole world (servers too), the run's config and a seeded RNG."""

    comm: Comm
    world: Comm
    config: Config
    device: torch.device
    workers: int
    rank: int
    generator: torch.Generator
    steps_per_epoch: int  # known once the job has a loader (1 until then)
    # the score of a replica for `final_model = "best"` (higher is better), e.g. accuracy on a validation split
    score: Callable[[nn.Module], float] | None = None
    log: Any = field(default=print)
    # a server process hands its checkpoint state here when it has one (fast.worker writes it atomically and
    # gives it back to `load_state_dict` on resume); None where nothing is checkpointed
    save_checkpoint: Callable[[dict[str, Any]], None] | None = None
    # a server's work on one request runs inside this (its machine's `serving`: timed, and charged in a simulation)
    serving: Callable[[], AbstractContextManager[None]] = nullcontext
    # a server of a live run's detached workers: its lines to them, formed as they come
    # (fast.runtime.detached.ServerLines); None where the workers share one group with the servers
    lines: Any = None
