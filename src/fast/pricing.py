"""A job's step priced by its strategy's cost model (`Strategy.cost`) from its config: the link between workers
([network], or the loopback), the size of a model-sized message (the parameters, or the codec's frames), the
compute of one step with the [compute] slowdowns and stragglers in expectation, and the strategy's options.
A codec whose frames are all-gathered also costs CPU: encoding the worker's message and decoding the N−1 frames
it receives, measured once on the model's shapes (`codec_work_s`) and paid on top of the step at each exchange.

`predicted_step_time` is what a run's summary sets beside its measured step time; `fast predict` (fast.tools.
predict) measures the compute and prints the table. `step_cost(name, ...)` prices a strategy by name.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from fast.assemble import world_size
from fast.codecs import Codec, build_codec
from fast.config import Config
from fast.emulation.deployment import link_table, slowdown_of
from fast.emulation.links import EmulatedLink
from fast.errors import ConfigError
from fast.perfmodel import Link, StepCost
from fast.perfmodel.allreduce import check_nbytes, check_workers
from fast.strategies import Strategy, registry, strategy_for, strategy_options, variant
from fast.strategies.peers import PeerOptions, degree
from fast.units import parse_duration

# Native links between the processes of one host (orders of magnitude): gloo over the loopback interface, and
# the shared memory that sync's buckets are summed through on the CPU (fitted by bench/shared_sum.py)
LOOPBACK = Link(latency_s=100e-6, bandwidth_Bps=1e9)
SHARED_MEMORY = Link(latency_s=12e-6, bandwidth_Bps=5e9)


def priced() -> dict[str, type[Strategy]]:
    """Every registered strategy that has a cost model, by name."""
    return {name: cls for name, cls in registry().items() if cls.priced}


def step_cost(strategy: str, *, nbytes: float, workers: int, link: Link, compute_s: float, **options: Any) -> StepCost:
    """The predicted StepCost of the strategy called `strategy`, with the `options` its cost model reads."""
    known = priced()
    if strategy not in known:
        raise ConfigError(f"no cost model for strategy {strategy!r}: choose one of {', '.join(known)}")
    check_nbytes(nbytes)
    check_workers(workers)
    if not math.isfinite(compute_s) or compute_s < 0:
        raise ConfigError(f"compute_s = {compute_s!r} must be finite and >= 0 (seconds of one step's compute)")
    wanted = known[strategy].cost_options
    unknown = sorted(set(options) - wanted)
    if unknown:
        allowed = ", ".join(sorted(wanted)) or "none"
        raise ConfigError(f"option(s) {', '.join(unknown)} do not apply to {strategy!r}: its options are {allowed}")
    return variant(known[strategy], options, "none").cost(nbytes, workers, link, compute_s, options)


def _strategy(config: Config) -> type[Strategy] | None:
    try:
        return strategy_for(config)
    except ConfigError:  # not registered (yet): no declarations to go by
        return None


def has_cost_model(config: Config) -> bool:
    """Whether the config's strategy (a user's own included, once `strategy.module` is imported) can be priced."""
    cls = _strategy(config)
    return cls is not None and cls.priced


def expected_maximum_factor(shape: float, cap: float, workers: int) -> float:
    """E[max of `workers` draws of min(X, cap)], X ~ Pareto(shape, 1): 1 + ∫_1^cap P(max > x) dx."""
    points = 2000
    grid = [cap ** (k / points) for k in range(points + 1)]
    survival = [1.0 - (1.0 - x ** (-shape)) ** workers for x in grid]
    return 1.0 + sum((grid[k + 1] - grid[k]) * (survival[k] + survival[k + 1]) / 2 for k in range(points))


def effective_compute_s(config: Config, compute_s: float) -> float:
    """Compute time per step with the [compute] slowdowns and stragglers, in expectation."""
    spec = config.compute
    if spec is None:
        return compute_s
    workers = config.run.workers
    slowest = max(slowdown_of(config, rank) for rank in range(workers))
    barrier = _strategy(config) is not None and _strategy(config).waits_every_step
    draws = workers if barrier else 1  # no barrier: over many steps each worker pays the mean
    tail = expected_maximum_factor(spec.heavy_tail, spec.heavy_tail_max, draws) if spec.heavy_tail > 0 else 1.0
    p = spec.straggler_probability
    pause = parse_duration(spec.straggler_pause) * (1 - (1 - p) ** draws if barrier else p)
    return compute_s * slowest * tail + pause


def sums_in_shared_memory(config: Config) -> bool:
    """Whether the strategy's all-reduces go through shared memory: `run.shared_memory` on one host's CPU with no
    [network] to emulate, a strategy that reduces through it, flat and uncompressed."""
    cls = _strategy(config)
    if cls is None or not cls.reduces_in_shared_memory or not config.run.shared_memory:
        return False
    flat = not getattr(strategy_options(config), "hierarchical", 0)
    return flat and config.network is None and config.run.device == "cpu" and message_codec(config) is None


def links_between_workers(config: Config) -> tuple[Link, Link | None]:
    """(the slowest link between workers, the slowest link inside a site when there are sites)."""
    if config.network is None:
        return (SHARED_MEMORY if sums_in_shared_memory(config) else LOOPBACK), None
    table = link_table(config, config.run.workers)
    workers = range(config.run.workers)

    def slowest(chosen: list[tuple[int, int]]) -> Link:
        links = [table.link(a, b) for a, b in chosen]
        return Link(max(x.latency_s for x in links), min(x.bandwidth_Bps for x in links))

    def slowest_of(links: list[EmulatedLink]) -> Link:
        return Link(max(x.latency_s for x in links), min(x.bandwidth_Bps for x in links))

    if not config.network.sites:  # (the table's distinct links: every pair of a thousand workers is a million)
        return slowest_of(table.among(workers) or [table.default]), None
    pairs = [(a, b) for a in workers for b in workers if a != b] or [(0, 0)]
    site_of = {rank: site for site, ranks in config.network.sites.items() for rank in ranks}
    inside = [(a, b) for a, b in pairs if not (a in site_of and b in site_of and site_of[a] != site_of[b])]
    return slowest(pairs), (slowest(inside) if inside else None)


def message_codec(config: Config) -> Codec | None:
    """The codec a model-sized message goes through: the strategy's own (sparseloco, demo), or `[codec]`'s."""
    cls = _strategy(config)
    own = cls.own_codec(strategy_options(config)) if cls is not None else None
    if own is not None or config.codec.name == "none":
        return own
    return build_codec(config.codec.name, **config.codec.options())


def message_bytes(config: Config, model: nn.Module) -> int:
    """Bytes of one model-sized message: float32 parameters, or the codec's frames for them."""
    shapes = [tuple(p.shape) for p in model.parameters() if p.requires_grad]
    codec = message_codec(config)
    if codec is None:
        return sum(4 * math.prod(shape) for shape in shapes)
    return sum(codec.encoded_size(shape) for shape in shapes)


