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

On a GPU: the job trains where the parameters' arrays are. Arrays on a GPU make the run a CUDA one (run.device
follows them, as it follows a PyTorch model a script put on a GPU itself): the weights, gradients and Optax state
stay on the GPU and cross between JAX and torch through DLPack there, and the loader's batches come as JAX arrays on
the GPU (DLPack again) instead of NumPy's. A run.device that says otherwise is refused in one line (`run_device`).
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


def check_config(config: Config) -> None:
    """What a JAX job cannot take, refused in one line each."""
    run = config.run
    if run.precision != "fp32":
        raise ConfigError(f"run.precision = {run.precision!r} with a JAX job: FAST's autocast is PyTorch's; cast in "
                          "your own JAX step (jnp.bfloat16) and leave run.precision = \"fp32\"")  # fmt: skip
    if run.accumulate != 1:
        raise ConfigError(f"run.accumulate = {run.accumulate} with a JAX job: sum the micro-batches' gradients in your "
                          "own JAX step and give optimizer.step their mean; set run.accumulate = 1")  # fmt: skip


def platform_of(leaf: Any) -> str:
    """Where an array of the pytree lives, as FAST names devices: "cpu", "cuda" (JAX's "gpu"), or JAX's own name."""
    devices = leaf.devices() if hasattr(leaf, "devices") else set()  # (a NumPy array is on the CPU)
    platforms = {"cuda" if d.platform in ("gpu", "cuda") else d.platform for d in devices} or {"cpu"}
    return platforms.pop() if len(platforms) == 1 else "+".join(sorted(platforms))


def run_device(platforms: set[str], configured: str, explicit: bool) -> str:
    """The device a JAX job trains on: where its parameters are (`platforms`, as `platform_of` names them). A
    run.device left at its default follows them; one the config set (`explicit`) must agree. Else one line, with
    the fix."""
    if len(platforms) != 1:
        raise ConfigError(f"job.prepare: the parameters are on {' and '.join(sorted(platforms))}: put them all on one "
                          "device (jax.device_put(params, device))")  # fmt: skip
    (where,) = platforms
    if where not in ("cpu", "cuda"):
        raise ConfigError(f"job.prepare: the parameters are on {where}, where FAST does not train: put them on the "
                          "CPU or a GPU (jax.device_put(params, jax.devices(\"cpu\")[0]))")  # fmt: skip
    if where == configured or (where == "cuda" and not explicit):
        return where
    place = {"cpu": "the CPU", "cuda": "a GPU"}
    jax_name = "gpu" if configured == "cuda" else "cpu"
    raise ConfigError(f"run.device = {configured!r} but the JAX parameters are on {place[where]}: set run.device = "
                      f"{where!r}, or put them on {place[configured]} (jax.device_put(params, "
                      f"jax.devices({jax_name!r})[0]))")  # fmt: skip


def span(tensors: list[torch.Tensor | None]) -> tuple[torch.Tensor, tuple[int, ...]] | None:
    """One 1-D tensor over the memory that contiguous tensors of one dtype lie in, and each one's offset in it
    (a flat tensor's views, a bucket's gradients); None when they are not such tensors."""
    first = tensors[0]
    if first is None:
        return None
    storage = first.untyped_storage()
    for t in tensors:
        if (
            t is None
            or not t.is_contiguous()
            or t.dtype != first.dtype
            or t.untyped_storage().data_ptr() != storage.data_ptr()
        ):
            return None
    starts = [t.storage_offset() for t in tensors]
    low, high = min(starts), max(start + t.numel() for start, t in zip(starts, tensors, strict=True))
    base = torch.empty(0, dtype=first.dtype, device=first.device).set_(storage, low, (high - low,))
    return base, tuple(start - low for start in starts)


def to_jax(tensors: list[torch.Tensor]) -> tuple[Any, tuple[int, ...] | None]:
    """The tensors for JAX without a copy (DLPack), to be read before they change: one array over their memory and
    their offsets in it when they lie in one span (one crossing, however many), else one array each."""
    spanned = span(tensors)
    if spanned is None:
        return [jax.dlpack.from_dlpack(t.detach()) for t in tensors], None
    base, offsets = spanned
    return jax.dlpack.from_dlpack(base.detach()), offsets


