"""Run a function in N real processes over torch.distributed (gloo on 127.0.0.1) for tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fast.runtime.launch import launch_group


def run_distributed(fn: Callable[..., Any], nprocs: int, *args: Any, deadline_s: float = 30.0) -> dict[int, Any]:
    """`fn(comm, *args)` on each of `nprocs` ranks; returns {rank: result}."""
    return launch_group(fn, nprocs, *args, deadline_s=deadline_s)
