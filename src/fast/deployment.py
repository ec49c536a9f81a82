"""The emulated deployment of a run: the `[network]`, `[compute]` and `[faults]` config tables, checked and
resolved into the link table and per-process machine plans that `comm` emulates.

    [network]                      # every link, each direction (within a site, when there are sites)
    bandwidth = "20Mbit"
    latency = "20ms"
    jitter = "0ms"                 # each message's latency varies uniformly within ± jitter
    loss = 0.0                     # chance that a droppable message is lost (gossip family, async-ps data)
    sites = { a = [0, 1], b = [2, 3] }                 # named sites, by global rank
    wan = { bandwidth = "10Mbit", latency = "50ms" }  # links between sites (unset keys: as above)
    links = [ { a = 0, b = 3, bandwidth = "1Mbit" } ]  # per-link overrides, both directions

    [compute]
    slowdown = [1, 1, 1, 4]        # per-worker compute time factors, or a table { 3 = 4.0 }
    straggler_probability = 0.0    # a worker pauses with this probability per step...
    straggler_pause = "200ms"      # ...for this long
    heavy_tail = 0.0               # Pareto shape of a per-step slowdown factor (0 = off; 1.5 = heavy)
    heavy_tail_max = 20.0          # the largest factor a heavy-tailed draw gives

    [faults]
    crash = [ { worker = 2, step = 100 } ]             # or { worker = 2, time = "30s" }
    link_down = [ { a = 0, b = 1, start = "10s", end = "20s" } ]

No `[network]` table means native communication, untouched. Ranks are global: parameter servers (ranks
from run.workers on) may be placed in sites, links and faults too; ranks in no site use the top-level link.
Times of faults count from the common start of training. Every random draw is keyed by run.seed.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from fast.errors import ConfigError
from fast.units import parse_bandwidth, parse_duration

if TYPE_CHECKING:
    from fast.comm import Comm
    from fast.comm.emulation import Network
    from fast.comm.links import LinkTable
    from fast.comm.machine import EmulatedMachine
    from fast.config import Config


class _Table(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def _checked(parse: Any, value: Any) -> Any:
    """The value as written (it goes back into config.toml) once `parse` accepts it."""
    if value is None:
        return value
    try:
        parse(value)
    except ConfigError as e:
        raise ValueError(str(e)) from None
    return value


class LinkValues(_Table):
    """Some of a link's properties; the unset ones come from the table above."""

    bandwidth: str | float | None = Field(None, description='bandwidth of each direction, e.g. "10Mbit"')
    latency: str | float | None = Field(None, description='one-way latency, e.g. "50ms"')
    jitter: str | float | None = Field(None, description="each message's latency varies within ± jitter")
    loss: float | None = Field(None, ge=0, lt=1, description="probability that a droppable message is lost")

    @field_validator("bandwidth")
    @classmethod
    def _bandwidth(cls, value: Any) -> Any:
        return _checked(parse_bandwidth, value)

    @field_validator("latency", "jitter")
    @classmethod
    def _duration(cls, value: Any) -> Any:
        return _checked(parse_duration, value)


class LinkOverride(LinkValues):
    """The link between ranks `a` and `b` (both directions)."""

    a: int = Field(ge=0)
    b: int = Field(ge=0)

    @model_validator(mode="after")
    def _two_ranks(self) -> LinkOverride:
        if self.a == self.b:
            raise ValueError(f"a link joins two different ranks, got a = b = {self.a}")
        return self


class NetworkConfig(LinkValues):
    bandwidth: str | float = Field("1Gbit", description="every link, each direction (the LAN with sites)")
    latency: str | float = Field("0ms", description="one-way latency of every link")
    jitter: str | float = Field("0ms", description="each message's latency varies within ± jitter")
    loss: float = Field(0.0, ge=0, lt=1, description="probability that a droppable message is lost")
    sites: dict[str, list[int]] = Field(default_factory=dict, description="named sites: lists of ranks")
    wan: LinkValues | None = Field(None, description="links between sites; unset keys as the top level")
    links: list[LinkOverride] = Field(default_factory=list, description="per-link overrides")

    @field_validator("sites")
    @classmethod
    def _sites(cls, sites: dict[str, list[int]]) -> dict[str, list[int]]:
        seen: dict[int, str] = {}
        for site, ranks in sites.items():
            for rank in ranks:
                if rank < 0:
                    raise ValueError(f"site {site!r} lists rank {rank}: ranks are >= 0")
                if rank in seen:
                    raise ValueError(f"rank {rank} is in both sites {seen[rank]!r} and {site!r}")
                seen[rank] = site
        return sites

    @model_validator(mode="after")
    def _wan_needs_sites(self) -> NetworkConfig:
        if self.wan is not None and len(self.sites) < 2:
            raise ValueError("`wan` sets the links between sites: define at least two `sites` or drop `wan`")
        return self


