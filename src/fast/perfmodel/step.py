"""Predicted time and traffic of one training step, per strategy, from the α-β link model.

Inputs: the bytes of one model-sized message n (the parameters, or what a codec encodes them into), N
workers, the link, and the compute time of one step. Every communication cost is per step: amortised
over a period (1/H of an all-reduce every H steps) and an expectation over random choices (a message
sent with probability p costs p times as much).

How computation and communication combine:
- with a barrier (sync, gossip): step = compute + comm − overlap·min(compute, comm),
  where `overlap` in [0, 1] is the fraction of the shorter of the two hidden behind the other. The
  default 0 hides nothing; 1 gives max(compute, comm). FAST's bucketed `sync` all-reduces during
  backward, so it hides at most the backward pass (about 2/3 of compute); D-PSGD as in paper 002
  Fig. 15 (send, compute, then await) is overlap = 1. local-sgd and diloco wait for their periodic
  all-reduce: step = compute + all-reduce / H.
- without a barrier (ssp, ad-psgd, push-sum, async-broadcast): workers compute while their messages
  travel, so step = max(compute, comm): the step is compute-bound or bound by the busiest NIC. SSP is
  modelled so: its staleness bound removes the barrier waits. Servers: below.

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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fast.errors import ConfigError
from fast.perfmodel.allreduce import allreduce_cost, check_nbytes, check_workers, group_sizes
from fast.perfmodel.link import Link


@dataclass(frozen=True)
class StepCost:
    """One worker's step: wall-clock `time_s`, its `compute_s`, its amortised `comm_s` (hidden or not),
    and `bytes_per_worker` put on the wire per step (see the module docstring)."""

    time_s: float
    compute_s: float
    comm_s: float
    bytes_per_worker: float


_COLLECTIVE_OPTIONS = frozenset({"algorithm", "group_size", "inner_link", "hierarchical"})
_PEER_OPTIONS = frozenset({"degree", "peers_per_round", "send_probability"})

COST_OPTIONS: dict[str, frozenset[str]] = {
    "none": frozenset(),
    "sync": _COLLECTIVE_OPTIONS | {"overlap"},
    "ssp": _COLLECTIVE_OPTIONS,
    "async-ps": frozenset({"servers", "push_every", "pull_every"}),
    "easgd": frozenset({"tau", "variant"}),
    "eamsgd": frozenset({"tau", "variant"}),
    "ea-wild": frozenset({"tau", "group_size", "inner_link"}),
    "local-sgd": _COLLECTIVE_OPTIONS | {"period"},
    "diloco": _COLLECTIVE_OPTIONS | {"period"},
    "gossip": _PEER_OPTIONS | {"overlap"},
    "ad-psgd": _PEER_OPTIONS,
    "push-sum": _PEER_OPTIONS,
    "async-broadcast": frozenset(),
}
"""The options `step_cost` reads for each strategy; filter a strategy's config options with it."""


def _count(options: dict[str, Any], key: str, default: int | None, low: int, high: float = math.inf) -> int:
    value = options.get(key, default)
    if value is None:
        raise ConfigError(f"step_cost needs the option {key}=<integer >= {low}>")
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        bound = f"between {low} and {high}" if high < math.inf else f">= {low}"
        raise ConfigError(f"option {key} = {value!r} must be an integer {bound}")
    return value


def _fraction(options: dict[str, Any], key: str, default: float, allow_zero: bool) -> float:
    value = options.get(key, default)
    is_number = not isinstance(value, bool) and isinstance(value, int | float)
    if not is_number or not (0 <= value <= 1) or (value == 0 and not allow_zero):
        raise ConfigError(f"option {key} = {value!r} must be a number in {'[0' if allow_zero else '(0'}, 1]")
    return float(value)


def _with_barrier(compute_s: float, comm_s: float, nbytes: float, options: dict[str, Any]) -> StepCost:
    hidden = _fraction(options, "overlap", 0.0, allow_zero=True) * min(compute_s, comm_s)
    return StepCost(compute_s + comm_s - hidden, compute_s, comm_s, nbytes)


