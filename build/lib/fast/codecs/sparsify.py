"""Sparsifying codecs: a few elements sent exactly, the rest received as zeros.

- `topk`: the k = max(1, ceil(ratio * n)) elements of largest magnitude.
- `randomk` (Stich et al. 2018): k elements drawn uniformly without replacement. The frame carries the
  seed of the draw instead of the indices; the receiver redraws the same indices on its CPU (same torch
  version on both sides). Not rescaled, so biased: pair it with error feedback.
- `threshold` (Strom 2015): the elements with |x| > value; how many is known only after encoding.

Sparse body (topk, threshold, dgc): count (uint64), count values in the tensor's dtype, count indices
in the narrowest of 1, 2, 4 or 8 bytes that holds n - 1 (ascending). randomk: seed (uint64), values.
"""

from __future__ import annotations

import math

import torch

from fast.codecs.base import Codec, fraction, non_negative_float
from fast.codecs.frame import frame_size
from fast.codecs.packing import (
    BodyReader,
    index_width,
    pack_indices,
    scalar_bytes,
    tensor_bytes,
    unpack_indices,
)
from fast.errors import FrameError

_EXACT_TOPK_BELOW = 1 << 16  # smaller tensors go straight to torch.topk
_SAMPLE_SIZE = 1 << 14


def kept_count(numel: int, ratio: float) -> int:
    """How many elements a sparsifier with density `ratio` keeps of `numel`."""
    return min(numel, max(1, math.ceil(ratio * numel)))


