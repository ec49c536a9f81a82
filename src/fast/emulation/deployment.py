"""The emulated deployment of a run resolved from its config: the link table and per-process machine plans that
the emulation applies, and what happened, for summary.json. (The tables themselves: fast.config.deployment.)"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fast.comm import Comm
from fast.config.deployment import LinkValues
from fast.errors import ConfigError
from fast.units import parse_bandwidth, parse_duration

if TYPE_CHECKING:
    from fast.config import Config
    from fast.emulation.compute import EmulatedMachine
    from fast.emulation.links import LinkTable
    from fast.emulation.network import Network


# -- resolution into what comm emulates --------------------------------------------------------------------
def link_table(config: Config, size: int) -> LinkTable:
    """Every directed link among the run's processes, from [network] and [faults].link_down."""
    from fast.emulation.links import EmulatedLink, LinkTable, Outage

    network = config.network
    if network is None:
        raise ConfigError("the run has no [network] table, so its links are native, not emulated")

    def resolved(values: LinkValues | None, base: EmulatedLink) -> EmulatedLink:
        if values is None:
            return base
        return EmulatedLink(
            latency_s=base.latency_s if values.latency is None else parse_duration(values.latency),
            bandwidth_Bps=base.bandwidth_Bps if values.bandwidth is None else parse_bandwidth(values.bandwidth),
            jitter_s=base.jitter_s if values.jitter is None else parse_duration(values.jitter),
            loss=base.loss if values.loss is None else values.loss,
        )

    lan = EmulatedLink(
        latency_s=parse_duration(network.latency),
        bandwidth_Bps=parse_bandwidth(network.bandwidth),
        jitter_s=parse_duration(network.jitter),
        loss=network.loss,
    )
    links: dict[tuple[int, int], EmulatedLink] = {}
    site_of = {rank: site for site, ranks in network.sites.items() for rank in ranks}
    wan = resolved(network.wan, lan)
    for src in site_of:
        for dst in site_of:
            if site_of[src] != site_of[dst] and src < size and dst < size:
                links[(src, dst)] = wan
    for override in network.links:
        base = links.get((override.a, override.b), lan)
        links[(override.a, override.b)] = links[(override.b, override.a)] = resolved(override, base)
    outages = [
        Outage(down.a, down.b, parse_duration(down.start), parse_duration(down.end))
        for down in (config.faults.link_down if config.faults is not None else [])
    ]
    return LinkTable(size=size, default=lan, links=links, outages=outages)


