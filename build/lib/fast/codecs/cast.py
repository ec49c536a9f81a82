"""Codecs that send every element: as it is (`none`), or cast to 16-bit floats (`fp16`, `bf16`).

Their values can be summed elementwise, so a strategy may all-reduce them in `wire_dtype` instead of
gathering frames.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch

from fast.codecs.base import Codec, decode_raw
from fast.codecs.packing import BodyReader, tensor_bytes


class NoCompression(Codec):
    """`none`: the tensor's own memory, any dtype."""

    contractive = True

    name = "none"
    summable = True
    floats_only = False

    def wire_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype the values travel in."""
        return dtype

    def _encode_body(self, x: torch.Tensor, key: str) -> torch.Tensor:
        return tensor_bytes(x)

    def _decode_body(self, body: BodyReader, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return decode_raw(body, shape, dtype)

    def _body_size(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        return math.prod(shape) * dtype.itemsize


class _Cast(Codec):
    """Every element cast to `cast_dtype`, 2 bytes each; decoded back to the sender's dtype."""

    contractive = True

    cast_dtype: ClassVar[torch.dtype]
    summable = True

    def wire_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return self.cast_dtype

    def _encode_body(self, x: torch.Tensor, key: str) -> torch.Tensor:
        return tensor_bytes(x.to(self.cast_dtype))

    def _decode_body(self, body: BodyReader, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return body.take(self.cast_dtype, math.prod(shape)).reshape(shape).to(dtype, copy=True)

    def _body_size(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        return math.prod(shape) * self.cast_dtype.itemsize


class Float16(_Cast):
    """`fp16`: IEEE half precision (values beyond ±65504 become infinite)."""

    name = "fp16"
    cast_dtype = torch.float16


class BFloat16(_Cast):
    """`bf16`: bfloat16, fp32's range with 8 bits of mantissa."""

    name = "bf16"
    cast_dtype = torch.bfloat16
