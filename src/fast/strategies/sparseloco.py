"""`sparseloco`: SparseLoCo (Sarfi et al. 2025), DiLoCo's rounds with sparse, 2-bit pseudo-gradients.

Every worker runs `period` (H) steps of its inner optimizer from the shared weights θ, as in DiLoCo. Its
pseudo-gradient Δ = θ − θ_local goes into a decaying error-feedback memory, e ← β·e + Δ (`error_decay` β),
which stands in for DiLoCo's outer momentum; what is sent is e's k largest entries in each 64 x 64 block,
quantised to 2 bits (the `chunk-topk` codec, fast.codecs.chunked), and what was sent leaves the memory:
e ← e − Δ̂. The frames are all-gathered (fast.exchange.allreduce), every worker decodes the same mean
Δ̄ = (1/R) Σ_r Δ̂_r, and θ ← θ − α·Δ̄ (`outer_lr` α, no momentum). So a round sends about
ratio · (12 + 2) bits per parameter instead of DiLoCo's 32.

The reference code averages each coordinate over the workers that selected it; the paper's update, which this
follows, divides by R.
"""

from __future__ import annotations

import torch
from pydantic import Field

from fast.codecs import Codec, ErrorFeedback
from fast.codecs.chunked import ChunkTopK
from fast.strategies.diloco import DiLoCo
from fast.strategies.periodic import WarmupOptions


class SparseLoCoOptions(WarmupOptions):
    period: int = Field(16, ge=1, description="inner steps per round (H)")
    outer_lr: float = Field(1.0, gt=0, description="the outer step's learning rate (α): θ ← θ − α · mean")
    error_decay: float = Field(0.95, ge=0, le=1, description="the error-feedback memory's decay (β)")
    ratio: float = Field(128 / 4096, gt=0, le=1, description="share of each block's entries sent (top-k)")
    bits: int = Field(2, ge=0, le=8, description="bits per sent value (0: fp32)")
    chunk: int = Field(64, ge=1, le=256, description="side of the blocks top-k picks in (64: 64 x 64 blocks)")


class SparseLoCo(DiLoCo):
    name = "sparseloco"
    Options = SparseLoCoOptions
    catch_up_copies = 1.0  # θ (a joiner's error feedback starts empty)

    @classmethod
    def accepts_codec(cls, codec: Codec) -> bool:
        return codec.name == "none"  # its compressor is its own (the options above)

    @classmethod
    def own_codec(cls, options: SparseLoCoOptions) -> Codec:
        return ChunkTopK(ratio=options.ratio, bits=options.bits, chunk=options.chunk)

    def make_codec(self) -> Codec:
        return ErrorFeedback(self.own_codec(self.options), decay=self.options.error_decay)

    def outer_optimizer(self, theta: torch.Tensor) -> torch.optim.Optimizer:
        """Plain SGD: the error feedback is the momentum."""
        return torch.optim.SGD([theta], lr=self.options.outer_lr)

    def summary(self) -> dict[str, object]:
        return {**super().summary(), "codec": repr(self.compressed.codec)}
