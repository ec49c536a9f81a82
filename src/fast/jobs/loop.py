"""The pre-defined worker node of `fast train`: a training loop written on the job API, as a user would write it.

The job's code comes from the config: a built-in data set and model by name, or the user's own through
`[data] factory`, `[model] factory`, `[step] factory` and `[eval] factory` ("package.module:function"); from
Python, `fast.train(model_fn=..., step_fn=...)` replaces the model and the step.

    data.factory(**[data] keys)                      -> (train_dataset, test_dataset or None)
    model.factory(**[model] keys, input_shape=..., num_classes=...)  -> nn.Module (the last two if it takes them)
    step.factory(model, *batch, **[step] keys)       -> the loss of one batch (default: cross-entropy)
    eval.factory(model, test_dataset, **[eval] keys) -> {"metric": value, ...} (default: accuracy and loss)
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, IterableDataset, Subset, TensorDataset

from fast.archive import Package, read_package
from fast.comm import timing
from fast.config import Config
from fast.errors import ConfigError, UsageError
from fast.factories import call_factory, expect, load_factory
from fast.jobs.datasets import load_dataset
from fast.jobs.evaluate import EvalFn, classification_metrics
from fast.jobs.models import build_model
from fast.jobs.package import PackedModel, check_data, packed_evaluation, packed_step
from fast.optim import build_optimizer
from fast.runtime import init
from fast.runtime.job import FAST_LOOP
from fast.targets import lower_is_better

ModelFn = Callable[[tuple[int, ...], int], nn.Module]
StepFn = Callable[..., torch.Tensor]
VALIDATION_SAMPLES = 1000  # training samples that score replicas for final_model = "best"


def cross_entropy_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The default per-batch step: supervised classification loss."""
    return F.cross_entropy(model(x), y)


@dataclass
class UserCode:
    """What a Python user may replace: the model factory and the per-batch step (both picklable)."""

    model_fn: ModelFn | None = None
    step_fn: StepFn | None = None
    # unpickling the class in a worker process imports its module, which registers a strategy defined
    # outside fast.strategies (e.g. in the user's script) there too
    strategy_class: type | None = None


class LabelledTensors(TensorDataset):
    """Samples and labels as two tensors; `targets` are the labels (for the dirichlet partition)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        super().__init__(x, y)
        self.targets = y


def datasets(config: Config) -> tuple[Dataset, Dataset | None]:
    """The training and test datasets: the built-in one `data.name`, or `data.factory`'s; for a packed job,
    checked against the package's schema. The workers of a simulation share one copy."""
    if timing.simulated():
        key = f"datasets {config.data.model_dump_json()} {config.run.seed} {config.package}"
        return timing.shared(key, lambda: _checked_datasets(config))
    return _checked_datasets(config)


def _checked_datasets(config: Config) -> tuple[Dataset, Dataset | None]:
    train, test = _datasets(config)
    if config.package is not None:
        schema = packaged(config).schema
        check_data(schema, train, "training")
        if test is not None:
            check_data(schema, test, "test")
    return train, test


def packaged(config: Config) -> Package:
    """The packed job the config names (read and checked once per process: fast.archive keeps it)."""
    return read_package(config.package.path, config.package.trusted_key)


def packed_model(config: Config) -> PackedModel:
    """The packed job's model, each node of its programs held to the owner's budget (package.max_node_gib)."""
    return PackedModel(packaged(config), budget=config.package.node_bytes)


def packed_job(config: Config) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A packed job's model and its author's optimizer, for the data owner's own loop (`fast.packaged`)."""
    if config.package is None:
        raise UsageError("fast.packaged(): the run names no package: start it with `fast run --config JOB.fastjob`")
    model = packed_model(config)
    return model, build_optimizer(config.optimizer, model.parameters())


def _datasets(config: Config) -> tuple[Dataset, Dataset | None]:
    data = config.data
    if data.factory is not None:
        made = call_factory(load_factory(data.factory, "data.factory"), "data.factory", {}, data.arguments())
        if not (isinstance(made, tuple | list) and len(made) == 2):
            raise ConfigError(
                f"`data.factory` returned a {type(made).__name__}: it must return (train_dataset, test_dataset), "
                "the test dataset possibly None"
            )
        train, test = made
        expect(train, (Dataset, IterableDataset), "data.factory", "a torch Dataset first")
        if test is not None:
            expect(test, (Dataset, IterableDataset), "data.factory", "a torch Dataset (or None) second")
        return train, test
    built = load_dataset(
        data.name,
        seed=config.run.seed,
        data_dir=data.dir,
        synthetic_train=data.synthetic_train,
        synthetic_test=data.synthetic_test,
    )
    return LabelledTensors(built.x_train, built.y_train), LabelledTensors(built.x_test, built.y_test)


def _shape_and_classes(train: Dataset) -> dict[str, Any]:
    """input_shape and num_classes of a dataset of (x, y) samples, as far as they can be told."""
    known: dict[str, Any] = {}
    tensors = getattr(train, "tensors", None)
    if tensors is not None and len(tensors) == 2:
        known["input_shape"] = tuple(tensors[0].shape[1:])
    elif not isinstance(train, IterableDataset) and len(train):
        sample = train[0]
        if isinstance(sample, tuple | list) and isinstance(sample[0], torch.Tensor):
            known["input_shape"] = tuple(sample[0].shape)
    targets = getattr(train, "targets", None)
    if targets is not None and len(targets):
        known["num_classes"] = int(torch.as_tensor(targets).max()) + 1
    return known


