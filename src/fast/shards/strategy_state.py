"""A strategy's state in a sharded replica's checkpoint: its vectors laid out like the local parameters (θ, an outer
momentum, an error feedback's memory) go into DCP's files, where they reshard with the model; the rest stays in each
shard's own file.

A strategy's `state_dict` on local shards holds tensors of the shard's own layout. `split` takes out every tensor of
exactly as many elements as the local parameters (fast.strategies.flat's vectors; not a codec's memories, which are
laid out by its buckets) and leaves a marker in its place; `join` puts them back. At the same K every shard reads its
own file and its own vectors, so a resume is bit for bit; at another K (or unsharded, K = 1) the vectors come back
resharded and the rest from shard 0's file, which works for a strategy whose other state holds no tensor laid out by
shard (`by_shard` names them; the job refuses the resume).
"""

from __future__ import annotations

from typing import Any

import torch

MARK = "__flat__"  # the key of a marker dict: {MARK: the vector's name in the checkpoint's flat vectors}


def split(state: Any, numel: int) -> tuple[Any, dict[str, torch.Tensor]]:
    """(`state` with each tensor of `numel` elements replaced by a marker, those tensors flattened by name)."""
    flats: dict[str, torch.Tensor] = {}

    def walk(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.numel() == numel and numel > 1:
            name = f"strategy{len(flats)}"
            flats[name] = value.detach().reshape(-1)
            return {MARK: name, "shape": list(value.shape) if value.dim() > 1 else [-1]}
        if isinstance(value, dict):  # (a codec's memories are laid out by its buckets, not like the parameters)
            return {key: item if key == "codec" else walk(item) for key, item in value.items()}
        if isinstance(value, list | tuple):
            return type(value)(walk(item) for item in value)
        return value

    return walk(state), flats


def join(skeleton: Any, flats: dict[str, torch.Tensor]) -> Any:
    """The state `split` took apart, each marker replaced by its vector (shaped as it was)."""
    if isinstance(skeleton, dict) and MARK in skeleton:
        return flats[skeleton[MARK]].reshape(skeleton["shape"])
    if isinstance(skeleton, dict):
        return {key: join(item, flats) for key, item in skeleton.items()}
    if isinstance(skeleton, list | tuple):
        return type(skeleton)(join(item, flats) for item in skeleton)
    return skeleton


def by_shard(skeleton: Any, where: str = "") -> list[str]:
    """Where the state `split` left holds tensors of more than one element: laid out by shard, not resharded."""
    if isinstance(skeleton, torch.Tensor):
        return [where or "state"] if skeleton.numel() > 1 else []
    if isinstance(skeleton, dict) and MARK not in skeleton:
        return [found for key, item in skeleton.items() for found in by_shard(item, f"{where}.{key}".strip("."))]
    if isinstance(skeleton, list | tuple):
        return [found for i, item in enumerate(skeleton) for found in by_shard(item, f"{where}[{i}]")]
    return []
