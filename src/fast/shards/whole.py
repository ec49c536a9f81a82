"""The whole model of a sharded replica: its state gathered from the K shards (model.pt), and an unsharded copy of the
user's class to hold it (an evaluation on one process).

Evaluation. FSDP2's forward is collective inside the replica: each block is all-gathered from the K shards as the
forward reaches it. So a user's `evaluate(model)` on the sharded model works when every shard of the replica calls it
on the same data (each computes the same figures): that is how a strategy whose evaluation is collective evaluates.
Where one process alone evaluates (rank 0 while the others train on), it evaluates `Unsharded.build` of the gathered
state, a model of the user's own class on that process, which the others of its replica gather for it.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def gathered_state_dict(
    model: nn.Module, *, local: Mapping[str, torch.Tensor] | None = None, everywhere: bool = False
) -> dict[str, torch.Tensor]:
    """The whole state of the sharded `model` (full tensors, on the CPU), as the user's unsharded class names and
    loads it. Collective inside the replica: each of its shards calls it. It is returned on the replica's shard 0
    (`everywhere`: on each shard); the others get {}. `local`: local shards of the model's state to gather instead
    of the model's own (the view's state_dict of a strategy's final model, fast.shards.local), by the same names.
    Buffers are the calling shard's own (FSDP2 leaves them whole on each shard, and BatchNorm's statistics differ
    between shards as between DDP's processes without its buffer broadcast): on shard 0, shard 0's."""
    state = model.state_dict()
    keep = everywhere or _shard_index(model) == 0
    whole: dict[str, torch.Tensor] = {}
    for name, value in state.items():
        mine = local[name] if local is not None else None
        if isinstance(value, DTensor):
            if mine is not None:
                value = DTensor.from_local(mine, value.device_mesh, value.placements, shape=value.shape,
                                           stride=value.stride(), run_check=False)  # fmt: skip
            full = value.full_tensor().detach()  # an all-gather inside the replica, every shard in the same order
            if keep:
                whole[name] = full.cpu()
        elif keep:
            whole[name] = (mine if mine is not None else value).detach().to("cpu", copy=True)
    return whole


def _shard_index(model: nn.Module) -> int:
    p = next((p for p in model.parameters() if isinstance(p, DTensor)), None)
    return 0 if p is None else p.device_mesh.get_local_rank()


class Unsharded:
    """A copy of the user's model taken before it was sharded, its tensors on the meta device (no memory): `build`
    gives a model of the user's class holding a gathered state."""

    def __init__(self, model: nn.Module) -> None:
        memo: dict[int, object] = {}
        for p in model.parameters():
            memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
        for b in model.buffers():
            memo[id(b)] = torch.empty_like(b, device="meta")
        self.skeleton = copy.deepcopy(model, memo)

    def build(self, state: Mapping[str, torch.Tensor], buffers_of: nn.Module | None = None) -> nn.Module:
        """A model of the user's class on the CPU holding `state` (from `gathered_state_dict`); its buffers that the
        state does not hold (non-persistent ones) are copied from `buffers_of` (the sharded model) where given."""
        model = copy.deepcopy(self.skeleton).to_empty(device="cpu")
        if buffers_of is not None:
            theirs = dict(buffers_of.named_buffers())
            with torch.no_grad():
                for name, b in model.named_buffers():
                    if name in theirs:
                        b.copy_(theirs[name])
        model.load_state_dict(state)
        return model
