"""The processes a test started, found by session: a command started in a session of its own, and everything it
started however far down (the launcher, multiprocessing's fork server and resource tracker, the workers)."""

import os
import socket

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


def _address(hex_address: str) -> str:
    """An address of /proc/net/tcp or tcp6 (the kernel's words, each in this machine's byte order) as text."""
    raw = bytes.fromhex(hex_address)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, words)


def listening(sid: int) -> list[tuple[str, str, int]]:
    """Every TCP socket that a live process of session `sid` listens on, as (process, address, port), read from the
    processes' descriptors and the kernel's tables (/proc/net/tcp and tcp6)."""
    sockets = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in f.read().splitlines()[1:]:
                fields = row.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state == "0A":  # LISTEN
                    address, port = local.rsplit(":", 1)
                    sockets[inode] = (_address(address), int(port, 16))
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if os.getsid(p.pid) != sid:
                continue
            for fd in os.listdir(f"/proc/{p.pid}/fd"):
                target = os.readlink(f"/proc/{p.pid}/fd/{fd}")
                inode = target[len("socket:[") : -1] if target.startswith("socket:[") else None
                if inode in sockets:
                    found.append((" ".join(p.info["cmdline"] or [])[:80], *sockets[inode]))
        except (ProcessLookupError, FileNotFoundError, PermissionError, psutil.Error):
            pass
    return found
