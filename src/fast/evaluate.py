"""Test-set evaluation of a model: summed loss and correct predictions, in batches, without gradients."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


@torch.no_grad()
def evaluate(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, device: torch.device, batch_size: int = 1000
) -> tuple[float, float, int]:
    """(correct, summed cross-entropy, count) of `model` on `x`, `y`."""
    was_training = model.training
    model.eval()
    correct, loss = 0.0, 0.0
    for i in range(0, len(x), batch_size):
        xb, yb = x[i : i + batch_size].to(device), y[i : i + batch_size].to(device)
        logits = model(xb)
        loss += float(F.cross_entropy(logits, yb, reduction="sum"))
        correct += float((logits.argmax(1) == yb).sum())
    model.train(was_training)
    return correct, loss, len(x)


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor, device: torch.device) -> float:
    correct, _, n = evaluate(model, x, y, device)
    return correct / max(n, 1)
