"""Shared test set-up: quiet progress output, one thread per process, and a process-table check."""

import os

import psutil
import pytest
import torch

os.environ.setdefault("FAST_PROGRESS", "0")
torch.set_num_threads(1)


def _helper(p: psutil.Process) -> bool:
    """multiprocessing's own long-lived helpers (the fork server and resource tracker), not workers."""
    command = " ".join(p.cmdline())
    return "resource_tracker" in command or "forkserver" in command


def fast_children() -> list[psutil.Process]:
    """Live processes started by this test process (workers that should have ended), not counting
    multiprocessing's fork server and resource tracker; workers forked by the fork server do count."""
    try:
        me = psutil.Process()
        helpers = {c.pid for c in me.children() if _helper(c)}
        return [
            p
            for p in me.children(recursive=True)
            if p.pid not in helpers and p.is_running() and p.status() != psutil.STATUS_ZOMBIE
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
    left = [(p.pid, " ".join(p.cmdline())[:200]) for p in fast_children()]
    assert not left, f"processes left behind: {left}"
