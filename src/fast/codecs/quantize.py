"""Quantising codecs: every element kept, in fewer bits.

- `uint8`: per-tensor min-max, 8 bits per element, deterministic rounding (biased, small error).
- `qsgd` (Alistarh et al. 2017): per bucket of `bucket_size` elements the L2 norm, then per element a
  sign bit and a level in 0..levels reached by stochastic rounding of |x| / norm * levels: unbiased.
- `terngrad` (Wen et al. 2017): scale max|x|, each element -1, 0 or +1 by stochastic rounding, 2 bits
  each: unbiased.
"""

from __future__ import annotations

import math

import torch

from fast.codecs.base import Codec, non_negative_int, positive_int
from fast.codecs.packing import BodyReader, pack_codes, packed_size, scalar_bytes, unpack_codes
from fast.errors import FrameError


class Uint8(Codec):
    """Per-tensor min-max quantisation to 256 levels: min, max (fp32) and one byte per element."""

    name = "uint8"

    def _encode_body(self, x: torch.Tensor, key: str) -> torch.Tensor:
        flat = x.reshape(-1).float()
        low, high = torch.aminmax(flat)
        step = torch.where(high > low, (high - low) / 255, torch.ones_like(high))
        codes = ((flat - low) / step).round_().clamp_(0, 255).to(torch.uint8)
        return torch.cat([scalar_bytes(low), scalar_bytes(high), codes])

    def _decode_body(self, body: BodyReader, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        low, high = body.take_scalar(), body.take_scalar()
        codes = body.take(torch.uint8, math.prod(shape))
        return (low + codes.float() * ((high - low) / 255)).to(dtype).reshape(shape)

    def _body_size(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        return 8 + math.prod(shape)


class QSGD(Codec):
    """Stochastic quantisation to `levels` levels of |x| / norm per bucket, with a sign bit (unbiased).

    Body: one fp32 norm per bucket, then per element a code of 1 + bits(levels) bits (level in the low
    bits, sign above it). `bucket_size = 0` makes the whole tensor one bucket.
    """

    name = "qsgd"

    def __init__(self, *, levels: int = 15, bucket_size: int = 512, min_elements: int = 0, seed: int = 0):
        super().__init__(min_elements=min_elements, seed=seed)
        self.levels = positive_int("levels", levels, limit=2**15 - 1)
        self.bucket_size = non_negative_int("bucket_size", bucket_size)
        self.level_bits = self.levels.bit_length()

    def _buckets(self, numel: int) -> tuple[int, int]:
        """(number of buckets, elements per bucket) for a tensor of `numel` elements."""
        size = numel if self.bucket_size == 0 else min(self.bucket_size, numel)
        return -(-numel // size), size

    def _encode_body(self, x: torch.Tensor, key: str) -> torch.Tensor:
        numel = x.numel()
        buckets, size = self._buckets(numel)
        grid = torch.zeros(buckets * size, dtype=torch.float32, device=x.device)
        grid[:numel] = x.reshape(-1)
        grid = grid.view(buckets, size)
        norms = torch.linalg.vector_norm(grid, dim=1)
        scale = torch.where(norms > 0, self.levels / norms, torch.zeros_like(norms))
        ratio = grid.abs().mul_(scale.unsqueeze(1))  # in [0, levels]
        level = ratio.floor()
        noise = torch.rand(ratio.shape, generator=self.generator(x.device), device=x.device)
        level += noise < ratio.sub_(level)  # round up with probability equal to the fractional part
        level.clamp_(max=self.levels)
        code_dtype = torch.uint8 if self.level_bits < 8 else torch.int32
        codes = level.to(code_dtype) | ((grid < 0).to(code_dtype) << self.level_bits)
        return torch.cat([norms.view(torch.uint8), pack_codes(codes.view(-1)[:numel], self.level_bits + 1)])

    def _decode_body(self, body: BodyReader, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        numel = math.prod(shape)
        buckets, size = self._buckets(numel)
        norms = body.take(torch.float32, buckets)
        codes = unpack_codes(body.take_bytes(packed_size(numel, self.level_bits + 1)), self.level_bits + 1, numel)
        level = codes & ((1 << self.level_bits) - 1)
        if bool((level > self.levels).any()):
            raise FrameError(f"qsgd frame holds a level above the configured {self.levels} levels")
        values = torch.zeros(buckets * size, dtype=torch.float32, device=codes.device)
        values[:numel] = level
        values = values.view(buckets, size).mul_((norms / self.levels).unsqueeze(1)).view(-1)[:numel]
        values = torch.where((codes >> self.level_bits).bool(), -values, values)
        return values.to(dtype).reshape(shape)

    def _body_size(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        numel = math.prod(shape)
        return 4 * self._buckets(numel)[0] + packed_size(numel, self.level_bits + 1)

    def __repr__(self) -> str:
        return f"QSGD(levels={self.levels}, bucket_size={self.bucket_size}, seed={self.seed})"


class TernGrad(Codec):
    """Ternary stochastic rounding: scale s = max|x|, each element s * sign(x) with probability |x| / s.

    Body: s (fp32), then 2 bits per element: 0 for 0, 1 for +s, 2 for -s.
    """

    name = "terngrad"

    def _encode_body(self, x: torch.Tensor, key: str) -> torch.Tensor:
        flat = x.reshape(-1).float()
        magnitude = flat.abs()
        scale = magnitude.max()
        noise = torch.rand(flat.shape, generator=self.generator(x.device), device=x.device)
        kept = (noise * scale < magnitude).to(torch.uint8)  # probability |x| / scale
        codes = kept << (flat < 0).to(torch.uint8)  # 1 for +, 2 for -
        return torch.cat([scalar_bytes(scale), pack_codes(codes, 2)])

    def _decode_body(self, body: BodyReader, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        numel = math.prod(shape)
        scale = body.take_scalar()
        codes = unpack_codes(body.take_bytes(packed_size(numel, 2)), 2, numel)
        if bool((codes == 3).any()):
            raise FrameError("terngrad frame holds the unused code 3")
        signs = codes.to(torch.int8)
        signs[codes == 2] = -1
        return (signs * scale).to(dtype).reshape(shape)

    def _body_size(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        return 4 + packed_size(math.prod(shape), 2)
