"""A new strategy written outside FAST: every `every` steps, average the weights with a ring all-reduce.

Importing this file registers the strategy "ring-average" (any `Strategy` subclass with a `name` does).
It moves tensors only through `comm`: a reduce-scatter, then an all-gather, each N - 1 hops around the
ring of the workers in rank order, so every worker sends 2(N - 1)/N of the model per averaging.

    python examples/custom_strategy.py     # trains digits on 3 workers and prints the accuracy
"""

from __future__ import annotations

import torch
from pydantic import Field

import fast
from fast.strategies import Strategy, StrategyOptions


class RingAverageOptions(StrategyOptions):
    every: int = Field(4, ge=1, description="steps between two averagings")


class RingAverage(Strategy):
    name = "ring-average"
    Options = RingAverageOptions
    decentralised = True  # replicas differ between averagings; `final_model` chooses the reported one

    def setup(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().setup(model, optimizer)
        n, me = self.comm.size, self.comm.index()
        self.right, self.left = self.comm.ranks[(me + 1) % n], self.comm.ranks[(me - 1) % n]

    def after_optimizer_step(self, step: int) -> None:
        if (step + 1) % self.options.every or self.comm.size == 1:
            return
        params = list(self.model.parameters())
        flat = torch.cat([p.detach().reshape(-1) for p in params])
        self.ring_all_reduce(flat)
        flat /= self.comm.size
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
