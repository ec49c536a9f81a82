"""The processes a test started, found by session: a command started in a session of its own, and everything it
started however far down (the launcher, multiprocessing's fork server and resource tracker, the workers)."""

import os

import psutil


def in_session(sid: int) -> list[str]:
    """Live processes of session `sid`, as "pid: command line"."""
    left = []
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            if os.getsid(p.pid) == sid and p.info["status"] != psutil.STATUS_ZOMBIE:
                left.append(f"{p.pid}: {' '.join(p.info['cmdline'] or [])[:160]}")
        except (ProcessLookupError, psutil.Error):
            pass
    return left
