"""A new strategy written outside FAST: every `every` steps, average the weights with a ring all-reduce.

Importing this file registers the strategy "ring-average" (any `Strategy` subclass with a `name` does); a
config names it with `[strategy] name = "ring-average"` and `module = "examples.custom_strategy"`. It moves
tensors only through `comm`: a reduce-scatter, then an all-gather, each N - 1 hops around the ring of the
workers in rank order, so every worker sends 2(N - 1)/N of the model per averaging. It declares the codecs it
can apply by their capabilities (summable ones: the ring adds values in the codec's wire dtype, e.g. fp16),
and its cost model, which `fast predict` uses.

    python examples/custom_strategy.py     # trains digits on 3 workers and prints the accuracy
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import Field

import fast
from fast.codecs import Codec, ErrorFeedback
from fast.perfmodel import Link, StepCost, allreduce_cost
from fast.strategies import Strategy, StrategyOptions


class RingAverageOptions(StrategyOptions):
    every: int = Field(4, ge=1, description="steps between two averagings")


class RingAverage(Strategy):
    name = "ring-average"
    Options = RingAverageOptions
    replicas_differ = True  # between averagings; `final_model` chooses the reported one
    cost_options = frozenset({"every"})  # what `cost` reads of the options

    @classmethod
    def accepts_codec(cls, codec: Codec) -> bool:
        # the ring adds what arrives, so the values must add up as they travel; it keeps no error-feedback memory
        return codec.summable and not isinstance(codec, ErrorFeedback)

    @classmethod
    def cost(cls, n: float, workers: int, link: Link, compute_s: float, options: dict[str, Any]) -> StepCost:
        """A ring all-reduce of the model (`n` bytes) every `every` steps, waited for after the step's compute."""
        seconds, nbytes = allreduce_cost(n, workers, link, "ring")
        every = options["every"]
        return StepCost(compute_s + seconds / every, compute_s, seconds / every, nbytes / every)

    def setup(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().setup(model, optimizer)
        n, me = self.comm.size, self.comm.index()
        self.right, self.left = self.comm.ranks[(me + 1) % n], self.comm.ranks[(me - 1) % n]
        codec = self.make_codec()  # the run's [codec], or None
        self.wire_dtype = codec.wire_dtype(torch.float32) if codec is not None else torch.float32

    def after_optimizer_step(self, step: int) -> None:
        if (step + 1) % self.options.every or self.comm.size == 1:
            return
        params = list(self.model.parameters())
        flat = torch.cat([p.detach().reshape(-1) for p in params]).to(self.wire_dtype)
        self.ring_all_reduce(flat)
        flat = flat.float() / self.comm.size
        for p, chunk in zip(params, flat.split([p.numel() for p in params]), strict=True):
            p.data.copy_(chunk.view_as(p))

    def ring_all_reduce(self, flat: torch.Tensor) -> None:
        """Sum `flat` across the ring in place: reduce-scatter, then all-gather of the summed chunks."""
        n, me = self.comm.size, self.comm.index()
        chunks = list(flat.chunk(n))
        chunks += [flat[:0]] * (n - len(chunks))  # fewer values than workers: empty chunks
        for hop in range(2 * (n - 1)):
            out, into = (me - hop) % n, (me - hop - 1) % n
            incoming = torch.empty_like(chunks[into])
            handle = self.comm.irecv(incoming, self.left)
            self.comm.send(chunks[out].contiguous(), self.right)
            handle.wait()
            if hop < n - 1:
                chunks[into] += incoming  # reduce-scatter: after n - 1 hops chunk me + 1 holds the sum
            else:
                chunks[into].copy_(incoming)  # all-gather: pass the summed chunks on


if __name__ == "__main__":
    summary = fast.train(
        data__name="digits",
        model__name="mlp",
        run__workers=3,
        run__epochs=4,
        run__batch_size=16,
        strategy__name="ring-average",
        strategy__every=4,
        out="runs/custom-strategy",
    )
    accuracy, sent = summary["final_test_accuracy"], summary["bytes_sent"]
    print(f"ring-average: test accuracy {accuracy:.3f}, {sent} bytes sent")
