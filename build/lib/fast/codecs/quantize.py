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

    contractive = True

    name = "uint8"

    def _encode_body(self, x: torch.Tensor, key: str) -> torch.Tensor:
        flat = x.reshape(-1).float()
        low, high = torch.aminmax(flat)
        step = torch.where(high > low, (high - low) / 255, torch.ones_like(high))
        codes = torch.sub(flat, low).div_(step).round_().clamp_(0, 255).to(torch.uint8)
        return torch.cat([scalar_bytes(low), scalar_bytes(high), codes])

    def _decode_body(self, body: BodyReader, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        low, high = body.take_scalar(), body.take_scalar()
        codes = body.take(torch.uint8, math.prod(shape))
        return codes.float().mul_((high - low) / 255).add_(low).to(dtype).reshape(shape)

    def _body_size(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        return 8 + math.prod(shape)


class QSGD(Codec):
    """Stochastic quantisation to `levels` levels of |x| / norm per bucket, with a sign bit (unbiased).

    Body: one fp32 norm per bucket, then per element a code of 1 + bits(levels) bits (level in the low
    bits, sign above it). `bucket_size = 0` makes the whole tensor one bucket. The default, 7 levels
    in buckets of 512, is the paper's 4-bit QSGD: two codes to a byte.
    """

    name = "qsgd"

    def __init__(self, *, levels: int = 7, bucket_size: int = 512, min_elements: int = 0, seed: int = 0):
        super().__init__(min_elements=min_elements, seed=seed)
        self.levels = positive_int("levels", levels, limit=2**15 - 1)
        self.bucket_size = non_negative_int("bucket_size", bucket_size)
        self.level_bits = self.levels.bit_length()
        # codes (level, then sign) fit a byte up to 127 levels; the signed level then fits an int8
        self._code_dtype = torch.uint8 if self.level_bits < 8 else torch.int32
        self._signed_dtype = torch.int8 if self.level_bits < 8 else torch.int32

    def _bucket_runs(self, numel: int) -> list[tuple[int, int, int]]:
        """(start, end, bucket size) of the runs of equal buckets: the full buckets, then a shorter last one."""
        size = numel if self.bucket_size == 0 else min(self.bucket_size, numel)
        full = numel // size * size
        return [(0, full, size)] + ([(full, numel, numel - full)] if full < numel else [])

    def _bucket_count(self, numel: int) -> int:
        size = numel if self.bucket_size == 0 else min(self.bucket_size, numel)
        return -(-numel // size)

    def _encode_body(self, x: torch.Tensor, key: str) -> torch.Tensor:
        flat = x.reshape(-1).float()
        numel = flat.numel()
        # Stochastic rounding of the signed level v = x * levels / norm: with u uniform in [0, 1),
        # floor(v + u) is floor(v) + 1 with probability v - floor(v) and floor(v) otherwise, so its mean
        # is exactly v, for either sign of v.
        level = torch.rand(numel, generator=self.generator(x.device), device=x.device)
        norms = []
        for start, end, size in self._bucket_runs(numel):
            rows = flat[start:end].view(-1, size)
            norm = torch.linalg.vector_norm(rows, dim=1)
            scale = torch.where(norm > 0, self.levels / norm, torch.zeros_like(norm))
            level[start:end].view(-1, size).addcmul_(rows, scale.unsqueeze(1))
            norms.append(norm)
        signed = level.floor_().clamp_(-self.levels, self.levels).to(self._signed_dtype)
        codes = signed.abs().view(self._code_dtype)
        codes |= (signed < 0).view(torch.uint8).to(self._code_dtype) << self.level_bits
        return torch.cat([torch.cat(norms).view(torch.uint8), pack_codes(codes, self.level_bits + 1)])

    def _decode_body(self, body: BodyReader, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        numel = math.prod(shape)
        norms = body.take(torch.float32, self._bucket_count(numel))
        width = self.level_bits + 1
        codes = unpack_codes(body.take_bytes(packed_size(numel, width)), width, numel)
        level = (codes & ((1 << self.level_bits) - 1)).view(self._signed_dtype)
        if self.levels != (1 << self.level_bits) - 1 and bool((level > self.levels).any()):
            raise FrameError(f"qsgd frame holds a level above the configured {self.levels} levels")
        negate = (codes >> self.level_bits).view(self._signed_dtype).neg_()  # 0, or -1 (all bits set)
        values = level.bitwise_xor_(negate).sub_(negate).float()  # two's complement negation where negative
        row = 0
        for start, end, size in self._bucket_runs(numel):
            rows = values[start:end].view(-1, size)
            rows.mul_((norms[row : row + rows.shape[0]] / self.levels).unsqueeze(1))
            row += rows.shape[0]
        return values.to(dtype).reshape(shape)

    def _body_size(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        numel = math.prod(shape)
        return 4 * self._bucket_count(numel) + packed_size(numel, self.level_bits + 1)

    def __repr__(self) -> str:
        return f"QSGD(levels={self.levels}, bucket_size={self.bucket_size}, seed={self.seed})"


class TernGrad(Codec):
    """Ternary stochastic rounding: scale s = max|x|, each element s * sign(x) with probability |x| / s.

    Body: s (fp32), then 2 bits per element, the value -1, 0 or +1 in two's complement (0, 1, 3; 2 unused).
    """

    name = "terngrad"

    def _encode_body(self, x: torch.Tensor, key: str) -> torch.Tensor:
        flat = x.reshape(-1).float()
        scale = torch.linalg.vector_norm(flat, ord=math.inf)
        divisor = torch.where(scale > 0, scale, torch.ones_like(scale))
        # floor(x / s + u), u uniform in [0, 1): sign(x) with probability |x| / s, else 0
        ternary = torch.rand(flat.shape, generator=self.generator(x.device), device=x.device)
        ternary.addcdiv_(flat, divisor).floor_().clamp_(-1, 1)
        codes = ternary.to(torch.int8).view(torch.uint8) & 3
        return torch.cat([scalar_bytes(scale), pack_codes(codes, 2)])

    def _decode_body(self, body: BodyReader, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        numel = math.prod(shape)
        scale = body.take_scalar()
        codes = unpack_codes(body.take_bytes(packed_size(numel, 2)), 2, numel)
        ternary = codes.bitwise_xor_(2).view(torch.int8).sub_(2)  # two's complement: 0, 1, 3 -> 0, 1, -1
        if numel and int(ternary.min()) < -1:
            raise FrameError("terngrad frame holds the unused code 2")
        return ternary.float().mul_(scale).to(dtype).reshape(shape)

    def _body_size(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        return 4 + packed_size(math.prod(shape), 2)