class ParameterTree(nn.Module):
    """The leaves of a pytree of floating-point arrays as torch parameters named by their path in the tree
    ("layers/0/w"). Leaves of one dtype are views of one flat tensor, so that the weights cross to JAX and back as
    one array however many leaves the tree has (a strategy that moves them elsewhere, hogwild, makes it one each)."""

    def __init__(self, params: Any) -> None:
        super().__init__()
        paths, self.treedef = jax.tree_util.tree_flatten_with_path(params)
        if not paths:
            raise UsageError("job.prepare: the pytree of parameters has no leaves")
        leaves = [leaf for _, leaf in paths]
        names = [
            jax.tree_util.keystr(path, simple=True, separator="/").replace(".", "_") or "param" for path, _ in paths
        ]
        for name, leaf in zip(names, leaves, strict=True):
            dtype = np.asarray(leaf).dtype if not hasattr(leaf, "dtype") else np.dtype(leaf.dtype)
            if not np.issubdtype(dtype, np.floating):
                raise UsageError(f"job.prepare: parameter {name!r} is {dtype}: every leaf of the pytree must be "
                                 "a floating-point array (keep integer state outside the parameters)")  # fmt: skip
        # on a GPU the weights stay there (DLPack: a view of JAX's buffer, copied into the flat tensor below)
        values = [torch.from_dlpack(leaf) if platform_of(leaf) == "cuda" else torch.tensor(np.asarray(leaf))
                  for leaf in leaves]  # fmt: skip
        self._lay_out(names, [tuple(v.shape) for v in values], values)
        self.split = jax.jit(self.unflatten, static_argnums=1)

    def _lay_out(self, names: list[str], shapes: list[tuple[int, ...]], values: list[torch.Tensor]) -> None:
        self.names, self.shapes = names, shapes
        self.offsets = tuple(int(o) for o in np.cumsum([0, *(math.prod(shape) for shape in shapes)])[:-1])
        one_dtype = len({v.dtype for v in values}) == 1
        flat = torch.cat([v.reshape(-1) for v in values]) if one_dtype else None
        for name, shape, value, offset in zip(names, shapes, values, self.offsets, strict=True):
            data = flat[offset : offset + math.prod(shape)].view(shape) if flat is not None else value.clone()
            self.register_parameter(name, nn.Parameter(data))

    def leaves(self) -> list[nn.Parameter]:
        return [getattr(self, name) for name in self.names]

    def unflatten(self, arrays: Any, offsets: tuple[int, ...] | None) -> Any:
        """The pytree of what `to_jax` made of tensors shaped as the leaves: one array cut at `offsets`, or a list."""
        if offsets is not None:
            arrays = [
                arrays[o : o + math.prod(shape)].reshape(shape) for o, shape in zip(offsets, self.shapes, strict=True)
            ]
        return jax.tree_util.tree_unflatten(self.treedef, arrays)

    def write(self, flat: jax.Array) -> None:
        """Copy the weights laid end to end in `flat` into the parameters: one copy when they are still the flat
        tensor's views."""
        new = torch.from_dlpack(flat)
        spanned = span(self.leaves())
        if spanned is not None and spanned[1] == self.offsets and spanned[0].numel() == new.numel():
            spanned[0].copy_(new)
            return
        for p, offset, shape in zip(self.leaves(), self.offsets, self.shapes, strict=True):
            p.detach().copy_(new[offset : offset + math.prod(shape)].view(shape))

    def tree(self) -> Any:
        """The weights as a pytree of new JAX arrays (one copy of them all, cut in one jitted call)."""
        spanned = span(self.leaves())
        if spanned is not None and spanned[1] == self.offsets:
            flat = spanned[0].detach().clone()
        else:
            flat = torch.cat([p.detach().reshape(-1) for p in self.leaves()])
        if flat.is_cuda:  # (JAX takes the copy over where it is)
            return self.split(jax.dlpack.from_dlpack(flat), self.offsets)
        return self.split(jax.device_put(flat.numpy()), self.offsets)

    def forward(self, *args: Any) -> Any:
        raise UsageError("a JAX job's model is its pytree: compute with your own JAX functions, not model(x)")

    def __deepcopy__(self, memo: dict[int, Any]) -> ParameterTree:
        """A copy (an average's, a replica's): its own flat tensor and views, the same tree."""
        twin = ParameterTree.__new__(ParameterTree)
        memo[id(self)] = twin
        nn.Module.__init__(twin)
        twin.treedef, twin.split = self.treedef, self.split
        twin._lay_out(self.names, self.shapes, [p.detach() for p in self.leaves()])
        for mine, theirs in zip(twin.leaves(), self.leaves(), strict=True):
            mine.requires_grad_(theirs.requires_grad)
        twin.train(self.training)
        return twin


