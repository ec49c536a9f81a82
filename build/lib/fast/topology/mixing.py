"""Mixing weights: the matrix W with which workers average with their neighbours (x_i <- sum_j W_ij x_j).

Gossip averaging converges to the mean of the workers' values when W is symmetric, doubly stochastic
(non-negative, rows and columns summing to one), non-zero only on the graph's channels and its diagonal,
and the graph is connected. Both rules here give such a W for any undirected graph.
"""

from collections.abc import Callable, Iterable

import torch

from fast.errors import ConfigError

TOLERANCE = 1e-9


def _degrees(size: int, edges: Iterable[tuple[int, int]]) -> torch.Tensor:
    degree = torch.zeros(size, dtype=torch.float64)
    for i, j in edges:
        degree[i] += 1
        degree[j] += 1
    return degree


def _with_diagonal(off_diagonal: torch.Tensor) -> torch.Tensor:
    """Puts on the diagonal whatever each row still lacks to sum to one (1 for a worker without channels)."""
    return off_diagonal + torch.diag(1.0 - off_diagonal.sum(dim=1))


def _edge_index(edges: Iterable[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    pairs = torch.tensor(sorted(edges), dtype=torch.long).reshape(-1, 2)
    return pairs[:, 0], pairs[:, 1]


def metropolis_hastings(size: int, edges: Iterable[tuple[int, int]]) -> torch.Tensor:
    """W_ij = 1 / (1 + max(d_i, d_j)) on each channel, W_ii = 1 - sum of the row (Xiao & Boyd)."""
    edges = list(edges)
    degree = _degrees(size, edges)
    rows, cols = _edge_index(edges)
    weight = 1.0 / (1.0 + torch.maximum(degree[rows], degree[cols]))
    off_diagonal = torch.zeros(size, size, dtype=torch.float64)
    off_diagonal[rows, cols] = weight
    off_diagonal[cols, rows] = weight
    return _with_diagonal(off_diagonal)


def uniform(size: int, edges: Iterable[tuple[int, int]]) -> torch.Tensor:
    """The same weight 1 / (1 + d_max) on every channel, W_ii = 1 - sum of the row.

    On a d-regular graph that is 1 / (d + 1) for every neighbour and for oneself. On an irregular graph
    1 / (1 + d_i) per row would not be symmetric, so the largest degree sets the weight for everyone.
    """
    edges = list(edges)
    degree = _degrees(size, edges)
    rows, cols = _edge_index(edges)
    weight = 1.0 / (1.0 + degree.max().item()) if size else 1.0
    off_diagonal = torch.zeros(size, size, dtype=torch.float64)
    off_diagonal[rows, cols] = weight
    off_diagonal[cols, rows] = weight
    return _with_diagonal(off_diagonal)


RULES: dict[str, Callable[[int, Iterable[tuple[int, int]]], torch.Tensor]] = {
    "metropolis": metropolis_hastings,
    "uniform": uniform,
}


def mixing_matrix(rule: str, size: int, edges: Iterable[tuple[int, int]]) -> torch.Tensor:
    """The size x size float64 mixing matrix the named rule gives for an undirected edge set."""
    if rule not in RULES:
        raise ConfigError(f"mixing weights {rule!r} are not known: use one of {', '.join(map(repr, RULES))}")
    return RULES[rule](size, edges)


def check_mixing_matrix(weights: torch.Tensor, edges: frozenset[tuple[int, int]], label: str) -> None:
    """Raises ConfigError unless `weights` is symmetric, doubly stochastic and zero off the channels."""
    fix = "use weights='metropolis' or 'uniform'"
    size = len(weights)
    if weights.shape != (size, size):
        raise ConfigError(f"{label}: mixing matrix has shape {tuple(weights.shape)}, not square: {fix}")
    w = weights.to(torch.float64)
    if not torch.isfinite(w).all():
        raise ConfigError(f"{label}: mixing matrix has NaN or infinite entries: {fix}")
    asymmetry = (w - w.T).abs()
    if asymmetry.max() > TOLERANCE:
        i, j = divmod(int(asymmetry.argmax()), size)
        raise ConfigError(
            f"{label}: mixing matrix is not symmetric (W[{i},{j}]={w[i, j]:.6g} but W[{j},{i}]={w[j, i]:.6g}): {fix}"
        )
    if w.min() < -TOLERANCE:
        i, j = divmod(int(w.argmin()), size)
        raise ConfigError(f"{label}: mixing matrix has a negative weight W[{i},{j}]={w[i, j]:.6g}: {fix}")
    row_error = (w.sum(dim=1) - 1.0).abs()
    if row_error.max() > TOLERANCE:
        i = int(row_error.argmax())
        raise ConfigError(
            f"{label}: mixing matrix is not doubly stochastic (row {i} sums to {w[i].sum():.6g}, not 1): {fix}"
        )
    allowed = torch.eye(size, dtype=torch.bool)
    for i, j in edges:
        allowed[i, j] = allowed[j, i] = True
    off_channel = w.abs().masked_fill(allowed, 0.0)
    if off_channel.numel() and off_channel.max() > TOLERANCE:
        i, j = divmod(int(off_channel.argmax()), size)
        raise ConfigError(
            f"{label}: mixing matrix gives weight W[{i},{j}]={w[i, j]:.6g} to workers {i} and {j}, "
            f"which have no channel: {fix}"
        )
