"""The wire frame: the header, body and checksum every encoded tensor travels in.

Layout (little-endian), all of it in one flat uint8 tensor, which is what torch.distributed moves:

    magic   4 bytes   b"FAST"
    version 1 byte    FRAME_VERSION
    codec   1 byte    a value of CODEC_IDS
    dtype   1 byte    a value of DTYPE_CODES: the dtype of the tensor the frame decodes to
    ndim    1 byte    at most MAX_NDIM
    shape   ndim x uint64
    length  uint64    the body's length in bytes
    body    length bytes, laid out by the codec
    crc32   uint32    zlib.crc32 of everything before it

The header is 16 + 8 * ndim bytes, a multiple of 8, so the body starts aligned for any dtype.
`unpack_frame` rejects anything inconsistent with a FrameError and never unpickles anything.
"""

from __future__ import annotations

import struct
import sys
import zlib
from dataclasses import dataclass

import numpy as np
import torch

from fast.errors import FrameError

if sys.byteorder != "little":  # bodies are raw tensor memory; the format is little-endian
    raise ImportError("fast.codecs needs a little-endian machine")

MAGIC = b"FAST"
FRAME_VERSION = 1
MAX_NDIM = 16
MAX_FRAME_BYTES = 1 << 32
CHECKSUM_BYTES = 4

# The wire's vocabulary: one id per codec. ef-sign travels as sign (error feedback happens at the sender).
CODEC_IDS: dict[str, int] = {
    "none": 0,
    "fp16": 1,
    "bf16": 2,
    "uint8": 3,
    "qsgd": 4,
    "terngrad": 5,
    "sign": 6,
    "signum": 7,
    "topk": 8,
    "randomk": 9,
    "threshold": 10,
    "dgc": 11,
    "powersgd": 12,
    "chunk-topk": 13,
    "dct-topk": 14,
}
CODEC_NAMES: dict[int, str] = {code: name for name, code in CODEC_IDS.items()}

DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.float64: 4,
    torch.uint8: 5,
    torch.int8: 6,
    torch.int16: 7,
    torch.int32: 8,
    torch.int64: 9,
    torch.bool: 10,
}
DTYPES: dict[int, torch.dtype] = {code: dtype for dtype, code in DTYPE_CODES.items()}

_PREFIX = struct.Struct("<4sBBBB")
_DIM = struct.Struct("<Q")
_CHECKSUM = struct.Struct("<I")


@dataclass(frozen=True)
class Frame:
    """A checked frame: which codec made it, what it decodes to, and the codec's body bytes."""

    codec_id: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    body: torch.Tensor  # uint8, a view into the frame

    @property
    def codec_name(self) -> str:
        return CODEC_NAMES[self.codec_id]


def header_size(ndim: int) -> int:
    """Bytes of the header of a frame for a tensor with `ndim` dimensions."""
    return _PREFIX.size + _DIM.size * ndim + _DIM.size


def frame_size(ndim: int, body_bytes: int) -> int:
    """Total bytes of a frame: header, body and checksum."""
    return header_size(ndim) + body_bytes + CHECKSUM_BYTES


def pack_frame(codec_id: int, dtype: torch.dtype, shape: tuple[int, ...], body: torch.Tensor) -> torch.Tensor:
    """One uint8 CPU tensor holding the header, `body` (a uint8 tensor) and the checksum."""
    if codec_id not in CODEC_NAMES:
        raise ValueError(f"unknown codec id {codec_id}")
    if dtype not in DTYPE_CODES:
        raise TypeError(f"tensors of dtype {dtype} cannot travel in a frame; use one of {list(DTYPE_CODES)}")
    if len(shape) > MAX_NDIM:
        raise ValueError(f"tensors of more than {MAX_NDIM} dimensions cannot travel in a frame")
    if body.dtype != torch.uint8 or body.dim() != 1:
        raise TypeError("a frame body must be a 1-D uint8 tensor")
    head = bytearray(_PREFIX.pack(MAGIC, FRAME_VERSION, codec_id, DTYPE_CODES[dtype], len(shape)))
    for size in shape:
        head += _DIM.pack(size)
    head += _DIM.pack(body.numel())
    frame = torch.empty(len(head) + body.numel() + CHECKSUM_BYTES, dtype=torch.uint8)
    frame[: len(head)] = torch.frombuffer(head, dtype=torch.uint8)
    frame[len(head) : len(head) + body.numel()] = body
    checksum = zlib.crc32(frame[:-CHECKSUM_BYTES].numpy())
    frame[-CHECKSUM_BYTES:] = torch.frombuffer(bytearray(_CHECKSUM.pack(checksum)), dtype=torch.uint8)
    return frame


