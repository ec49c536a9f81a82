"""A job none of FAST's built-ins knows: a small MLP on scikit-learn's breast-cancer data, as the user's own code.

Importable both as factories for TOML (`[data] factory = "tabular:datasets"`, ...) and by the tests' scripts.
"""

from __future__ import annotations

import torch
from sklearn.datasets import load_breast_cancer
from torch import nn
from torch.utils.data import Dataset, TensorDataset


def datasets(test_size: int = 100) -> tuple[TensorDataset, TensorDataset]:
    features, labels = load_breast_cancer(return_X_y=True)
    x = torch.tensor(features, dtype=torch.float32)
    x = (x - x.mean(0)) / x.std(0)
    y = torch.tensor(labels)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    train, test = order[:-test_size], order[-test_size:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])


class Unlabelled(Dataset):
    """Samples without a `targets` attribute (dirichlet cannot split them)."""

    def __init__(self, base: TensorDataset) -> None:
        self.base = base

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int):
        return self.base[i]


def unlabelled() -> tuple[Dataset, None]:
    return Unlabelled(datasets()[0]), None


def model(hidden: int = 64) -> nn.Module:
    return nn.Sequential(nn.Linear(30, hidden), nn.ReLU(), nn.Linear(hidden, 2))


def not_a_model(hidden: int = 64) -> str:
    return "a model"


def smoothed_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, smoothing: float = 0.0) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x), y, label_smoothing=smoothing)


def error_rate(model: nn.Module, dataset: TensorDataset) -> dict[str, float]:
    x, y = dataset.tensors
    wrong = (model(x).argmax(1) != y).float().mean().item()
    return {"error": wrong, "accuracy": 1 - wrong}
