"""Codec-aware operations on a `Comm`: sums, messages and neighbour exchanges of encoded tensors; CHOCO gossip.

How a compressed sum travels depends on the codec (`fast.codecs`):

- summable codecs (none, fp16, bf16): the values, cast to the codec's wire dtype, are all-reduced;
- PowerSGD: P = M Q is all-reduced, orthonormalised, then Q = M^T P is all-reduced (the tensors PowerSGD
  leaves raw, such as biases, travel in fp32 with P); every worker then holds P (sum of Q)^T;
- every other codec: each worker's frames are all-gathered, and every worker decodes all of them and adds
  them up in group order, so that every worker gets the same bits (top-k exchanges values and indices).

A flat tensor that packs several (`shapes`) is encoded a frame per tensor, so that scales, norms and
low-rank factors are per tensor; sparsifiers instead select over the whole flat tensor (a global top-k),
which lets the tensors with the largest values take more of the budget.

Error feedback (an ErrorFeedback codec) keeps at each worker what its codec did not send of each tensor key.
A worker may sit a sum out (its `count` is 0, e.g. its gradients were not finite): it sends zeros, or an
empty payload, and its codec state stays as it was; the sum says how many workers contributed.

Bytes: `comm` counts what really crosses it: frames, their length prefixes, the padding of a gather. Each
exchange also declares the same messages in dense fp32 (`ByteCounter.dense_equivalent`), which makes
`bytes_sent_uncompressed`: the same collective over the tensor and its count as fp32 values, or for
point-to-point the tensor as fp32, once per destination.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from fast.codecs import DGC, Codec, ErrorFeedback, PowerSGD, RandomK, Threshold, TopK, build_codec
from fast.codecs.frame import CHECKSUM_BYTES, header_size
from fast.codecs.powersgd import matrix_shape
from fast.comm.comm import Comm, Handle
from fast.errors import FrameError

FP32_BYTES = 4
SPARSIFIERS = (TopK, RandomK, Threshold, DGC)  # they select elements over a whole flat tensor
NDIM_OFFSET = 7  # a frame's ndim byte; its header ends with the body's length (uint64), see fast.codecs.frame


def dense_all_reduce_bytes(comm: Comm, numel: int) -> int:
    """What `comm` counts for one worker's part in an all-reduce of `numel` fp32 values (its ring share)."""
    return round(FP32_BYTES * numel * 2 * (comm.size - 1) / comm.size)


def dense_all_gather_bytes(comm: Comm, numel: int) -> int:
    """What `comm` counts for one worker's part in an all-gather of `numel` fp32 values."""
    return FP32_BYTES * numel * (comm.size - 1)


def base_codec(codec: Codec) -> Codec:
    """The codec inside an ErrorFeedback wrapper, or `codec` itself."""
    return codec.codec if isinstance(codec, ErrorFeedback) else codec


def worker_codec(name: str, options: dict[str, Any], rank: int) -> Codec:
    """The codec `[codec]` configures, built for worker `rank`.

    Stochastic codecs (qsgd, terngrad, randomk) draw independent random streams on each worker, seeded with
    (seed, rank), so that their rounding errors do not line up across workers; PowerSGD keeps the common
    seed, since every worker must start from the same Q.
    """
    options = dict(options)
    if name != "powersgd":
        options["seed"] = options.get("seed", 0) * 1_000_003 + rank
    return build_codec(name, **options)


class PendingSum:
    """A compressed sum under way: `wait()` completes it and returns how many workers contributed."""

    def __init__(self, finish: Callable[[], int]) -> None:
        self._finish = finish
        self._contributors: int | None = None

    def wait(self) -> int:
        if self._contributors is None:
            self._contributors = self._finish()
        return self._contributors


