"""The strategy's hooks around each of the user's steps, run from hooks on the user's own model and optimizer.

    forward (the first of a step)     machine.before_step, strategy.before_step   (e.g. gossip posts its exchange),
                                      machine.compute (the simulated engine's compute)
    end of loss.backward()            gradients checked, strategy.after_backward  (e.g. sync waits for its buckets)
    optimizer.step() begins           a step whose gradients were not finite is skipped (under `sync`, on every
                                      worker when one worker's were not); gradients clipped
    optimizer.step() ends             strategy.after_optimizer_step, then the job's bookkeeping

Nothing here reads a tensor's value back to the host: on a GPU the host runs ahead of the device, and a read
would make it wait for the device to drain. Whether a step's gradients were finite is a flag on the device; a
step to skip is skipped there: an optimizer that takes GradScaler's `found_inf` (fused Adam, AdamW, SGD) skips it
exactly, any other steps with zero gradients (its momentum and weight decay still move the weights a little; no
NaN or Inf ever reaches them). The job reads the flags at the boundaries the user asked for (fast.runtime.bad_steps).

So the user keeps their loop (forward, backward, optimizer.step, zero_grad) and the objects they passed in: the
model and optimizer are the user's own, with hooks added. The hooks are plain functions, so a copy of the model
(`copy.deepcopy`, as strategies take to evaluate an average) carries them without the job; they ignore it.
Inside `no_sync()` (gradient accumulation), or after a forward while the model's `require_backward_grad_sync` is
False (DDP's flag, read at each forward as DDP does), a backward only accumulates: the strategy runs at the last one.

A sharded replica's process (`run.shards` > 1, fast.shards) attaches with its `replica`: the hooks are on the user's
FSDP2 model and optimizer, and the strategy and the checks see the local shards (`replica.view`), whose gradients
cross the bridge around `after_backward`. FSDP2 gives a sharded parameter its gradient without autograd's
accumulation hooks, so the strategy runs when `optimizer.step()` begins (sync's buckets then do not overlap the
backward). A shard's non-finite gradients are its whole replica's: the replica agrees on one device flag, so that all
of its shards skip the step or none, and a strategy that checks its own gradients finds them on every shard. Clipping
takes the global norm over the model's sharded parameters; inside `no_sync()` FSDP2 keeps its gradients unreduced.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import nn

from fast.comm import timeline
from fast.errors import CommError, first_line
from fast.flags import Flag, either, zero_where
from fast.shards import ShardedReplica
from fast.shards.local import local_tensor
from fast.strategies import Strategy


def nonfinite(grads: list[torch.Tensor]) -> Flag:
    """Whether some gradient has a NaN or an infinity, as a flag on the gradients' device (not read). The extremes
    of a tensor are NaN or infinite exactly when some element is: on a GPU, the largest magnitudes (one multi-tensor
    kernel), on the CPU min and max (aminmax, several times faster there than isfinite(g).all())."""
    grads = [g for g in grads if g.numel()]
    if not grads:
        return False
    if grads[0].is_cuda:
        extremes = list(torch._foreach_norm(grads, math.inf))
    else:
        extremes = [torch.stack(torch.aminmax(g)) for g in grads]
    return ~torch.isfinite(torch.cat([e.float().reshape(-1) for e in extremes])).all()


def _mark_nonfinite(grads: list[torch.Tensor], flag: torch.Tensor) -> None:
    """Make `grads` non-finite where the device `flag` is set (a shard whose replica's gradients were not): the first
    element divided by 0 there, by 1 elsewhere."""
    first = next((g for g in grads if g.numel()), None)
    if first is not None:
        first.view(-1)[:1].div_(~flag)


def _batch_size(args: Any, kwargs: dict[str, Any]) -> int:
    """The first dimension of the first tensor a forward is given (a batch's samples), or 0."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    return 0


class StepDriver:
    """Hooks a strategy into one model and one optimizer (`attach`); `on_step_done` is the job's bookkeeping."""

    def __init__(
        self,
        strategy: Strategy,
        machine: Any,
        on_step_done: Callable[[bool], None],
        clip_norm: float | None = None,
        autocast: Any = None,
    ) -> None:
        self.strategy, self.machine, self.on_step_done = strategy, machine, on_step_done
        self.clip_norm, self.autocast = clip_norm, autocast
        self.step = 0  # the step under way (steps done so far)
        self.began = self.backward_done = self.callback_queued = False
        self.bad: Flag = False  # this worker's gradients of the step under way were not finite
        self._folded = False  # a skip is folded into the optimizer's found_inf for its step under way
        self._found_inf: Any = None  # the optimizer's own found_inf (a GradScaler's), kept meanwhile
        self.samples = 0  # the samples the loop passed through the model in training (their first dimension)
        self.loop_skipped = 0  # steps the user's loop skipped (a GradScaler's), counted apart from bad steps
        self.computing = False  # a compute span is open (fast.comm.timeline)
        self.accumulating = self.in_no_sync = False
        self.evaluating = False
        self._casting: Any = None
        self.on_begin: Callable[[], None] | None = None
        self.on_first_batch: Callable[[Any, Any], None] | None = None  # the first training forward's inputs, once
        # live membership: a step whose exchange failed (a peer is gone) is discarded, then this re-forms the group
        self.on_failure: Callable[[CommError], None] | None = None
        # (and a strategy that `agrees_before_step`) after the step's exchange, before its optimizer step: raises
        # CommError unless every member's exchange went through, so that the step is discarded by all or by none
        self.on_exchanged: Callable[[], None] | None = None
        self.failed: CommError | None = None  # the step's exchange failed (live membership): how
        self.replaying = False  # kept gradients go through the optimizer without the step's hooks (`replay`)
        self.model: nn.Module
        self.params: list[nn.Parameter] = []  # what the strategy and the checks see (a sharded replica's local shards)
        self.replica: ShardedReplica | None = None
        self.model_params: list[nn.Parameter] = []  # the model's own (a sharded replica's DTensors)

    # -- attaching --------------------------------------------------------------------------------------------
    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer, replica: ShardedReplica | None = None) -> None:
        """Hook into `model` and `optimizer`; a sharded replica's process gives its `replica` (`model` is then the
        replica's sharded model)."""
        self.model, self.optimizer, self.replica = model, optimizer, replica
        self.model_params = [p for p in model.parameters() if p.requires_grad]
        self.params = [p for p in replica.view.parameters() if p.requires_grad] if replica else self.model_params
        me = weakref.ref(self)
        target = weakref.ref(model)

        def before_forward(module: nn.Module, args: Any, kwargs: Any) -> None:
            driver = me()
            if driver is not None and module is target():
                driver._forward_starts(module, args, kwargs)

        def after_forward(module: nn.Module, args: Any, output: Any) -> None:
            driver = me()
            if driver is not None and module is target() and driver._casting is not None:
                driver._casting.__exit__(None, None, None)
                driver._casting = None

        def gradient_ready(p: torch.Tensor) -> None:
            driver = me()
            if driver is not None:
                driver._gradient_ready()

        def before_optimizer(optimizer: Any, args: Any, kwargs: Any) -> None:
            driver = me()
            if driver is not None and not driver.replaying:
                driver._optimizer_starts()

        def after_optimizer(optimizer: Any, args: Any, kwargs: Any) -> None:
            driver = me()
            if driver is not None and not driver.replaying:
                driver._optimizer_ends()

        def no_sync() -> Any:
            driver = me()
            return driver.no_sync() if driver is not None else nullcontext()

        if not hasattr(model, "no_sync"):  # DDP's spelling of gradient accumulation, for a script that uses it
            model.no_sync = no_sync
        # takes found_inf (GradScaler's); a sharded replica's steps are skipped by zeroing its gradients
        self.fused = bool(getattr(optimizer, "_step_supports_amp_scaling", False)) and replica is None
        self.handles = [
            model.register_forward_pre_hook(before_forward, with_kwargs=True),
            model.register_forward_hook(after_forward),
            optimizer.register_step_pre_hook(before_optimizer),
            optimizer.register_step_post_hook(after_optimizer),
            *(p.register_post_accumulate_grad_hook(gradient_ready) for p in self.model_params),
        ]

    def detach(self) -> None:
        for handle in getattr(self, "handles", []):
            handle.remove()
        self.handles = []

    # -- the step ---------------------------------------------------------------------------------------------
    def _forward_starts(self, module: nn.Module, args: Any = (), kwargs: Any = None) -> None:
        if self.evaluating or not module.training or not torch.is_grad_enabled():
            return
        self.samples += _batch_size(args, kwargs or {})
        if self.on_first_batch is not None:
            hook, self.on_first_batch = self.on_first_batch, None
            hook(args, kwargs)
        if not self.began:
            self.begin()
        elif self.backward_done and not self.accumulating and self._gradients_cleared():
            self._retake()
        self._accumulate(self.in_no_sync or not getattr(module, "require_backward_grad_sync", True))
        if self.autocast is not None:
            self._casting = self.autocast()
            self._casting.__enter__()

    def begin(self, computes: bool = True) -> None:
        if self.on_begin is not None:
            self.on_begin()
        with timeline.span("emulated slowdown", "compute"):  # an emulated machine's slower compute is compute
            self.machine.before_step(self.step)  # emulated crash, straggler pause, slowdown
        with timeline.span("strategy.before_step", "communicate"):
            self.strategy.before_step(self.step)
        if computes:  # a simulated machine's compute, while what the strategy posted travels
            self.machine.compute()
        self.began = True
        timeline.open_span("forward+backward", "compute")
        self.computing = True

    def _gradients_cleared(self) -> bool:
        """Whether the gradients were cleared (zero_grad) since the backward: a loop that skipped its step, not one
        that accumulates into them."""
        return all(p.grad is None or not bool(p.grad.any()) for p in self.params)

    def _retake(self) -> None:
        """A forward after the step's backward, no optimizer.step between and the gradients cleared: the loop
        skipped the step (a GradScaler that found an overflow skips it on every worker). The next backward makes
        the step anew."""
        self.backward_done = self.bad = False
        self.strategy.gradients_were_bad = self.strategy.skips_step = False
        self.loop_skipped += 1
        timeline.open_span("forward+backward", "compute")
        self.computing = True

    def _gradient_ready(self) -> None:
        if self.callback_queued or self.accumulating:
            return
        self.callback_queued = True
        torch.autograd.Variable._execution_engine.queue_callback(self._backward_ends)

    def _backward_ends(self) -> None:
        self.callback_queued = False
        if not self.began:  # a backward without a forward through the prepared model
            self.begin()
        self.gradients_done()

    def gradients_done(self) -> None:
        """The step's gradients are all in: keep a non-finite one from leaving this worker, then the strategy."""
        self._computed()
        replica = self.replica
        if replica is not None:
            replica.gradients_in()
        if replica is not None or not self.strategy.checks_gradients:
            grads = [p.grad for p in self.params if p.grad is not None]
            bad = nonfinite(grads)
            if replica is not None:  # one shard's are its replica's: every shard's flag is the replica's
                bad = replica.any(bad if bad is not False else torch.zeros((), dtype=torch.bool, device=self._device()))
            if self.strategy.checks_gradients:
                _mark_nonfinite(grads, bad)  # (so that the strategy finds its replica's on every shard)
            else:
                self.bad = bad
                if bad is not False and not self.strategy.gradients_stay_local(self.step):
                    for g in grads:  # nothing non-finite leaves the worker
                        zero_where(g, bad)
        with timeline.span("strategy.after_backward", "communicate"):
            try:
                self.strategy.after_backward(self.step)
                if replica is not None and self.on_failure is not None:  # a live run's replica: discarded by all
                    replica.settle()  # shards or none (a shard whose exchange failed leaves this barrier broken)
                if self.on_exchanged is not None:
                    self.on_exchanged()
            except CommError as e:
                if self.on_failure is None:
                    raise
                self.failed = e
                for p in self.params:  # the optimizer leaves parameters without a gradient alone
                    p.grad = None
        if replica is not None:
            replica.gradients_out()
        self.bad = either(self.bad, self.strategy.gradients_were_bad)
        self.backward_done = True

    def _device(self) -> torch.device:
        return self.params[0].device if self.params else torch.device("cpu")

    def _optimizer_starts(self) -> None:
        if not self.began:
            self.begin()
        if not self.backward_done:
            self.gradients_done()
        skips = self.strategy.skips_step
        self._skip_and_clip(skips if self.strategy.averages_gradients else either(self.bad, skips))
        self.strategy.before_optimizer_step()
        timeline.open_span("optimizer", "compute")
        self.computing = True

    def _skip_and_clip(self, skip: Flag) -> None:
        """Before the optimizer's step: skip it where `skip` says, else clip the gradients (run's clip_norm)."""
        if skip is True:  # known on the host (a strategy of the user's own may say so)
            for p in {*self.params, *self.model_params}:  # the optimizer leaves parameters without a gradient alone
                p.grad = None
        elif skip is not False:
            self._skip_on_device(skip)
        if self.clip_norm is not None and skip is not True:  # (a sharded model's: the global norm over its shards)
            torch.nn.utils.clip_grad_norm_(self.model_params, self.clip_norm)

    def replay(self, grads: list[torch.Tensor | None], skip: Flag) -> None:
        """Apply a step's averaged gradients `grads` (one per parameter) as the workers that took the step did: the
        same skip and clipping, then the optimizer's step, without the step's hooks and bookkeeping (a joiner whose
        state came behind steps it sat out, fast.runtime.live)."""
        self.replaying = True
        try:
            for p, g in zip(self.params, grads, strict=True):
                p.grad = g
            self._skip_and_clip(skip)
            self.optimizer.step()
        finally:
            self._restore_found_inf()
            self.replaying = False
            for p in self.params:
                p.grad = None

    def _skip_on_device(self, skip: torch.Tensor) -> None:
        """Skip the step where the device flag `skip` is set, without reading it: an optimizer that takes found_inf
        skips it exactly (as under a GradScaler: its found_inf, if any, is kept, the larger wins); any other steps
        with zero gradients."""
        if self.replica is not None:  # the model's own gradients, where the strategy left them
            for p in self.model_params:
                if p.grad is not None:
                    zero_where(local_tensor(p.grad), skip)
            return
        if not self.fused:
            if self.replaying:  # (the kept gradients, not the strategy's)
                for p in self.params:
                    if p.grad is not None:
                        zero_where(p.grad, skip)
            else:
                self.strategy.zero_gradients_where(skip)
            return
        flag = skip.to(torch.float32).reshape(())  # (the shape of the optimizer's step counts)
        theirs = self.optimizer.__dict__.get("found_inf")
        self._folded, self._found_inf = True, theirs
        self.optimizer.found_inf = flag if theirs is None else torch.maximum(theirs, flag.to(theirs))

    def _computed(self) -> None:
        """The compute span under way (forward and backward, or the optimizer's step) ends."""
        if self.computing:
            timeline.close_span()
            self.computing = False

    def _restore_found_inf(self) -> None:
        if self._folded:  # the optimizer's found_inf as it was (a GradScaler's, or none)
            if self._found_inf is not None:
                self.optimizer.found_inf = self._found_inf
            else:
                self.optimizer.__dict__.pop("found_inf", None)
            self._folded, self._found_inf = False, None

    def _optimizer_ends(self) -> None:
        self._computed()
        self._restore_found_inf()
        if self.failed is not None:  # discarded: the step is taken again over the re-formed group
            failure, self.failed = self.failed, None
            self.began = self.backward_done = self.bad = False
            self.on_failure(failure)
            return
        with timeline.span("strategy.after_optimizer_step", "communicate"):
            round_failure = self._round_failure()
        self.machine.after_step()  # times the step's own work, its communication waits left out
        bad = self.bad
        self.step += 1
        self.began = self.backward_done = self.bad = False
        self.on_step_done(bad)
        if round_failure is not None:
            self.on_failure(round_failure)

    def _round_failure(self) -> CommError | None:
        """The strategy's work after the optimizer's step; how a round's exchange in it failed in a live run (a peer
        is gone: the local step stands, the round is given up), None where it went through."""
        try:
            self.strategy.after_optimizer_step(self.step)
        except CommError as e:
            if self.on_failure is None:
                raise
            return e
        return None

    def null_step(self) -> None:
        """A step without data (a worker that has finished while the others go on): the strategy's exchanges with
        nothing of this worker's in them, so that the others' collectives complete."""
        self.strategy.contributing = False
        try:
            self.begin(computes=False)
            for p in {*self.params, *self.model_params}:
                p.grad = None
            self.gradients_done()
            if self.failed is not None:  # (a live run's) its exchange failed: discarded, as a step with data is
                failure, self.failed = self.failed, None
                self.began = self.backward_done = self.bad = False
                raise CommError(f"a step without data: its exchange failed ({first_line(failure)})")
            round_failure = self._round_failure()  # (the step stands, as a step with data's does)
            self.step += 1
            self.began = self.backward_done = self.bad = False
            if round_failure is not None:
                raise CommError(f"a step without data: its round's exchange failed ({first_line(round_failure)})")
        finally:
            self.strategy.contributing = True

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside only accumulate gradients; the strategy runs at the first one outside."""
        self.in_no_sync = True
        self._accumulate(True)
        if self.replica is not None:  # FSDP2 keeps the gradients unreduced until the backward outside
            self.model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.in_no_sync = False
            self._accumulate(False)
            if self.replica is not None:
                self.model.set_requires_gradient_sync(True)

    def _accumulate(self, accumulating: bool) -> None:
        self.accumulating = self.strategy.accumulating = accumulating

    @contextmanager
    def evaluation(self) -> Iterator[None]:
        """Forward passes inside are not training steps."""
        self.evaluating = True
        try:
            yield
        finally:
            self.evaluating = False
