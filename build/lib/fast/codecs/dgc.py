"""Deep Gradient Compression (Lin et al. 2018): top-k of an accumulated, momentum-corrected gradient.

Per tensor key, for each gradient g:

    g = g * min(1, clip_norm / ||g||)        local gradient clipping (when clip_norm is set)
    u = momentum * u + g                     momentum correction: accumulate the velocity...
    v = v + u                                ...not the raw gradient
    send the top ratio of |v| (values, indices)
    u, v = 0 where sent                      momentum factor masking

What is not sent stays in v, so DGC carries its own error feedback (do not wrap it in ErrorFeedback).
The momentum is already in what is sent: the receiver applies it with plain SGD (no optimizer momentum).
Sparsity warms up over the first `warmup_epochs` epochs exponentially (75%, 93.75%, 98.4%, ... kept
density 0.25 ** (epoch + 1)) until it reaches the final `ratio`; call `set_epoch` at each epoch start.
`clip_norm` is the per-worker threshold: the paper scales the global one by N ** -0.5 for N workers.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from fast.codecs.base import Codec, fraction, non_negative_int, per_tensor_state
from fast.codecs.packing import BodyReader
from fast.codecs.sparsify import decode_sparse, kept_count, largest_magnitudes, sparse_body, sparse_body_size
from fast.errors import ConfigError

WARMUP_DENSITY_BASE = 0.25


class DGC(Codec):
    """Deep Gradient Compression with momentum correction, factor masking, clipping and warm-up."""

    sparsifier = True
    fixed_size = False
    gradients_only = True

    name = "dgc"
    per_tensor_state = {"velocity": "_velocity", "accumulated": "_accumulated"}

    def __init__(
        self,
        *,
        ratio: float = 0.001,
        momentum: float = 0.9,
        clip_norm: float | None = None,
        warmup_epochs: int = 4,
        min_elements: int = 0,
        seed: int = 0,
    ):
        super().__init__(min_elements=min_elements, seed=seed)
        self.ratio = fraction("ratio", ratio)
        if isinstance(momentum, bool) or not isinstance(momentum, int | float) or not 0 <= momentum < 1:
            raise ConfigError(f"codec option momentum must be a number in [0, 1), got {momentum!r}")
        if clip_norm is not None and (
            isinstance(clip_norm, bool) or not isinstance(clip_norm, int | float) or not clip_norm > 0
        ):
            raise ConfigError(f"codec option clip_norm must be a number > 0 (or unset), got {clip_norm!r}")
        self.momentum = float(momentum)
        self.clip_norm = None if clip_norm is None else float(clip_norm)
        self.warmup_epochs = non_negative_int("warmup_epochs", warmup_epochs)
        self.epoch = 0
        self._velocity: dict[str, torch.Tensor] = {}  # u
        self._accumulated: dict[str, torch.Tensor] = {}  # v

    def set_epoch(self, epoch: int) -> None:
        """Tell DGC which epoch is starting (0-based), for the sparsity warm-up."""
        self.epoch = non_negative_int("epoch", epoch)

    @property
    def density(self) -> float:
        """The fraction of elements sent in the current epoch."""
        if self.epoch < self.warmup_epochs:
            return max(self.ratio, WARMUP_DENSITY_BASE ** (self.epoch + 1))
        return self.ratio

    def velocity(self, key: str = "") -> torch.Tensor | None:
        return self._velocity.get(key)

    def accumulated(self, key: str = "") -> torch.Tensor | None:
        return self._accumulated.get(key)

    def _encode_body(self, x: torch.Tensor, key: str) -> torch.Tensor:
        velocity = per_tensor_state(self._velocity, key, x)
        accumulated = per_tensor_state(self._accumulated, key, x)
        gradient = x
        if self.clip_norm is not None:
            norm = torch.linalg.vector_norm(x.float())
            gradient = x * (self.clip_norm / (norm + 1e-12)).clamp(max=1.0).to(x.dtype)
        velocity.mul_(self.momentum).add_(gradient)
        accumulated.add_(velocity)
        flat = accumulated.view(-1)
        sent = largest_magnitudes(flat, kept_count(flat.numel(), self.density))
        body = sparse_body(flat, sent)
        flat[sent] = 0
        velocity.view(-1)[sent] = 0
        return body

    def _decode_body(self, body: BodyReader, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return decode_sparse(body, shape, dtype)

    def _body_size(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        numel = math.prod(shape)
        return sparse_body_size(numel, kept_count(numel, self.density), dtype)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "epoch": self.epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.epoch = state["epoch"]

    def __repr__(self) -> str:
        return (
            f"DGC(ratio={self.ratio}, momentum={self.momentum}, clip_norm={self.clip_norm}, "
            f"warmup_epochs={self.warmup_epochs})"
        )
