"""One bit per element: the sign, packed eight to a byte.

- `sign` (1-bit SGD, Seide et al. 2014; scaled sign of Karimireddy et al. 2019): sign(x) times one fp32
  scale, mean |x|. Zero counts as positive. Biased: pair it with error feedback (`ef-sign`).
- `signum` (Bernstein et al. 2018): the sign of a momentum buffer m = momentum * m + (1 - momentum) * x
  kept per tensor key; with `scale` it is multiplied by mean |m|, without it the receiver sees ±1.
"""

from __future__ import annotations

import math

import torch

from fast.codecs.base import Codec, per_tensor_state
from fast.codecs.packing import BodyReader, pack_bits, scalar_bytes, unpack_bits
from fast.errors import ConfigError


def sign_body(values: torch.Tensor, with_scale: bool) -> torch.Tensor:
    """[mean |values| as fp32 if with_scale] + one bit per element, 1 for values >= 0."""
    flat = values.reshape(-1)
    bits = pack_bits(flat >= 0)
    if not with_scale:
        return bits
    wide = torch.promote_types(flat.dtype, torch.float32)
    mean_magnitude = torch.linalg.vector_norm(flat, ord=1, dtype=wide) / flat.numel()
    return torch.cat([scalar_bytes(mean_magnitude), bits])


def decode_sign_body(body: BodyReader, shape: tuple[int, ...], dtype: torch.dtype, with_scale: bool) -> torch.Tensor:
    """±scale (±1 without a scale) from the sign bits of a sign body."""
    numel = math.prod(shape)
    scale = body.take_scalar() if with_scale else torch.tensor(1.0)
    positive = unpack_bits(body.take_bytes((numel + 7) // 8), numel)
    return positive.to(dtype).mul_(2 * scale).sub_(scale).reshape(shape)


class Sign(Codec):
    """Scaled sign: mean |x| (fp32) and a sign bit per element."""

    contractive = True

    name = "sign"

    def _encode_body(self, x: torch.Tensor, key: str) -> torch.Tensor:
        return sign_body(x, with_scale=True)

    def _decode_body(self, body: BodyReader, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return decode_sign_body(body, shape, dtype, with_scale=True)

    def _body_size(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        return 4 + (math.prod(shape) + 7) // 8


class Signum(Codec):
    """Sign of the per-tensor momentum buffer, optionally scaled by its mean magnitude."""

    name = "signum"
    per_tensor_state = {"momenta": "_momenta"}

    def __init__(self, *, momentum: float = 0.9, scale: bool = False, min_elements: int = 0, seed: int = 0):
        super().__init__(min_elements=min_elements, seed=seed)
        if isinstance(momentum, bool) or not isinstance(momentum, int | float) or not 0 <= momentum < 1:
            raise ConfigError(f"codec option momentum must be a number in [0, 1), got {momentum!r}")
        if not isinstance(scale, bool):
            raise ConfigError(f"codec option scale must be true or false, got {scale!r}")
        self.momentum = float(momentum)
        self.scale = scale
        self._momenta: dict[str, torch.Tensor] = {}

    def momentum_buffer(self, key: str = "") -> torch.Tensor | None:
        return self._momenta.get(key)

    def _encode_body(self, x: torch.Tensor, key: str) -> torch.Tensor:
        buffer = per_tensor_state(self._momenta, key, x)
        buffer.mul_(self.momentum).add_(x, alpha=1 - self.momentum)
        return sign_body(buffer, with_scale=self.scale)

    def _decode_body(self, body: BodyReader, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return decode_sign_body(body, shape, dtype, with_scale=self.scale)

    def _body_size(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        return 4 * self.scale + (math.prod(shape) + 7) // 8

    def __repr__(self) -> str:
        return f"Signum(momentum={self.momentum}, scale={self.scale})"
