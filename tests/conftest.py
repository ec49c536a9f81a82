"""Shared test set-up: quiet progress output, one thread per process, and a process-table check."""

import os

import psutil
import pytest
import torch

os.environ.setdefault("FAST_PROGRESS", "0")
torch.set_num_threads(1)


def fast_children() -> list[psutil.Process]:
    """Live processes started by this test process (workers that should have ended)."""
    try:
        return [
            p
            for p in psutil.Process().children(recursive=True)
            if p.is_running()
            and p.status() != psutil.STATUS_ZOMBIE
            and "resource_tracker" not in " ".join(p.cmdline())
        ]
    except psutil.Error:
        return []


@pytest.fixture
def no_orphans():
    yield
    import time

    deadline = time.time() + 10
    while fast_children() and time.time() < deadline:
        time.sleep(0.2)
    left = [p.pid for p in fast_children()]
    assert not left, f"processes left behind: {left}"
