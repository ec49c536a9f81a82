"""The job's code, built in each process from the parts it was handed (fast.parts): its datasets, its model, its
loss of one batch, its evaluations; a packed job's from its package.

    data.factory(**[data] keys)                      -> (train_dataset, test_dataset or None)
    model.factory(**[model] keys, input_shape=..., num_classes=...)  -> nn.Module (the last two if it takes them)
    step.factory(model, *batch, **[step] keys)       -> the loss of one batch (default: cross-entropy)
    eval.factory(model, test_dataset, **[eval] keys) -> {"metric": value, ...} (default: accuracy and loss)
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, IterableDataset, Subset, TensorDataset

from fast.archive import Package, read_package
from fast.comm import timing
from fast.errors import ConfigError, UsageError
from fast.factories import call_factory, expect
from fast.jobs.datasets import check_available, load_dataset
from fast.jobs.evaluate import EvalFn, classification_metrics
from fast.jobs.models import build_model
from fast.jobs.package import PackedModel, packed_evaluation, packed_step
from fast.jobs.package import check_data as check_schema
from fast.optim import build_optimizer
from fast.parts import DataPart, EvaluationPart, JobParts, ModelPart, Packed, StepPart
from fast.targets import lower_is_better

StepFn = Callable[..., torch.Tensor]
VALIDATION_SAMPLES = 1000  # training samples that score replicas for final_model = "best"


def cross_entropy_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The default per-batch step: supervised classification loss."""
    return F.cross_entropy(model(x), y)


class LabelledTensors(TensorDataset):
    """Samples and labels as two tensors; `targets` are the labels (for the dirichlet partition)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        super().__init__(x, y)
        self.targets = y


# -- a packed job ------------------------------------------------------------------------------------------------------
def package_of(packed: Packed) -> Package:
    """The packed job (read and checked once per process: fast.archive keeps it)."""
    return read_package(packed.path, packed.trusted_key)


def packed_model(packed: Packed) -> PackedModel:
    """The packed job's model, each node of its programs held to the owner's budget (package.max_node_gib)."""
    return PackedModel(package_of(packed), budget=packed.node_bytes)


def packed_job(parts: JobParts) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A packed job's model and its author's optimizer, for the data owner's own loop (`fast.packaged`)."""
    if parts.packed is None:
        raise UsageError("fast.packaged(): the run names no package: start it with `fast run --config JOB.fastjob`")
    model = packed_model(parts.packed)
    return model, build_optimizer(parts.optimizer.config, model.parameters())


# -- data --------------------------------------------------------------------------------------------------------------
def load_data(part: DataPart) -> tuple[Dataset, Dataset | None]:
    """The training and test datasets (the workers of a simulation share one copy)."""
    if timing.simulated():
        return timing.shared(f"datasets {part.key}", lambda: _checked(part))
    return _checked(part)


def check_data(part: DataPart) -> None:
    """Fail now, in one line, when a built-in data set is not installed (nothing is loaded: a factory's data, and a
    packed job's against its schema, are checked where they are loaded)."""
    if part.factory is None:
        check_available(part.name, part.folder)


def _checked(part: DataPart) -> tuple[Dataset, Dataset | None]:
    train, test = _made(part)
    if part.packed is not None:
        schema = package_of(part.packed).schema
        check_schema(schema, train, "training")
        if test is not None:
            check_schema(schema, test, "test")
    return train, test


def _made(part: DataPart) -> tuple[Dataset, Dataset | None]:
    if part.factory is not None:
        made = call_factory(part.factory, "data.factory", {}, part.options)
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
    synthetic_train, synthetic_test = part.synthetic
    built = load_dataset(part.name, seed=part.seed, data_dir=part.folder, synthetic_train=synthetic_train,
                         synthetic_test=synthetic_test)  # fmt: skip
    return LabelledTensors(built.x_train, built.y_train), LabelledTensors(built.x_test, built.y_test)


# -- the model and the step --------------------------------------------------------------------------------------------
def make_model(part: ModelPart, train: Dataset) -> nn.Module:
    """The model, the same on every worker (seeded): Python's model_fn, `model.factory`'s, the built-in, or the
    package's."""
    if part.packed is not None:
        return packed_model(part.packed)
    known = _shape_and_classes(train)
    torch.manual_seed(part.seed)
    if part.function is not None:
        return part.function(known.get("input_shape"), known.get("num_classes"))
    if part.factory is not None:
        made = call_factory(part.factory, "model.factory", known, part.options)
        return expect(made, nn.Module, "model.factory", "a torch.nn.Module")
    if "input_shape" not in known or "num_classes" not in known:
        raise ConfigError(
            "the built-in `model.name` needs image samples with labels: name your own model with "
            'model.factory = "package.module:function"'
        )
    return build_model(part.name, known["input_shape"], known["num_classes"])


def step_of(part: StepPart) -> StepFn:
    """The loss of one batch: Python's step_fn, `step.factory`'s (with its keys), the package's, or cross-entropy."""
    if part.packed is not None and part.function is None:
        return packed_step
    if part.function is None:
        return cross_entropy_step
    if not part.from_factory:
        return part.function
    function, options, checked = part.function, part.options, []

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


# -- evaluation --------------------------------------------------------------------------------------------------------
def evaluation(part: EvaluationPart, test: Dataset | None, device: torch.device) -> EvalFn | None:
    """The evaluation of a model on `test`: `eval.factory`'s metrics, accuracy and loss, or the package's."""
    if test is None:
        return None
    if part.packed is not None:
        return packed_evaluation(test, device, part.batch_size, package_of(part.packed).schema)
    if part.factory is None:
        return classification_metrics(test, device, part.batch_size)
    function, options = part.factory, part.options
    return lambda model: function(model, test, **options)


def evaluation_during(part: EvaluationPart, test: Dataset | None, device: torch.device) -> EvalFn | None:
    """The evaluations during the run: on the first `eval.samples` of the test set (None: on all of it, as at the
    end)."""
    if part.samples and test is not None:
        return evaluation(part, first_samples(test, part.samples), device)
    return None


def validation_score(part: EvaluationPart, train: Dataset, device: torch.device) -> Callable[[nn.Module], float] | None:
    """A replica's score for final_model = "best": the first target's metric on the first training samples."""
    if isinstance(train, IterableDataset):
        return None
    evaluate = evaluation(part, first_samples(train, VALIDATION_SAMPLES), device)
    metric, sign = part.score_metric, -1.0 if lower_is_better(part.score_metric) else 1.0
    return lambda model: sign * evaluate(model)[metric]


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
