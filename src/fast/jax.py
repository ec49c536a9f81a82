"""The JAX front end: a pytree of parameters and an Optax optimizer trained by the strategies a PyTorch job uses.

    job = fast.init("job.toml")
    params, optimizer = job.prepare(params, optax.adam(1e-3))   # worker 0's weights (or the checkpoint's)
    for x, y in job.loader((images, labels), batch_size=64):    # this worker's shard, as NumPy arrays
        loss, grads = grad_fn(params, x, y)                     # the user's own (jitted) JAX
        params = optimizer.step(grads)                          # the strategy around the Optax update
        job.log(loss=loss)
    summary = job.finish(evaluate)                               # evaluate(params) -> {"accuracy": ...}

No strategy is written for JAX. The strategies hook a torch module and a torch optimizer (fast.runtime.steps), so
this module makes both out of the user's objects, once for every strategy: `ParameterTree`, a module whose
parameters are the pytree's leaves, and `OptaxOptimizer`, a torch optimizer whose step is the Optax update.
`JaxOptimizer.step(grads)` is one step through them:

- the gradients become the parameters' `.grad` without a copy (DLPack: torch tensors on JAX's buffers), so what a
  strategy writes into them (sync's average, a clipped norm) is what the Optax update then reads, with no copy back;
- the Optax update (jitted once) reads the weights through DLPack views too, and its result is copied into the
  module's parameters, which the strategies average, mix, push and pull in place;
- the weights go back to the user as a new pytree: one copy. A view would be cheaper, but JAX arrays are taken to
  be immutable and JAX computes asynchronously: weights that the next step overwrites in place could change under
  a computation still in flight.

So `step(grads)` takes the gradients over (they may hold the averaged ones afterwards, as a torch .grad does).
Evaluation functions receive the pytree of the model the run reports (an average, the best replica, ...).
A FAST `[schedule]` sets Optax's learning rate when the optimizer was made with `optax.inject_hyperparams`;
`optimizer.clip_norm` clips the gradients as for PyTorch. This module imports JAX; the PyTorch path never imports it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
from torch import nn

from fast.config import Config
from fast.errors import ConfigError, UsageError


def is_optax(optimizer: Any) -> bool:
    """Whether `optimizer` is an Optax GradientTransformation (what makes `job.prepare` a JAX job's)."""
    return isinstance(optimizer, optax.GradientTransformation)


def check_config(config: Config) -> None:
    """What a JAX job cannot take, refused in one line each."""
    run = config.run
    if run.device != "cpu":
        raise ConfigError(f"run.device = {run.device!r} with a JAX job: the JAX front end runs on the CPU; set "
                          'run.device = "cpu"')  # fmt: skip
    if run.precision != "fp32":
        raise ConfigError(f"run.precision = {run.precision!r} with a JAX job: FAST's autocast is PyTorch's; cast in "
                          "your own JAX step (jnp.bfloat16) and leave run.precision = \"fp32\"")  # fmt: skip
    if run.accumulate != 1:
        raise ConfigError(f"run.accumulate = {run.accumulate} with a JAX job: sum the micro-batches' gradients in your "
                          "own JAX step and give optimizer.step their mean; set run.accumulate = 1")  # fmt: skip


class ParameterTree(nn.Module):
    """The leaves of a pytree of floating-point arrays as torch parameters named by their path in the tree
    ("layers/0/w"). Leaves of one dtype are views of one flat tensor, so that the weights cross to JAX and back as
    one array (`weights`, `tree`) however many leaves the tree has."""

    def __init__(self, params: Any) -> None:
        super().__init__()
        paths, self.treedef = jax.tree_util.tree_flatten_with_path(params)
        if not paths:
            raise UsageError("job.prepare: the pytree of parameters has no leaves")
        arrays = [np.asarray(leaf) for _, leaf in paths]
        self.names = [jax.tree_util.keystr(path, simple=True, separator="/").replace(".", "_") or "param"
                      for path, _ in paths]  # fmt: skip
        for name, array in zip(self.names, arrays, strict=True):
            if not np.issubdtype(array.dtype, np.floating):
                raise UsageError(f"job.prepare: parameter {name!r} is {array.dtype}: every leaf of the pytree must be "
                                 "a floating-point array (keep integer state outside the parameters)")  # fmt: skip
        self.shapes = [array.shape for array in arrays]
        self.sizes = [array.size for array in arrays]
        one_dtype = len({array.dtype for array in arrays}) == 1
        self.flat = torch.tensor(np.concatenate([a.reshape(-1) for a in arrays])) if one_dtype else None
        offsets = np.cumsum([0, *self.sizes])
        for i, (name, array) in enumerate(zip(self.names, arrays, strict=True)):
            data = self.flat[offsets[i] : offsets[i + 1]].view(array.shape) if one_dtype else torch.tensor(array)
            self.register_parameter(name, nn.Parameter(data))
        self._split = jax.jit(self._unflatten)

    def leaves(self) -> list[nn.Parameter]:
        return [getattr(self, name) for name in self.names]

    def is_flat(self) -> bool:
        """Whether the parameters are still the flat tensor's views (a strategy may have moved them: hogwild)."""
        if self.flat is None:
            return False
        start, size = self.flat.data_ptr(), self.flat.element_size()
        offsets = np.cumsum([0, *self.sizes])
        return all(p.data_ptr() == start + size * int(o) for p, o in zip(self.leaves(), offsets, strict=False))

    def _unflatten(self, weights: Any) -> Any:
        """The pytree of `weights`: the flat array cut into the leaves, or the list of leaves."""
        if isinstance(weights, list):
            return jax.tree_util.tree_unflatten(self.treedef, weights)
        cuts = np.cumsum(self.sizes)[:-1].tolist()
        leaves = [x.reshape(shape) for x, shape in zip(jnp.split(weights, cuts), self.shapes, strict=True)]
        return jax.tree_util.tree_unflatten(self.treedef, leaves)

    def weights(self) -> Any:
        """Views of the weights for JAX (DLPack, no copy), to be read before they change: the flat array, or a list
        of the leaves'."""
        if self.is_flat():
            return jax.dlpack.from_dlpack(self.flat.detach())
        return [jax.dlpack.from_dlpack(p.detach()) for p in self.leaves()]

    def write(self, weights: Any) -> None:
        """Copy `weights` (as `weights()` gives them) into the parameters."""
        if isinstance(weights, list):
            for p, leaf in zip(self.leaves(), weights, strict=True):
                p.detach().copy_(torch.from_dlpack(leaf))
        else:
            self.flat.copy_(torch.from_dlpack(weights))

    def tree(self) -> Any:
        """The weights as a pytree of new JAX arrays (copies)."""
        if self.is_flat():
            return self._split(jax.device_put(self.flat.detach().numpy().copy()))
        return self._unflatten([jax.device_put(p.detach().numpy().copy()) for p in self.leaves()])

    def forward(self, *args: Any) -> Any:
        raise UsageError("a JAX job's model is its pytree: compute with your own JAX functions, not model(x)")

    def __deepcopy__(self, memo: dict[int, Any]) -> ParameterTree:
        """A copy (an average's, a replica's): its own flat tensor and views, the same tree."""
        twin = ParameterTree.__new__(ParameterTree)
        memo[id(self)] = twin
        nn.Module.__init__(twin)
        twin.treedef, twin.names, twin.shapes, twin.sizes = self.treedef, self.names, self.shapes, self.sizes
        twin._split = self._split
        twin.flat = self.flat.detach().clone() if self.flat is not None else None
        offsets = np.cumsum([0, *self.sizes])
        for i, (name, p) in enumerate(zip(self.names, self.leaves(), strict=True)):
            data = twin.flat[offsets[i] : offsets[i + 1]].view(p.shape) if twin.flat is not None else p.detach().clone()
            if twin.flat is not None and not self.is_flat():
                data.copy_(p.detach())
            twin.register_parameter(name, nn.Parameter(data, requires_grad=p.requires_grad))
        twin.train(self.training)
        return twin


class OptaxOptimizer(torch.optim.Optimizer):
    """A torch optimizer over a ParameterTree whose step is the Optax update of `transformation` (the hooks FAST's
    strategies put on a torch optimizer run around it). A parameter without a gradient (a skipped step: none has
    one) leaves the state and the weights alone. Its state_dict holds the Optax state's leaves as tensors."""

    def __init__(self, tree: ParameterTree, transformation: optax.GradientTransformation) -> None:
        self.tree, self.transformation = tree, transformation
        self.state_tree = transformation.init(tree.tree())
        lr = self._injected_lr()
        super().__init__(tree.leaves(), {"lr": lr if lr is not None else math.nan})

        def update(grads: Any, state: Any, weights: Any) -> tuple[Any, Any]:
            params = tree._unflatten(weights)
            updates, state = transformation.update(grads, state, params)
            new = jax.tree_util.tree_leaves(optax.apply_updates(params, updates))
            return (new if isinstance(weights, list) else jnp.concatenate([x.reshape(-1) for x in new])), state

        self._update = jax.jit(update)
        self.handed: list[tuple[torch.Tensor, jax.Array]] = []  # (the .grad tensor, the JAX array it views)

    def _hyperparameters(self) -> dict[str, Any] | None:
        hyper = getattr(self.state_tree, "hyperparams", None)
        return hyper if isinstance(hyper, dict) and "learning_rate" in hyper else None

    def _injected_lr(self) -> float | None:
        hyper = self._hyperparameters()
        return float(hyper["learning_rate"]) if hyper is not None else None

    @property
    def sets_learning_rate(self) -> bool:
        """Whether FAST's lr (a [schedule]) reaches Optax: the optimizer was made with optax.inject_hyperparams."""
        return self._hyperparameters() is not None

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> None:
        params = self.tree.leaves()
        if all(p.grad is None for p in params):  # the step is skipped (non-finite gradients, say)
            return
        handed = {id(t): array for t, array in self.handed if t.dtype == array.dtype}
        grads = [self._gradient(p, handed) for p in params]
        hyper = self._hyperparameters()
        if hyper is not None:
            hyper["learning_rate"] = jnp.asarray(self.param_groups[0]["lr"], jnp.asarray(hyper["learning_rate"]).dtype)
        grads_tree = jax.tree_util.tree_unflatten(self.tree.treedef, grads)
        new, self.state_tree = self._update(grads_tree, self.state_tree, self.tree.weights())
        self.tree.write(jax.block_until_ready(new))
        self.handed = []

    @staticmethod
    def _gradient(p: torch.Tensor, handed: dict[int, jax.Array]) -> jax.Array:
        """p's gradient for Optax: the JAX array handed over when .grad is still its view (what a strategy wrote in
        place is in it), a view of a .grad a strategy replaced, or zeros."""
        if p.grad is None:
            return jnp.zeros(p.shape, np.dtype(str(p.dtype).removeprefix("torch.")))
        return handed[id(p.grad)] if id(p.grad) in handed else jax.dlpack.from_dlpack(p.grad.detach())

    def state_dict(self) -> dict[str, Any]:
        leaves = jax.tree_util.tree_leaves(self.state_tree)
        return {"optax": [torch.tensor(np.asarray(leaf)) for leaf in leaves], "lr": self.param_groups[0]["lr"]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        treedef = jax.tree_util.tree_structure(self.state_tree)
        leaves = [jnp.asarray(t.numpy()) for t in state_dict["optax"]]
        if len(leaves) != treedef.num_leaves:
            raise UsageError(f"the saved Optax state has {len(leaves)} arrays where this optimizer's has "
                             f"{treedef.num_leaves}: resume with the optimizer the run was started with")  # fmt: skip
        self.state_tree = jax.tree_util.tree_unflatten(treedef, leaves)
        for group in self.param_groups:
            group["lr"] = state_dict["lr"]


class JaxOptimizer:
    """What `job.prepare(params, transformation)` returns beside the weights: `step(grads)` is one training step of
    the strategy around the Optax update, and returns the new weights."""

    def __init__(self, job: Any, tree: ParameterTree, optimizer: OptaxOptimizer) -> None:
        self.job, self.tree, self.optimizer = job, tree, optimizer

    @property
    def state(self) -> Any:
        """The Optax state, as Optax made it."""
        return self.optimizer.state_tree

    def step(self, grads: Any) -> Any:
        """Hand over the step's gradients (a pytree shaped as the parameters), run the strategy and the Optax update;
        the new weights, as a pytree."""
        leaves, treedef = jax.tree_util.tree_flatten(grads)
        if treedef != self.tree.treedef:
            raise UsageError(f"optimizer.step: the gradients' tree {treedef} is not the parameters' "
                             f"{self.tree.treedef}: give the gradients of the parameters job.prepare took")  # fmt: skip
        handed = []
        for p, leaf, name in zip(self.tree.leaves(), leaves, self.tree.names, strict=True):
            g = torch.from_dlpack(leaf)
            if g.shape != p.shape:
                raise UsageError(f"optimizer.step: the gradient of {name!r} has shape {tuple(g.shape)} where the "
                                 f"parameter has {tuple(p.shape)}: give the gradients of the parameters")  # fmt: skip
            p.grad = g if g.dtype == p.dtype else g.to(p.dtype)  # (a copy then, read back through DLPack)
            handed.append((p.grad, leaf))
        self.optimizer.handed = handed
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return self.tree.tree()


def prepare(job: Any, params: Any, transformation: optax.GradientTransformation) -> tuple[Any, JaxOptimizer]:
    """`job.prepare` for a JAX job: the module and optimizer the strategies hook, prepared as a PyTorch job's are;
    returns the starting weights (worker 0's, or the checkpoint's) and the optimizer's handle."""
    check_config(job.config)
    tree = ParameterTree(params)
    optimizer = OptaxOptimizer(tree, transformation)
    schedule = job.config.schedule
    if schedule is not None and schedule.name != "constant" and not optimizer.sets_learning_rate:
        raise ConfigError(f"schedule.name = {schedule.name!r} with an Optax optimizer whose learning rate FAST cannot "
                          "set: make it with optax.inject_hyperparams(optax.adam)(learning_rate=...), or give Optax "
                          "a schedule and drop [schedule]")  # fmt: skip
    job.prepare(tree, optimizer)
    job.frontend = JaxFrontEnd(job)
    return tree.tree(), JaxOptimizer(job, tree, optimizer)


class JaxFrontEnd:
    """What the job asks of its front end: batches for the user's JAX code (each one begins a step), and
    evaluation functions that take the pytree."""

    def __init__(self, job: Any) -> None:
        self.job = job

    def batch(self, batch: Any) -> Any:
        """A loader's batch, as NumPy arrays (JAX takes them as they are); the step begins here, as a PyTorch job's
        begins at its forward, so that the strategy's start of step and the compute timeline come before the user's
        computation."""
        driver = self.job.driver
        first = next((t for t in _tensors(batch)), None)
        if first is not None and first.dim() > 0:
            driver.samples += int(first.shape[0])
        if not driver.began:
            driver.begin()
        return _to_numpy(batch)

    def on_tree(self, fn: Callable[[Any], Any]) -> Callable[[nn.Module], Any]:
        """`fn(params)` as the job calls evaluation functions: on a module (a ParameterTree, or a copy of it)."""

        def on_module(model: nn.Module) -> Any:
            return fn(model.tree() if isinstance(model, ParameterTree) else model)

        on_module.__name__ = getattr(fn, "__name__", "evaluate")
        return on_module


def _tensors(batch: Any) -> list[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, list | tuple):
        return [t for item in batch for t in _tensors(item)]
    if isinstance(batch, dict):
        return [t for item in batch.values() for t in _tensors(item)]
    return []


def _to_numpy(batch: Any) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.numpy()
    if isinstance(batch, list | tuple):
        return type(batch)(_to_numpy(item) for item in batch)
    if isinstance(batch, dict):
        return {key: _to_numpy(value) for key, value in batch.items()}
    return batch
