"""Achieved TFLOP/s and model FLOPs utilisation (MFU) of a worker on a GPU, for the summary and the progress line.

The model's training FLOPs per sample are counted once, at the first metric record (outside the steps): torch's
FlopCounterMode on one sample of the first batch the loop trained on, forward only, times 3 for forward and backward
(fast.perfmodel.flops). A worker's achieved FLOP/s are that times the samples it trained on per second of training
time; its MFU is that over its GPU's peak (fast.perfmodel.peak). On the CPU, or a GPU the table does not know, there
are none (unless FAST_PEAK_TFLOPS gives the peak), and nothing is counted.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fast.perfmodel.flops import TRAINING_FLOPS_PER_FORWARD_FLOP, forward_flops
from fast.perfmodel.peak import peak_tflops


def one_sample(value: Any) -> Any:
    """The first sample of a batch's inputs (each tensor's first row, copied on its device; tuples, lists and dicts
    kept; other values as they are)."""
    if isinstance(value, torch.Tensor):
        return value[:1].clone() if value.dim() > 0 else value
    if isinstance(value, tuple | list):
        return type(value)(one_sample(v) for v in value)
    if isinstance(value, dict):
        return {k: one_sample(v) for k, v in value.items()}
    return value


class Throughput:
    """One worker's figures: see the module docstring."""

    def __init__(self, device: torch.device) -> None:
        self.peak = peak_tflops(device)  # TFLOP/s; None: no figures
        self.sample: tuple[Any, Any] | None = None  # (args, kwargs) of one sample of the first training batch
        self.flops_per_sample: float | None = None  # training FLOPs; 0.0 when they could not be counted

    @property
    def wanted(self) -> bool:
        return self.peak is not None

    def first_batch(self, args: Any, kwargs: Any) -> None:
        """The inputs of the first training forward: one sample of them is kept for the count."""
        if self.sample is None and self.flops_per_sample is None:
            self.sample = (one_sample(tuple(args)), one_sample(dict(kwargs or {})))

    def count(self, model: nn.Module) -> None:
        """Count the training FLOPs of one sample, once (a model whose forward cannot be counted gives none)."""
        if self.sample is None or self.flops_per_sample is not None:
            return
        args, kwargs = self.sample
        self.sample = None
        try:
            forward = forward_flops(getattr(model, "_orig_mod", model), args, kwargs)  # (a compiled model's own)
        except Exception:  # a measurement: never the reason a run fails
            forward = 0.0
        self.flops_per_sample = TRAINING_FLOPS_PER_FORWARD_FLOP * forward

    def figures(self, samples: int, seconds: float) -> dict[str, float]:
        """{"tflops": achieved TFLOP/s, "mfu": their share of the peak} for `samples` trained in `seconds`, or {}."""
        if not self.flops_per_sample or self.peak is None or seconds <= 0:
            return {}
        tflops = self.flops_per_sample * samples / seconds / 1e12
        return {"tflops": float(f"{tflops:.4g}"), "mfu": float(f"{tflops / self.peak:.4g}")}