class CompressedAllReduce:
    """Sums tensors across `comm` through `codec`, which keeps its state (error feedback, warm starts) per key.

    With `background=True`, the exchanges of codecs that are not summable run in the order they were started
    on a thread of their own, over a channel of their own, so that they overlap the caller's computation as
    the native asynchronous all-reduce of summable codecs does. The channel is created here, so every member
    of `comm` must construct its CompressedAllReduce at the same point. `close()` stops the thread.
    """

    def __init__(self, comm: Comm, codec: Codec, *, background: bool = False) -> None:
        self.comm, self.codec = comm, codec
        self.memory = codec if isinstance(codec, ErrorFeedback) else None
        self.inner = base_codec(codec)
        self._executor: ThreadPoolExecutor | None = None
        if background and not codec.summable:
            self.comm = comm.channel()
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="fast-compressed")

    def start(
        self,
        tensor: torch.Tensor,
        key: str,
        *,
        shapes: Sequence[Sequence[int]] | None = None,
        count: torch.Tensor | None = None,
    ) -> PendingSum:
        """Begin replacing `tensor` by the sum over the group of what each worker's codec made of its own.

        `key` names the tensor for the codec's state (use the same key for the same tensor every time).
        `shapes` splits a flat `tensor` into the tensors it packs (see the module docstring). `count` is a
        one-element tensor, 1 if this worker contributes and 0 if it sits out; it is replaced by the number
        of workers that contributed.
        """
        contributes = count is None or float(count.reshape(-1)[0]) > 0
        if self.codec.summable:
            return self._sum_cast(tensor, key, count, contributes)
        exchange = self._sum_low_rank if isinstance(self.inner, PowerSGD) else self._sum_gathered

        def job() -> int:
            return exchange(tensor, key, shapes, count, contributes)

        if self._executor is None:
            contributors = job()
            return PendingSum(lambda: contributors)
        context = self.comm.counter.context()  # the thread counts traffic as this caller would
        future = self._executor.submit(self._entered, context, job)
        return PendingSum(future.result)

    def sum(self, tensor: torch.Tensor, key: str, *, shapes: Sequence[Sequence[int]] | None = None) -> int:
        """`start(...).wait()`: `tensor` becomes the sum; returns the number of contributors."""
        return self.start(tensor, key, shapes=shapes).wait()

    def average(self, tensor: torch.Tensor, key: str, *, shapes: Sequence[Sequence[int]] | None = None) -> None:
        """`tensor` becomes the mean over the group of what each worker's codec made of its own."""
        tensor.div_(self.sum(tensor, key, shapes=shapes))

    def set_epoch(self, epoch: int) -> None:
        """Tell a codec with a schedule over epochs (DGC's sparsity warm-up) which epoch is starting."""
        if hasattr(self.inner, "set_epoch"):
            self.inner.set_epoch(epoch)

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)

    def state_dict(self) -> dict[str, Any]:
        return {"codec": self.codec.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.codec.load_state_dict(state["codec"])

    # -- the three ways a sum travels -----------------------------------------------------------------------
    def _sum_cast(self, tensor: torch.Tensor, key: str, count: torch.Tensor | None, contributes: bool) -> PendingSum:
        """Summable codecs: one native asynchronous all-reduce in the wire dtype, the count as its last value."""
        flat = tensor.reshape(-1)
        raw = self.codec.sends_raw(tuple(flat.shape))
        wire_dtype = flat.dtype if raw else self.inner.wire_dtype(flat.dtype)
        wire = torch.zeros(flat.numel() + 1, dtype=wire_dtype, device=flat.device)
        if contributes:
            values = self.memory.compensate(key, flat) if self.memory is not None else flat
            wire[:-1].copy_(values)
            if self.memory is not None:
                self.memory.update(key, values, wire[:-1].to(values.dtype))
            wire[-1] = 1
        with self.comm.counter.dense_equivalent(dense_all_reduce_bytes(self.comm, wire.numel())):
            handle = self.comm.all_reduce(wire, async_op=True)

        def finish() -> int:
            handle.wait()
            tensor.copy_(wire[:-1].view_as(tensor))
            return _counted(wire[-1], count)

        return PendingSum(finish)

    def _sum_gathered(
        self,
        tensor: torch.Tensor,
        key: str,
        shapes: Sequence[Sequence[int]] | None,
        count: torch.Tensor | None,
        contributes: bool,
    ) -> int:
        """Other codecs: all-gather every worker's frames (none from one that sits out), decode, add in order."""
        flat = tensor.reshape(-1)
        shapes = frame_shapes(self.codec, tensor, shapes)
        payload, mine = torch.empty(0, dtype=torch.uint8), None
        if contributes:
            payload, mine = encode_parts(self.codec, flat, key, shapes)
        with self.comm.counter.dense_equivalent(dense_all_gather_bytes(self.comm, flat.numel() + 1)):
            payloads = self.comm.all_gather_bytes(payload.to(self.comm.device))
        total = torch.zeros_like(flat)
        contributors = 0
        for index, theirs in enumerate(payloads):
            if theirs.numel() == 0:
                continue
            if index == self.comm.index():
                total += mine
            else:
                total += decode_parts(self.codec, theirs, len(shapes)).to(flat.device)
            contributors += 1
        tensor.copy_(total.view_as(tensor))
        return _counted(contributors, count)

    def _sum_low_rank(
        self,
        tensor: torch.Tensor,
        key: str,
        shapes: Sequence[Sequence[int]] | None,
        count: torch.Tensor | None,
        contributes: bool,
    ) -> int:
        """PowerSGD (Vogels et al. 2019, Algorithm 1): all-reduce P (with the raw tensors), then Q."""
        powersgd: PowerSGD = self.inner  # type: ignore[assignment]
        flat = tensor.reshape(-1)
        shapes, sizes = _parts(tensor, shapes)
        if not contributes:
            values = torch.zeros_like(flat)
        else:
            values = self.memory.compensate(key, flat) if self.memory is not None else flat
        parts = values.split(sizes)
        low_rank = [i for i, shape in enumerate(shapes) if not powersgd.sends_raw(shape)]
        raw = [i for i in range(len(shapes)) if i not in low_rank]
        matrices = {i: parts[i].reshape(matrix_shape(shapes[i])) for i in low_rank}
        keys = {i: f"{key}.{i}" for i in low_rank}
        p_local = {i: powersgd.compute_p(keys[i], matrices[i]) for i in low_rank}
        p_numel = sum(p.numel() for p in p_local.values())
        flag = torch.full((1,), float(contributes), device=flat.device)
        first = torch.cat([p_local[i].reshape(-1) for i in low_rank] + [parts[i].float() for i in raw] + [flag])
        second = torch.zeros(0, device=flat.device)
        with self.comm.counter.dense_equivalent(dense_all_reduce_bytes(self.comm, flat.numel() + 1)):
            self.comm.all_reduce(first)
            p_sums = first[:p_numel].split([p_local[i].numel() for i in low_rank])
            factors = {
                i: powersgd.compute_q(keys[i], matrices[i], p_sum.view_as(p_local[i]))
                for i, p_sum in zip(low_rank, p_sums, strict=True)
            }
            if low_rank:  # every worker packs the same shapes, so all agree whether this round happens
                second = torch.cat([factors[i][1].reshape(-1) for i in low_rank])
                self.comm.all_reduce(second)
        q_sums = second.split([factors[i][1].numel() for i in low_rank])
        total = torch.empty_like(flat)
        total_parts = total.split(sizes)
        for i, q_sum in zip(low_rank, q_sums, strict=True):
            p, q = factors[i]
            total_parts[i].copy_(powersgd.decompress(keys[i], p, q_sum.view_as(q)).reshape(-1))
        raw_sums = first[p_numel:-1].split([sizes[i] for i in raw])
        for i, raw_sum in zip(raw, raw_sums, strict=True):
            total_parts[i].copy_(raw_sum)
        if contributes and self.memory is not None:  # what the others got of this worker's values: P Q_mine^T
            sent = values.clone()
            sent_parts = sent.split(sizes)
            for i in low_rank:
                p, q = factors[i]
                sent_parts[i].copy_((p @ q.T).reshape(-1))
            self.memory.update(key, values, sent)
        tensor.copy_(total.view_as(tensor))
        return _counted(first[-1], count)

    def _entered(self, context: tuple[int, int], job: Callable[[], int]) -> int:
        with self.comm.counter.entered(context):
            return job()


def _parts(tensor: torch.Tensor, shapes: Sequence[Sequence[int]] | None) -> tuple[list[tuple[int, ...]], list[int]]:
    """The shapes a flat `tensor` packs (just its own shape without `shapes`) and their element counts."""
    shapes = [tuple(tensor.shape)] if shapes is None else [tuple(shape) for shape in shapes]
    sizes = [math.prod(shape) for shape in shapes]
    if sum(sizes) != tensor.numel():
        raise ValueError(f"shapes {shapes} hold {sum(sizes)} elements, the tensor {tensor.numel()}")
    return shapes, sizes


def frame_shapes(codec: Codec, tensor: torch.Tensor, shapes: Sequence[Sequence[int]] | None) -> list[tuple[int, ...]]:
    """The shapes of the frames `tensor` is encoded in: one per tensor of `shapes`, or the flat tensor whole
    for sparsifiers (and when `shapes` is not given)."""
    if isinstance(base_codec(codec), SPARSIFIERS):
        return [(tensor.numel(),)] if shapes is not None else [tuple(tensor.shape)]
    return _parts(tensor, shapes)[0]


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


def _counted(total: torch.Tensor | int, count: torch.Tensor | None) -> int:
    contributors = round(float(total))
    if count is not None:
        count.fill_(contributors)
    return contributors


# -- point to point ---------------------------------------------------------------------------------------
def send_compressed(
    comm: Comm, tensor: torch.Tensor, dst: int, codec: Codec, key: str = "", *, tag: int = 0, droppable: bool = False
) -> None:
    """Encode `tensor` (a step of the codec's state for `key`) and send its frame to `dst` (length-prefixed)."""
    send_frame(comm, codec.encode(tensor, key), tensor.numel(), dst, tag=tag, droppable=droppable)


def send_frame(comm: Comm, frame: torch.Tensor, numel: int, dst: int, *, tag: int = 0, droppable: bool = False) -> None:
    """Send an already encoded frame of a `numel`-element tensor (to send one encoding to several peers)."""
    with comm.counter.dense_equivalent(FP32_BYTES * numel):
        comm.send_bytes(frame.to(comm.device), dst, tag, droppable)


def recv_compressed(comm: Comm, codec: Codec, src: int | None = None, *, tag: int = 0) -> tuple[int, torch.Tensor]:
    """Receive a frame sent by `send_compressed` (from `src`, or whoever comes first): (sender, decoded tensor)."""
    peer, frame = comm.recv_bytes(src, tag)
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
    """One neighbour exchange: encode `tensor` once (each tensor of `shapes` in a frame of its own), send the
    frames to every rank in `send_to` and receive a worker's frames from every rank in `receive_from`, all
    at once (no order to deadlock on).

    Frames go without a length prefix: the codec must have a fixed frame size for a shape (not `threshold`).
    Returns what the receivers decode of this worker's tensor and {rank: decoded tensor}.
    """
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


# -- compressed gossip ------------------------------------------------------------------------------------
class ChocoGossip:
    """CHOCO-SGD's compressed gossip (Koloskova, Stich and Jaggi 2019, Algorithm 2), for one worker i.

    Every worker keeps a public estimate x̂_j of each neighbour's model, known alike to j and to all of j's
    neighbours because it only ever moves by what j sent. Each round, after the local SGD step:

        q_i = Q(x_i - x̂_i)                              send q_i to the neighbours, receive their q_j
        x̂_j += q_j  for j in N(i) and i itself
        x_i += γ Σ_j w_ij (x̂_j - x̂_i)                   γ: the consensus step size

    Naively compressed weights do not converge; compressed differences to the estimates do, for codecs
    with E‖Q(v) − v‖² < ‖v‖² (top-k, random-k, sign, low rank, casts). As in the paper's memory-efficient
    form, only x̂_i and s_i = Σ_j w_ij x̂_j (j in N(i) and i) are kept, so W must stay fixed. The estimates
    start at the initial model, which every worker has, instead of at zero.
    """

    def __init__(
        self,
        comm: Comm,
        codec: Codec,
        weights: dict[int, float],
        self_weight: float,
        consensus_lr: float,
        initial: torch.Tensor,
        shapes: Sequence[Sequence[int]] | None = None,
    ) -> None:
        self.comm, self.codec = comm, codec
        self.weights, self.self_weight, self.consensus_lr = weights, self_weight, consensus_lr
        self.shapes = shapes
        self.estimate = initial.detach().clone()  # x̂_i
        self.mixed = initial.detach().clone()  # s_i (rows of W sum to 1)

    def step(self, x: torch.Tensor) -> torch.Tensor:
        """One round from x_i (after the SGD step): the exchange, then the consensus step; returns the new x_i."""
        peers = list(self.weights)
        mine, theirs = exchange_compressed(
            self.comm, x - self.estimate, self.codec, "choco", peers, peers, shapes=self.shapes
        )
        self.estimate += mine
        self.mixed.add_(mine, alpha=self.self_weight)
        for peer, q in theirs.items():
            self.mixed.add_(q, alpha=self.weights[peer])
        return x + self.consensus_lr * (self.mixed - self.estimate)

    def state_dict(self) -> dict[str, Any]:
        return {"estimate": self.estimate.clone(), "mixed": self.mixed.clone(), "codec": self.codec.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.estimate.copy_(state["estimate"])
        self.mixed.copy_(state["mixed"])
        self.codec.load_state_dict(state["codec"])
