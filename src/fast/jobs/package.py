"""A packed job's model, loss and evaluation at the data owner's site: its archive's graphs run by fast.program on
its weights, without the author's code and without unpickling (fast.archive reads and checks the archive)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from fast.archive import Package
from fast.errors import PackageError
from fast.jobs.evaluate import EvalFn
from fast.operators import NODE_BYTES


# -- the model --------------------------------------------------------------------------------------------------
class PackedModel(nn.Module):
    """The packed job's model: called with a batch (x, y) it returns the loss in training mode, and (loss, metric,
    ...) in evaluation mode. Its parameters and buffers (w0, w1, ... b0, ...) are held by `program` (model.pt's
    keys are program.w0, ...), and both programs run on them, no node of theirs allocating more than `budget`
    bytes from the sizes it is given (PackageError, naming the node, here where the sizes are constants)."""

    def __init__(self, package: Package, budget: int = NODE_BYTES) -> None:
        super().__init__()
        self.budget = budget
        for graph in package.graphs.values():
            graph.check_budget(budget)
        self.program = nn.Module()
        for name, tensor in package.weights().items():
            if name.startswith("w"):
                self.program.register_parameter(name, nn.Parameter(tensor, tensor.is_floating_point()))
            else:
                self.program.register_buffer(name, tensor)
        self.graphs = {True: package.graphs["train.json"], False: package.graphs["eval.json"]}
        self.metrics: list[str] = package.schema["metrics"]

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> Any:
        tensors = {**self.program._parameters, **self.program._buffers}
        outputs = self.graphs[self.training].run(tensors, x, y, budget=self.budget)
        return outputs[0] if self.training else outputs


def packed_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The loss of one batch: the training program's output."""
    return model(x, y)


def packed_evaluation(test: Any, device: torch.device, batch_size: int, schema: dict[str, Any]) -> EvalFn:
    """The evaluation of a packed model on the owner's test set: the mean loss and metrics over its samples (each
    batch's weighted by its size), and the perplexity exp(loss) when the author asked for it."""
    tensors = getattr(test, "tensors", None)
    if tensors is None:
        tensors = tuple(torch.stack([torch.as_tensor(s[i]) for s in test]) for i in (0, 1))
    x_all, y_all = tensors[0], tensors[1]
    names = ["loss", *schema["metrics"]]

    @torch.no_grad()
    def evaluate(model: nn.Module) -> dict[str, float]:
        was_training = model.training
        model.eval()
        totals = torch.zeros(len(names), dtype=torch.float64)
        for start in range(0, len(x_all), batch_size):
            x, y = x_all[start : start + batch_size].to(device), y_all[start : start + batch_size].to(device)
            values = model(x, y)
            totals += torch.stack([torch.as_tensor(v).double().cpu() for v in values]) * len(x)
        model.train(was_training)
        metrics = {name: float(total) / max(len(x_all), 1) for name, total in zip(names, totals, strict=True)}
        if "perplexity" in schema.get("derived", []):
            metrics["perplexity"] = math.exp(min(metrics["loss"], 700.0))
        return metrics

    return evaluate


def check_data(schema: dict[str, Any], dataset: Any, which: str) -> None:
    """PackageError unless the dataset's samples are what the package was exported for."""
    tensors = getattr(dataset, "tensors", None)
    sample = (tensors[0][0], tensors[1][0]) if tensors is not None else dataset[0]
    for value, expected, what in ((sample[0], schema["input"], "input"), (sample[1], schema["label"], "label")):
        value = torch.as_tensor(value)
        have = (str(value.dtype).removeprefix("torch."), list(value.shape))
        want = (expected["dtype"], list(expected["shape"]))
        if have != want:
            raise PackageError(
                f"{which} data: each {what} is {have[0]} of shape {tuple(have[1])}, but the package was made for "
                f"{want[0]} of shape {tuple(want[1])}: give data of that kind (data.name, data.factory or data.dir)"
            )
