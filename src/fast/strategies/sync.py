"""`sync`: synchronous data parallelism with averaged gradients, bucketed and overlapped with backward.

Gradients are grouped into buckets in the order backward produces them (last layer first). As soon as
every gradient of a bucket is ready, the bucket's all-reduce starts in the background while backward goes
on with earlier layers; `after_backward` waits for the buckets and writes the averages back. When every
worker of the group is on this machine's CPU (`run.shared_memory`), a bucket is summed through shared memory
instead (fast.comm.shared_memory: no sockets, no helper threads): its gradients are written straight into the
worker's slot, published as soon as the bucket is full, and summed when the worker waits for it. With
`hierarchical = G` a bucket is summed inside groups of G consecutive workers, all-reduced among the group
leaders, then broadcast inside each group (Wongpanich et al. 2020 Sec. 3, Sync Solver).

With a `[codec]`, each bucket is summed through it instead (`fast.exchange.allreduce`: an all-reduce in the
wire dtype for fp16/bf16, two all-reduces for PowerSGD, an all-gather of frames for the others), with the
codec's error feedback kept per bucket, still overlapped with backward. With `momentum_correction` (by
default for every codec but PowerSGD, whose paper applies momentum after the sum), SGD's momentum and weight
decay move from the optimizer to each worker, before compression (fast.strategies.momentum).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from pydantic import Field
from torch import nn

from fast.codecs import Codec
from fast.comm import Comm, Handle
from fast.comm.shared_memory import SumBuffer, sum_buffer
from fast.config import Config
from fast.errors import ConfigError
from fast.exchange.allreduce import NONFINITE, CompressedAllReduce, PendingSum
from fast.flags import zero_where
from fast.perfmodel import Link, StepCost
from fast.perfmodel.step import COLLECTIVE_OPTIONS, collective, with_barrier
from fast.strategies.base import UNTIL_STATE_COMES, Strategy, StrategyOptions
from fast.strategies.momentum import MomentumCorrection


class SyncOptions(StrategyOptions):
    bucket_mb: float = Field(1.0, gt=0, description="size of a gradient bucket in MB (fp32)")
    hierarchical: int = Field(0, ge=0, description="group size G for hierarchical all-reduce; 0 = flat")
    momentum_correction: bool | None = Field(
        None,
        description="with a codec, SGD's momentum on each worker before compression; None: all but powersgd",
    )


class Bucket:
    """A run of parameters whose gradients travel together in one flat buffer.

    The buffer's last element counts the workers that contributed: 1 from each, 0 from a worker without data,
    and NONFINITE from a worker whose gradients in this bucket are not finite, which sends zeros: a NaN or Inf
    never reaches another replica as data, but every worker learns that one was there, and the bucket's
    average is then NaN on every worker. So every worker skips the step, as with DDP (whose all-reduce spreads
    the Inf): a GradScaler on each sees the overflow and backs off, and without one FAST's guard skips it
    (fast.runtime.steps). The averages stay in the buffer: each parameter's `.grad` becomes a view into it
    (DDP's gradient_as_bucket_view), so nothing is copied back. The check, the zeros and the count are made on
    the device, and nothing of them is read back to the host: a GPU never waits on them.
    """

    def __init__(self, params: list[nn.Parameter], zeros: torch.Tensor, summed: SumBuffer | None = None) -> None:
        self.params = params
        size = sum(p.numel() for p in params)
        self.summed = summed  # what sums the buffer across the workers (None: a codec does, from a copy)
        self.buffer = summed.tensor if summed is not None else torch.zeros(size + 1, device=zeros.device)
        self.grads, self.count = self.buffer[:-1], self.buffer[-1:]
        self.zeros = zeros[:size]  # shared by all buckets; never written
        flat = torch.split(self.grads, [p.numel() for p in params])
        self.views = [view.view_as(p) for view, p in zip(flat, params, strict=True)]
        self.ready = 0
        self.handle: Handle | PendingSum | None = None

    def fill(self, contributing: bool = True) -> torch.Tensor:
        """Put this worker's gradients in the buffer; returns the device flag "not finite" (then zeros, counted
        NONFINITE). A worker without data (`contributing` False) puts zeros, counted 0."""
        if not contributing:
            self.buffer.zero_()
            return torch.zeros((), dtype=torch.bool, device=self.buffer.device)
        for p, view in zip(self.params, self.views, strict=True):
            if p.grad is None:
                view.zero_()
            elif p.grad.data_ptr() != view.data_ptr():  # not already the view (zero_grad(set_to_none=False))
                view.copy_(p.grad)
        # x * 0 is NaN exactly when x is NaN or infinite, and a sum of zeros cannot overflow: one pass, no
        # allocation, far cheaper than isfinite().all() and than min and max
        bad = torch.dot(self.grads, self.zeros).isnan()
        zero_where(self.grads, bad)
        self.count.copy_(torch.where(bad, NONFINITE, 1.0))
        return bad

    def average(self) -> torch.Tensor:
        """The sum becomes the average over the workers that contributed; returns the device flag "skip the step"
        (then NaN): a worker's gradients were not finite."""
        skip = self.count >= NONFINITE
        # (a sum of no contributor is zeros: any scale keeps them; one contributor's sum is its average)
        self.grads.mul_(torch.where(skip, math.nan, self.count.clamp_min(1.0).reciprocal()))
        return skip

    def write_back(self) -> None:
        for p, view in zip(self.params, self.views, strict=True):
            p.grad = view


