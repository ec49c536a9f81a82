"""`fast predict`: each variant's time per step and per epoch and its bytes per step, from the cost model.

Nothing is trained. The inputs of the strategy's cost model (fast.pricing) come from the config:

- compute: a few forward + backward + optimizer steps of the model at the run's batch size, timed in this
  process with the run's threads per worker, and scaled by how much the run's workers oversubscribe the
  cores; then the `[compute]` slowdowns and stragglers, in expectation (with a barrier every step the
  slowest worker sets the pace, so the expected maximum over workers);
- the link: from `[network]`, the slowest link between workers (a ring or a gossip round waits for its
  slowest hop); with sites and a hierarchical all-reduce, the LAN inside sites and the WAN between them.
  Without `[network]`, `LOOPBACK`, or `SHARED_MEMORY` for a strategy that sums through it (`sync` on the CPU);
- the message: the model's parameters as float32, or the size of the codec's frames when a codec is set; a codec
  whose frames are all-gathered adds its CPU work, timed here on the model's shapes (encode one, decode N−1);
- a live run's catch-up (`run.membership = "live"`): the state a joiner receives from a live peer, over that link, and
  with `[faults] churn` how many joiners an epoch brings (each catch-up holds up the members it heals with).

Variants cannot be ranked by time to accuracy before training (the epochs each needs are unknown), so
"first" ranks them by predicted time per epoch. Also printed: the model's computation/communication ratio
(Wongpanich et al. 2020 Sec. 4.6: FLOPs of one sample's forward pass / parameters; high favours synchronous solvers).
"""

from __future__ import annotations

import copy
import io
import math
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from torch import nn
from torch.utils.data import TensorDataset

from fast.archive import PACKAGE_SUFFIX
from fast.assemble import load_config
from fast.config import Config, _describe
from fast.errors import ConfigError
from fast.jobs.datasets import Dataset, load_dataset, partition
from fast.perfmodel import Link, StepCost, compute_communication_ratio
from fast.pricing import (
    LOOPBACK,
    SHARED_MEMORY,
    codec_work_s,
    has_cost_model,
    links_between_workers,
    message_bytes,
    oversubscription,
    price,
    threads_per_worker,
)
from fast.tools.variants import variants
from fast.units import format_bytes, format_seconds, parse_duration

WARMUP_STEPS = 2
TIMED_STEPS = 5


@dataclass(frozen=True)
class CatchUp:
    """A joiner's catch-up in a live run: the state member 0 sends it, the time that takes on the link, and
    how often churn brings a joiner in (per second of the run)."""

    nbytes: int
    seconds: float
    joins_per_s: float


@dataclass(frozen=True)
class Prediction:
    """One variant's predicted step (None when the cost model cannot price it, with the reason)."""

    name: str
    strategy: str
    cost: StepCost | None
    steps_per_epoch: int
    workers: int
    message_bytes: int
    link: Link
    model: str
    parameters: int
    cc_ratio: float
    problem: str | None = None
    catch_up: CatchUp | None = None  # a live run's

    @property
    def epoch_s(self) -> float | None:
        """An epoch's steps, and the catch-ups churn brings in it (every member waits while one heals)."""
        if self.cost is None:
            return None
        steps_s = self.cost.time_s * self.steps_per_epoch
        if self.catch_up is None or not self.catch_up.joins_per_s:
            return steps_s
        return steps_s / (1 - min(0.99, self.catch_up.joins_per_s * self.catch_up.seconds))

    @property
    def bytes_per_step(self) -> float | None:
        """Bytes all processes put on the wire per step, as summary.json's bytes_sent counts them."""
        return None if self.cost is None else self.cost.bytes_per_worker * self.workers


# -- inputs -------------------------------------------------------------------------------------------------
def _dataset(config: Config) -> Dataset:
    return load_dataset(
        config.data.name,
        seed=config.run.seed,
        data_dir=config.data.dir,
        synthetic_train=config.data.synthetic_train,
        synthetic_test=config.data.synthetic_test,
    )


def measure_compute_s(config: Config, dataset: Dataset, model: nn.Module | None = None, step_fn: Any = None) -> float:
    """Median seconds of one step's computation (forward, backward, optimizer) for one worker of the run."""
    from fast.jobs.code import cross_entropy_step
    from fast.jobs.models import build_model
    from fast.optim import build_optimizer

    model = (
        copy.deepcopy(model)
        if model is not None
        else build_model(config.model.name, dataset.input_shape, dataset.num_classes)
    )
    model = model.cpu().train()
    step_fn = step_fn or cross_entropy_step
    optimizer = build_optimizer(config.optimizer, model.parameters())
    generator = torch.Generator().manual_seed(config.run.seed)
    index = torch.randint(len(dataset.x_train), (config.run.batch_size,), generator=generator)
    x, y = dataset.x_train[index], dataset.y_train[index]
    threads = torch.get_num_threads()
    torch.set_num_threads(threads_per_worker(config))
    try:
        times = []
        for i in range(WARMUP_STEPS + TIMED_STEPS):
            started = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            step_fn(model, x, y).backward()
            optimizer.step()
            if i >= WARMUP_STEPS:
                times.append(time.perf_counter() - started)
    finally:
        torch.set_num_threads(threads)
    return statistics.median(times) * oversubscription(config)