def _without_barrier(compute_s: float, comm_s: float, nbytes: float) -> StepCost:
    return StepCost(max(compute_s, comm_s), compute_s, comm_s, nbytes)


def _collective(nbytes: float, workers: int, link: Link, options: dict[str, Any]) -> tuple[float, float]:
    algorithm = options.get("algorithm", "ring")
    group_size = options.get("group_size")
    hierarchical = options.get("hierarchical", 0)
    if hierarchical:
        if "algorithm" in options or group_size is not None:
            raise ConfigError("give either hierarchical=G or algorithm='hierarchical' with group_size=G, not both")
        algorithm, group_size = "hierarchical", hierarchical
    return allreduce_cost(nbytes, workers, link, algorithm, group_size, options.get("inner_link"))


def _server_exchange_s(
    nbytes: float, clients: int, servers: int, link: Link, pushes: float, pulls: float
) -> tuple[float, float]:
    """Per step: a client's own exchange (`pushes` + `pulls` messages of n, one after another) and the busier
    direction of a server's NIC (every client's shard of n/servers per push, or per pull)."""
    own = (pushes + pulls) * link.message_time(nbytes)
    busiest = clients * (nbytes / servers) / link.bandwidth_Bps * max(pushes, pulls)
    return own, busiest


def _sync(n: float, workers: int, link: Link, compute_s: float, options: dict[str, Any]) -> StepCost:
    return _with_barrier(compute_s, *_collective(n, workers, link, options), options)


def _ssp(n: float, workers: int, link: Link, compute_s: float, options: dict[str, Any]) -> StepCost:
    return _without_barrier(compute_s, *_collective(n, workers, link, options))


def _local_sgd(n: float, workers: int, link: Link, compute_s: float, options: dict[str, Any]) -> StepCost:
    period = _count(options, "period", None, low=1)
    seconds, nbytes = _collective(n, workers, link, options)
    return StepCost(compute_s + seconds / period, compute_s, seconds / period, nbytes / period)


def _async_ps(n: float, workers: int, link: Link, compute_s: float, options: dict[str, Any]) -> StepCost:
    servers = _count(options, "servers", 1, low=1)
    pushes = 1 / _count(options, "push_every", 1, low=1)
    pulls = 1 / _count(options, "pull_every", 1, low=1)
    own, busiest = _server_exchange_s(n, workers, servers, link, pushes, pulls)
    return StepCost(max(compute_s + own, busiest), compute_s, max(own, busiest), (pushes + pulls) * n)


def _easgd(n: float, workers: int, link: Link, compute_s: float, options: dict[str, Any]) -> StepCost:
    """async: every tau steps a worker sends its weights to the master and gets the center back, and waits
    for it. sync: one all-reduce of the replicas every tau steps. The master's update time (the lock that
    EA-wild removes) is left out."""
    tau = _count(options, "tau", None, low=1)
    if options.get("variant", "sync") == "sync":
        seconds, nbytes = allreduce_cost(n, workers, link)
        return StepCost(compute_s + seconds / tau, compute_s, seconds / tau, nbytes / tau)
    own, busiest = _server_exchange_s(n, workers, 1, link, 1 / tau, 1 / tau)
    return StepCost(max(compute_s + own, busiest), compute_s, max(own, busiest), 2 * n / tau)


def _ea_wild(n: float, workers: int, link: Link, compute_s: float, options: dict[str, Any]) -> StepCost:
    """Paper 004 Algorithm 1 with worker groups: each group ring-all-reduces every step over the inner
    link (a barrier inside the group), and its leader exchanges with the master every tau steps while the
    group computes."""
    tau = _count(options, "tau", None, low=1)
    group_size = _count(options, "group_size", 1, low=1, high=workers)
    inner_link = options.get("inner_link") or link
    sizes = group_sizes(workers, group_size)
    in_group_s = allreduce_cost(n, max(sizes), inner_link)[0]
    in_group_bytes = sum(allreduce_cost(n, size, inner_link)[1] * size for size in sizes)
    own, busiest = _server_exchange_s(n, len(sizes), 1, link, 1 / tau, 1 / tau)
    total_bytes = in_group_bytes + len(sizes) * 2 * n / tau
    step_s = max(compute_s + in_group_s, own, busiest)
    return StepCost(step_s, compute_s, in_group_s + max(own, busiest), total_bytes / workers)


