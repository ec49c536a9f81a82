"""Time and traffic of one all-reduce of n bytes among N workers, per algorithm, in the α-β model.

The formulas are those of Ben-Nun and Hoefler 2019 Sec. 2.5 (T_pipe, T_tree, T_bfly) and Langer et al. 2020 Sec.
3.4.1 (ring
and recursive doubling), with α + n/β for one message of n bytes:

- ring (a pipeline of N segments):     2(N−1)·(α + n/(Nβ)),  each worker sends 2(N−1)·n/N
- tree (binomial reduce + broadcast):  2⌈log2 N⌉·(α + n/β),  N−1 messages of n per tree
- recursive-doubling (butterfly):      ⌈log2 N⌉·(α + n/β),   each worker sends n per round
- hierarchical (Wongpanich et al. 2020 Sec. 3, Sync Solver): groups of G workers reduce along a binomial tree over
  the fast inner link, the ⌈N/G⌉ group leaders ring-all-reduce over the slow link, and each leader
  broadcasts back along the tree: 2⌈log2 G⌉·(α_in + n/β_in) + ring(n, ⌈N/G⌉).

Codecs whose frames cannot be added (top-k, quantisers: `gathered`) are all-gathered instead, each frame of n
bytes passed around the ring after its length: 2(N−1)·α + (N−1)·n/β, each worker sending (N−1)·n.

For N that is not a power of two, tree and recursive doubling keep the papers' ⌈log2 N⌉ rounds.
Traffic is reported as bytes sent per worker averaged over workers (total bytes on the wire / N).
"""

from __future__ import annotations

import math

from fast.errors import ConfigError
from fast.perfmodel.link import Link

ALLREDUCE_ALGORITHMS = ("ring", "tree", "recursive-doubling", "hierarchical")


def rounds_of_doubling(workers: int) -> int:
    """⌈log2 N⌉: the rounds of a binomial tree or a butterfly over N workers."""
    return (workers - 1).bit_length()


def group_sizes(workers: int, group_size: int) -> list[int]:
    """Consecutive groups of `group_size` workers; the last holds the remainder when it does not divide."""
    full, remainder = divmod(workers, group_size)
    return [group_size] * full + ([remainder] if remainder else [])


def check_workers(workers: int) -> None:
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ConfigError(f"workers = {workers!r} must be an integer >= 1")


def check_nbytes(nbytes: float) -> None:
    if not math.isfinite(nbytes) or nbytes < 0:
        raise ConfigError(f"nbytes = {nbytes!r} must be finite and >= 0 (the bytes of one message)")


def ring_cost(nbytes: float, workers: int, link: Link) -> tuple[float, float]:
    messages = 2 * (workers - 1)
    return messages * link.message_time(nbytes / workers), messages * nbytes / workers


def tree_cost(nbytes: float, workers: int, link: Link) -> tuple[float, float]:
    total_bytes = 2 * (workers - 1) * nbytes  # N−1 messages of n up the reduce tree, N−1 down the broadcast
    return 2 * rounds_of_doubling(workers) * link.message_time(nbytes), total_bytes / workers


def recursive_doubling_cost(nbytes: float, workers: int, link: Link) -> tuple[float, float]:
    rounds = rounds_of_doubling(workers)
    return rounds * link.message_time(nbytes), rounds * nbytes


def hierarchical_cost(
    nbytes: float, workers: int, link: Link, group_size: int, inner_link: Link
) -> tuple[float, float]:
    sizes = group_sizes(workers, group_size)
    leaders = len(sizes)
    in_group_s = 2 * rounds_of_doubling(max(sizes)) * inner_link.message_time(nbytes)
    leaders_s, leader_bytes = ring_cost(nbytes, leaders, link)
    in_group_bytes = sum(2 * (size - 1) * nbytes for size in sizes)
    return in_group_s + leaders_s, (in_group_bytes + leaders * leader_bytes) / workers


def allreduce_cost(
    nbytes: float,
    workers: int,
    link: Link,
    algorithm: str = "ring",
    group_size: int | None = None,
    inner_link: Link | None = None,
) -> tuple[float, float]:
    """(seconds, bytes sent per worker) of one all-reduce of `nbytes` bytes among `workers` workers.

    `group_size` and `inner_link` belong to `algorithm="hierarchical"` only; `inner_link` defaults to
    `link` (then hierarchical only pays off in latency, through fewer ring hops).
    """
    check_nbytes(nbytes)
    check_workers(workers)
    if algorithm not in ALLREDUCE_ALGORITHMS:
        raise ConfigError(
            f"all-reduce algorithm {algorithm!r} is unknown: choose one of {', '.join(ALLREDUCE_ALGORITHMS)}"
        )
    if algorithm != "hierarchical":
        if group_size is not None or inner_link is not None:
            raise ConfigError(
                f"group_size and inner_link apply to the hierarchical all-reduce only, not {algorithm!r}: "
                "drop them or set algorithm='hierarchical'"
            )
        return {"ring": ring_cost, "tree": tree_cost, "recursive-doubling": recursive_doubling_cost}[algorithm](
            nbytes, workers, link
        )
    if isinstance(group_size, bool) or not isinstance(group_size, int) or not 1 <= group_size <= workers:
        raise ConfigError(
            f"hierarchical all-reduce needs group_size between 1 and workers = {workers}, got {group_size!r}"
        )
    return hierarchical_cost(nbytes, workers, link, group_size, inner_link or link)


def all_gather_cost(nbytes: float, workers: int, link: Link) -> tuple[float, float]:
    """(seconds, bytes sent per worker) of FAST's all-gather of one frame of `nbytes` from each of `workers`: a
    ring of the lengths (N−1 latencies), then a ring of the frames (fast.comm.Comm.all_gather_bytes)."""
    check_nbytes(nbytes)
    check_workers(workers)
    hops = workers - 1
    return hops * (2 * link.latency_s + nbytes / link.bandwidth_Bps), hops * nbytes
