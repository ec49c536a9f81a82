"""Turning tensors into body bytes and back: raw memory, packed bit fields, narrow indices, a body reader.

All packing is vectorised (shifts over a few columns, or one int64 multiply per eight bits), never a
Python loop over elements. Codes of `width` bits are split into bit planes of 8, 4, 2 and 1 bits
(lowest bits first, e.g. 5 = 4 + 1), and each plane is packed on its own, LSB first, so that a byte
always holds a whole number of codes: code i of a w-bit plane is bits [(i % (8 // w)) * w, ...) of
byte i // (8 // w).
"""

from __future__ import annotations

import torch

from fast.errors import FrameError


def tensor_bytes(x: torch.Tensor) -> torch.Tensor:
    """The memory of `x` as a flat uint8 tensor (a view when `x` is contiguous)."""
    return x.contiguous().reshape(-1).view(torch.uint8)


def scalar_bytes(value: torch.Tensor | float, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """One number as the bytes of `dtype`, kept on the device of `value` (no host sync)."""
    if not isinstance(value, torch.Tensor):
        value = torch.tensor(value, device=device)
    return value.detach().reshape(1).to(dtype).view(torch.uint8)


def bit_planes(width: int) -> list[int]:
    """How codes of `width` bits are stored: planes of 8, 4, 2 or 1 bits, lowest bits first."""
    planes = []
    while width:
        plane = next(size for size in (8, 4, 2, 1) if size <= width)
        planes.append(plane)
        width -= plane
    return planes


def packed_size(count: int, width: int) -> int:
    """Bytes taken by `count` codes of `width` bits each."""
    return sum((count * plane + 7) // 8 for plane in bit_planes(width))


def pack_codes(codes: torch.Tensor, width: int) -> torch.Tensor:
    """Integer `codes` (each below 2**width, width 1..16) packed into uint8 bytes, plane by plane."""
    codes = codes.reshape(-1)
    if codes.dtype == torch.bool:
        codes = codes.view(torch.uint8)
    elif width <= 8:
        codes = codes.to(torch.uint8)
    pieces, offset = [], 0
    for plane in bit_planes(width):
        values = codes if plane == width else (codes >> offset) & ((1 << plane) - 1)
        pieces.append(_pack_plane(values.to(torch.uint8), plane))
        offset += plane
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def unpack_codes(packed: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """The `count` codes of `width` bits in `packed` (inverse of pack_codes): uint8 up to 8 bits, else int32.

    Up to 7 bits the result is a fresh tensor the caller may modify in place; at 8 it views `packed`.
    """
    codes = None
    start, offset = 0, 0
    for plane in bit_planes(width):
        size = (count * plane + 7) // 8
        values = _unpack_plane(packed[start : start + size], plane, count)
        if width > 8:
            values = values.to(torch.int32)
        if codes is None:
            codes = values
        else:
            codes |= values.bitwise_left_shift_(offset)
        start += size
        offset += plane
    return codes


# Eight 0/1 bytes read as one little-endian int64 gather into its top byte (byte j -> bit 56 + j) when
# multiplied by this; no two partial products meet there, so nothing carries in (the overflow wraps).
_GATHER_BITS = 0x0102040810204080
# One byte repeated into all eight, then masked so that byte j keeps only bit j.
_SPREAD_BYTE = 0x0101010101010101
_BIT_J_OF_BYTE_J = 0x8040201008040201 - (1 << 64)  # as a signed int64


def _pack_plane(values: torch.Tensor, width: int) -> torch.Tensor:
    """uint8 values below 2**width (width 1, 2, 4 or 8), 8 // width of them in each byte, LSB first."""
    if width == 8:
        return values
    per_byte = 8 // width
    values = _pad(values, per_byte)
    if width == 1:
        if values.storage_offset() % 8 or not values.is_contiguous():
            values = values.clone(memory_format=torch.contiguous_format)
        gathered = values.view(torch.int64) * _GATHER_BITS
        return gathered.view(torch.uint8).view(-1, 8)[:, 7].contiguous()
    grid = values.view(-1, per_byte)
    packed = grid[:, 0].clone(memory_format=torch.contiguous_format)
    for column in range(1, per_byte):
        packed |= grid[:, column] << (column * width)
    return packed


def _unpack_plane(packed: torch.Tensor, width: int, count: int) -> torch.Tensor:
    if width == 8:
        return packed[:count]
    if width == 1:
        spread = (packed.to(torch.int64) * _SPREAD_BYTE).bitwise_and_(_BIT_J_OF_BYTE_J)
        return spread.view(torch.uint8).ne(0).view(torch.uint8)[:count]
    shifts = torch.arange(0, 8, width, dtype=torch.uint8, device=packed.device)
    values = torch.bitwise_right_shift(packed.unsqueeze(1), shifts).bitwise_and_((1 << width) - 1)
    return values.view(-1)[:count]


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """Booleans packed eight to a byte, LSB-first."""
    return pack_codes(bits, 1)


def unpack_bits(packed: torch.Tensor, count: int) -> torch.Tensor:
    """The first `count` booleans packed in `packed`, as uint8 zeros and ones."""
    return unpack_codes(packed, 1, count)


def index_width(numel: int) -> int:
    """Bytes per index for a tensor of `numel` elements: the narrowest of 1, 2, 4, 8 that holds numel - 1."""
    for width in (1, 2, 4):
        if numel <= 1 << (8 * width):
            return width
    return 8


def pack_indices(indices: torch.Tensor, numel: int) -> torch.Tensor:
    """Indices into a tensor of `numel` elements, each in index_width(numel) little-endian bytes."""
    width = index_width(numel)
    return indices.to(torch.int64).view(torch.uint8).view(-1, 8)[:, :width].reshape(-1)


def unpack_indices(packed: torch.Tensor, numel: int, count: int) -> torch.Tensor:
    """The `count` int64 indices in `packed`; FrameError if any points outside a `numel`-element tensor."""
    width = index_width(numel)
    wide = torch.zeros(count, 8, dtype=torch.uint8, device=packed.device)
    wide[:, :width] = packed.view(count, width)
    indices = wide.view(torch.int64).reshape(count)
    if count and (int(indices.max()) >= numel or int(indices.min()) < 0):
        raise FrameError(f"frame holds an index beyond the tensor's {numel} elements")
    return indices


class BodyReader:
    """Reads typed pieces off a body in order; FrameError if the body is too short or too long."""

    def __init__(self, body: torch.Tensor, codec: str):
        self.body = body
        self.codec = codec
        self.offset = 0

    def take_bytes(self, count: int) -> torch.Tensor:
        if self.offset + count > self.body.numel():
            raise FrameError(
                f"{self.codec} frame body is too short: needs at least {self.offset + count} bytes, "
                f"has {self.body.numel()}"
            )
        piece = self.body[self.offset : self.offset + count]
        self.offset += count
        return piece

    def take(self, dtype: torch.dtype, count: int) -> torch.Tensor:
        """`count` values of `dtype` (copied when the bytes are not aligned for it)."""
        size = dtype.itemsize
        piece = self.take_bytes(count * size)
        if piece.storage_offset() % size:
            piece = piece.clone()
        return piece.view(dtype)

    def take_scalar(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.take(dtype, 1)[0]

    def take_count(self) -> int:
        """A uint64 element count."""
        count = int(self.take(torch.int64, 1)[0])
        if count < 0:
            raise FrameError(f"{self.codec} frame holds a negative count")
        return count

    def finish(self) -> None:
        if self.offset != self.body.numel():
            raise FrameError(f"{self.codec} frame body has {self.body.numel()} bytes where {self.offset} were expected")


def _pad(values: torch.Tensor, multiple: int) -> torch.Tensor:
    short = -values.numel() % multiple
    if short == 0:
        return values
    return torch.cat([values, values.new_zeros(short)])