def _peer_messages(workers: int, options: dict[str, Any], default_peers: int | None) -> float:
    """Expected models a worker sends per step: send_probability × peers_per_round.

    peers_per_round defaults to `default_peers`, or to the degree when that is None; the degree (the
    neighbours of a worker, at most N−1) defaults to N−1 when peers are drawn from everyone.
    """
    if workers == 1:
        return 0.0  # no peers to talk to
    degree = _count(options, "degree", None if default_peers is None else workers - 1, low=1, high=workers - 1)
    peers = _count(options, "peers_per_round", default_peers or degree, low=1, high=degree)
    return _fraction(options, "send_probability", 1.0, allow_zero=False) * peers


def _gossip(n: float, workers: int, link: Link, compute_s: float, options: dict[str, Any]) -> StepCost:
    """D-PSGD: the model goes to every neighbour (or peers_per_round of them) each step."""
    messages = _peer_messages(workers, options, default_peers=None)
    return _with_barrier(compute_s, messages * link.message_time(n), messages * n, options)


def _ad_psgd(n: float, workers: int, link: Link, compute_s: float, options: dict[str, Any]) -> StepCost:
    """Pairwise averaging with a random neighbour: each exchange is two models, one each way. A worker
    initiates one exchange per step and, on average, answers one, so its NIC sends two models."""
    messages = 2 * _peer_messages(workers, options, default_peers=1)
    return _without_barrier(compute_s, messages * link.message_time(n), messages * n)


def _push_sum(n: float, workers: int, link: Link, compute_s: float, options: dict[str, Any]) -> StepCost:
    """GoSGD / push-sum: with probability p, send the model (and its weight) to a random peer."""
    messages = _peer_messages(workers, options, default_peers=1)
    return _without_barrier(compute_s, messages * link.message_time(n), messages * n)


def _async_broadcast(n: float, workers: int, link: Link, compute_s: float, options: dict[str, Any]) -> StepCost:
    """Statement 1 of paper 000: every update goes to the N−1 other workers, one NIC, N−1 messages."""
    return _without_barrier(compute_s, (workers - 1) * link.message_time(n), (workers - 1) * n)


def _no_communication(n: float, workers: int, link: Link, compute_s: float, options: dict[str, Any]) -> StepCost:
    return StepCost(compute_s, compute_s, 0.0, 0.0)


_COST_OF: dict[str, Callable[[float, int, Link, float, dict[str, Any]], StepCost]] = {
    "none": _no_communication,
    "sync": _sync,
    "ssp": _ssp,
    "async-ps": _async_ps,
    "easgd": _easgd,
    "eamsgd": _easgd,
    "ea-wild": _ea_wild,
    "local-sgd": _local_sgd,
    "diloco": _local_sgd,
    "gossip": _gossip,
    "ad-psgd": _ad_psgd,
    "push-sum": _push_sum,
    "async-broadcast": _async_broadcast,
}


def step_cost(strategy: str, *, nbytes: float, workers: int, link: Link, compute_s: float, **options: Any) -> StepCost:
    """The predicted StepCost of `strategy`; `options` are those in COST_OPTIONS[strategy]."""
    if strategy not in _COST_OF:
        raise ConfigError(f"no cost model for strategy {strategy!r}: choose one of {', '.join(_COST_OF)}")
    check_nbytes(nbytes)
    check_workers(workers)
    if not math.isfinite(compute_s) or compute_s < 0:
        raise ConfigError(f"compute_s = {compute_s!r} must be finite and >= 0 (seconds of one step's compute)")
    unknown = sorted(set(options) - COST_OPTIONS[strategy])
    if unknown:
        allowed = ", ".join(sorted(COST_OPTIONS[strategy])) or "none"
        raise ConfigError(f"option(s) {', '.join(unknown)} do not apply to {strategy!r}: its options are {allowed}")
    return _COST_OF[strategy](nbytes, workers, link, compute_s, options)
