"""Checkpoints: each worker's full training state, written atomically and read back with weights_only."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch


def save_atomic(obj: Any, path: Path) -> None:
    """torch.save to a temporary file beside `path`, then rename: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def checkpoint_path(run_dir: Path, rank: int) -> Path:
    return run_dir / "checkpoints" / f"worker{rank}.pt"


def load(path: Path) -> dict[str, Any]:
    return torch.load(path, map_location="cpu", weights_only=True)
