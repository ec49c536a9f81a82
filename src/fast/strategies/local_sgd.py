"""`local-sgd`: every worker trains alone for `period` steps, then all replicas are averaged (model averaging).

Optionally the run starts with `warmup_steps` synchronous steps that average gradients every step (the
replicas stay identical through them). Each worker keeps its own optimizer state (momentum, Adam moments)
across averaging rounds; only the weights and floating-point buffers are averaged. The last averaging comes
at the end of the run, so every replica ends with the same weights.

With a `[codec]`, the averaging sends each replica's difference from the last average through the codec
(with its error feedback; `fast.exchange.allreduce`), and every replica becomes that average plus the mean
decoded difference; warm-up gradients go through the codec too.
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import Field
from torch import nn

from fast.strategies.flat import FlatState
from fast.strategies.periodic import PeriodicAveraging, WarmupOptions


class LocalSGDOptions(WarmupOptions):
    period: int = Field(8, ge=1, description="local steps between two averagings of the replicas")


class LocalSGD(PeriodicAveraging):
    name = "local-sgd"
    Options = LocalSGDOptions
    background_heal = True

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().setup(model, optimizer)
        self.state = FlatState.of_model(model)
        if self.compressed is not None:
            self.anchor = self.state.read().clone()  # the last average, the same on every worker
        self.averagings = 0
        self.last_averaged = -1
        self.agreed = False

    def after_optimizer_step(self, step: int) -> None:
        self.last_step = step
        local_steps = self.local_steps(step)
        if local_steps > 0 and local_steps % self.options.period == 0:
            self.average()

    def average(self) -> None:
        """Replace every replica by the mean of all replicas."""
        if self.compressed is not None:
            difference = self.state.read() - self.anchor
            self.mean(difference, "difference", [t.shape for t in self.state.tensors])
            self.anchor += difference
            self.state.write(self.anchor)
        else:
            weights = self.state.read()
            if not self.mean_of_movers(weights):
                return  # every worker's loop has ended: the replicas are the last average already
            self.state.write(weights)
        self.averagings += 1
        self.last_averaged = self.last_step

    def end_of_run(self) -> None:
        # in the warm-up gradients were averaged: the replicas agree
        if not self.warming_up(self.last_step) and self.last_averaged != self.last_step:
            if self.compressed is not None or self.round_owed(self.last_averaged):
                self.average()
        self.agreed = True  # every replica holds the last average

    def final_model(self, choice: str | None = None) -> nn.Module:
        """After the run's end every replica is the average (no communication); before it, the average of the
        replicas; "best" and "worker:K" pick one."""
        if self.agreed and (choice or self.options.final_model) == "average":
            return self.model
        return super().final_model(choice)

    def replay_round(self, mean: torch.Tensor, step: int) -> None:
        """The round's mean is the replicas' average: every replica became it."""
        self.state.write(mean)
        self.averagings += 1
        self.last_step = self.last_averaged = step

    def state_dict(self) -> dict[str, Any]:
        """The averaging counters and, with a codec, the last average and the codec's error feedback (the
        schedule itself follows the step, and each worker's replica and optimizer are in its checkpoint)."""
        state: dict[str, Any] = {
            "averagings": self.averagings,
            "last_step": self.last_step,
            "last_averaged": self.last_averaged,
        }
        if self.compressed is not None:
            state.update(anchor=self.anchor.clone(), codec=self.compressed.state_dict())
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.averagings = int(state.get("averagings", 0))
        self.last_step = int(state.get("last_step", -1))
        self.last_averaged = int(state.get("last_averaged", -1))
        if self.compressed is not None and "codec" in state:
            self.anchor.copy_(state["anchor"])
            self.compressed.load_state_dict(state["codec"])

    def summary(self) -> dict[str, int]:
        return {"averagings": self.averagings}