def cost_options(config: Config, inner_link: Link | None) -> dict[str, Any]:
    """What the strategy's cost model reads: its options (defaults included), its declared defaults for the
    predictor's own (`overlap`), the degree of its topology, and the link inside a site where it groups."""
    cls = _strategy(config)
    if cls is None:
        return {}
    wanted = cls.cost_options
    options = strategy_options(config)
    values = options.model_dump()
    chosen = {k: v for k, v in values.items() if k in wanted and v is not None and k != "degree"}
    if chosen.get("hierarchical") == 0:
        del chosen["hierarchical"]
    for key, value in cls.cost_defaults.items():
        chosen.setdefault(key, value)
    if "degree" in wanted and isinstance(options, PeerOptions) and config.run.workers > 1:
        chosen["degree"] = degree(options, config.run.workers, config.run.seed)
        if options.schedule is not None:
            chosen["peers_per_round"] = 1
        elif chosen.get("peers_per_round"):
            chosen["peers_per_round"] = min(chosen["peers_per_round"], chosen["degree"])
    if inner_link is not None and ("hierarchical" in chosen or "group_size" in chosen) and "inner_link" in wanted:
        chosen["inner_link"] = inner_link
    if "gathered" in wanted and frames_are_gathered(config):
        chosen["gathered"] = True
    return {k: v for k, v in chosen.items() if k in wanted}