# -- predictions --------------------------------------------------------------------------------------------
def predict(
    config: Config,
    name: str | None = None,
    *,
    dataset: Dataset | None = None,
    compute_s: float | None = None,
    model: nn.Module | None = None,
    step_fn: Any = None,
) -> Prediction:
    """The predicted step of one config; `compute_s` (one step's computation) is measured when not given."""
    from fast.jobs.models import build_model

    dataset = dataset if dataset is not None else _dataset(config)
    run = config.run
    if model is None:
        model = build_model(config.model.name, dataset.input_shape, dataset.num_classes)
    shards = partition(dataset.y_train, run.workers, config.data.partition, alpha=config.data.alpha, seed=run.seed)
    steps = max(1, min(len(s) for s in shards) // run.batch_size)  # the smallest shard decides
    link, _ = links_between_workers(config)
    nbytes = message_bytes(config, model)
    parameters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    ratio = compute_communication_ratio(model, dataset.input_shape)
    base = Prediction(
        name=name or run.name,
        strategy=config.strategy.name,
        cost=None,
        steps_per_epoch=steps,
        workers=run.workers,
        message_bytes=nbytes,
        link=link,
        model=config.model.name,
        parameters=parameters,
        cc_ratio=ratio,
    )
    if not has_cost_model(config):
        return replace(base, problem=f"no cost model for strategy {config.strategy.name!r}")
    if compute_s is None:
        compute_s = measure_compute_s(config, dataset, model, step_fn)
    catch_up = price_catch_up(config, model, dataset, link, step_fn) if run.live else None
    try:
        cost = price(config, nbytes, compute_s, codec_work_s(config, model))
        return replace(base, cost=cost, catch_up=catch_up)
    except ConfigError as e:
        return replace(base, problem=str(e))


def price_catch_up(config: Config, model: nn.Module, dataset: Dataset, link: Link, step_fn: Any = None) -> CatchUp:
    """A joiner's catch-up: the bytes of the state a live peer sends it (the weights and the optimizer's state
    after a step, as saved, and the strategy's own: `Strategy.catch_up_copies`; a strategy that `joins_alone`: the
    weights its servers send), over the slowest link; with
    `[faults] churn`, a joiner every (lifetime + absence) / workers seconds once the run is in its stride (each
    member stays a lifetime, then its place is empty for an absence; a detached run's worker 0 stays: workers - 1)."""
    from fast.jobs.code import cross_entropy_step
    from fast.optim import build_optimizer
    from fast.strategies import strategy_for

    model = copy.deepcopy(model).cpu().train()
    optimizer = build_optimizer(config.optimizer, model.parameters())
    x, y = dataset.x_train[: config.run.batch_size], dataset.y_train[: config.run.batch_size]
    (step_fn or cross_entropy_step)(model, x, y).backward()
    optimizer.step()  # the optimizer's state exists from the first step on
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    parameters = sum(p.numel() * p.element_size() for p in model.parameters())
    strategy = strategy_for(config)
    # a worker that joins alone pulls the weights from the servers, nothing else (fast.runtime.detached)
    nbytes = parameters if strategy.joins_alone else buffer.tell() + int(strategy.catch_up_copies * parameters)
    churn = config.faults.churn if config.faults is not None else None
    joins_per_s = 0.0
    if churn is not None and config.run.workers > 1:
        cycle_s = parse_duration(churn.lifetime) + parse_duration(churn.absence)
        joins_per_s = (config.run.workers - strategy.joins_alone) / cycle_s
    return CatchUp(nbytes, link.latency_s + nbytes / link.bandwidth_Bps, joins_per_s)


def config_for_prediction(data: dict[str, Any]) -> Config:
    """The validated config; a strategy that is not registered (yet) is accepted with its keys as written,
    since the cost model needs only its name and options."""
    try:
        return load_config(data)
    except ConfigError:
        from fast.strategies import registry

        if data.get("strategy", {}).get("name", "sync") in registry():
            raise
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_describe(e)) from None


def predict_package(source: str | Path, **overrides: Any) -> list[Prediction]:
    """The prediction for a packed job (with the data owner's keys on top, as `fast train` takes them): its own
    model and loss, timed on the data set the config names."""
    from fast.jobs.code import package_of, packed_model
    from fast.jobs.package import check_data, packed_step
    from fast.parts import resolve

    parts = resolve(source, **overrides)
    config, packed = parts.config, parts.packed
    dataset = _dataset(config)
    package = package_of(packed)
    check_data(package.schema, TensorDataset(dataset.x_train[:1], dataset.y_train[:1]), "training")
    model = _CountedPackage(packed_model(packed), dataset.y_train[:1])
    prediction = predict(config, dataset=dataset, model=model, step_fn=lambda m, x, y: packed_step(m.packed, x, y))
    return [replace(prediction, model=f"packed ({Path(source).name})")]


