"""What the periodic-averaging strategies (`local-sgd`, `diloco`) share: which codecs they take, their cost model,
and the compressed all-reduce their rounds go through."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fast.codecs import Codec
from fast.exchange.allreduce import CompressedAllReduce
from fast.perfmodel import Link, StepCost
from fast.perfmodel.step import COLLECTIVE_OPTIONS, periodic
from fast.strategies.base import Strategy


class PeriodicAveraging(Strategy):
    """A strategy that averages something (replicas, pseudo-gradients) every `period` steps."""

    cost_options = COLLECTIVE_OPTIONS | {"period"}

    @classmethod
    def accepts_codec(cls, codec: Codec) -> bool:
        return not codec.gradients_only  # DGC's momentum correction is for gradients, not model differences

    @classmethod
    def cost(cls, n: float, workers: int, link: Link, compute_s: float, options: dict[str, Any]) -> StepCost:
        return periodic(n, workers, link, compute_s, options)

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().setup(model, optimizer)
        codec = self.make_codec()
        self.compressed = CompressedAllReduce(self.comm, codec) if codec is not None else None

    def mean(self, tensor: torch.Tensor, key: str, shapes: list[torch.Size]) -> None:
        """Average `tensor` (the flat `shapes`) over the workers in place: through the run's codec, with its error
        feedback, or by a plain all-reduce."""
        if self.compressed is not None:
            self.compressed.average(tensor, key, shapes=shapes)
        else:
            self.comm.all_reduce(tensor, op="mean")
