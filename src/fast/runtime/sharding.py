"""How a dataset's samples are cut into per-worker shards, deterministically by seed: `iid` or `dirichlet`."""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from fast.errors import ConfigError

PARTITION_SCHEMES: tuple[str, ...] = ("iid", "dirichlet")
DIRICHLET_MAX_DRAWS = 100
KEPT_CUTS = 4
_CUTS: dict[tuple, list[torch.Tensor]] = {}  # the last cuts made, by their arguments (see partition)


def partition(
    labels: torch.Tensor, workers: int, scheme: str = "iid", *, alpha: float = 0.5, seed: int = 0
) -> list[torch.Tensor]:
    """Split sample indices into `workers` disjoint, sorted int64 index tensors, deterministically by seed.

    `iid`: a seeded permutation cut into equal shards (the remainder is dropped).
    `dirichlet`: label skew; each class is split across workers in proportions drawn from Dir(alpha),
    the usual non-IID federated recipe (small alpha: few classes per worker; large alpha: near uniform).
    Every worker receives at least one sample.

    The last few cuts are kept (the shards are shared: read them, do not write them), so that the workers of one
    process (a simulated run's thousand) cut the data once, not once each.
    """
    key = (scheme, len(labels), workers, alpha, seed, _digest(labels) if scheme == "dirichlet" else None)
    cut = _CUTS.pop(key, None)
    if cut is None:
        cut = _partition(labels, workers, scheme, alpha=alpha, seed=seed)
    _CUTS[key] = cut  # (the newest last)
    while len(_CUTS) > KEPT_CUTS:
        del _CUTS[next(iter(_CUTS))]
    return list(cut)


def _digest(labels: torch.Tensor) -> str:
    return hashlib.blake2b(labels.detach().cpu().contiguous().numpy().tobytes(), digest_size=16).hexdigest()


def _partition(labels: torch.Tensor, workers: int, scheme: str, *, alpha: float, seed: int) -> list[torch.Tensor]:
    count = len(labels)
    if not 1 <= workers <= count:
        raise ConfigError(f"workers must be between 1 and the number of samples ({count}), got {workers}")
    rng = np.random.default_rng(seed)
    if scheme == "iid":
        shard = count // workers
        order = rng.permutation(count)
        shards = [np.sort(order[rank * shard : (rank + 1) * shard]) for rank in range(workers)]
    elif scheme == "dirichlet":
        if not alpha > 0:
            raise ConfigError(f"dirichlet alpha must be positive, got {alpha}")
        shards = _dirichlet_shards(labels.cpu().numpy(), workers, alpha, rng)
    else:
        raise ConfigError(f"unknown partition scheme {scheme!r}: choose one of {', '.join(PARTITION_SCHEMES)}")
    return [torch.from_numpy(shard.astype(np.int64)) for shard in shards]


def _dirichlet_shards(labels: np.ndarray, workers: int, alpha: float, rng: np.random.Generator) -> list[np.ndarray]:
    for _ in range(DIRICHLET_MAX_DRAWS):
        shards: list[list[np.ndarray]] = [[] for _ in range(workers)]
        for label in np.unique(labels):
            members = rng.permutation(np.flatnonzero(labels == label))
            proportions = rng.dirichlet(np.full(workers, alpha))
            cuts = (np.cumsum(proportions)[:-1] * len(members)).astype(np.int64)
            for rank, part in enumerate(np.split(members, cuts)):
                shards[rank].append(part)
        merged = [np.sort(np.concatenate(parts)) for parts in shards]
        if all(len(shard) > 0 for shard in merged):
            return merged
    # Tiny data or extreme alpha kept leaving a worker empty: hand each empty worker one sample taken
    # from the currently largest shard, so the draw stays skewed but nobody idles.
    for rank, shard in enumerate(merged):
        if len(shard) == 0:
            donor = max(range(workers), key=lambda other: len(merged[other]))
            merged[rank], merged[donor] = merged[donor][-1:], merged[donor][:-1]
    return merged
