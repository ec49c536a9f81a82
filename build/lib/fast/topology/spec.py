"""Topologies by name, as the config (`strategy.topology = "torus:4x4"`) and the command line write them."""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Any

from fast.errors import ConfigError
from fast.topology import builders
from fast.topology.graph import Topology
from fast.topology.schedules import ExponentialOnePeer, PeerSchedule, RandomMatchings

if TYPE_CHECKING:
    import networkx

NAMES = ("complete", "ring", "torus:RxC", "exponential", "star", "random-regular:K")
SCHEDULE_NAMES = ("exponential-one-peer", "random-matchings")
_TORUS = re.compile(r"torus:(\d+)x(\d+)")
_RANDOM_REGULAR = re.compile(r"random-regular:(\d+)")


def closest_torus(size: int) -> str:
    """The squarest torus:RxC with R * C = size (R <= C)."""
    rows = max(r for r in range(1, math.isqrt(size) + 1) if size % r == 0)
    return f"torus:{rows}x{size // rows}"


def _torus_shape(spec: str) -> tuple[int, int] | None:
    match = _TORUS.fullmatch(spec)
    return (int(match[1]), int(match[2])) if match else None


def _unknown(spec: Any) -> ConfigError:
    return ConfigError(
        f"strategy.topology = {spec!r} is not a topology: use one of {', '.join(NAMES)} "
        "or an edge list [[0, 1], [1, 2], ...]"
    )


def parse_topology(
    spec: str | list[list[int]] | networkx.Graph | Topology,
    size: int,
    *,
    weights: str = "metropolis",
    seed: int = 0,
) -> Topology:
    """The topology `spec` names, over `size` workers, with the named mixing weights.

    `spec` is a name ("complete", "ring", "torus:RxC", "exponential", "star", "random-regular:K"), an
    edge list [[0, 1], [1, 2], ...], a networkx graph or a Topology; `seed` picks the random graph.
    """
    if size < 1:
        raise ConfigError(f"a topology needs at least one worker, got {size}")
    if isinstance(spec, Topology):
        topology = spec
    elif isinstance(spec, str):
        topology = _from_name(spec.strip().lower(), size, weights, seed)
    elif isinstance(spec, list | tuple):
        topology = builders.from_edges(size, spec, weights)
    elif hasattr(spec, "edges") and hasattr(spec, "nodes"):
        topology = builders.from_networkx(spec, weights)
    else:
        raise _unknown(spec)
    if topology.size != size:
        raise ConfigError(
            f"strategy.topology {topology.name!r} has {topology.size} workers but the run has {size}: make them match"
        )
    return topology


def _from_name(spec: str, size: int, weights: str, seed: int) -> Topology:
    simple = {
        "complete": builders.complete,
        "ring": builders.ring,
        "exponential": builders.exponential,
        "star": builders.star,
    }
    if spec in simple:
        return simple[spec](size, weights)
    shape = _torus_shape(spec)
    if shape:
        rows, cols = shape
        if rows * cols != size:
            raise ConfigError(
                f"strategy.topology = {spec!r} has {rows * cols} workers but the run has {size}: "
                f"set strategy.topology = {closest_torus(size)!r} (rows x cols = workers) "
                "or change the worker count"
            )
        return builders.torus(rows, cols, weights)
    if spec.startswith("torus"):
        raise ConfigError(
            f"strategy.topology = {spec!r}: write the torus shape as torus:RxC, e.g. {closest_torus(size)!r}"
        )
    match = _RANDOM_REGULAR.fullmatch(spec)
    if match:
        return builders.random_regular(size, int(match[1]), seed, weights)
    if spec.startswith("random-regular"):
        raise ConfigError(
            f"strategy.topology = {spec!r}: write the degree as random-regular:K, e.g. 'random-regular:4'"
        )
    raise _unknown(spec)


def parse_schedule(spec: str, size: int, *, seed: int = 0) -> PeerSchedule:
    """The time-varying schedule `spec` names: "exponential-one-peer" or "random-matchings"."""
    name = spec.strip().lower()
    if name == "exponential-one-peer":
        return ExponentialOnePeer(size)
    if name == "random-matchings":
        return RandomMatchings(size, seed)
    raise ConfigError(f"schedule {spec!r} is not known: use one of {', '.join(SCHEDULE_NAMES)}")


def format_topology(spec: str, size: int | None = None, *, weights: str = "metropolis", seed: int = 0) -> str:
    """What `fast topology SPEC` prints: each worker's neighbours and weights, and the spectral gap.

    A torus:RxC knows its size; every other topology needs it (--workers N).
    """
    if size is None:
        shape = _torus_shape(spec.strip().lower())
        if shape is None:
            raise ConfigError(f"topology {spec!r} needs the number of workers: add --workers N")
        size = shape[0] * shape[1]
    return parse_topology(spec, size, weights=weights, seed=seed).describe()
