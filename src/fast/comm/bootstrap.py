"""The process-group bootstrap: join torch.distributed (gloo on CPU, NCCL on CUDA), started by FAST's local launcher
or under torchrun, and hand back the `Comm` every layer above moves tensors through."""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import struct
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from fast.comm.comm import Comm, connect_timeout, with_deadline
from fast.errors import ConfigError, say

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def under_torchrun() -> bool:
    """True when torchrun (or another launcher) has already set the rendezvous variables."""
    return all(v in os.environ for v in TORCHRUN_VARIABLES)


def resolved(addr: str) -> str:
    """`addr` (run.master_addr, MASTER_ADDR) once it is known to resolve; ConfigError naming it otherwise."""
    try:
        socket.getaddrinfo(addr, None)
    except (socket.gaierror, UnicodeError) as e:
        raise ConfigError(f"run.master_addr {addr!r} does not resolve ({e}): give an address or a name this machine "
                          "knows, or leave it at 127.0.0.1 for a run on this machine") from None  # fmt: skip
    return addr


def interface_to(addr: str) -> tuple[str, str] | None:
    """(interface, local address) through which this machine reaches `addr`, as the routing table says; None when
    it cannot tell (no route, not IPv4). Gloo binds the address the host name resolves to unless told an
    interface, which on many hosts is loopback: peers on other machines could not connect."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((socket.gethostbyname(addr), 9))  # no packet is sent: the kernel picks the route
            local = probe.getsockname()[0]
        for _, name in socket.if_nameindex():
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                try:
                    packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
                except OSError:  # no IPv4 address on it
                    continue
            if socket.inet_ntoa(packed[20:24]) == local:
                return name, local
    except OSError:
        return None
    return None


def gloo_interface(addr: str, say: bool = True) -> dict[str, str]:
    """GLOO_SOCKET_IFNAME for a process that meets its peers at `addr`: loopback for a local run, the user's own
    choice if set, else the interface that routes to `addr` (said in one line when `say`)."""
    if addr.startswith("127.") or addr == "localhost":
        return {"GLOO_SOCKET_IFNAME": "lo"}
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return {"GLOO_SOCKET_IFNAME": os.environ["GLOO_SOCKET_IFNAME"]}
    found = interface_to(addr)
    if found is None:
        return {}
    if say:
        print(f"fast: gloo on {found[0]} ({found[1]}), the interface that routes to {addr}", file=sys.stderr)
    return {"GLOO_SOCKET_IFNAME": found[0]}


def free_port(addr: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def device_for(kind: str) -> torch.device:
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError('`run.device` = "cuda" but no CUDA device is visible: use device = "cpu"')
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


_told_sharing = False


def backend_for(device: torch.device) -> str:
    """gloo on the CPU; on CUDA, NCCL when each of this machine's processes has a GPU of its own, else gloo, which
    moves CUDA tensors through host memory (NCCL refuses two ranks on one GPU)."""
    if device.type != "cuda":
        return "gloo"
    global _told_sharing
    sharing = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > torch.cuda.device_count()
    if sharing and os.environ.get("LOCAL_RANK", "0") == "0" and not _told_sharing:  # once, not at each regroup
        _told_sharing = True
        say(
            f"fast: {os.environ['LOCAL_WORLD_SIZE']} workers share {torch.cuda.device_count()} GPU(s) on this "
            "machine: gloo carries their tensors (NCCL needs a GPU per worker)"
        )
    return "gloo" if sharing else "nccl"


def start(
    rank: int,
    world_size: int,
    addr: str,
    port: int,
    device: torch.device,
    deadline_s: float,
    make_comm: Callable[..., Comm] = Comm,
) -> Comm:
    """Join the job's default process group (`backend_for` the device) and return its `Comm`, made by
    `make_comm(deadline_s=..., device=...)` (an emulated one, say, whose traffic crosses emulated links)."""
    backend = backend_for(device)
    timeout = timedelta(seconds=deadline_s)
    if backend == "gloo" and "GLOO_SOCKET_IFNAME" not in os.environ:  # under torchrun: across machines, say
        os.environ.update(gloo_interface(addr, say=os.environ.get("LOCAL_RANK", "0") == "0"))
    # under torch's elastic agent (torchrun, run.max_restarts) the agent hosts the store and keeps it across
    # restarts, so every attempt gets keys of its own; otherwise rank 0 hosts it
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if os.environ.get("FAST_STORE_FILE"):  # local runs: a file, so nothing listens beyond gloo's loopback pairs
        store = dist.FileStore(f"{os.environ['FAST_STORE_FILE']}-{attempt}", world_size)  # a file per attempt
    else:
        store = _tcp_store(addr, port, world_size, rank == 0 and not agent, timeout)
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"fast/attempt-{attempt}", store),
        rank=rank,
        world_size=world_size,
        timeout=timeout,
    )
    return make_comm(deadline_s=deadline_s, device=device)


def start_group(
    store: Any,
    rank: int,
    world_size: int,
    device: torch.device,
    deadline_s: float,
    counter: Any = None,
    make_comm: Callable[..., Comm] = Comm,
    connect_s: float | None = None,
) -> Comm:
    """Form a default process group of `world_size` over `store` (one generation of a live run's membership,
    fast.runtime.live) and return its `Comm` (`make_comm`'s), counting into `counter` (the count goes on across
    groups). Connecting gives up after `connect_s` (a member gone meanwhile; `store` is then a group store,
    RunStore.for_group); operations then have `deadline_s`."""
    global _group_timeout_s
    backend = backend_for(device)
    timeout = connect_timeout(backend, deadline_s, connect_s)
    _group_timeout_s = max(_group_timeout_s, min(deadline_s, connect_s or deadline_s))
    # torch names a group after the count of groups its process made (the name is part of every key its members
    # meet on), and only a group left resets the count, not an attempt that failed to form: without this, a member
    # that failed to form one more time than another would never meet it again (every re-form would time out)
    dist.distributed_c10d._world.group_count = 0
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    with_deadline(None, deadline_s)
    # the group itself, not None (whatever group is the default when an operation starts): a collective of an
    # earlier generation still running in the background (an emulated one's rounds) fails on its aborted group
    # rather than sending into this one
    group = dist.distributed_c10d._get_default_group()
    return make_comm(group=group, deadline_s=deadline_s, device=device, counter=counter)


_listening: list[socket.socket] = []  # the sockets this process's stores listen on (the store owns their descriptors)


def _tcp_store(addr: str, port: int, world_size: int, host: bool, timeout: timedelta) -> dist.TCPStore:
    """The job's store at `addr`:`port`, hosted by this process if `host`: on a socket bound to `addr` alone (torch's
    own binds every interface, whatever address it is given)."""
    try:
        if not host:
            return dist.TCPStore(addr, port, world_size, is_master=False, timeout=timeout)
        listener = socket.create_server((addr, port), family=socket.getaddrinfo(addr, port)[0][0], backlog=4096)
        _listening.append(listener)
        return dist.TCPStore(addr, port, world_size, is_master=True, timeout=timeout,
                             master_listen_fd=listener.fileno())  # fmt: skip
    except (RuntimeError, OSError) as e:
        if host and ("EADDRINUSE" in str(e) or getattr(e, "errno", None) == errno.EADDRINUSE):
            raise ConfigError(f"port {port} of {addr} is in use (run.master_port, MASTER_PORT): choose another, or "
                              "run.master_port = 0 for any free one") from None  # fmt: skip
        raise


def stop() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


# groups a member left, each perhaps with a collective still running, and when: gloo's abort of such a group, or its
# last reference dropped, waits out the collective's timeout (gloo joins the thread that runs it: 9 s of a 10 s
# timeout, measured, holding the interpreter's lock meanwhile), so a group left is kept until its timeout has passed
_left_groups: list[tuple[float, Any]] = []
_group_timeout_s = 0.0  # the operations' timeout of the groups start_group forms


def abort() -> None:
    """Leave a broken group at once (a live run's member re-forming): its connections close, so a peer still
    waiting in one of its collectives fails now rather than at its deadline. Nothing of it is waited for."""
    now = time.monotonic()
    _left_groups[:] = [(left, group) for left, group in _left_groups if now - left <= _group_timeout_s + 1.0]
    if dist.is_initialized():
        _left_groups.extend((now, group) for group in dist.distributed_c10d._world.pg_names)
        dist.destroy_process_group()