class ComputeConfig(_Table):
    slowdown: list[float] | dict[str, float] = Field(
        default_factory=list, description="per-worker compute time factors (>= 1): a list, or {rank = factor}"
    )
    straggler_probability: float = Field(0.0, ge=0, le=1, description="chance that a worker pauses in a step")
    straggler_pause: str | float = Field("200ms", description="how long a straggler pauses")
    heavy_tail: float = Field(0.0, ge=0, description="Pareto shape of a per-step slowdown factor; 0 = off")
    heavy_tail_max: float = Field(20.0, ge=1, description="the largest factor a heavy-tailed draw gives")

    @field_validator("straggler_pause")
    @classmethod
    def _pause(cls, value: Any) -> Any:
        return _checked(parse_duration, value)

    @field_validator("slowdown")
    @classmethod
    def _factors(cls, value: Any) -> Any:
        factors = value.values() if isinstance(value, dict) else value
        for factor in factors:
            if not factor >= 1:
                raise ValueError(f"slowdown factors multiply compute time and must be >= 1, got {factor}")
        for key in value if isinstance(value, dict) else ():
            if not key.isdigit():
                raise ValueError(f"slowdown table keys are worker ranks, got {key!r}")
        return value


class Crash(_Table):
    worker: int = Field(ge=0, description="the rank that crashes")
    step: int | None = Field(None, ge=0, description="crash before running this step (0-based)")
    time: str | float | None = Field(None, description="or: crash this long after the start of training")

    @field_validator("time")
    @classmethod
    def _time(cls, value: Any) -> Any:
        return _checked(parse_duration, value)

    @model_validator(mode="after")
    def _when(self) -> Crash:
        if (self.step is None) == (self.time is None):
            raise ValueError("a crash needs exactly one of `step` or `time`")
        return self


class LinkDown(_Table):
    a: int = Field(ge=0)
    b: int = Field(ge=0)
    start: str | float = Field(description="when the link goes down, from the start of training")
    end: str | float = Field(description="when it is up again")

    @field_validator("start", "end")
    @classmethod
    def _time(cls, value: Any) -> Any:
        return _checked(parse_duration, value)

    @model_validator(mode="after")
    def _interval(self) -> LinkDown:
        if self.a == self.b:
            raise ValueError(f"a link joins two different ranks, got a = b = {self.a}")
        if parse_duration(self.end) <= parse_duration(self.start):
            raise ValueError(f"end {self.end!r} must come after start {self.start!r}")
        return self


class FaultsConfig(_Table):
    crash: list[Crash] = Field(default_factory=list, description="workers that stop at a step or time")
    link_down: list[LinkDown] = Field(default_factory=list, description="links down for an interval")


# -- checks that need the whole config ---------------------------------------------------------------------
def world_size(config: Config) -> int:
    """Processes of the run: the workers and the strategy's servers."""
    from fast.strategies import strategy_class, strategy_options

    options = strategy_options(config)
    return config.run.workers + strategy_class(config.strategy.name).server_count(options, config.run.workers)