def frames_are_gathered(config: Config) -> bool:
    """Whether the codec's frames cannot be added on the way, so its collectives are all-gathers (top-k, the
    quantisers) rather than all-reduces (none, fp16, bf16) or sums of factors (PowerSGD)."""
    from fast.exchange.allreduce import base_codec

    codec = message_codec(config)
    return codec is not None and not codec.summable and not base_codec(codec).low_rank


def processes(config: Config) -> int:
    """The run's processes: its workers, and its servers where the strategy has them."""
    try:
        return world_size(config)
    except ConfigError:  # a strategy not (yet) registered: assume it has no servers
        return config.run.workers


def threads_per_worker(config: Config) -> int:
    return config.run.threads_per_worker or max(1, (os.cpu_count() or 1) // processes(config))


def oversubscription(config: Config) -> float:
    """How much slower each worker computes because the workers together want more threads than cores."""
    return max(1.0, config.run.workers * threads_per_worker(config) / (os.cpu_count() or 1))


def codec_work_s(config: Config, model: nn.Module, repeats: int = 3) -> float:
    """Seconds of one worker's codec work in one exchange of a model-sized message whose frames are all-gathered:
    encoding its own and decoding the N−1 it receives, timed on random tensors of the model's shapes with the run's
    threads per worker, times the oversubscription of the cores. 0 when frames are not gathered (a cast costs next
    to nothing; PowerSGD's matrix products are not priced)."""
    if not frames_are_gathered(config):
        return 0.0
    codec = message_codec(config)
    generator = torch.Generator().manual_seed(0)
    tensors = [torch.randn(p.shape, generator=generator) for p in model.parameters() if p.requires_grad]
    threads = torch.get_num_threads()
    torch.set_num_threads(threads_per_worker(config))
    try:
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            frames = [codec.encode(x, key=f"price.{i}") for i, x in enumerate(tensors)]
            encoded = time.perf_counter()
            for frame in frames:
                codec.decode(frame)
            decoded = time.perf_counter()
            times.append(encoded - started + (config.run.workers - 1) * (decoded - encoded))
    finally:
        torch.set_num_threads(threads)
    return statistics.median(times) * oversubscription(config)


def price(config: Config, nbytes: float, compute_s: float, codec_s: float = 0.0) -> StepCost:
    """The step of `config` for a message of `nbytes`, one step's `compute_s` and `codec_s` of codec work per
    all-gathered exchange (`codec_work_s`) (ConfigError when its strategy has no cost model)."""
    cls = _strategy(config)
    if cls is None or not cls.priced:
        raise ConfigError(f"no cost model for strategy {config.strategy.name!r}")
    link, inner_link = links_between_workers(config)
    options = cost_options(config, inner_link)
    cost = cls.cost(nbytes, config.run.workers, link, effective_compute_s(config, compute_s), options)
    if codec_s <= 0 or not options.get("gathered") or config.run.workers < 2 or nbytes <= 0:
        return cost
    exchanges = cost.bytes_per_worker / ((config.run.workers - 1) * nbytes)  # an all-gather's bytes per worker
    work = exchanges * codec_s
    return replace(cost, time_s=cost.time_s + work, comm_s=cost.comm_s + work)


def predicted_step_time(config: Config, *, model: nn.Module, compute_s: float) -> float:
    """Predicted seconds per step of `config` (ConfigError when its strategy has no cost model), when one step's
    computation takes `compute_s` (e.g. as measured in the run itself); the codec's work is measured here."""
    return price(config, message_bytes(config, model), compute_s, codec_work_s(config, model)).time_s
