"""The emulated deployment's config tables: `[network]` (links), `[compute]` (slowdowns, stragglers) and `[faults]`.

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
In a sharded run (`run.shards` > 1) a rank names a worker, which is a replica of K processes (its links join
replicas, its compute and crashes are all of its processes': fast.emulation.links.ReplicaLinks, docs/sharded.md).
Times of faults count from the common start of training. Every random draw is keyed by run.seed.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from fast.errors import ConfigError
from fast.units import parse_bandwidth, parse_duration


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


class Churn(_Table):
    """Workers that leave and come back at random, each on its own exponential clock (run.membership = "live")."""

    lifetime: str | float = Field(description="a worker's mean time in the run before it leaves (worker 0 too)")
    absence: str | float = Field(description="its mean time away before it comes back, through `fast join`")
    leave: Literal["kill", "term"] = Field(
        "kill", description='"kill": SIGKILL, a crash; "term": SIGTERM, a clean leave'
    )

    @field_validator("lifetime", "absence")
    @classmethod
    def _time(cls, value: Any) -> Any:
        checked = _checked(parse_duration, value)
        if parse_duration(checked) <= 0:
            raise ValueError('must be a positive duration such as "20s"')
        return checked


class FaultsConfig(_Table):
    crash: list[Crash] = Field(default_factory=list, description="workers that stop at a step or time")
    link_down: list[LinkDown] = Field(default_factory=list, description="links down for an interval")
    churn: Churn | None = Field(
        None, description="workers leave and come back at random (needs run.membership = 'live')"
    )
