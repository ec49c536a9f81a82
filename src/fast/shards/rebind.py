"""A sharded model moved onto a new replica group, its local shards where they are: how a live run's replica goes on
after its members re-form (fast.runtime.live).

Re-forming a live run's membership aborts every process group of the process (torch's `_abort_process_group` on the
world), the replica's own included, and FSDP2 binds its group when it shards: its DeviceMesh names the group, and
each parameter group's mesh info holds it. The replica's K processes are the same after a re-form (a replica joins
and leaves whole), at the same shard indices, so the layout and every local shard stay as they are; only the group
they gather and reduce-scatter over is new. `rebind` points the model's mesh (the one object every DTensor parameter,
gradient and optimizer state refers to) and FSDP2's mesh infos at the new group, as `DeviceMesh.from_group` and
`fully_shard` would have set them, with the ranks the replica's processes have in the new world (a replica before
them may have left), and nothing moves: not a value, not the optimizer's state.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule


def rebind(model: nn.Module, mesh: DeviceMesh, group: ProcessGroup) -> None:
    """Point `model` (sharded by FSDP2 over `mesh`) and `mesh` at `group`, a new group of the same ranks' processes in
    the same order (the replica's, re-made)."""
    # (the mesh's own coordinate, kept since it was made: its old group may be gone, and with it get_local_rank)
    (shard,) = mesh.get_coordinate()
    if group.size() != mesh.size() or group.rank() != shard:
        raise ValueError(f"rebinding shard {shard} of {mesh.size()} to a group where it is {group.rank()} of "
                         f"{group.size()}: a replica's shards keep their places")  # fmt: skip
    # the replica's processes keep their places in it, but not their ranks in the world (a replica before them left)
    ranks = torch.tensor(dist.get_process_group_ranks(group), dtype=mesh._rank_map.dtype)
    mesh._rank_map, mesh._flatten_rank_map = ranks, tuple(ranks.tolist())
    mesh._dim_group_names = [group.group_name]  # (what DeviceMesh.from_group sets)
    mesh._pg_registry[group.group_name] = group
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        groups = module._get_fsdp_state()._fsdp_param_groups
        holders = [h for g in groups for h in (g, *g.fsdp_params)]
        infos = {id(i): i for h in holders for i in (h.mesh_info, h.post_forward_mesh_info) if i is not None}
        for info in infos.values():
            info.shard_process_group = group