class OptaxOptimizer(torch.optim.Optimizer):
    """A torch optimizer over a ParameterTree whose step is the Optax update of `transformation` (the hooks FAST's
    strategies put on a torch optimizer run around it). A step where no parameter has a gradient (a skipped step)
    leaves the state and the weights alone; a parameter without one gets zeros. Its state_dict holds the Optax
    state's leaves as tensors."""

    def __init__(self, tree: ParameterTree, transformation: optax.GradientTransformation) -> None:
        self.tree, self.transformation = tree, transformation
        self.state_tree = transformation.init(tree.tree())
        lr = self._injected_lr()
        super().__init__(tree.leaves(), {"lr": lr if lr is not None else math.nan})

        def update(grads: Any, state: Any, weights: Any, grad_offsets: Any, weight_offsets: Any) -> tuple[Any, Any]:
            params = tree.unflatten(weights, weight_offsets)
            updates, state = transformation.update(tree.unflatten(grads, grad_offsets), state, params)
            new = jax.tree_util.tree_leaves(optax.apply_updates(params, updates))
            return jnp.concatenate([x.reshape(-1) for x in new]), state

        self._update = jax.jit(update, static_argnums=(3, 4))

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
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        hyper = self._hyperparameters()
        if hyper is not None:
            hyper["learning_rate"] = jnp.asarray(self.param_groups[0]["lr"], jnp.asarray(hyper["learning_rate"]).dtype)
        grads, grad_offsets = to_jax([p.grad for p in params])
        weights, weight_offsets = to_jax(params)
        new, self.state_tree = self._update(grads, self.state_tree, weights, grad_offsets, weight_offsets)
        self.tree.write(jax.block_until_ready(new))

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

    def __init__(self, tree: ParameterTree, optimizer: OptaxOptimizer) -> None:
        self.tree, self.optimizer = tree, optimizer

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
        for p, leaf, name in zip(self.tree.leaves(), leaves, self.tree.names, strict=True):
            g = torch.from_dlpack(leaf)
            if g.shape != p.shape:
                raise UsageError(f"optimizer.step: the gradient of {name!r} has shape {tuple(g.shape)} where the "
                                 f"parameter has {tuple(p.shape)}: give the gradients of the parameters")  # fmt: skip
            p.grad = g if g.dtype == p.dtype else g.to(p.dtype)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return self.tree.tree()


def prepare(job: Any, params: Any, transformation: optax.GradientTransformation) -> tuple[Any, JaxOptimizer]:
    """`job.prepare` for a JAX job: the module and optimizer the strategies hook, prepared as a PyTorch job's are;
    returns the starting weights (worker 0's, or the checkpoint's) and the optimizer's handle."""
    check_config(job.config)
    run = job.config.run
    explicit = "device" in run.model_fields_set or job.loop_is_fast
    run_device({platform_of(leaf) for leaf in jax.tree_util.tree_leaves(params)} or {"cpu"}, run.device, explicit)
    tree = ParameterTree(params)  # on the parameters' device: job.prepare follows it there (Job._place)
    optimizer = OptaxOptimizer(tree, transformation)
    schedule = job.parts.optimizer.schedule
    if schedule is not None and schedule.name != "constant" and not optimizer.sets_learning_rate:
        raise ConfigError(f"schedule.name = {schedule.name!r} with an Optax optimizer whose learning rate FAST cannot "
                          "set: make it with optax.inject_hyperparams(optax.adam)(learning_rate=...), or give Optax "
                          "a schedule and drop [schedule]")  # fmt: skip
    job.prepare(tree, optimizer)
    job.frontend = JaxFrontEnd(job)
    return tree.tree(), JaxOptimizer(tree, optimizer)


class JaxFrontEnd:
    """What the job asks of its front end: batches for the user's JAX code (each one begins a step), and
    evaluation functions that take the pytree."""

    def __init__(self, job: Any) -> None:
        self.job = job

    def batch(self, batch: Any) -> Any:
        """A loader's batch, as NumPy arrays (JAX takes them as they are), or on a GPU as JAX arrays there (DLPack);
        the step begins here, as a PyTorch job's begins at its forward, so that the strategy's start of step and the
        compute timeline come before the user's computation."""
        driver = self.job.driver
        first = next((t for t in _tensors(batch)), None)
        if first is not None and first.dim() > 0:
            driver.samples += int(first.shape[0])
        if not driver.began:
            driver.begin()
        return _for_jax(batch)

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


def _for_jax(batch: Any) -> Any:
    if isinstance(batch, torch.Tensor):
        return jax.dlpack.from_dlpack(batch) if batch.is_cuda else batch.numpy()
    if isinstance(batch, list | tuple):
        return type(batch)(_for_jax(item) for item in batch)
    if isinstance(batch, dict):
        return {key: _for_jax(value) for key, value in batch.items()}
    return batch