class _CountedPackage(nn.Module):
    """A packed model called as `forward(x)`, which FLOP counting does: with labels shaped like the data's."""

    def __init__(self, packed: nn.Module, label: torch.Tensor) -> None:
        super().__init__()
        self.packed, self.label = packed, label

    def forward(self, x: torch.Tensor) -> Any:
        return self.packed(x, self.label.expand(len(x), *self.label.shape[1:]))


def predict_variants(source: str | Path | dict[str, Any], **overrides: Any) -> list[Prediction]:
    """A prediction per variant of a config (the base alone when it has no [[variant]]), measuring the
    compute time once per distinct (data, model, batch size, optimizer, threads); a packed job's own."""
    if isinstance(source, str | Path) and str(source).endswith(PACKAGE_SUFFIX):
        return predict_package(source, **overrides)
    if overrides:
        raise ConfigError("fast predict: --set and --trust apply to a packed job (JOB.fastjob); in a config, edit "
                          "the keys or add [[variant]] tables")  # fmt: skip
    found = variants(source)
    if not found:
        base = load_config(source)
        found = [(base.run.name, base.to_dict())]
    datasets: dict[str, Dataset] = {}
    computes: dict[str, float] = {}
    predictions = []
    for name, data in found:
        try:
            config = config_for_prediction(data)
        except ConfigError as e:
            raise ConfigError(f"variant {name!r}: {e}") from None
        data_key = repr(config.data.model_dump())
        dataset = datasets.setdefault(data_key, _dataset(config))
        compute_key = repr((data_key, config.model, config.optimizer, config.run.batch_size,
                            threads_per_worker(config), oversubscription(config)))  # fmt: skip
        if compute_key not in computes and has_cost_model(config):
            computes[compute_key] = measure_compute_s(config, dataset)
        predictions.append(predict(config, name, dataset=dataset, compute_s=computes.get(compute_key)))
    return predictions


# -- output -------------------------------------------------------------------------------------------------
def prediction_table(predictions: list[Prediction]) -> Table:
    priced = [p for p in predictions if p.cost is not None]
    order = sorted(priced, key=lambda p: (p.epoch_s, p.name))
    rank = {p.name: i + 1 for i, p in enumerate(order)}
    table = Table(title="FAST predicted (cost model, nothing trained)", header_style="bold")
    live = any(p.catch_up is not None for p in predictions)
    columns = ["variant", "strategy", "workers", "step", "compute", "epoch", "bytes/step", "comm/compute", "first"]
    if live:  # a joiner's catch-up, and how many churn brings in an epoch
        columns[-1:-1] = ["catch-up", "joins/epoch"]
    for column in columns:
        table.add_column(column, justify="left" if column in ("variant", "strategy") else "right")
    for p in predictions:
        if p.cost is None:
            table.add_row(p.name, p.strategy, str(p.workers), *["—"] * (len(columns) - 3))
            continue
        ratio = p.cost.comm_s / p.cost.compute_s if p.cost.compute_s > 0 else math.inf
        row = [p.name, p.strategy, str(p.workers), format_seconds(p.cost.time_s), format_seconds(p.cost.compute_s),
               format_seconds(p.epoch_s), format_bytes(p.bytes_per_step), f"{ratio:.2f}"]  # fmt: skip
        if live:
            up = p.catch_up
            row += ["—", "—"] if up is None else [f"{format_bytes(up.nbytes)}, {format_seconds(up.seconds)}",
                                                  f"{up.joins_per_s * (p.epoch_s or 0):.1f}"]  # fmt: skip
        table.add_row(*row, str(rank[p.name]))
    return table


def print_predictions(
    source: str | Path | dict[str, Any], console: Console | None = None, **overrides: Any
) -> list[Prediction]:
    """`fast predict CONFIG.toml` (or JOB.fastjob): the table, the links it assumed, and the models' CC ratios."""
    console = console or Console(width=max(Console().width, 110))
    predictions = predict_variants(source, **overrides)
    console.print(prediction_table(predictions))
    for link in sorted({p.link for p in predictions}, key=lambda x: (x.latency_s, x.bandwidth_Bps)):
        where = {LOOPBACK: "native loopback", SHARED_MEMORY: "shared memory, one machine"}.get(
            link, "\\[network], the slowest between workers"
        )
        console.print(
            f"link: {format_seconds(link.latency_s)} latency, {link.bandwidth_Bps * 8 / 1e6:.4g} Mbit/s ({where})"
        )
    for model, parameters, ratio in sorted({(p.model, p.parameters, p.cc_ratio) for p in predictions}):
        console.print(
            f"model {model}: {parameters:,} parameters; computation/communication ratio {ratio:.1f} "
            "(forward FLOPs per sample / parameters, Wongpanich et al. 2020 Sec. 4.6: high favours synchronous solvers)"
        )
    for p in predictions:
        if p.problem is not None:
            console.print(f"{escape(p.name)}: not priced: {escape(p.problem)}")
    priced = [p for p in predictions if p.cost is not None]
    if priced:
        best = min(priced, key=lambda p: (p.epoch_s, p.name))
        console.print(
            f"first to the target, if all need as many epochs: [bold]{best.name}[/bold] "
            f"({format_seconds(best.epoch_s)} per epoch)"
        )
    return predictions
