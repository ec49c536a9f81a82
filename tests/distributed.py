"""Run a function in N real processes over torch.distributed (gloo on 127.0.0.1) for tests."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from fast.comm import bootstrap as engine
from fast.runtime.launch import launch


def _entry(fn: Callable[..., Any], deadline_s: float, args: tuple) -> Any:
    torch.set_num_threads(1)
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    comm = engine.start(rank, size, "127.0.0.1", int(os.environ["MASTER_PORT"]), torch.device("cpu"), deadline_s)
    try:
        return fn(comm, *args)
    finally:
        engine.stop()


def run_distributed(fn: Callable[..., Any], nprocs: int, *args: Any, deadline_s: float = 30.0) -> dict[int, Any]:
    """`fn(comm, *args)` on each of `nprocs` ranks; returns {rank: result}."""
    return launch(_entry, nprocs, (fn, deadline_s, args), port=engine.free_port(), threads=1)
