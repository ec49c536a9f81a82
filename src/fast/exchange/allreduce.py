"""Sums of encoded tensors over a `Comm`: every worker gets the sum of what each worker's codec made of its own.

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
A worker may sit a sum out: its `count` is 0 (no data), or NONFINITE (its gradients were not finite). It sends
zeros, or an empty payload (one byte for NONFINITE), and its codec state stays as it was; the sum's count says
how many workers contributed, plus NONFINITE for each that was not finite, so that every worker knows.

Bytes: `comm` counts what really crosses it: frames, their length prefixes, the padding of a gather. Each
exchange also declares the same messages in dense fp32 (`ByteCounter.dense_equivalent`), which makes
`bytes_sent_uncompressed`: the same collective over the tensor and its count as fp32 values, or for
point-to-point the tensor as fp32, once per destination.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from fast.codecs import Codec, ErrorFeedback, build_codec
from fast.codecs.parts import decode_parts, encode_parts, frame_shapes, packed_shapes
from fast.codecs.powersgd import PowerSGD, matrix_shape
from fast.comm import timeline, timing
from fast.comm.arrivals import Ticket
from fast.comm.comm import Comm
from fast.comm.waiting import waiting
from fast.flags import zero_where

NONFINITE = 4096.0  # the count of a worker whose values were not finite: more than any run's workers, exact in fp32

FP32_BYTES = 4


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


Contributors = int | torch.Tensor  # how many workers contributed to a sum: a number, or a one-element device tensor


def divide(total: torch.Tensor, contributors: Contributors) -> torch.Tensor:
    """`total` divided in place by the number of contributors (at least 1), a number or a device tensor (not read)."""
    if isinstance(contributors, torch.Tensor):
        return total.div_(contributors.reshape(-1)[:1].clamp_min(1.0))
    return total.div_(max(1, contributors))


class PendingSum:
    """A compressed sum under way: `wait()` completes it and returns how many workers contributed (a device tensor
    for the sums that run on the caller's thread: nothing is read back to the host)."""

    def __init__(self, finish: Callable[[], Contributors]) -> None:
        self._finish = finish
        self._contributors: Contributors | None = None

    def wait(self) -> Contributors:
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
            self.comm = comm.separate_group()
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
        one-element tensor, 1 if this worker contributes, 0 if it sits out and NONFINITE if its values were not
        finite; it is replaced by the number of workers that contributed plus NONFINITE for each that was not.
        """
        if self.codec.summable:
            return self._sum_cast(tensor, key, count)
        exchange = self._sum_low_rank if self.inner.low_rank else self._sum_gathered

        def job() -> int:  # (in the background, the flag is read on the exchange's own thread)
            flag = 1.0 if count is None else float(count.reshape(-1)[0])
            return exchange(tensor, key, shapes, count, flag)

        if self._executor is None:
            contributors = job()
            return PendingSum(lambda: contributors)
        context = self.comm.counter.context()  # the thread counts traffic as this caller would
        # every member starts its exchanges in the same order: the last one's start is when the peers were all there
        ticket = timeline.ticket(f"{self.comm.key}:background", issue=True)
        future = self._executor.submit(self._entered, context, job)
        return PendingSum(lambda: _waited_for(future.result, ticket))

    def sum(self, tensor: torch.Tensor, key: str, *, shapes: Sequence[Sequence[int]] | None = None) -> Contributors:
        """`start(...).wait()`: `tensor` becomes the sum; returns the number of contributors."""
        return self.start(tensor, key, shapes=shapes).wait()

    def average(self, tensor: torch.Tensor, key: str, *, shapes: Sequence[Sequence[int]] | None = None) -> None:
        """`tensor` becomes the mean over the group of what each worker's codec made of its own."""
        divide(tensor, self.sum(tensor, key, shapes=shapes))

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
    def _sum_cast(self, tensor: torch.Tensor, key: str, count: torch.Tensor | None) -> PendingSum:
        """Summable codecs: one native asynchronous all-reduce in the wire dtype, the count as its last value (in
        fp16 or bf16 a sum with NONFINITE in it rounds, but never below NONFINITE). A worker whose count is not 1
        sends zeros and keeps its codec's memory, decided on the device: nothing is read back."""
        flat = tensor.reshape(-1)
        raw = self.codec.sends_raw(tuple(flat.shape))
        wire_dtype = flat.dtype if raw else self.inner.wire_dtype(flat.dtype)
        wire = torch.empty(flat.numel() + 1, dtype=wire_dtype, device=flat.device)
        absent = None if count is None else count.reshape(-1)[:1] != 1.0
        if absent is not None:
            zero_where(flat, absent)  # (then the memory is compensated by zeros: it stays as it was)
        values = self.memory.compensate(key, flat) if self.memory is not None else flat
        wire[:-1].copy_(values)
        if self.memory is not None:
            if absent is not None:  # (its residual, compensated by zeros, is not sent)
                zero_where(wire[:-1], absent)
            self.memory.update(key, values, wire[:-1].to(values.dtype))
        if count is None:
            wire[-1] = 1.0
        else:
            wire[-1:].copy_(count.reshape(-1)[:1])
        with self.comm.counter.dense_equivalent(dense_all_reduce_bytes(self.comm, wire.numel())):
            handle = self.comm.all_reduce(wire, async_op=True)

        def finish() -> torch.Tensor:
            handle.wait()
            tensor.copy_(wire[:-1].view_as(tensor))
            total = wire[-1:].float()
            if count is not None:
                count.copy_(total.view_as(count))
            return total

        return PendingSum(finish)

    def _sum_gathered(
        self,
        tensor: torch.Tensor,
        key: str,
        shapes: Sequence[Sequence[int]] | None,
        count: torch.Tensor | None,
        flag: float,
    ) -> int:
        """Other codecs: all-gather every worker's frames (none from one that sits out, a byte from one that was
        not finite), decode, add in order."""
        flat = tensor.reshape(-1)
        shapes = frame_shapes(self.codec, tensor, shapes)
        payload, mine = torch.zeros(int(flag == NONFINITE), dtype=torch.uint8), None
        if flag == 1.0:
            payload, mine = encode_parts(self.codec, flat, key, shapes)
        with self.comm.counter.dense_equivalent(dense_all_gather_bytes(self.comm, flat.numel() + 1)):
            payloads = self.comm.all_gather_bytes(payload.to(self.comm.device))
        total = torch.zeros_like(flat)
        contributors = 0
        for index, theirs in enumerate(payloads):
            if theirs.numel() <= 1:  # sat out; one byte: was not finite (a frame is longer)
                contributors += int(NONFINITE) * theirs.numel()
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
        flag: float,
    ) -> int:
        """PowerSGD (Vogels et al. 2019, Algorithm 1): all-reduce P (with the raw tensors), then Q."""
        contributes = flag == 1.0
        powersgd: PowerSGD = self.inner  # type: ignore[assignment]
        flat = tensor.reshape(-1)
        shapes, sizes = packed_shapes(tensor, shapes)
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
        counted = torch.full((1,), flag, device=flat.device)
        first = torch.cat([p_local[i].reshape(-1) for i in low_rank] + [parts[i].float() for i in raw] + [counted])
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


def _waited_for(result: Callable[[], int], ticket: Ticket | None) -> int:
    """A background exchange's result; the time it takes to come is the caller's wait on communication (its time
    shares), not work of its own: until the last member started the exchange, waiting for peers (`ticket`)."""
    with waiting():  # (the times split into waiting for peers lie inside the trace's wait span)
        started = timing.wall()
        contributors = result()
        timeline.waited(ticket, started, timing.wall())
    return contributors


def _counted(total: torch.Tensor | int, count: torch.Tensor | None) -> int:
    contributors = round(float(total))
    if count is not None:
        count.fill_(contributors)
    return contributors
