"""Checkpoints of a sharded replica through torch.distributed.checkpoint (DCP): a replica's model and optimizer written
by its K shards into one folder, read back at the same K or at another (DCP reshards; at K = 1 into the user's
unsharded model).

One folder per replica and step (`replica_folder`): replicas may differ (local SGD, DiLoCo between rounds), so each
keeps its own, as each unsharded worker keeps its own file. In it:

- DCP's files: each shard's part of the model and the optimizer (`get_state_dict`: keyed by the parameters' names,
  so another K, or the unsharded model, reads them), and `.metadata`, which DCP writes last, once every shard's part
  is in: a folder without it is not a checkpoint (`complete`);
- `flat`: vectors laid out like the local parameters, one after the other (a strategy's θ, its outer momentum: what
  fast.strategies.flat reads from the local view), stored per parameter as DTensors, so that they reshard too;
- `extra-shard<k>.pt`: each shard's own small state (the step, its RNG, the loader's position), written atomically
  before DCP's files; read back by shard k, or by shard 0's file where the checkpoint had no shard k.

Every process writes and reads the same way at every step, so a resume is bit for bit at the same K.
"""

from __future__ import annotations

import re
import shutil
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from fast.runtime import files
from fast.shards.local import local_tensor

METADATA = ".metadata"  # DCP's index of a checkpoint, written last


def replica_folder(run_dir: Path, replica: int, step: int) -> Path:
    """`checkpoints/replica<r>-step<N>`: replica r's checkpoint of step N."""
    return run_dir / "checkpoints" / f"replica{replica}-step{step}"


def complete(folder: Path) -> bool:
    """Whether `folder` holds a whole checkpoint (DCP's metadata, written once every shard's part is in)."""
    return (folder / METADATA).is_file()


def saved_steps(run_dir: Path, replica: int) -> list[int]:
    """The steps of replica `replica`'s whole checkpoints in `run_dir`, oldest first."""
    pattern = re.compile(rf"replica{replica}-step(\d+)")
    folder = run_dir / "checkpoints"
    if not folder.is_dir():
        return []
    found = ((m, p) for p in folder.iterdir() if (m := pattern.fullmatch(p.name)))
    return sorted(int(m.group(1)) for m, p in found if complete(p))


def remove(run_dir: Path, replica: int, steps: list[int]) -> None:
    """Delete replica `replica`'s checkpoints of `steps` (its shard 0 does, once no shard reads them)."""
    for step in steps:
        shutil.rmtree(replica_folder(run_dir, replica, step), ignore_errors=True)


def read_extra(folder: Path, index: int) -> dict[str, Any]:
    """Shard `index`'s own small state in `folder`, or shard 0's where the checkpoint had no shard `index`."""
    own = folder / f"extra-shard{index}.pt"
    return torch.load(own if own.is_file() else folder / "extra-shard0.pt", map_location="cpu", weights_only=True)


def _group_of(model: nn.Module) -> tuple[Any, int]:
    """The replica's process group (None for an unsharded model) and this process's shard index."""
    p = next((p for p in model.parameters() if isinstance(p, DTensor)), None)
    return (None, 0) if p is None else (p.device_mesh.get_group(), p.device_mesh.get_local_rank())


def _flat_as_parameters(model: nn.Module, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    """`flat` (the local parameters' elements, in order) as one tensor per parameter, shaped and sharded like it
    (views into `flat`)."""
    out, offset = {}, 0
    for name, p in model.named_parameters():
        mine = local_tensor(p.data)
        chunk = flat[offset : offset + mine.numel()].view_as(mine)
        offset += mine.numel()
        out[name] = (DTensor.from_local(chunk, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(),
                                        run_check=False) if isinstance(p, DTensor) else chunk)  # fmt: skip
    if offset != flat.numel():
        raise ValueError(f"a flat vector of {flat.numel()} elements, but the local parameters hold {offset}")
    return out


@contextmanager
def _quiet(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """The optimizer without its step hooks (the job's, fast.runtime.steps): DCP's `get_state_dict` makes a fresh
    optimizer's state by a step with zero gradients and no learning rate, which is no training step."""
    hooks = optimizer._optimizer_step_pre_hooks, optimizer._optimizer_step_post_hooks
    optimizer._optimizer_step_pre_hooks, optimizer._optimizer_step_post_hooks = type(hooks[0])(), type(hooks[1])()
    try:
        yield
    finally:
        optimizer._optimizer_step_pre_hooks, optimizer._optimizer_step_post_hooks = hooks


def save(
    folder: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    extra: dict[str, Any] | None = None,
    flat: Mapping[str, torch.Tensor] | None = None,
) -> None:
    """Write the replica's checkpoint into `folder`. Collective inside the replica (each of its shards calls it)."""
    group, index = _group_of(model)
    folder.mkdir(parents=True, exist_ok=True)
    files.save(extra or {}, folder / f"extra-shard{index}.pt")
    with _quiet(optimizer):
        model_state, optimizer_state = get_state_dict(model, optimizer)
    state: dict[str, Any] = {"model": model_state, "optimizer": optimizer_state}
    if flat:
        state["flat"] = {key: _flat_as_parameters(model, vector) for key, vector in flat.items()}
    with warnings.catch_warnings():  # (as in `load`)
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.save(state, checkpoint_id=folder, process_group=group, no_dist=group is None)


def load(
    folder: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    flat: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, Any]:
    """Read the replica's checkpoint in `folder` into `model` and `optimizer` (sharded at any K, or unsharded), and
    into the vectors of `flat` (each laid out like the local parameters, as saved), in place. Collective inside the
    replica. Returns this shard's extra state."""
    group, index = _group_of(model)
    with _quiet(optimizer):
        model_state, optimizer_state = get_state_dict(model, optimizer)
    state: dict[str, Any] = {"model": model_state, "optimizer": optimizer_state}
    if flat:
        state["flat"] = {key: _flat_as_parameters(model, vector) for key, vector in flat.items()}
    with warnings.catch_warnings():  # DCP warns that a load without a group is a single process's: it is
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(state, checkpoint_id=folder, process_group=group, no_dist=group is None)
    with _quiet(optimizer):
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    return read_extra(folder, index)
