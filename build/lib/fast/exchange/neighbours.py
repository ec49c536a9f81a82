"""The neighbour all-reduce (BlueFog's neighbor_allreduce): send a tensor to some peers, receive theirs from
others, and combine them with weights given per call, self_weight · mine + Σ_j w_j · theirs_j. The weights are
data, so one call serves a fixed topology, a round of a time-varying schedule, or a partial round where some
channels are down. D-PSGD mixes replicas with it, CHOCO-SGD compressed differences.

`NeighbourRound` is one round posted before the step's computation and finished after it, over a patient group
(fast.comm.patience), so that a neighbour that died, or whose droppable message was lost on an emulated lossy
link, is an outcome of the round (its share stays with this worker), never a hang. `compressed_allreduce`
encodes the tensor once (a frame per packed tensor) and exchanges fixed-size frames with every neighbour
(`exchange_compressed`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fast.codecs import Codec
from fast.codecs.parts import decode_parts, encode_parts, frame_shapes
from fast.comm import Handle, MessageLost
from fast.comm.comm import Comm
from fast.comm.patience import PatientGroup
from fast.errors import CommError
from fast.exchange.allreduce import FP32_BYTES


def combine(
    mine: torch.Tensor, theirs: dict[int, torch.Tensor], weights: dict[int, float], keep: float
) -> torch.Tensor:
    """keep · mine + Σ_j weights[j] · theirs[j]; a neighbour missing from `theirs` leaves its weight on mine."""
    mixed = mine * keep
    for peer, weight in weights.items():
        mixed.add_(theirs[peer] if peer in theirs else mine, alpha=weight)
    return mixed


class NeighbourRound:
    """One round: `message` to every rank in `send_to` (droppable), a message of the same shape from every rank
    in `receive_from`. `finish()` returns what arrived, the peers whose message was lost, and the peers found
    gone with why."""

    def __init__(self, group: PatientGroup, message: torch.Tensor, send_to: Sequence[int],
                 receive_from: Sequence[int], tag: int = 0) -> None:  # fmt: skip
        self.group = group
        self.inbox = {peer: torch.empty_like(message) for peer in receive_from}
        self.handles: list[tuple[int, Handle]] = []
        self.gone: dict[int, str] = {}
        for peer, buffer in self.inbox.items():
            self._post(peer, lambda p=peer, b=buffer: group.comm.irecv(b, p, tag=tag))
        for peer in send_to:
            self._post(peer, lambda p=peer: group.comm.isend(message, p, tag=tag, droppable=True))

    def _post(self, peer: int, start: object) -> None:
        try:
            self.handles.append((peer, start()))  # type: ignore[operator]
        except CommError as e:  # a connection already known to be closed
            self.gone.setdefault(peer, str(e))

    def finish(self) -> tuple[dict[int, torch.Tensor], set[int], dict[int, str]]:
        lost: set[int] = set()
        for peer, handle in self.handles:
            if peer in self.gone:
                continue  # its other operation failed already
            try:
                self.group.wait(handle)
            except MessageLost:
                lost.add(peer)
            except CommError as e:
                self.gone[peer] = str(e)
        arrived = {p: b for p, b in self.inbox.items() if p not in lost and p not in self.gone}
        return arrived, lost, self.gone


def exchange_compressed(
    comm: Comm,
    tensor: torch.Tensor,
    codec: Codec,
    key: str,
    send_to: Sequence[int],
    receive_from: Sequence[int],
    *,
    shapes: Sequence[Sequence[int]] | None = None,
    tag: int = 0,
) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """One exchange of a compressed tensor: encode it once (a frame per tensor of `shapes`), send the frames to
    every rank in `send_to` and receive a worker's frames from every rank in `receive_from`, all at once (no
    order to deadlock on). Frames go without a length prefix, so the codec must have `fixed_size` frames.
    Returns what the receivers decode of this worker's tensor and {rank: decoded tensor}."""
    flat = tensor.reshape(-1)
    shapes = frame_shapes(codec, tensor, shapes)
    size = sum(codec.encoded_size(shape, tensor.dtype) for shape in shapes)
    payload, sent = encode_parts(codec, flat, key, shapes)
    payload = payload.to(comm.device)
    inbox = {peer: torch.empty(size, dtype=torch.uint8, device=comm.device) for peer in receive_from}
    handles = [comm.irecv(buffer, peer, tag) for peer, buffer in inbox.items()]
    with comm.counter.dense_equivalent(FP32_BYTES * tensor.numel() * len(send_to)):
        handles += [comm.isend(payload, peer, tag) for peer in send_to]
    for handle in handles:
        handle.wait()
    received = {peer: decode_parts(codec, buffer, len(shapes)).view_as(tensor) for peer, buffer in inbox.items()}
    return sent.view_as(tensor), {peer: theirs.to(tensor.device) for peer, theirs in received.items()}


def compressed_allreduce(
    comm: Comm,
    tensor: torch.Tensor,
    codec: Codec,
    key: str,
    weights: dict[int, float],
    self_weight: float,
    *,
    shapes: Sequence[Sequence[int]] | None = None,
    tag: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The neighbour all-reduce of a compressed tensor with every neighbour in `weights`, both ways: returns what
    the neighbours decode of this worker's tensor, and self_weight · that + Σ_j w_j · (what j sent, decoded)."""
    peers = list(weights)
    mine, theirs = exchange_compressed(comm, tensor, codec, key, peers, peers, shapes=shapes, tag=tag)
    return mine, combine(mine, theirs, weights, self_weight)
