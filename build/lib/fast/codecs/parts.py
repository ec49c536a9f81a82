"""A flat tensor that packs several tensors, as codec frames: one frame per packed tensor (so scales, norms and
low-rank factors are per tensor), or the whole flat tensor in one frame for sparsifiers (a global top-k lets the
tensors with the largest values take more of the budget). Frames are laid end to end in one payload."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from fast.codecs.base import Codec
from fast.codecs.frame import CHECKSUM_BYTES, header_size
from fast.errors import FrameError

NDIM_OFFSET = 7  # a frame's ndim byte; its header ends with the body's length (uint64), see fast.codecs.frame


def packed_shapes(
    tensor: torch.Tensor, shapes: Sequence[Sequence[int]] | None
) -> tuple[list[tuple[int, ...]], list[int]]:
    """The shapes a flat `tensor` packs (just its own shape without `shapes`) and their element counts."""
    shapes = [tuple(tensor.shape)] if shapes is None else [tuple(shape) for shape in shapes]
    sizes = [math.prod(shape) for shape in shapes]
    if sum(sizes) != tensor.numel():
        raise ValueError(f"shapes {shapes} hold {sum(sizes)} elements, the tensor {tensor.numel()}")
    return shapes, sizes


def frame_shapes(codec: Codec, tensor: torch.Tensor, shapes: Sequence[Sequence[int]] | None) -> list[tuple[int, ...]]:
    """The shapes of the frames `tensor` is encoded in: one per tensor of `shapes`, or the flat tensor whole
    for sparsifiers (and when `shapes` is not given)."""
    if codec.sparsifier:
        return [(tensor.numel(),)] if shapes is not None else [tuple(tensor.shape)]
    return packed_shapes(tensor, shapes)[0]


def split_frames(payload: torch.Tensor, count: int) -> list[torch.Tensor]:
    """The `count` frames laid end to end in `payload`, each cut at the length its header gives (the frames
    are checked when decoded); FrameError if the payload does not hold exactly that many."""
    frames, offset, data = [], 0, payload.numpy()
    for _ in range(count):
        if offset + header_size(0) > len(data):
            raise FrameError(f"payload of {len(data)} bytes ends inside frame {len(frames)} of {count}")
        head = header_size(int(data[offset + NDIM_OFFSET]))
        body = int.from_bytes(data[offset + head - 8 : offset + head].tobytes(), "little")
        end = offset + head + body + CHECKSUM_BYTES
        frames.append(payload[offset:end])
        offset = end
    if offset != len(data):
        raise FrameError(f"payload of {len(data)} bytes does not hold exactly {count} frames")
    return frames


def encode_parts(
    codec: Codec, flat: torch.Tensor, key: str, shapes: Sequence[tuple[int, ...]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The frames of the tensors of `shapes` packed in `flat` (key `key.i` for the i-th), end to end, and
    what a receiver decodes of them, flat."""
    sizes = [math.prod(shape) for shape in shapes]
    encoded = [
        codec.encode_and_decode(part.view(shape), f"{key}.{i}")
        for i, (part, shape) in enumerate(zip(flat.split(sizes), shapes, strict=True))
    ]
    return torch.cat([frame for frame, _ in encoded]), torch.cat([sent.reshape(-1) for _, sent in encoded])


def decode_parts(codec: Codec, payload: torch.Tensor, count: int) -> torch.Tensor:
    """The flat tensor that `count` frames laid end to end in `payload` decode to."""
    frames = split_frames(payload.cpu(), count)
    return torch.cat([codec.decode(frame).reshape(-1) for frame in frames])
