"""Batches moved to a GPU one step ahead, on a CUDA stream of their own, from pinned host memory.

A copy from ordinary (pageable) host memory makes the host wait until it is done; from pinned memory it is queued
like a kernel (`non_blocking`). `prefetched` starts the copy of the next batch on a side stream before it hands out
the current one, so the copy runs while the current step computes; the step's stream waits for its batch's copy
(an event, on the device: the host waits for nothing), and each tensor is marked used on that stream, so its memory
is not reused before the step is done with it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch


def tensors_of(batch: Any) -> Iterator[torch.Tensor]:
    """The tensors of a batch: a tensor, or tuples, lists and dicts of them (other values are left alone)."""
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, tuple | list):
        for item in batch:
            yield from tensors_of(item)
    elif isinstance(batch, dict):
        for item in batch.values():
            yield from tensors_of(item)


def to_device(batch: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """The batch with its tensors on `device` (tuples, lists and dicts kept)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, tuple | list):
        return type(batch)(to_device(b, device, non_blocking) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device, non_blocking) for k, v in batch.items()}
    return batch


def pinned_rows(tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """tensor[index] gathered straight into pinned host memory (one copy), ready for a copy that does not wait."""
    out = torch.empty((len(index), *tensor.shape[1:]), dtype=tensor.dtype, pin_memory=True)
    return torch.index_select(tensor, 0, index, out=out)


def prefetched(batches: Iterable[Any], device: torch.device) -> Iterator[Any]:
    """`batches` (on the host, pinned) on the CUDA `device`, each one's copy started while the one before is used."""
    stream = torch.cuda.Stream(device)
    waiting: tuple[Any, torch.cuda.Event] | None = None
    for batch in batches:
        with torch.cuda.stream(stream):
            moved = to_device(batch, device, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(stream)
        if waiting is not None:
            yield _ready(*waiting, device)
        waiting = (moved, copied)
    if waiting is not None:
        yield _ready(*waiting, device)


def _ready(batch: Any, copied: torch.cuda.Event, device: torch.device) -> Any:
    """The batch, for use on the current stream: that stream waits for its copy (not for the next one's, which may
    follow it on the side stream), and its memory is marked as used there (without that, the allocator could hand
    it out again once the side stream is done with it)."""
    current = torch.cuda.current_stream(device)
    current.wait_event(copied)
    for tensor in tensors_of(batch):
        if tensor.is_cuda:
            tensor.record_stream(current)
    return batch