def network_for(config: Config, size: int, rank: int, worker_processes: int | None = None) -> Network | None:
    """Process `rank`'s emulated network among `size` processes, or None when the run's links are native. In a
    sharded run (`run.shards` = K > 1) the first `worker_processes` (default: all) are its replicas' processes, K
    to a replica, and [network] names replicas (fast.emulation.links.ReplicaLinks)."""
    if config.network is None:
        return None
    from fast.emulation.links import ReplicaLinks
    from fast.emulation.network import Network

    k = config.run.shards
    if k == 1:
        return Network(link_table(config, size), rank, config.run.seed)
    workers = size if worker_processes is None else worker_processes
    table = link_table(config, size - workers + workers // k)
    return Network(ReplicaLinks(table, k, workers), rank, config.run.seed)


def worker_of(config: Config, rank: int, worker_processes: int | None = None) -> int:
    """The rank [compute] and [faults] name process `rank` by: itself, or in a sharded run its replica (a server's
    after the replicas), out of `worker_processes` (default: run.workers × run.shards)."""
    from fast.emulation.links import named_as

    k = config.run.shards
    return named_as(rank, k, config.run.workers * k if worker_processes is None else worker_processes)


def comm_maker(network: Network | None, piece_kb: int = 0) -> Callable[..., Comm]:
    """What makes this process's Comm: a plain one (its all-reduces in pieces of `piece_kb` KiB, if set), or one
    whose traffic crosses the emulated `network` (which drops nothing: its all-reduces go whole)."""
    if network is None:
        return functools.partial(Comm, piece_bytes=piece_kb * 1024 or None)
    from fast.emulation.network import EmulatedComm

    return functools.partial(EmulatedComm, network=network)


def slowdown_of(config: Config, rank: int) -> float:
    """The compute time factor of worker `rank` (1 when none is set)."""
    if config.compute is None or rank >= config.run.workers:
        return 1.0
    slowdown = config.compute.slowdown
    if isinstance(slowdown, dict):
        return float(slowdown.get(str(rank), 1.0))
    return float(slowdown[rank]) if slowdown else 1.0


def machine_for(
    config: Config, rank: int, events_file: Path | None = None, *, simulated: bool = False
) -> EmulatedMachine:
    """The emulated machine under process `rank`: its slowdown, stragglers and crash (all off by default); in a
    simulation, the machine that charges each step its compute in virtual time. A sharded replica's K processes
    take their worker's: the same slowdown, the same draws, the same crash (each of them crashes)."""
    from fast.emulation.compute import EmulatedMachine, MachinePlan

    compute, faults = config.compute, config.faults
    worker = worker_of(config, rank)
    crashes = [c for c in (faults.crash if faults is not None else []) if c.worker == worker]
    steps = [c.step for c in crashes if c.step is not None]
    times = [parse_duration(c.time) for c in crashes if c.time is not None]
    plan = MachinePlan(
        rank=rank,
        worker=worker,
        seed=config.run.seed,
        slowdown=slowdown_of(config, worker),
        straggler_probability=compute.straggler_probability if compute and worker < config.run.workers else 0.0,
        straggler_pause_s=parse_duration(compute.straggler_pause) if compute else 0.0,
        heavy_tail=compute.heavy_tail if compute and worker < config.run.workers else 0.0,
        heavy_tail_max=compute.heavy_tail_max if compute else 20.0,
        crash_step=min(steps) if steps else None,
        crash_time_s=min(times) if times else None,
        step_time_s=None if simulated else config.run.step_time_s,  # (the simulated machine charges it itself)
    )
    if simulated:
        from fast.emulation.simulated_machine import SimulatedMachine
        from fast.emulation.wire import wire

        run = config.run
        return SimulatedMachine(plan, wire(), run.step_time_s, run.eval_time_s, events_file, run.step_time_spread,
                                run.server_time_s)  # fmt: skip
    return EmulatedMachine(plan, events_file)


def emulated(config: Config) -> bool:
    return config.network is not None or config.compute is not None or config.faults is not None


def describe(config: Config, per_rank: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The deployment for summary.json: resolved links and outages, compute, faults, and what each process
    saw happen (straggler pauses, lost messages, waits for down links); None for a native run."""
    if not emulated(config):
        return None
    k = config.run.shards  # (a sharded run's table names its replicas, K processes each: fast.emulation.links)
    network = link_table(config, len(per_rank) // k).describe() if config.network is not None else "native"
    return {
        "network": network if k == 1 or network == "native" else {**network, "shards": k},
        "compute": config.compute.model_dump(mode="json") if config.compute is not None else None,
        "faults": config.faults.model_dump(mode="json", exclude_none=True) if config.faults is not None else None,
        "per_rank": per_rank,
    }


def bytes_per_link(config: Config, everyone: list[dict[str, Any]]) -> list[dict[str, int]]:
    """The bytes each worker sent each other worker (`src`, `dst`: ranks as [network] names them; a sharded run's
    replicas, their processes' counts summed), from every process's byte counter (its figures' `rank` and
    `counter`). A fixed run's: a live run's counters name peers by their places in changing groups."""
    totals: dict[tuple[int, int], int] = {}
    processes = sum(not p["server"] for p in everyone)
    for figures in everyone:
        src = worker_of(config, figures["rank"], processes)
        for peer, sent in figures["counter"]["sent_per_peer"].items():
            dst = worker_of(config, int(peer), processes)
            if dst != src:  # (a sharded replica's traffic inside it is its own, not on a link)
                totals[(src, dst)] = totals.get((src, dst), 0) + sent
    return [{"src": src, "dst": dst, "bytes": sent} for (src, dst), sent in sorted(totals.items())]


def record_of(machine: EmulatedMachine, world: Comm) -> dict[str, Any]:
    """What happened on one process: its machine's events and, when emulated, its network's."""
    network = getattr(world, "network", None)
    return {**machine.record(), **({"network": network.record()} if network is not None else {})}
