"""A job's config assembled and checked whole: the schema (fast.config), then what the registries say about it:
the strategy's and the codec's own options, which codecs the strategy can use, the optimizer and schedule, the
processes the run needs (workers and the strategy's servers) and the ranks its deployment names."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from fast.archive import PACKAGE_SUFFIX, check_trust, read_package
from fast.codecs import CODECS, build_codec, codec_options
from fast.config import CodecConfig, Config, _describe, apply_overrides, check_renamed, load_dict, without_renamed
from fast.config.schema import PROCESS_WORKERS
from fast.errors import ConfigError, UnknownKey
from fast.optim import check_optimizer, check_schedule
from fast.ownership import owners_config
from fast.strategies import strategy_for, strategy_options, validate_strategy_options


def build_config(data: dict[str, Any]) -> Config:
    """Validate a nested dict into a Config, including strategy and codec options and cross-key checks."""
    if "variant" in data:
        raise ConfigError(
            "this config has [[variant]] tables: run it with `fast compare` (or `fast predict`), "
            "or remove them to train the base job"
        )
    check_renamed(data)
    try:
        config = Config.model_validate(data)
    except ValidationError as e:
        unknown = any(error["type"] == "extra_forbidden" for error in e.errors())
        raise (UnknownKey if unknown else ConfigError)(_describe(e)) from None

    check_codec(config.codec)
    check_optimizer(config.optimizer)
    check_schedule(config.schedule)
    validate_strategy_options(config)
    check_codec_fits_strategy(config)
    check_deployment(config)
    check_membership(config)
    check_shards(config)
    return config


def check_codec_fits_strategy(config: Config) -> None:
    """ConfigError when the strategy does not apply the configured codec to what it sends (it decides, by the
    codec's capabilities)."""
    cls = strategy_for(config)
    if not cls.accepts_codec(build_codec(config.codec.name, **config.codec.options())):
        usable = [name for name in CODECS if cls.accepts_codec(build_codec(name))]
        raise ConfigError(
            f"`codec.name` = {config.codec.name!r} does not work with strategy {config.strategy.name!r}, which "
            f"can use {', '.join(repr(name) for name in usable)}: change codec.name or strategy.name"
        )


def check_codec(codec: CodecConfig) -> None:
    """ConfigError naming `codec.<key>` for an unknown codec, option or value (the codec registry decides)."""
    if codec.name not in CODECS:
        raise ConfigError(f"`codec.name` = {codec.name!r} is not a codec: choose one of {', '.join(CODECS)}")
    valid = codec_options(codec.name)
    for key in codec.options():
        if key not in valid:
            raise ConfigError(f"unknown key `codec.{key}`: codec {codec.name!r} takes {', '.join(valid)}")
    try:
        build_codec(codec.name, **codec.options())
    except ConfigError as e:
        message = re.sub(r"codec option (\w+)", r"`codec.\1`", str(e))
        if "`codec." not in message:  # the rules on ef-sign, dgc and error feedback
            message = f"`codec.error_feedback`: {message}"
        raise ConfigError(message) from None


# -- checks that need the whole config ---------------------------------------------------------------------
def world_size(config: Config) -> int:
    """Processes of the run: the workers and the strategy's servers."""
    options = strategy_options(config)
    return config.run.workers + strategy_for(config).server_count(options, config.run.workers)


def check_membership(config: Config) -> None:
    """ConfigError for a live run (`run.membership = "live"`) its strategy or its other keys cannot give live
    membership, and for churn in a run that is not live."""
    run = config.run
    if config.faults is not None and config.faults.churn is not None and not run.live:
        raise ConfigError("[faults] churn takes workers out and brings them back through `fast join`: set "
                          "run.membership = 'live'")  # fmt: skip
    if not run.live:
        return
    strategy = strategy_for(config)
    if not strategy.joins:
        from fast.strategies import registry

        taking = ", ".join(sorted(name for name, cls in registry().items() if cls.joins))
        raise ConfigError(f"run.membership = 'live': strategy {config.strategy.name!r} does not take live membership "
                          f"changes yet ({strategy.joins_why}); live runs take: {taking}")  # fmt: skip
    faults = config.faults
    refused = {
        "run.max_restarts": (run.max_restarts, "restarts every worker from a checkpoint: a live run heals live"),
        "[compute]": (config.compute, "per-rank compute emulation cannot follow members whose ranks change"),
        "[faults] crash or link_down": (
            faults is not None and (faults.crash or faults.link_down),
            "[faults] churn takes members out and brings them back",
        ),
        "codec.name": (config.codec.name != "none", "a codec's residuals are not reset on a membership change yet"),
        "run.accumulate": (run.accumulate > 1, "a change of membership falls between whole steps"),
    }
    if strategy.joins_alone:  # (fast.runtime.detached)
        refused |= {
            "run.checkpoint_every": (run.checkpoint_every > 0, "the servers' snapshots count a fixed set of workers"),
            "[network]": (config.network is not None, "its workers' own lines to the servers have no emulated links"),
            'run.engine = "simulated"': (run.engine == "simulated", "its workers join on lines of real processes"),
        }
    for key, (set_, why) in refused.items():
        if set_:
            raise ConfigError(f"run.membership = 'live' with {key}: {why}; leave one of them out")
    if run.min_workers > run.workers:
        raise ConfigError(f"run.min_workers = {run.min_workers} is more than the {run.workers} workers the run starts "
                          "with: lower it")  # fmt: skip
    if run.max_workers and run.max_workers < run.workers:
        raise ConfigError(f"run.max_workers = {run.max_workers} is fewer than the {run.workers} workers the run "
                          "starts with: raise it, or 0 for no limit")  # fmt: skip


LIVE_SHARDED = ("sync", "local-sgd", "diloco")  # the strategies a live run's sharded replicas take


def check_shards(config: Config) -> None:
    """ConfigError for a sharded run (`run.shards` > 1) its strategy, its options or its other keys cannot give
    sharded replicas, each naming why (fast.shards, docs/sharded.md)."""
    run = config.run
    k = run.shards
    if k == 1:
        return
    strategy, options = strategy_for(config), strategy_options(config)
    why = strategy.refuses_shards(options, config)
    if why:
        from fast.strategies import registry

        taking = ", ".join(sorted(name for name, cls in registry().items() if cls.takes_shards))
        raise ConfigError(f"run.shards = {k}: strategy {config.strategy.name!r} does not run on sharded replicas "
                          f"({why}); sharded runs take: {taking}")  # fmt: skip
    refused = {
        "strategy.final_model = 'best'": (
            strategy.replicas_differ and options.final_model == "best",
            "a replica is scored by a forward of its own, and a sharded replica's strategy holds local shards only",
        ),
        "run.membership = 'live' and this strategy": (
            run.live and config.strategy.name not in LIVE_SHARDED,
            f"a live run's replicas re-form and heal shard for shard with {', '.join(LIVE_SHARDED)} only (the others "
            "are not made to carry their state across a re-form of a sharded replica yet)",
        ),
        'run.engine = "simulated"': (run.engine == "simulated", "FSDP2 shards over real process groups"),
        "[faults] churn": (
            config.faults is not None and config.faults.churn is not None,
            "churn draws a stay for each member, and a sharded run's members come and go as replicas of K processes",
        ),
    }
    for key, (set_, why) in refused.items():
        if set_:
            raise ConfigError(f"run.shards = {k} with {key}: {why}; leave one of them out")
    if run.batch_size % k:
        raise ConfigError(f"run.batch_size = {run.batch_size} does not split into run.shards = {k} equal slices (a "
                          f"replica's batch, each shard a slice): use a multiple of {k}")  # fmt: skip
    processes = run.workers * k
    if run.engine == "processes" and processes > PROCESS_WORKERS:
        raise ConfigError(f"run.workers = {run.workers} replicas of run.shards = {k} are {processes} processes, more "
                          f"than a run's {PROCESS_WORKERS}: use fewer workers or fewer shards")  # fmt: skip


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


def load_config(source: str | Path | dict[str, Any] | Config | None = None, **overrides: Any) -> Config:
    """A Config from a TOML path, a dict or a Config, with dotted-key overrides (`run__workers` also works)."""
    if isinstance(source, Config):  # the keys it was given, not its defaults: what was set stays set
        data = source.model_dump(mode="json", exclude_none=True, exclude_unset=True)
    elif isinstance(source, dict):
        data = {k: dict(v) if isinstance(v, dict) else v for k, v in source.items()}
    elif source is None:
        data = {}
    elif str(source).endswith(PACKAGE_SUFFIX):  # a packed job: its own config, the owner's keys on top
        data = {"package": {"path": str(Path(source).resolve())}}
    else:
        data = load_dict(source)
    dotted = {k.replace("__", "."): v for k, v in overrides.items()}
    given = data.get("package")
    if not (isinstance(given, dict) and given.get("path")):
        data = apply_overrides(data, dotted)
        if isinstance(data.get("package"), dict) and set(data["package"]) - {"path"}:
            raise ConfigError("--trust and --unsigned (package.*) apply to a packed job: give JOB.fastjob, or drop "
                              "them")  # fmt: skip
        return build_config(data)
    # a packed job: read and checked once, its config the author's with the owner's keys on top (fast.ownership)
    owner = apply_overrides({"package": given} if isinstance(source, Config) else data, dotted)
    package = read_package(owner["package"]["path"], owner["package"].get("trusted_key"))
    check_trust(package, owner["package"].get("trusted_key"), owner["package"].get("unsigned"))
    merged = owners_config(without_renamed(package.config), package.schema, owner)
    # (a Config was merged and checked when it was built: only the overrides are new)
    config = build_config(apply_overrides(data, dotted) if isinstance(source, Config) else merged)
    for graph in package.graphs.values():  # no node allocates more than the owner's budget from constant sizes
        graph.check_budget(config.package.node_bytes)
    return config
