"""The strategies' view of a sharded replica: this process's local shards as an ordinary nn.Module.

FAST's strategies read `model.parameters()`, `p.grad` and `model.state_dict()` and write `p.data` and `p.grad`
(fast.strategies.flat). Under FSDP2 the model's parameters are DTensors, and a sharded DTensor is not a tensor a
strategy can flatten, average or send. `LocalShards.module` is a module of the same tree and names as the user's,
whose parameters are plain tensors sharing memory with the DTensors' local shards (and whose buffers are the model's
own): a strategy's write to one is the model's, and the optimizer's step on the model is seen in it. Shard k of every
replica has the same shapes, so the strategies' exchanges over the replica group line up shard by shard.

Gradients cross at the strategy's hook, each step: FSDP2 gives each parameter its gradient as a new sharded DTensor
after its reduce-scatter inside the replica (the mean over the replica's K slices of the batch), so `gradients_in`
gives the view's parameters those local tensors before the strategy's `after_backward`, and `gradients_out` brings
back whatever the strategy left there (a bucket's average, a decoded sum) after it. Neither reads a value back.

The view has no forward of its own: the model is the user's sharded one, whose forward is collective inside the
replica. What needs a whole model gathers it (fast.shards.whole).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the same memory), or a plain tensor itself."""
    return t._local_tensor if isinstance(t, DTensor) else t


class LocalShards:
    """The local shards of the sharded `model` as `module` (same tree, same names), and the gradients' bridge."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.module = nn.Module()
        made = {"": self.module}
        for name, _ in model.named_modules():
            if name:
                parent, _, leaf = name.rpartition(".")
                made[name] = nn.Module()
                made[parent].add_module(leaf, made[name])
        self.pairs: list[tuple[nn.Parameter, nn.Parameter]] = []  # (the model's DTensor parameter, its local view)
        for name, p in model.named_parameters():
            owner, _, leaf = name.rpartition(".")
            view = nn.Parameter(local_tensor(p.data), requires_grad=p.requires_grad)  # shares the shard's memory
            made[owner].register_parameter(leaf, view)
            self.pairs.append((p, view))
        persistent = set(model.state_dict())
        for name, b in model.named_buffers():
            owner, _, leaf = name.rpartition(".")
            made[owner].register_buffer(leaf, b, persistent=name in persistent)

    def gradients_in(self) -> None:
        """Before the strategy's `after_backward`: each view parameter's gradient is its DTensor's local shard of
        gradient (the same memory), or None where the model's is None."""
        for p, view in self.pairs:
            view.grad = None if p.grad is None else local_tensor(p.grad)

    def gradients_out(self) -> None:
        """After the strategy's `after_backward`: the model's gradients hold what the strategy left in the view's
        (copied only where the strategy put a tensor of its own there)."""
        for p, view in self.pairs:
            g = view.grad
            if g is None:
                p.grad = None
            elif not isinstance(p, DTensor):  # a parameter FSDP2 leaves whole
                p.grad = g
            elif p.grad is None:
                p.grad = DTensor.from_local(g, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
            elif local_tensor(p.grad) is not g:
                local_tensor(p.grad).copy_(g)


def local_optimizer_state(optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's state_dict with each DTensor in it as its local shard (a live run's heal sends this process's
    shards of the state, shard k to shard k: fast.runtime.live)."""
    state = optimizer.state_dict()
    state["state"] = {i: {k: local_tensor(v) for k, v in s.items()} for i, s in state["state"].items()}
    return state


def load_local_optimizer_state(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load a `local_optimizer_state` (a shard's, of the same layout): each tensor shaped like its parameter's local
    shard becomes a DTensor on the parameter's mesh again, as FSDP2's optimizer state is."""
    optimizer.load_state_dict(state)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for p in params:
        if not isinstance(p, DTensor) or p not in optimizer.state:
            continue
        mine = optimizer.state[p]
        for key, value in mine.items():
            laid_like_p = isinstance(value, torch.Tensor) and value.shape == local_tensor(p).shape
            if laid_like_p and not isinstance(value, DTensor):
                mine[key] = DTensor.from_local(value, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(),
                                               run_check=False)  # fmt: skip