def model_for(config: Config, train: Dataset, user: UserCode) -> nn.Module:
    """The model, the same on every worker (seeded): the Python model_fn, `model.factory`'s, or the built-in."""
    if config.package is not None:
        return packed_model(config)
    known = _shape_and_classes(train)
    torch.manual_seed(config.run.seed)
    if user.model_fn is not None:
        return user.model_fn(known.get("input_shape"), known.get("num_classes"))
    if config.model.factory is not None:
        function = load_factory(config.model.factory, "model.factory")
        made = call_factory(function, "model.factory", known, config.model.arguments())
        return expect(made, nn.Module, "model.factory", "a torch.nn.Module")
    if "input_shape" not in known or "num_classes" not in known:
        raise ConfigError(
            "the built-in `model.name` needs image samples with labels: name your own model with "
            'model.factory = "package.module:function"'
        )
    return build_model(config.model.name, known["input_shape"], known["num_classes"])


def step_for(config: Config, user: UserCode) -> StepFn:
    """The loss of one batch: the Python step_fn, `step.factory`'s (with its keys), or cross-entropy."""
    if user.step_fn is not None:
        return user.step_fn
    if config.package is not None:
        return packed_step
    if config.step.factory is None:
        return cross_entropy_step
    function = load_factory(config.step.factory, "step.factory")
    options = config.step.arguments()
    checked = []

    def step(model: nn.Module, *batch: Any) -> torch.Tensor:
        loss = function(model, *batch, **options)
        if not checked:
            if not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.requires_grad):
                raise ConfigError(
                    f"`step.factory` returned {type(loss).__name__}: it must return the batch's loss, a scalar "
                    "tensor that backward() can go through"
                )
            checked.append(True)
        return loss

    return step


def eval_for(config: Config, test: Dataset | None, device: torch.device) -> EvalFn | None:
    """The evaluation of a model: `eval.factory(model, test_dataset)`'s metrics, or accuracy and loss."""
    if test is None:
        return None
    if config.package is not None:
        return packed_evaluation(test, device, config.eval.batch_size, packaged(config).schema)
    if config.eval.factory is None:
        return classification_metrics(test, device, config.eval.batch_size)
    function = load_factory(config.eval.factory, "eval.factory")
    options = config.eval.arguments()
    return lambda model: function(model, test, **options)


class _FirstOf(IterableDataset):
    """The first `n` samples of an iterable dataset."""

    def __init__(self, dataset: IterableDataset, n: int) -> None:
        self.dataset, self.n = dataset, n

    def __iter__(self) -> Any:
        return itertools.islice(iter(self.dataset), self.n)


def first_samples(dataset: Dataset, n: int) -> Dataset:
    """The first `n` samples of `dataset` (all of them if it has fewer), the same ones every time."""
    if isinstance(dataset, IterableDataset):
        return _FirstOf(dataset, n)
    tensors = getattr(dataset, "tensors", None)
    if tensors is not None:
        return TensorDataset(*(t[:n] for t in tensors))
    return Subset(dataset, range(min(n, len(dataset))))


def validation_score(config: Config, train: Dataset, device: torch.device) -> Callable[[nn.Module], float] | None:
    """A replica's score for final_model = "best": the first target's metric on the first training samples."""
    if isinstance(train, IterableDataset):
        return None
    evaluate = eval_for(config, first_samples(train, VALIDATION_SAMPLES), device)
    metric = config.run.parsed_targets[0].metric if config.run.targets else "accuracy"
    sign = -1.0 if lower_is_better(metric) else 1.0
    return lambda model: sign * evaluate(model)[metric]


def _call(step: StepFn, model: nn.Module, batch: Any) -> torch.Tensor:
    return step(model, *batch) if isinstance(batch, tuple | list) else step(model, batch)


def train_worker(config: Config, run_dir: Path, user: UserCode, resume: bool = False) -> dict[str, Any] | None:
    """One process of `fast train`: the whole training loop on the job API (servers serve inside init)."""
    FAST_LOOP.set(True)
    job = init(config, out=run_dir, resume=run_dir if resume else None)
    train, test = datasets(config)
    # everything but the model first: training time counts from job.prepare's common start
    loader = job.loader(train, config.run.batch_size)
    step = step_for(config, user)
    evaluate = eval_for(config, test, job.device)
    evaluate_during = evaluate  # the evaluations during the run: on the first eval.samples of the test set
    if config.eval.samples and test is not None:
        evaluate_during = eval_for(config, first_samples(test, config.eval.samples), job.device)
    score = validation_score(config, train, job.device)
    model = model_for(config, train, user)
    model, optimizer = job.prepare(model, build_optimizer(config.optimizer, model.parameters()))
    if score is not None:
        job.validate_with(score)
    # Dropout and other training randomness: seeded apart from how the model was built (source or package).
    torch.manual_seed(config.run.seed * 7919 + 1 + job.rank)
    accumulate = config.run.accumulate
    every = round(config.run.eval_every * job.steps_per_epoch) if job.steps_per_epoch else 0
    for _ in job.epochs(config.run.epochs):
        for i, batch in enumerate(loader):
            last = (i + 1) % accumulate == 0
            with contextlib.nullcontext() if last else job.no_sync():
                loss = _call(step, model, batch)
                (loss / accumulate).backward()
            if not last:
                continue
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            job.log(loss=loss)
            if evaluate is not None and every and job.step % every == 0 and not job.stopped:
                job.evaluate(evaluate_during)
    return job.finish(evaluate)
