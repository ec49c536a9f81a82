"""Sharding a user's model over its replica with FSDP2: `fully_shard` on the model's blocks, then on the root; or a
model the user sharded already, taken as it is.

The blocks are the units FSDP2 gathers one at a time in the forward and backward, so a process holds the whole of
one block at a time and the shards of the rest. The rule (`blocks`):

- a *stack* is an nn.Sequential or nn.ModuleList in which at least two items of one class hold parameters (a
  transformer's blocks, a ResNet's stages, an MLP's Linear layers);
- the blocks are the parameter-holding items of every outermost stack, looked for from the root down (stacks inside a
  chosen stack are not looked at);
- a model without a stack (an LSTM between two Linear layers) has its parameter-holding direct children as blocks.

The root is sharded last: it holds what no block does (embeddings, a head, a norm outside the stack). So examples/lm's
Transformer is sharded block by block with the embeddings and the last norm at the root; fast.jobs.models' MLP Linear
by Linear, LeNet-5 convolution by convolution and Linear by Linear, ResNet8 stage by stage, the LSTM model as its
three children.

`fully_shard` puts new parameters (DTensors) in the model's place, so the optimizer the user made over the old ones
is given the new ones (`shard(..., optimizer=)`), in the same param groups: the user's model, optimizer and loop stay
theirs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from fast.errors import UsageError


def _holds_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _is_stack(module: nn.Module) -> bool:
    if not isinstance(module, nn.Sequential | nn.ModuleList):
        return False
    classes = [type(m) for m in module.children() if _holds_parameters(m)]
    return any(classes.count(c) > 1 for c in classes)


def blocks(model: nn.Module) -> list[nn.Module]:
    """The modules `shard` gives a `fully_shard` of their own, before the root's (the rule in the module's text)."""
    found: list[nn.Module] = []

    def look(module: nn.Module) -> None:
        for child in module.children():
            if _is_stack(child):
                found.extend(m for m in child.children() if _holds_parameters(m))
            else:
                look(child)

    look(model)
    return found or [m for m in model.children() if _holds_parameters(m)]


def is_sharded(model: nn.Module) -> bool:
    """Whether `model` holds DTensor parameters (sharded by FSDP2, by the user or by `shard`)."""
    return any(isinstance(p, DTensor) for p in model.parameters())


def check_sharded(model: nn.Module, mesh: DeviceMesh) -> None:
    """UsageError unless every parameter of an already-sharded `model` is a DTensor on a 1-D mesh of the ranks of
    `mesh` (this process's replica) and its root is an FSDP module."""
    ranks = sorted(mesh.mesh.flatten().tolist())
    for name, p in model.named_parameters():
        if not isinstance(p, DTensor):
            raise UsageError(f"the model is partly sharded: parameter {name!r} is not a DTensor; apply fully_shard "
                             "to the root module too, or pass the model unsharded and FAST shards it")  # fmt: skip
        theirs = sorted(p.device_mesh.mesh.flatten().tolist())
        if p.device_mesh.ndim != 1 or theirs != ranks:
            raise UsageError(f"parameter {name!r} is sharded over ranks {theirs}, but this process's replica is "
                             f"ranks {ranks}: shard it over the replica's mesh (the `mesh` FAST gives), or pass the "
                             "model unsharded and FAST shards it")  # fmt: skip
    if not isinstance(model, FSDPModule):
        raise UsageError("the model's parameters are DTensors but its root is not sharded: apply fully_shard(model) "
                         "to the root too, or pass the model unsharded and FAST shards it")  # fmt: skip


def shard(model: nn.Module, mesh: DeviceMesh, optimizer: torch.optim.Optimizer | None = None) -> nn.Module:
    """`model` sharded over `mesh` (this process's replica): `fully_shard` on its `blocks`, then on the root, in
    place; a model already sharded over the same ranks is checked and taken as it is. The `optimizer` made over the
    model's parameters, if given, is moved onto the sharded ones (it must not have stepped yet). Returns `model`,
    whose FSDP2 state is initialised, so that its local shards stay where they are from now on (fast.shards.local)."""
    if is_sharded(model):
        check_sharded(model, mesh)
    else:
        before = {id(p): name for name, p in model.named_parameters()}
        if optimizer is not None:
            _check_fresh(optimizer, before)
        for block in blocks(model):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        if optimizer is not None:
            after = dict(model.named_parameters())
            for group in optimizer.param_groups:
                group["params"] = [after[before[id(p)]] for p in group["params"]]
    # FSDP2 initialises itself at the first forward and may then move a shard to new memory (a rank with an empty
    # shard, a model loaded before it): done now, the local tensors stay the same objects for the rest of the run
    model._get_fsdp_state()._lazy_init()  # type: ignore[operator]
    return model


def _check_fresh(optimizer: torch.optim.Optimizer, names: dict[int, Any]) -> None:
    if optimizer.state:
        raise UsageError("the optimizer has already stepped: pass the model and optimizer to FAST before the first "
                         "step, so that its state is made on the model's shards")  # fmt: skip
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in names:
                raise UsageError("the optimizer holds a tensor that is not a parameter of the model: make it over "
                                 "model.parameters() (FAST moves it onto the sharded parameters)")  # fmt: skip
