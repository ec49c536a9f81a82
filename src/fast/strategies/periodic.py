"""What the periodic-averaging strategies (`local-sgd`, `diloco`, `streaming-diloco`) share: which codecs they
take, their cost model, the compressed all-reduce their rounds go through, and an optional warm-up of
synchronous steps before the first local one (post-local SGD, Lin et al. 2020; DeepSpeed's `freeze_step`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
from pydantic import Field
from torch import nn

from fast.codecs import Codec
from fast.exchange.allreduce import CompressedAllReduce, Contributors, divide
from fast.perfmodel import Link, StepCost
from fast.perfmodel.step import COLLECTIVE_OPTIONS, periodic
from fast.strategies.base import Strategy, StrategyOptions
from fast.strategies.flat import flat_gradients, write_gradients


class WarmupOptions(StrategyOptions):
    warmup_steps: int = Field(0, ge=0, description="synchronous steps (averaged gradients) before the first local one")


class PeriodicAveraging(Strategy):
    """A strategy that averages something (replicas, pseudo-gradients) every `period` local steps, after
    `warmup_steps` steps that average gradients (the codec applies to those too)."""

    cost_options = COLLECTIVE_OPTIONS | {"period"}
    overlapped: ClassVar[bool] = False  # True: rounds run behind the next steps (their exchange in the background)
    reduces_in_shared_memory = True
    joins = True
    joins_when = "between rounds"

    @classmethod
    def accepts_codec(cls, codec: Codec) -> bool:
        return not codec.gradients_only  # DGC's momentum correction is for gradients, not model differences

    @classmethod
    def cost(cls, n: float, workers: int, link: Link, compute_s: float, options: dict[str, Any]) -> StepCost:
        return periodic(n, workers, link, compute_s, options)

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().setup(model, optimizer)
        codec = self.make_codec()
        background = self.in_background()
        self.compressed = CompressedAllReduce(self.comm, codec, background=background) if codec is not None else None
        self.trainable = [p for p in model.parameters() if p.requires_grad]
        self.last_step = -1
        self.moved = False  # this replica took a step since the last round
        self.means_taken = 0  # the rounds whose mean went through here (`kept_by_now`)

    def in_background(self) -> bool:
        """Whether the rounds' exchanges run behind the next steps, on a thread of their own."""
        return self.overlapped

    def regroup(self) -> None:
        if self.compressed is not None and not self.in_background():  # (its codec's memory is this worker's own)
            self.compressed.comm = self.comm

    def before_optimizer_step(self) -> None:
        super().before_optimizer_step()
        self.moved = True  # (a worker whose loop has ended takes steps without data, which do not get here)

    def round_owed(self, last_round: int) -> bool:
        """Whether the run's end owes a last round: a worker stepped after the one at step `last_round`. No when
        that round (or a later one) found that no worker had moved, or when the workers' last check says none
        took more steps than that (every loop ended on a round: the replicas already agree)."""
        if self.nobody_contributed:
            return False
        return self.steps_of_all is None or self.steps_of_all > last_round + 1

    def mean_of_movers(self, tensor: torch.Tensor) -> bool:
        """Average `tensor` in place over the workers whose replica moved since the last round: a worker whose loop
        has ended (its steps without data, as with DDP's Join) sends zeros and is not counted. False, and
        `nobody_contributed`, when no worker moved: the round then changes nothing (no outer step either)."""
        moved = self.moved
        buffer = with_count(tensor, moved)
        self.comm.all_reduce(buffer)  # (should it fail, the round is given up: this replica still moved since the last)
        self.moved = False
        mean = mean_of_counted(buffer, moved)
        self.nobody_contributed = mean is None
        if mean is not None:
            tensor.copy_(mean)
            self.means_taken += 1
        self.sat_out_mean = tensor if mean is not None and not moved else None
        return mean is not None

    # a joiner may sit out rounds while its state comes (`sits_out_from`); one whose state is not in at a round's
    # mean keeps what the mean gave (`sat_out_mean`), and applies it with `replay_round` once the state is in
    background_heal: ClassVar[bool] = False
    sat_out_mean: torch.Tensor | None = None  # (a worker that did not move) what the last round's mean gave

    def replay_round(self, mean: torch.Tensor, step: int) -> None:
        """A round that ended at `step`, which this worker sat out before it held the run's state, applied to the
        state it holds now as every member applied it: `mean` is what that round's mean gave (`sat_out_mean`)."""
        raise NotImplementedError(f"strategy {self.name} does not sit rounds out")

    def sits_out_from(self, step: int, resuming: bool = False) -> int | None:
        """A round's mean over the workers that moved brings a worker that sat the round out (its share zeros, not
        counted) level with the others, provided it holds the state the round started from: so a joiner sits out
        the round starting at `step` while that state comes behind the others' steps, and takes it before the
        round's mean; if it is not in by then, the joiner keeps what the mean gave, sits the next round out too,
        and applies the kept means once it is (`replay_round`). Not with a codec (its error feedback is every
        worker's own) nor an exchange running behind. A joiner `resuming` a line a re-form cut holds, once the
        rest is in and its kept means applied, the state the round under way started from: it sits out the rest
        of that round, from any step of it."""
        if not self.background_heal or self.compressed is not None or self.in_background() or self.warming_up(step):
            return None
        if self.change_point(step):
            return step + self.options.period
        return step + self.options.period - self.local_steps(step - 1) % self.options.period if resuming else None

    def kept_by_now(self, step: int) -> int:
        return self.means_taken

    def sat_out_to(self, step: int) -> None:
        """The steps sat out count as taken without moving, as the others took them: the state loaded says where its
        source stood when it was sent, and a round given up since (a resumed line's) replays no mean to move it on;
        else the run's end would owe the others a last round and not this worker."""
        self.last_step = max(self.last_step, step - 1)

    def change_point(self, step: int) -> bool:
        """Any warm-up step, and the first step of each round: a joiner starts a round from the shared weights."""
        return self.warming_up(step) or self.local_steps(step - 1) % self.options.period == 0

    def warming_up(self, step: int) -> bool:
        return step < self.options.warmup_steps

    def local_steps(self, step: int) -> int:
        """Local steps done once step `step` is."""
        return step + 1 - self.options.warmup_steps

    def gradients_stay_local(self, step: int) -> bool:
        return not self.warming_up(step)  # (warm-up steps average gradients)

    def after_backward(self, step: int) -> None:
        if self.warming_up(step):
            grads = flat_gradients(self.trainable)
            self.mean(grads, "gradients", [p.shape for p in self.trainable])
            write_gradients(self.trainable, grads)

    def mean(self, tensor: torch.Tensor, key: str, shapes: list[torch.Size]) -> None:
        """Average `tensor` (the flat `shapes`) over the workers in place: through the run's codec, with its error
        feedback, or by a plain all-reduce."""
        if self.compressed is not None:
            self.compressed.average(tensor, key, shapes=shapes)
        else:
            self.comm.all_reduce(tensor, op="mean")