def check_deployment(config: Config) -> None:
    """ConfigError naming the key when a rank in [network], [compute] or [faults] is not in the run."""
    if config.network is None and config.compute is None and config.faults is None:
        return
    size, workers = world_size(config), config.run.workers

    def in_run(key: str, rank: int, limit: int = size) -> None:
        if rank >= limit:
            what = "workers" if limit == workers else "processes (workers, then servers)"
            raise ConfigError(f"`{key}` names rank {rank}, but the run has {limit} {what}: use ranks below {limit}")

    if config.network is not None:
        if config.run.device != "cpu":
            raise ConfigError('[network] emulates links between CPU processes: set run.device = "cpu"')
        for site, ranks in config.network.sites.items():
            for rank in ranks:
                in_run(f"network.sites.{site}", rank)
        for i, link in enumerate(config.network.links):
            in_run(f"network.links.{i}.a", link.a)
            in_run(f"network.links.{i}.b", link.b)
    if config.compute is not None:
        slowdown = config.compute.slowdown
        if isinstance(slowdown, list) and slowdown and len(slowdown) != workers:
            raise ConfigError(
                f"`compute.slowdown` has {len(slowdown)} factors for {workers} workers: give one per worker, "
                "or a table {rank = factor}"
            )
        for key in slowdown if isinstance(slowdown, dict) else ():
            in_run(f"compute.slowdown.{key}", int(key), workers)
    if config.faults is not None:
        for i, crash in enumerate(config.faults.crash):
            in_run(f"faults.crash.{i}.worker", crash.worker)
            if crash.step is not None and crash.worker >= workers:
                raise ConfigError(f"`faults.crash.{i}`: a server has no steps: give it a `time` instead")
        for i, down in enumerate(config.faults.link_down):
            in_run(f"faults.link_down.{i}.a", down.a)
            in_run(f"faults.link_down.{i}.b", down.b)
        if config.faults.link_down and config.network is None:
            raise ConfigError("`faults.link_down` needs emulated links: add a [network] table")


# -- resolution into what comm emulates --------------------------------------------------------------------
def link_table(config: Config, size: int | None = None) -> LinkTable:
    """Every directed link among the run's processes, from [network] and [faults].link_down."""
    from fast.comm.links import EmulatedLink, LinkTable, Outage

    network = config.network
    if network is None:
        raise ConfigError("the run has no [network] table, so its links are native, not emulated")
    size = world_size(config) if size is None else size

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


def network_for(config: Config, size: int, rank: int) -> Network | None:
    """This process's emulated network, or None when the run's links are native."""
    if config.network is None:
        return None
    from fast.comm.emulation import Network

    return Network(link_table(config, size), rank, config.run.seed)


def slowdown_of(config: Config, rank: int) -> float:
    """The compute time factor of worker `rank` (1 when none is set)."""
    if config.compute is None or rank >= config.run.workers:
        return 1.0
    slowdown = config.compute.slowdown
    if isinstance(slowdown, dict):
        return float(slowdown.get(str(rank), 1.0))
    return float(slowdown[rank]) if slowdown else 1.0


def machine_for(config: Config, rank: int, events_file: Path | None = None) -> EmulatedMachine:
    """The emulated machine under process `rank`: its slowdown, stragglers and crash (all off by default)."""
    from fast.comm.machine import EmulatedMachine, MachinePlan

    compute, faults = config.compute, config.faults
    crashes = [c for c in (faults.crash if faults is not None else []) if c.worker == rank]
    steps = [c.step for c in crashes if c.step is not None]
    times = [parse_duration(c.time) for c in crashes if c.time is not None]
    plan = MachinePlan(
        rank=rank,
        seed=config.run.seed,
        slowdown=slowdown_of(config, rank),
        straggler_probability=compute.straggler_probability if compute and rank < config.run.workers else 0.0,
        straggler_pause_s=parse_duration(compute.straggler_pause) if compute else 0.0,
        heavy_tail=compute.heavy_tail if compute and rank < config.run.workers else 0.0,
        heavy_tail_max=compute.heavy_tail_max if compute else 20.0,
        crash_step=min(steps) if steps else None,
        crash_time_s=min(times) if times else None,
    )
    return EmulatedMachine(plan, events_file)


def emulated(config: Config) -> bool:
    return config.network is not None or config.compute is not None or config.faults is not None


def describe(config: Config, per_rank: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The deployment for summary.json: resolved links and outages, compute, faults, and what each process
    saw happen (straggler pauses, lost messages, waits for down links); None for a native run."""
    if not emulated(config):
        return None
    return {
        "network": link_table(config, len(per_rank)).describe() if config.network is not None else "native",
        "compute": config.compute.model_dump(mode="json") if config.compute is not None else None,
        "faults": config.faults.model_dump(mode="json", exclude_none=True) if config.faults is not None else None,
        "per_rank": per_rank,
    }


def record_of(machine: EmulatedMachine, world: Comm) -> dict[str, Any]:
    """What happened on one process: its machine's events and, when emulated, its network's."""
    network = getattr(world, "network", None)
    return {**machine.record(), **({"network": network.record()} if network is not None else {})}
