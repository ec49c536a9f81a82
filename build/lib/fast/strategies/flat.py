"""A model's tensors seen as one flat vector: what averaging, gossip and server strategies move (weights) and what
gradient-exchanging ones send (gradients)."""

from __future__ import annotations

import torch
from torch import nn


class FlatState:
    """Some of a model's tensors (shared with it, not copied) read and written as one flat vector."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = tensors
        self.sizes = [t.numel() for t in tensors]
        self.numel = sum(self.sizes)

    @classmethod
    def of_model(cls, model: nn.Module) -> FlatState:
        """Parameters and floating-point buffers (e.g. BatchNorm statistics): everything averaging moves."""
        return cls([t for t in model.state_dict().values() if t.is_floating_point()])

    @classmethod
    def of_replica(cls, model: nn.Module) -> FlatState:
        """Parameters, then floating-point buffers: what a gossip message carries."""
        return cls([p.data for p in model.parameters()] + [b for b in model.buffers() if b.is_floating_point()])

    @classmethod
    def of_parameters(cls, model: nn.Module) -> FlatState:
        return cls([p.detach() for p in model.parameters()])

    @classmethod
    def of_buffers(cls, model: nn.Module) -> FlatState:
        return cls([b for b in model.buffers() if b.is_floating_point()])

    def read(self) -> torch.Tensor:
        if not self.tensors:
            return torch.zeros(0)
        return torch.cat([t.detach().reshape(-1) for t in self.tensors])

    @torch.no_grad()
    def write(self, flat: torch.Tensor) -> None:
        for tensor, chunk in zip(self.tensors, flat.split(self.sizes), strict=True):
            tensor.copy_(chunk.view_as(tensor))

    @torch.no_grad()
    def add(self, delta: torch.Tensor) -> None:
        for tensor, chunk in zip(self.tensors, delta.split(self.sizes), strict=True):
            tensor.add_(chunk.view_as(tensor).to(tensor.device))


def flat_gradients(params: list[nn.Parameter]) -> torch.Tensor:
    """The gradients of `params` as one flat vector (zeros where a parameter got no gradient)."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])


def write_gradients(params: list[nn.Parameter], flat: torch.Tensor) -> None:
    """Give each parameter its slice of `flat` as its gradient (a copy)."""
    for p, chunk in zip(params, flat.split([p.numel() for p in params]), strict=True):
        p.grad = chunk.view_as(p).clone()
