"""Replicas larger than one process: each of `run.workers` replicas is K processes that shard the user's model,
gradients and optimizer state with FSDP2, and FAST's strategies run between replicas shard by shard (HSDP's pattern:
shard within, replicate across). `ShardedReplica` is what the job holds; the parts are one concept a module."""

from fast.shards.layout import Groups, Layout, form_groups
from fast.shards.local import LocalShards
from fast.shards.replica import ShardedReplica
from fast.shards.sharding import blocks, is_sharded, shard
from fast.shards.whole import Unsharded, gathered_state_dict

__all__ = [
    "Groups",
    "Layout",
    "LocalShards",
    "ShardedReplica",
    "Unsharded",
    "blocks",
    "form_groups",
    "gathered_state_dict",
    "is_sharded",
    "shard",
]
