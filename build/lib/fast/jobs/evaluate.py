"""Test-set evaluation of a model: summed loss and correct predictions, in batches, without gradients."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

EvalFn = Callable[[nn.Module], dict[str, float]]


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


def classification_metrics(dataset: Any, device: torch.device, batch_size: int = 1000) -> EvalFn:
    """The built-in evaluation: accuracy and mean cross-entropy of a classifier on `dataset` (x, y pairs)."""
    tensors = getattr(dataset, "tensors", None)

    def metrics(model: nn.Module) -> dict[str, float]:
        if tensors is not None:
            correct, loss, n = evaluate(model, tensors[0], tensors[1], device, batch_size)
        else:
            correct = loss = n = 0.0
            loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size)
            for x, y in loader:
                c, s, k = evaluate(model, x, y, device, batch_size)
                correct, loss, n = correct + c, loss + s, n + k
        return {"accuracy": correct / max(n, 1), "loss": loss / max(n, 1)}

    return metrics