def unpack_frame(frame: torch.Tensor | bytes | bytearray, *, max_bytes: int = MAX_FRAME_BYTES) -> Frame:
    """Check `frame` end to end and split it into its parts; FrameError if anything is off."""
    data = _as_frame_tensor(frame)
    size = data.numel()
    if size > max_bytes:
        raise FrameError(f"oversized frame: {size} bytes, more than the limit of {max_bytes}")
    if size < header_size(0) + CHECKSUM_BYTES:
        raise FrameError(f"truncated frame: {size} bytes, shorter than the smallest possible frame")
    raw = data.numpy()
    magic, version, codec_id, dtype_code, ndim = _PREFIX.unpack_from(raw, 0)
    if magic != MAGIC:
        raise FrameError(f"bad magic {magic!r}: these bytes are not a FAST frame")
    if version != FRAME_VERSION:
        raise FrameError(f"unknown frame version {version}; this FAST reads version {FRAME_VERSION}")
    if codec_id not in CODEC_NAMES:
        raise FrameError(f"unknown codec id {codec_id} in frame")
    if dtype_code not in DTYPES:
        raise FrameError(f"unknown dtype code {dtype_code} in frame")
    if ndim > MAX_NDIM:
        raise FrameError(f"frame claims {ndim} dimensions, more than the limit of {MAX_NDIM}")
    head = header_size(ndim)
    if size < head + CHECKSUM_BYTES:
        raise FrameError(f"truncated frame: {size} bytes, shorter than its {head}-byte header and checksum")
    shape = tuple(_DIM.unpack_from(raw, _PREFIX.size + _DIM.size * axis)[0] for axis in range(ndim))
    if any(dim >= 1 << 62 for dim in shape):
        raise FrameError(f"frame claims an impossible shape {shape}")
    (length,) = _DIM.unpack_from(raw, head - _DIM.size)
    expected = head + length + CHECKSUM_BYTES
    if expected > max_bytes:
        raise FrameError(f"oversized frame: it claims {expected} bytes, more than the limit of {max_bytes}")
    if size != expected:
        problem = "truncated" if size < expected else "overlong"
        raise FrameError(f"{problem} frame: {size} bytes where its header promises {expected}")
    (checksum,) = _CHECKSUM.unpack_from(raw, size - CHECKSUM_BYTES)
    if zlib.crc32(raw[:-CHECKSUM_BYTES]) != checksum:
        raise FrameError("frame checksum mismatch: the bytes were corrupted on the way")
    return Frame(codec_id, DTYPES[dtype_code], shape, data[head : head + length])


def _as_frame_tensor(frame: torch.Tensor | bytes | bytearray) -> torch.Tensor:
    if isinstance(frame, bytes | bytearray | memoryview):
        return torch.from_numpy(np.frombuffer(frame, dtype=np.uint8).copy())
    if not isinstance(frame, torch.Tensor):
        raise FrameError(f"a frame must be a uint8 tensor or bytes, got {type(frame).__name__}")
    if frame.dtype != torch.uint8 or frame.dim() != 1:
        raise FrameError(f"a frame must be a 1-D uint8 tensor, got {frame.dtype} of shape {tuple(frame.shape)}")
    return frame.detach().cpu().contiguous()