def with_count(tensor: torch.Tensor, moved: bool) -> torch.Tensor:
    """`tensor` and a count of 1 after it, both zeros from a worker that did not move: summed over the workers in
    one all-reduce, the count says how many contributed."""
    return torch.cat([tensor, tensor.new_ones(1)]).mul_(float(moved))


def mean_of_counted(summed: torch.Tensor, moved: bool) -> torch.Tensor | None:
    """The mean of a sum `with_count` made, in place (a view without the count); None when nobody contributed."""
    return mean_of_sum(summed[:-1], summed[-1:], moved)


def mean_of_sum(total: torch.Tensor, contributors: Contributors, moved: bool) -> torch.Tensor | None:
    """`total` divided in place by its number of contributors; None when there were none. A worker that `moved` is
    one of them, so its mean is made on the device and nothing is read back; only one that did not (its loop has
    ended, at the end of the run) reads whether anybody did."""
    if not moved:
        if not (float(contributors.reshape(-1)[0]) if isinstance(contributors, torch.Tensor) else contributors):
            return None
    return divide(total, contributors)


def once(compute: Callable[[], torch.Tensor | None]) -> Callable[[], torch.Tensor | None]:
    """`compute`, run at the first call only: a round's mean in flight, which an evaluation or a checkpoint may
    read before it lands."""
    result: list[torch.Tensor | None] = []

    def first_time() -> torch.Tensor | None:
        if not result:
            result.append(compute())
        return result[0]

    return first_time
