"""`demo`: DeMo (Peng, Quesnelle, Kingma 2024), decoupled momentum: only the momentum's fast components travel.

Each step every worker adds its gradient to a momentum of its own, m ← β·m + g (`momentum_decay` β), and sends
only m's fast components: the `k` largest coefficients of an orthonormal DCT of each 64 x 64 block (each chunk
of 64 of a vector), the `dct-topk` codec (fast.codecs.chunked). What it sent leaves its momentum, m ← m − q,
so that the slow components build up until they are fast enough to go. The frames are all-gathered, every
worker decodes the same mean of the q's (back in the parameters' basis), and the step's gradient is its sign
(`sign = true`, as the paper's signum update; `false`: the mean itself). The run's `[optimizer]` applies it:
plain SGD (no momentum: the strategy's is the momentum) with the learning rate and weight decay is the paper's.

A sign moves every weight by the whole learning rate each step, which a learning rate made for gradients (the
job's 0.05, say) cannot take: demo brings the step its sign needs, `sign_lr` (the paper's signum learning rate,
1e-3 by default). The sign is scaled by sign_lr / the optimizer's learning rate, so that SGD steps each weight by
sign_lr, times the schedule's factor as it goes; `sign_lr = none` takes the optimizer's learning rate as it is.

The reference code puts the learning rate inside the momentum (m ← β·m + lr·g); with a constant learning rate
that only rescales m, which the sign ignores.
"""

from __future__ import annotations

import torch
from pydantic import Field
from torch import nn

from fast.codecs import Codec, ErrorFeedback
from fast.codecs.chunked import DctTopK
from fast.config import Config
from fast.errors import ConfigError
from fast.strategies.sync import Sync, SyncOptions


class DeMoOptions(SyncOptions):
    momentum_decay: float = Field(0.999, ge=0, lt=1, description="the decoupled momentum's decay (β)")
    k: int = Field(32, ge=1, description="DCT coefficients sent per block (chunk x chunk of a matrix)")
    chunk: int = Field(64, ge=1, le=256, description="side of the blocks the DCT is taken on")
    sign: bool = Field(True, description="the step's gradient is the sign of the mean (the paper's signum)")
    sign_lr: float | None = Field(
        1e-3,
        gt=0,
        description="how far the sign moves each weight in a step (SGD's learning rate for it, scaled by the "
        "schedule); none: the optimizer's learning rate",
    )
    momentum_correction: bool | None = Field(False, description="(the decoupled momentum is the momentum)")


class DeMo(Sync):
    name = "demo"
    takes_shards = False
    shards_why = (
        "it scales each parameter's sign by its optimizer group's learning rate, found by parameter, and a "
        "replica's local shards are not the optimizer's parameters"
    )
    Options = DeMoOptions

    @classmethod
    def accepts_codec(cls, codec: Codec) -> bool:
        return codec.name == "none"  # its compressor is its own (the options above)

    @classmethod
    def check(cls, options: DeMoOptions, config: Config) -> None:
        super().check(options, config)
        if options.momentum_correction:
            raise ConfigError("`strategy.momentum_correction` with demo: its decoupled momentum is the momentum; "
                              "leave it out")  # fmt: skip
        if options.hierarchical:
            raise ConfigError("`strategy.hierarchical` with demo: it gathers frames, not sums; set it to 0")
        if config.optimizer.clip_norm is not None:
            raise ConfigError(f"`optimizer.clip_norm` = {config.optimizer.clip_norm:g} with demo: FAST clips the "
                              "averaged gradient, which for demo is a sign (every entry ±1), so clipping would shrink "
                              "each step by the model's size; drop optimizer.clip_norm")  # fmt: skip
        if config.run.live:
            raise ConfigError("demo with run.membership = 'live': its momenta are each worker's own and a joiner's "
                              "would start empty mid-run; set run.membership = 'fixed'")  # fmt: skip

    @classmethod
    def own_codec(cls, options: DeMoOptions) -> Codec:
        return DctTopK(k=options.k, chunk=options.chunk)

    def make_codec(self) -> Codec:
        return ErrorFeedback(self.own_codec(self.options), decay=self.options.momentum_decay)

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().setup(model, optimizer)
        # what the sign is multiplied by, per bucket: one factor for the whole bucket, or one per parameter where
        # their groups' learning rates differ (as the groups stand now: a schedule's factor applies on top)
        base = {p: group.get("initial_lr", group["lr"]) for group in optimizer.param_groups for p in group["params"]}
        wanted = self.options.sign_lr
        self.scales: list[list[tuple[torch.Tensor, float]]] = []
        for bucket in self.buckets:
            factors = [1.0 if wanted is None or not base[p] else wanted / base[p] for p in bucket.params]
            one = len(set(factors)) == 1
            pairs = [(bucket.grads, factors[0])] if one else list(zip(bucket.views, factors, strict=True))
            self.scales.append([(tensor, factor) for tensor, factor in pairs if factor != 1.0])

    def after_backward(self, step: int) -> None:
        super().after_backward(step)
        if self.options.sign:
            for bucket, scales in zip(self.buckets, self.scales, strict=True):
                bucket.grads.sign_()
                for tensor, factor in scales:
                    tensor.mul_(factor)
