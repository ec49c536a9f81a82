"""Topologies: who talks to whom, as data (a graph of workers and channels with mixing weights)."""

from fast.topology.builders import (
    complete,
    exponential,
    from_edges,
    from_networkx,
    random_regular,
    ring,
    star,
    torus,
)
from fast.topology.graph import Topology
from fast.topology.mixing import metropolis_hastings, mixing_matrix, uniform
from fast.topology.schedules import (
    ExponentialOnePeer,
    PeerSchedule,
    RandomMatchings,
    exponential_one_peer,
    random_matchings,
)
from fast.topology.spec import format_topology, parse_schedule, parse_topology

__all__ = [
    "ExponentialOnePeer",
    "PeerSchedule",
    "RandomMatchings",
    "Topology",
    "complete",
    "exponential",
    "exponential_one_peer",
    "format_topology",
    "from_edges",
    "from_networkx",
    "metropolis_hastings",
    "mixing_matrix",
    "parse_schedule",
    "parse_topology",
    "random_matchings",
    "random_regular",
    "ring",
    "star",
    "torus",
    "uniform",
]