def largest_magnitudes(flat: torch.Tensor, count: int) -> torch.Tensor:
    """Ascending indices of `count` elements of `flat` with the largest |value| (exact; ties broken freely).

    On large tensors a strided sample gives a threshold that is very likely below the count-th largest
    magnitude; torch.topk then runs only on the elements above it. If the guess was too high (fewer than
    `count` candidates), it falls back to torch.topk on everything, so the answer is always exact.
    """
    numel = flat.numel()
    if count >= numel:
        return torch.arange(numel, device=flat.device)
    if numel >= _EXACT_TOPK_BELOW and count * 16 <= numel:
        sample = flat[:: numel // _SAMPLE_SIZE].abs()
        wanted = min(sample.numel(), 2 * math.ceil(count * sample.numel() / numel) + 16)
        floor = torch.topk(sample, wanted, sorted=False).values.min()
        candidates = ((flat >= floor) | (flat <= -floor)).nonzero().squeeze(1)
        if candidates.numel() >= count:
            best = torch.topk(flat[candidates].abs(), count, sorted=False).indices
            return candidates[best].sort().values
    return torch.topk(flat.abs(), count, sorted=False).indices.sort().values


def random_indices(numel: int, count: int, seed: int) -> torch.Tensor:
    """`count` distinct indices below `numel`, uniformly at random, ascending, on the CPU; same seed, same draw.

    For small fractions it draws with replacement and drops repeats (a few rounds at most), which costs
    O(count) instead of the O(numel) of a permutation; the result is still uniform over count-subsets
    because nothing in the process favours any index.
    """
    generator = torch.Generator().manual_seed(seed)
    if 4 * count > numel:
        return torch.randperm(numel, generator=generator)[:count].sort().values
    chosen = torch.zeros(0, dtype=torch.int64)
    while chosen.numel() < count:
        draw = torch.randint(numel, (count + count // 4 + 8,), generator=generator)
        chosen = torch.cat([chosen, draw]).unique()
    keep = torch.randperm(chosen.numel(), generator=generator)[:count]
    return chosen[keep].sort().values


def sparse_body(flat: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """count, values of `flat` at `indices`, and the packed indices."""
    return torch.cat(
        [
            scalar_bytes(indices.numel(), torch.int64, device=flat.device),
            tensor_bytes(flat[indices]),
            pack_indices(indices, flat.numel()),
        ]
    )


def decode_sparse(
    body: BodyReader, shape: tuple[int, ...], dtype: torch.dtype, expected_count: int | None = None
) -> torch.Tensor:
    """The dense tensor of a sparse body: zeros except at the sent indices."""
    numel = math.prod(shape)
    count = body.take_count()
    if count > numel or (expected_count is not None and count != expected_count):
        wanted = f"{expected_count}" if expected_count is not None else f"at most {numel}"
        raise FrameError(f"{body.codec} frame holds {count} elements where {wanted} were expected")
    values = body.take(dtype, count)
    indices = unpack_indices(body.take_bytes(count * index_width(numel)), numel, count)
    if count > 1 and not bool((indices[1:] > indices[:-1]).all()):
        raise FrameError(f"{body.codec} frame holds indices that are not strictly ascending")
    dense = torch.zeros(numel, dtype=dtype, device=values.device)
    dense[indices] = values
    return dense.reshape(shape)


def sparse_body_size(numel: int, count: int, dtype: torch.dtype) -> int:
    return 8 + count * (dtype.itemsize + index_width(numel))


class KeepsRatio(Codec):
    """A sparsifier that keeps a fixed share `ratio` of the elements."""

    sparsifier = True
    contractive = True

    def __init__(self, *, ratio: float = 0.01, min_elements: int = 0, seed: int = 0):
        super().__init__(min_elements=min_elements, seed=seed)
        self.ratio = fraction("ratio", ratio)


class TopK(KeepsRatio):
    """The ceil(ratio * n) largest magnitudes, with their indices."""

    name = "topk"

    def _encode_body(self, x: torch.Tensor, key: str) -> torch.Tensor:
        flat = x.reshape(-1)
        return sparse_body(flat, largest_magnitudes(flat, kept_count(flat.numel(), self.ratio)))

    def _decode_body(self, body: BodyReader, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return decode_sparse(body, shape, dtype, kept_count(math.prod(shape), self.ratio))

    def _body_size(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        numel = math.prod(shape)
        return sparse_body_size(numel, kept_count(numel, self.ratio), dtype)

    def __repr__(self) -> str:
        return f"TopK(ratio={self.ratio})"


class RandomK(KeepsRatio):
    """ceil(ratio * n) elements chosen at random; the frame carries the draw's seed, not the indices."""

    name = "randomk"

    def _encode_body(self, x: torch.Tensor, key: str) -> torch.Tensor:
        flat = x.reshape(-1)
        draw_seed = int(torch.randint(0, 2**62, (1,), generator=self.generator("cpu")))
        indices = random_indices(flat.numel(), kept_count(flat.numel(), self.ratio), draw_seed)
        values = flat[indices.to(flat.device)]
        return torch.cat([scalar_bytes(draw_seed, torch.int64, device=flat.device), tensor_bytes(values)])

    def _decode_body(self, body: BodyReader, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        numel = math.prod(shape)
        draw_seed = body.take_count()
        values = body.take(dtype, kept_count(numel, self.ratio))
        dense = torch.zeros(numel, dtype=dtype, device=values.device)
        dense[random_indices(numel, values.numel(), draw_seed).to(values.device)] = values
        return dense.reshape(shape)

    def _body_size(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        return 8 + kept_count(math.prod(shape), self.ratio) * dtype.itemsize

    def __repr__(self) -> str:
        return f"RandomK(ratio={self.ratio}, seed={self.seed})"


class Threshold(Codec):
    """The elements with |x| > value, with their indices; the frame's size depends on the data."""

    sparsifier = True
    fixed_size = False

    name = "threshold"

    def __init__(self, *, value: float = 1e-3, min_elements: int = 0, seed: int = 0):
        super().__init__(min_elements=min_elements, seed=seed)
        self.value = non_negative_float("value", value)

    def _encode_body(self, x: torch.Tensor, key: str) -> torch.Tensor:
        flat = x.reshape(-1)
        return sparse_body(flat, ((flat > self.value) | (flat < -self.value)).nonzero().squeeze(1))

    def _decode_body(self, body: BodyReader, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return decode_sparse(body, shape, dtype)

    def encoded_size(
        self, shape: tuple[int, ...], dtype: torch.dtype = torch.float32, *, kept: int | None = None
    ) -> int:
        """Exact frame bytes when `kept` elements pass the threshold (the count is known after encoding)."""
        shape = tuple(shape)
        if self.sends_raw(shape):
            return super().encoded_size(shape, dtype)
        if kept is None:
            raise ValueError("a threshold frame's size depends on how many elements pass: give kept=")
        return frame_size(len(shape), sparse_body_size(math.prod(shape), kept, dtype))

    def __repr__(self) -> str:
        return f"Threshold(value={self.value})"
