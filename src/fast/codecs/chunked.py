"""Chunked top-k codecs: a tensor cut into small blocks, the k largest entries of each block kept.

- `chunk-topk` (SparseLoCo, Sarfi et al. 2025): the kept values quantised to `bits` bits (2 by default) on one
  scale per tensor: shift = their mean, bins of 6σ / 2^bits around it, each value sent as its bin, and each bin
  decoded as the mean of the values that fell in it (a lookup of 2^bits floats). `bits = 0` sends the values
  in fp32.
- `dct-topk` (DeMo, Peng et al. 2024): each block first goes through an orthonormal DCT-II (2-D on a matrix's
  blocks), and the k largest coefficients are kept in fp32; decoding is the inverse DCT of the kept ones, so
  that what a receiver decodes is the tensor's "fast" components in the original basis.

Blocks: a tensor is seen as a matrix (its first dimension by the rest; a vector as one row). A side of length s
is one piece if s <= `chunk`; else pieces of its largest divisor of at most `chunk` if that is at least half of
`chunk` (96 -> 2 x 48), else pieces of `chunk`, the last one padded with zeros (which decode to nothing). Every
block of a tensor has the same size. `chunk-topk` keeps round(ratio · block size) entries of a block
(at least 1), `dct-topk` keeps `k` (at most the block size). Indices within a block travel in as few bits as
hold the block's size (12 for 64 x 64); each block's are ascending.

Body: chunk-topk: shift (fp32), 2^bits lookup values (fp32), the indices, the codes (or the values in fp32 for
bits = 0). dct-topk: the values (fp32), the indices.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

from fast.codecs.base import Codec, fraction, non_negative_int, positive_int
from fast.codecs.packing import BodyReader, pack_codes, packed_size, scalar_bytes, tensor_bytes, unpack_codes
from fast.errors import ConfigError, FrameError

RANGE_IN_SIGMAS = 6.0  # the quantiser's bins span this many standard deviations of the kept values


def block_side(size: int, chunk: int) -> int:
    """The pieces a side of `size` is cut into (see the module's docstring)."""
    if size <= chunk:
        return size
    divisor = max(d for d in range(1, chunk + 1) if size % d == 0)
    return divisor if 2 * divisor >= chunk else chunk


def as_matrix(shape: tuple[int, ...]) -> tuple[int, int]:
    """The matrix a tensor of `shape` is cut as: its first dimension by the rest (a vector: one row)."""
    if len(shape) <= 1:
        return 1, math.prod(shape)
    return shape[0], math.prod(shape[1:])


class Blocks:
    """How a tensor of `shape` is cut into equal blocks (rows of a (blocks, block size) matrix) and put back."""

    def __init__(self, shape: tuple[int, ...], chunk: int) -> None:
        self.rows, self.cols = as_matrix(shape)
        self.row_side, self.col_side = block_side(self.rows, chunk), block_side(self.cols, chunk)
        self.down, self.across = -(-self.rows // self.row_side), -(-self.cols // self.col_side)
        self.count = self.down * self.across
        self.size = self.row_side * self.col_side

    def cut(self, x: torch.Tensor) -> torch.Tensor:
        """(count, row side, col side) blocks of `x`, padded with zeros where the sides do not divide."""
        r, c = self.row_side, self.col_side
        matrix = x.reshape(self.rows, self.cols)
        padding = (0, self.across * c - self.cols, 0, self.down * r - self.rows)
        if any(padding):
            matrix = torch.nn.functional.pad(matrix, padding)
        return matrix.reshape(self.down, r, self.across, c).transpose(1, 2).reshape(self.count, r, c)

    def join(self, blocks: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        r, c = self.row_side, self.col_side
        matrix = blocks.reshape(self.down, self.across, r, c).transpose(1, 2).reshape(self.down * r, self.across * c)
        return matrix[: self.rows, : self.cols].reshape(shape)


@lru_cache(maxsize=64)
def dct_basis(n: int) -> torch.Tensor:
    """The orthonormal DCT-II matrix of size n (rows: frequencies): X = D x, x = D^T X."""
    i = torch.arange(n, dtype=torch.float64)
    basis = torch.cos(math.pi * (2 * i[None, :] + 1) * i[:, None] / (2 * n)) * math.sqrt(2 / n)
    basis[0] /= math.sqrt(2)
    return basis.to(torch.float32)


def dct(blocks: torch.Tensor) -> torch.Tensor:
    """The 2-D DCT-II of each (r, c) block."""
    r, c = blocks.shape[-2:]
    return dct_basis(r).to(blocks) @ blocks @ dct_basis(c).to(blocks).T


def inverse_dct(coefficients: torch.Tensor) -> torch.Tensor:
    r, c = coefficients.shape[-2:]
    return dct_basis(r).to(coefficients).T @ coefficients @ dct_basis(c).to(coefficients)


def largest_in_each(rows: torch.Tensor, k: int) -> torch.Tensor:
    """The ascending indices of the k largest magnitudes of each row."""
    return torch.topk(rows.abs(), k, dim=1, sorted=False).indices.sort(dim=1).values


def quantise(values: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes, lookup, shift): each value's bin among 2^bits spanning 6σ around the mean, each bin's mean offset."""
    bins = 1 << bits
    shift = values.mean()
    centred = values - shift
    sigma = centred.std() if values.numel() > 1 else centred.new_zeros(())
    scale = float(RANGE_IN_SIGMAS * sigma / bins)
    if not math.isfinite(scale) or scale <= 0:
        scale = 1.0
    codes = torch.round(centred / scale + bins / 2).clamp_(0, bins - 1).to(torch.int64)
    sums = torch.zeros(bins, dtype=values.dtype, device=values.device).index_add_(0, codes, centred)
    counts = torch.bincount(codes, minlength=bins).to(values.dtype)
    lookup = torch.where(counts > 0, sums / counts.clamp(min=1), torch.zeros_like(sums))
    return codes, lookup, shift


class ChunkedTopK(Codec):
    """The k largest entries of each block of a tensor (in a basis of the subclass's choosing)."""

    def __init__(self, *, chunk: int = 64, min_elements: int = 0, seed: int = 0):
        super().__init__(min_elements=min_elements, seed=seed)
        self.chunk = positive_int("chunk", chunk, limit=256)

    def kept(self, block_size: int) -> int:
        raise NotImplementedError

    def _layout(self, shape: tuple[int, ...]) -> tuple[Blocks, int, int]:
        """The blocks, entries kept per block, and the bits of an index within a block."""
        blocks = Blocks(shape, self.chunk)
        return blocks, self.kept(blocks.size), max(1, (blocks.size - 1).bit_length())

    def _take_indices(self, body: BodyReader, blocks: Blocks, k: int, width: int) -> torch.Tensor:
        indices = unpack_codes(body.take_bytes(packed_size(blocks.count * k, width)), width, blocks.count * k)
        indices = indices.to(torch.int64).reshape(blocks.count, k)
        if bool((indices >= blocks.size).any()) or (k > 1 and not bool((indices[:, 1:] > indices[:, :-1]).all())):
            raise FrameError(f"{body.codec} frame holds indices outside their block or not strictly ascending")
        return indices


class ChunkTopK(ChunkedTopK):
    """SparseLoCo's compressor: per-block top-k, the kept values quantised to `bits` bits."""

    name = "chunk-topk"

    def __init__(self, *, ratio: float = 128 / 4096, bits: int = 2, chunk: int = 64, min_elements: int = 0,
                 seed: int = 0):  # fmt: skip
        super().__init__(chunk=chunk, min_elements=min_elements, seed=seed)
        self.ratio = fraction("ratio", ratio)
        self.bits = non_negative_int("bits", bits)
        if self.bits > 8:
            raise ConfigError(f"codec option bits must be 0 (fp32 values) to 8, got {bits}")

    def kept(self, block_size: int) -> int:
        return min(block_size, max(1, round(self.ratio * block_size)))

    def _encode_body(self, x: torch.Tensor, key: str) -> torch.Tensor:
        blocks, k, width = self._layout(tuple(x.shape))
        rows = blocks.cut(x.float()).reshape(blocks.count, blocks.size)
        indices = largest_in_each(rows, k)
        values = rows.gather(1, indices).reshape(-1)
        packed = pack_codes(indices.reshape(-1), width)
        if self.bits == 0:
            return torch.cat([packed, tensor_bytes(values)])
        codes, lookup, shift = quantise(values, self.bits)
        return torch.cat([scalar_bytes(shift), tensor_bytes(lookup), packed, pack_codes(codes, self.bits)])

    def _decode_body(self, body: BodyReader, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        blocks, k, width = self._layout(shape)
        count = blocks.count * k
        if self.bits == 0:
            indices = self._take_indices(body, blocks, k, width)
            values = body.take(torch.float32, count)
        else:
            shift = body.take_scalar(torch.float32)
            lookup = body.take(torch.float32, 1 << self.bits)
            indices = self._take_indices(body, blocks, k, width)
            codes = unpack_codes(body.take_bytes(packed_size(count, self.bits)), self.bits, count).to(torch.int64)
            values = lookup[codes] + shift
        rows = torch.zeros(blocks.count, blocks.size, dtype=torch.float32, device=values.device)
        rows.scatter_(1, indices.to(values.device), values.reshape(blocks.count, k))
        return blocks.join(rows, shape).to(dtype)

    def _body_size(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        blocks, k, width = self._layout(shape)
        count = blocks.count * k
        if self.bits == 0:
            return packed_size(count, width) + 4 * count
        return 4 + 4 * (1 << self.bits) + packed_size(count, width) + packed_size(count, self.bits)

    def __repr__(self) -> str:
        return f"ChunkTopK(ratio={self.ratio:g}, bits={self.bits}, chunk={self.chunk})"


class DctTopK(ChunkedTopK):
    """DeMo's compressor: the `k` largest DCT coefficients of each block, in fp32."""

    name = "dct-topk"

    def __init__(self, *, k: int = 32, chunk: int = 64, min_elements: int = 0, seed: int = 0):
        super().__init__(chunk=chunk, min_elements=min_elements, seed=seed)
        self.k = positive_int("k", k)

    def kept(self, block_size: int) -> int:
        return min(block_size, self.k)

    def _encode_body(self, x: torch.Tensor, key: str) -> torch.Tensor:
        blocks, k, width = self._layout(tuple(x.shape))
        rows = dct(blocks.cut(x.float())).reshape(blocks.count, blocks.size)
        indices = largest_in_each(rows, k)
        return torch.cat([tensor_bytes(rows.gather(1, indices)), pack_codes(indices.reshape(-1), width)])

    def _decode_body(self, body: BodyReader, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        blocks, k, width = self._layout(shape)
        values = body.take(torch.float32, blocks.count * k).reshape(blocks.count, k)
        indices = self._take_indices(body, blocks, k, width).to(values.device)
        rows = torch.zeros(blocks.count, blocks.size, dtype=torch.float32, device=values.device)
        rows.scatter_(1, indices, values)
        coefficients = rows.reshape(blocks.count, blocks.row_side, blocks.col_side)
        return blocks.join(inverse_dct(coefficients), shape).to(dtype)

    def _body_size(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        blocks, k, width = self._layout(shape)
        return 4 * blocks.count * k + packed_size(blocks.count * k, width)

    def __repr__(self) -> str:
        return f"DctTopK(k={self.k}, chunk={self.chunk})"
