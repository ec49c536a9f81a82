"""Checks on what runs wrote, shared by the test modules."""

from pathlib import Path

import torch


def assert_same_model(first: Path, second: Path) -> None:
    """The model.pt of two run folders hold the same tensors, bit for bit."""
    a = torch.load(Path(first) / "model.pt", weights_only=True)
    b = torch.load(Path(second) / "model.pt", weights_only=True)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
