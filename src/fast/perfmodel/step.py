"""The pieces a strategy's cost model is made of (`Strategy.cost`): the time and traffic of one training step
from the α-β link model.

Inputs: the bytes of one model-sized message n (the parameters, or what a codec encodes them into), N
workers, the link, and the compute time of one step. Every communication cost is per step: amortised
over a period (1/H of an all-reduce every H steps) and an expectation over random choices (a message
sent with probability p costs p times as much).

How computation and communication combine:
- with a barrier (sync, gossip): step = compute + comm − overlap·min(compute, comm),
  where `overlap` in [0, 1] is the fraction of the shorter of the two hidden behind the other. The
  default 0 hides nothing; 1 gives max(compute, comm). FAST's bucketed `sync` all-reduces during
  backward, so it hides at most the backward pass (about 2/3 of compute); D-PSGD as in Langer et al. 2020
  Fig. 15 (send, compute, then await) is overlap = 1. local-sgd and diloco wait for their periodic
  all-reduce: step = compute + all-reduce / H.
- without a barrier (ssp, push-sum, async-broadcast): workers compute while their messages
  travel, so step = max(compute, comm): the step is compute-bound or bound by the busiest NIC. SSP is
  modelled so: its staleness bound removes the barrier waits. ad-psgd waits for each neighbour's answer
  (a round trip after the step) and for NICs busy with others' exchanges (its own model). Servers: below.

Centralised exchanges (async-ps, easgd async, ea-wild) have two limits. A client's own exchange: its pushes
and pulls go out and come back one after another, α + n/β each through its NIC (n in all, split over k
servers). The server's NIC: every one of N clients sends it a shard of n/k in each push phase and receives
one in each pull phase; links are full duplex, so pushes (in) and pulls (out) overlap and the busier
direction sets the pace: N·n/(kβ) per phase. async-ps and easgd wait for their pull (step = max(compute +
own exchange, busiest direction)); ea-wild overlaps its exchange with compute (step = max(compute +
in-group all-reduce, own exchange, busiest direction)). Synchronous EASGD all-reduces every tau steps,
like local-sgd. Gossip NICs also serialise: d messages cost d·(α + n/β), not the α + n/β that parallel
links per peer would give.

`bytes_per_worker` is the traffic of a step summed over every sender (servers included) divided by N,
so N·bytes_per_worker is what FAST's byte accounting measures for the step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from fast.errors import ConfigError
from fast.perfmodel.allreduce import all_gather_cost, allreduce_cost
from fast.perfmodel.link import Link


@dataclass(frozen=True)
class StepCost:
    """One worker's step: wall-clock `time_s`, its `compute_s`, its amortised `comm_s` (hidden or not),
    and `bytes_per_worker` put on the wire per step (see the module docstring)."""

    time_s: float
    compute_s: float
    comm_s: float
    bytes_per_worker: float


COLLECTIVE_OPTIONS = frozenset({"algorithm", "group_size", "inner_link", "hierarchical", "gathered"})
PEER_OPTIONS = frozenset({"degree", "peers_per_round", "send_probability"})


def count(options: dict[str, Any], key: str, default: int | None, low: int, high: float = math.inf) -> int:
    value = options.get(key, default)
    if value is None:
        raise ConfigError(f"step_cost needs the option {key}=<integer >= {low}>")
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        bound = f"between {low} and {high}" if high < math.inf else f">= {low}"
        raise ConfigError(f"option {key} = {value!r} must be an integer {bound}")
    return value


def fraction(options: dict[str, Any], key: str, default: float, allow_zero: bool) -> float:
    value = options.get(key, default)
    is_number = not isinstance(value, bool) and isinstance(value, int | float)
    if not is_number or not (0 <= value <= 1) or (value == 0 and not allow_zero):
        raise ConfigError(f"option {key} = {value!r} must be a number in {'[0' if allow_zero else '(0'}, 1]")
    return float(value)


def with_barrier(compute_s: float, comm_s: float, nbytes: float, options: dict[str, Any]) -> StepCost:
    hidden = fraction(options, "overlap", 0.0, allow_zero=True) * min(compute_s, comm_s)
    return StepCost(compute_s + comm_s - hidden, compute_s, comm_s, nbytes)


def without_barrier(compute_s: float, comm_s: float, nbytes: float) -> StepCost:
    return StepCost(max(compute_s, comm_s), compute_s, comm_s, nbytes)


def collective(nbytes: float, workers: int, link: Link, options: dict[str, Any]) -> tuple[float, float]:
    """One all-reduce of `nbytes`, or, with `gathered` (a codec whose frames cannot be added), an all-gather."""
    if options.get("gathered"):
        return all_gather_cost(nbytes, workers, link)
    algorithm = options.get("algorithm", "ring")
    group_size = options.get("group_size")
    hierarchical = options.get("hierarchical", 0)
    if hierarchical:
        if "algorithm" in options or group_size is not None:
            raise ConfigError("give either hierarchical=G or algorithm='hierarchical' with group_size=G, not both")
        algorithm, group_size = "hierarchical", hierarchical
    return allreduce_cost(nbytes, workers, link, algorithm, group_size, options.get("inner_link"))


def server_exchange_s(
    nbytes: float, clients: int, servers: int, link: Link, pushes: float, pulls: float
) -> tuple[float, float]:
    """Per step: a client's own exchange (`pushes` + `pulls` messages of n, one after another) and the busier
    direction of a server's NIC (every client's shard of n/servers per push, or per pull)."""
    own = (pushes + pulls) * link.message_time(nbytes)
    busiest = clients * (nbytes / servers) / link.bandwidth_Bps * max(pushes, pulls)
    return own, busiest


def peer_messages(workers: int, options: dict[str, Any], default_peers: int | None) -> float:
    """Expected models a worker sends per step: send_probability × peers_per_round.

    peers_per_round defaults to `default_peers`, or to the degree when that is None; the degree (the
    neighbours of a worker, at most N−1) defaults to N−1 when peers are drawn from everyone.
    """
    if workers == 1:
        return 0.0  # no peers to talk to
    degree = count(options, "degree", None if default_peers is None else workers - 1, low=1, high=workers - 1)
    peers = count(options, "peers_per_round", default_peers or degree, low=1, high=degree)
    return fraction(options, "send_probability", 1.0, allow_zero=False) * peers


def periodic(n: float, workers: int, link: Link, compute_s: float, options: dict[str, Any]) -> StepCost:
    """An all-reduce every `period` steps, waited for (local SGD, DiLoCo): compute + all-reduce / period; with
    `eager`, behind the next round's steps: only what they do not hide is waited for."""
    period = count(options, "period", None, low=1)
    seconds, nbytes = collective(n, workers, link, options)
    waited = max(0.0, seconds - period * compute_s) if options.get("eager") else seconds
    return StepCost(compute_s + waited / period, compute_s, seconds / period, nbytes / period)
