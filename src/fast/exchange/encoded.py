"""Codec frames sent point to point: with a length prefix (any codec), or without one when the receiver knows the
frame's size from the tensor's shape (codecs with `fixed_size` frames), so that it can post its receive first.
Each send declares the dense fp32 bytes it stands for (`bytes_sent_uncompressed`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fast.codecs import Codec
from fast.comm.comm import RECV_BYTES, Comm, Handle
from fast.exchange.allreduce import FP32_BYTES


def send_compressed(
    comm: Comm, tensor: torch.Tensor, dst: int, codec: Codec, key: str = "", *, tag: int = 0, droppable: bool = False
) -> None:
    """Encode `tensor` (a step of the codec's state for `key`) and send its frame to `dst` (length-prefixed)."""
    send_frame(comm, codec.encode(tensor, key), tensor.numel(), dst, tag=tag, droppable=droppable)


def send_frame(comm: Comm, frame: torch.Tensor, numel: int, dst: int, *, tag: int = 0, droppable: bool = False) -> None:
    """Send an already encoded frame of a `numel`-element tensor (to send one encoding to several peers)."""
    with comm.counter.dense_equivalent(FP32_BYTES * numel):
        comm.send_bytes(frame.to(comm.device), dst, tag, droppable)


def recv_compressed(comm: Comm, codec: Codec, src: int | None = None, *, tag: int = 0,
                    limit: int = RECV_BYTES) -> tuple[int, torch.Tensor]:  # fmt: skip
    """Receive a frame sent by `send_compressed` (from `src`, or whoever comes first): (sender, decoded tensor);
    `limit`: the most bytes its frame may have (the codec's frame of the largest tensor it may carry)."""
    peer, frame = comm.recv_bytes(src, tag, limit)
    return peer, codec.decode(frame)


def isend_encoded(
    comm: Comm, tensor: torch.Tensor, dst: int, codec: Codec, key: str = "", *, tag: int = 0, droppable: bool = False
) -> Handle:
    """Encode `tensor` and start sending its frame to `dst` with no length prefix: the receiver knows the
    size from the shape (`recv_encoded`), so the codec must have a fixed frame size (not `threshold`)."""
    frame = codec.encode(tensor, key).to(comm.device)
    with comm.counter.dense_equivalent(FP32_BYTES * tensor.numel()):
        return comm.isend(frame, dst, tag, droppable)


def recv_encoded(comm: Comm, codec: Codec, shape: Sequence[int], src: int, *, tag: int = 0) -> torch.Tensor:
    """Receive from `src` the frame of a tensor of `shape` sent by `isend_encoded`, decoded."""
    frame = torch.empty(codec.encoded_size(tuple(shape)), dtype=torch.uint8, device=comm.device)
    return codec.decode(comm.recv(frame, src, tag))