class Sync(Strategy):
    name = "sync"
    Options = SyncOptions
    replicas_differ = False
    averages_gradients = True
    checks_gradients = True  # each bucket, as it leaves
    cost_options = COLLECTIVE_OPTIONS | {"overlap"}
    waits_every_step = True
    reduces_in_shared_memory = True
    joins = True  # at every step (run.membership = "live")
    agrees_before_step = True

    @classmethod
    def accepts_codec(cls, codec: Codec) -> bool:
        return True

    @classmethod
    def cost(cls, n: float, workers: int, link: Link, compute_s: float, options: dict[str, Any]) -> StepCost:
        """An all-reduce every step, behind a barrier (its buckets overlap backward: `overlap`)."""
        return with_barrier(compute_s, *collective(n, workers, link, options), options)

    @classmethod
    def check(cls, options: SyncOptions, config: Config) -> None:
        g = options.hierarchical
        if g and config.run.workers % g:
            raise ConfigError(
                f"`strategy.hierarchical` = {g} does not divide run.workers = {config.run.workers}: "
                f"choose a group size that divides the number of workers"
            )
        if g and config.run.live:
            raise ConfigError(f"`strategy.hierarchical` = {g} with run.membership = 'live': groups of a fixed size "
                              "cannot follow a changing membership; set strategy.hierarchical = 0")  # fmt: skip
        if g and config.codec.name != "none":
            raise ConfigError(
                f"`codec.name` = {config.codec.name!r} with `strategy.hierarchical` = {g}: hierarchical all-reduce "
                "moves dense sums; set strategy.hierarchical = 0 to compress, or codec.name = 'none'"
            )
        if config.codec.name == "dgc" and config.optimizer.momentum > 0:
            raise ConfigError(
                "`codec.name` = 'dgc' with optimizer.momentum > 0: DGC sends momentum-corrected updates "
                "(codec.momentum), so set optimizer.momentum = 0"
            )

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().setup(model, optimizer)
        self.group: Comm | None = None
        self.leaders: Comm | None = None
        g = self.options.hierarchical
        if g and g < self.comm.size:
            ranks = self.comm.ranks
            self.group = self.comm.subgroups([ranks[i : i + g] for i in range(0, len(ranks), g)])
            self.leaders = self.comm.subgroups([ranks[::g]])
        codec = self.make_codec()
        self.buckets = self._make_buckets(self._trainable(), codec is None)
        self.compressed: CompressedAllReduce | None = None
        self.momentum: MomentumCorrection | None = None
        if codec is not None:
            self.compressed = CompressedAllReduce(self.comm, codec, background=True)
            correct = self.options.momentum_correction
            if correct or (correct is None and codec.name != "powersgd"):
                if isinstance(optimizer, torch.optim.SGD) and self.ctx.config.run.shards > 1:
                    raise ConfigError("sync's momentum correction (with a codec) applies SGD's momentum by parameter, "
                                      "and a sharded replica's local shards are not the optimizer's parameters: set "
                                      "strategy.momentum_correction = false, or run.shards = 1")  # fmt: skip
                self.momentum = MomentumCorrection(optimizer)
        self.bucket_of = {p: b for b in self.buckets for p in b.params}
        self.order: list[int] = []  # buckets (indices) in the order this step launched them
        self.bad_buckets: list[torch.Tensor] = []  # this step's, as launched: device flags "not finite"
        self.launched: dict[int, int] = {}  # bucket index -> its place in the last step's order
        for p in self.bucket_of:
            p.register_post_accumulate_grad_hook(self._gradient_ready)

    def _trainable(self) -> list[nn.Parameter]:
        """The parameters the buckets hold, in the model's order: every member's buckets, made at setup or re-made at
        a change of membership, must hold the same parameters at the same places."""
        return [p for p in self.model.parameters() if p.requires_grad]

    def _make_buckets(self, params: list[nn.Parameter], summed: bool) -> list[Bucket]:
        cap = self.options.bucket_mb * 2**20 / 4
        runs, current, size = [], [], 0
        for p in reversed(params):  # backward produces the last layers' gradients first
            current.append(p)
            size += p.numel()
            if size >= cap:
                runs.append(current)
                current, size = [], 0
        if current:
            runs.append(current)
        sizes = [sum(p.numel() for p in run) for run in runs]
        zeros = torch.zeros(max(sizes, default=0), device=self.ctx.device)
        if not summed:
            return [Bucket(run, zeros) for run in runs]
        first_hop = self.group or self.comm
        run = self.ctx.config.run
        # a live run's group changes: sums go through the backend, which a lost peer cannot leave waiting
        summers = [sum_buffer(first_hop, size + 1, run.shared_memory and not run.live) for size in sizes]
        return [Bucket(run, zeros, summer) for run, summer in zip(runs, summers, strict=True)]

    def _gradient_ready(self, p: nn.Parameter) -> None:
        if self.accumulating:
            return
        bucket = self.bucket_of[p]
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            self._launch(bucket)

    def _launch(self, bucket: Bucket) -> None:
        self.order.append(self.buckets.index(bucket))
        bad = bucket.fill(self.contributing)
        self.bad_buckets.append(bad)
        if self.compressed is not None:  # the count of contributing workers travels alongside, uncompressed
            if self.momentum is not None and self.contributing:  # (a bucket that was not finite keeps its velocity)
                self.momentum.apply(bucket.params, bucket.views, bad)
                zero_where(bucket.grads, bad)
            shapes = [p.shape for p in bucket.params]
            key = f"bucket{self.buckets.index(bucket)}"
            bucket.handle = self.compressed.start(bucket.grads, key, shapes=shapes, count=bucket.count)
            return
        bucket.handle = bucket.summed.start()

    def before_step(self, step: int) -> None:
        self.gradients_were_bad = self.skips_step = False
        if self.compressed is not None:
            self.compressed.set_epoch(step // self.ctx.steps_per_epoch)

    def after_backward(self, step: int) -> None:
        # buckets no gradient launched (a parameter without one; a step without data) go in the order the last
        # step launched them, which every worker's collectives must follow
        for index in sorted(range(len(self.buckets)), key=lambda i: self.launched.get(i, i)):
            if self.buckets[index].handle is None:
                self._launch(self.buckets[index])
        self.launched = {index: n for n, index in enumerate(self.order)}
        self.order = []
        skips = []
        for bucket in self.buckets:
            bucket.handle.wait()
            if self.group is not None:
                if self.leaders is not None:
                    self.leaders.all_reduce(bucket.buffer)
                self.group.broadcast(bucket.buffer, src=self.group.ranks[0])
            skips.append(bucket.average())
            bucket.write_back()
            bucket.ready, bucket.handle = 0, None
        # device flags, never read here: the step's guard acts on them on the device (fast.runtime.steps)
        self.gradients_were_bad = torch.stack(self.bad_buckets).any() if self.bad_buckets else False
        self.skips_step = torch.cat(skips).any() if skips else False
        self.bad_buckets = []
        # only a worker without data can find that nobody had any (its own count is 0): it reads the counts, at the
        # run's end (fast.runtime.ending), where a read costs nothing
        self.nobody_contributed = not self.contributing and not float(torch.cat([b.count for b in self.buckets]).sum())

    def zero_gradients_where(self, flag: torch.Tensor) -> None:
        """The gradients are the buckets' buffers: one pass over each."""
        for bucket in self.buckets:
            zero_where(bucket.grads, flag)

    def regroup(self) -> None:
        self.buckets = self._make_buckets(self._trainable(), True)
        self.bad_buckets = []
        self.bucket_of = {p: b for b in self.buckets for p in b.params}
        self.order, self.launched = [], {}

    def abandon(self) -> None:
        for bucket in self.buckets:
            if bucket.handle is not None:
                try:
                    bucket.handle.wait(deadline_s=1.0)
                except Exception:  # the group is broken: what is pending fails or is dropped with it
                    pass
            bucket.ready, bucket.handle = 0, None
        self.order, self.bad_buckets = [], []

    def end_of_run(self) -> None:
        if self.compressed is not None:
            self.compressed.close()

    def sits_out_from(self, step: int, resuming: bool = False) -> int | None:
        """A joiner takes each step's all-reduce without data until its state is in, then applies the averages it
        kept (fast.runtime.live): not with a codec, whose error feedback and momentum are each worker's own."""
        return UNTIL_STATE_COMES if self.compressed is None else None

    def summary(self) -> dict[str, Any]:
        summed = {b.summed.transport for b in self.buckets if b.summed is not None}
        return {"all_reduce": ", ".join(sorted(summed))} if summed else {}

    def state_dict(self) -> dict[str, Any]:
        if self.compressed is None:
            return {}
        state: dict[str, Any] = {"codec": self.compressed.state_dict()}
        if self.momentum is not None:
            index = {p: i for i, p in enumerate(self.model.parameters())}
            state["velocity"] = {index[p]: v.clone() for p, v in self.momentum.velocity.items()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.compressed is not None and "codec" in state:
            self.compressed.load_state_dict(state["codec"])
        if self.momentum is not None and "velocity" in state:
            params = list(self.model.parameters())
            self.momentum.velocity = {params[i]: v.clone() for i, v in state["velocity"].items()}
