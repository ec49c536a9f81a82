"""The strategy interface: lifecycle hooks the worker calls around each step, and the model it reports.

A strategy decides when and what to communicate and how received tensors enter the replica. It moves
tensors only through `self.comm` (the workers' group) or `self.world` (workers and servers), never through
torch.distributed. Subclasses declare their config keys as an `Options` model and override the hooks they
need; the defaults do nothing, so local training with no communication is `Strategy` itself.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any, ClassVar, Literal

import torch
from torch import nn

from fast.codecs import Codec
from fast.comm import tags, timing
from fast.config import Config
from fast.errors import ConfigError
from fast.exchange.allreduce import worker_codec
from fast.flags import zero_where
from fast.perfmodel import Link, StepCost
from fast.strategies.compensation import CompensationOptions, MomentumCompensation
from fast.strategies.context import ModelLayout, StrategyContext, StrategyOptions, pick_replica

__all__ = ["CompensationOptions", "ModelLayout", "Strategy", "StrategyContext", "StrategyOptions"]

UNTIL_STATE_COMES = sys.maxsize  # (sits_out_from) a joiner sits out every step until its state is in


class Strategy:
    """Base strategy: no communication at all (each worker trains alone); the hooks subclasses override.

    A strategy declares everything about itself here, and the job, the config checks and `fast predict` ask it:
    its hooks, its `Options`, which codecs it can apply (`accepts_codec`, by the codec's capabilities), how its
    workers relate (the flags below), the processes it needs (`server_count`) and its cost model (`cost`).
    """

    name: ClassVar[str] = "none"
    Options: ClassVar[type[StrategyOptions]] = StrategyOptions
    replicas_differ: ClassVar[bool] = True  # replicas may differ, so `final_model` chooses what is reported
    collective_eval: ClassVar[bool] = True  # False: during training only rank 0 evaluates, and nobody waits
    # True: after_backward leaves the same averaged gradient on every replica (bad workers excluded), so a
    # worker whose own gradient was not finite still steps, to stay identical to the others
    averages_gradients: ClassVar[bool] = False
    # True: the run goes on when a worker other than rank 0 dies; the strategy drops the peers it finds dead
    # (recording each with `lost`), evaluation during training is rank 0's alone, and the end of the run is
    # point-to-point to rank 0 (fast.runtime.ending) instead of collective
    survives_failures: ClassVar[bool] = False
    # True: a worker may end its training at its own step while the others go on (asynchronous strategies), so
    # `run.max_time` is each worker's own clock; False: the workers move in step and end together
    stops_alone: ClassVar[bool] = False
    # True: the servers write checkpoints of their own (through `ctx.save_checkpoint`, a dict with its "step"),
    # so on resume they take part in choosing the step every process resumes from (fast.runtime.checkpoints)
    server_checkpoints: ClassVar[bool] = False
    # True: the strategy takes live membership changes (`run.membership = "live"`, fast.runtime.live): workers leave and
    # join at its change points, and `regroup` re-makes what it built on the old group; `joins_why` says why not
    joins: ClassVar[bool] = False
    joins_when: ClassVar[str] = "every step"  # when a change may happen (`change_point`), for the reference
    joins_why: ClassVar[str] = "it has not been made to re-form its groups while it runs"
    # True (a strategy whose members apply one averaged step): a live run's members agree, after each step's
    # exchange and before any applies it, that every member's exchange went through (fast.runtime.live)
    agrees_before_step: ClassVar[bool] = False
    # True: its workers never step together, so a live run's members take no membership rounds: each joins on
    # lines of its own to the servers and heals by `catch_up` from them (fast.runtime.detached)
    joins_alone: ClassVar[bool] = False
    # True: it runs on sharded replicas (`run.shards` > 1, fast.shards): on `model`, the replica's local shards as an
    # ordinary module (no forward of its own), and `comm`, shard k of every replica; `shards_why` says why not
    takes_shards: ClassVar[bool] = True
    shards_why: ClassVar[str] = ""
    # what a joiner's catch-up carries besides the weights and the optimizer (`fast predict`): model-sized copies
    # of the strategy's own state (DiLoCo: θ and the outer momentum)
    catch_up_copies: ClassVar[float] = 0.0
    # True: the strategy checks its gradients for NaN/Inf itself (and sets `gradients_were_bad`), so the job does not
    checks_gradients: ClassVar[bool] = False
    tags: ClassVar[tuple[int, ...]] = ()  # the message tags it sends on (checked against FAST's own: fast.comm.tags)
    # the cost model: the options `cost` reads (of the strategy's own, and the predictor's `degree`, `overlap`,
    # `inner_link`), the defaults the predictor fills in, and whether every step waits for every worker (then
    # the slowest sets the pace of each step); `priced` False: no cost model (`cost` is not asked)
    priced: ClassVar[bool] = True
    cost_options: ClassVar[frozenset[str]] = frozenset()
    cost_defaults: ClassVar[dict[str, Any]] = {}
    waits_every_step: ClassVar[bool] = False
    # its exchanges are blocking all-reduces or sync's buckets, which a run on one machine's CPU sums through
    # shared memory (`run.shared_memory`): priced on that link rather than gloo's loopback
    reduces_in_shared_memory: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        tags.check(f"strategy {getattr(cls, 'name', cls.__name__)!r}", cls.tags)
        if "decentralised" in cls.__dict__:  # its old name
            warnings.warn(
                f"{cls.__name__}.decentralised is deprecated: name it replicas_differ", DeprecationWarning, stacklevel=2
            )
            cls.replicas_differ = cls.__dict__["decentralised"]

    # a class that runs a registered strategy under some of its options (EASGD's `variant = "async"`, gossip with
    # a codec): `variant_of` is the registered class, and `chosen_when` says when (fast.strategies.strategy_for)
    variant_of: ClassVar[type[Strategy] | None] = None

    @classmethod
    def chosen_when(cls, options: dict[str, Any], codec: str) -> bool:
        """For a variant: whether it runs the strategy with these options (a dict) and this codec name."""
        return False

    @classmethod
    def accepts_codec(cls, codec: Codec) -> bool:
        """Whether this strategy applies `codec` to what it sends (by its capabilities); the base: dense only."""
        return codec.name == "none"

    @classmethod
    def own_codec(cls, options: StrategyOptions) -> Codec | None:
        """The codec this strategy sends through whatever `[codec]` says (sparseloco, demo), for its cost model and
        its exchanges; None: `[codec]`'s."""
        return None

    @classmethod
    def cost(cls, n: float, workers: int, link: Link, compute_s: float, options: dict[str, Any]) -> StepCost:
        """The predicted step (fast.perfmodel): `n` bytes of one model-sized message, the link, one step's
        compute, and the options named in `cost_options`. The base strategy does not communicate."""
        return StepCost(compute_s, compute_s, 0.0, 0.0)

    def __init__(self, options: StrategyOptions, ctx: StrategyContext) -> None:
        self.options = options
        self.ctx = ctx
        self.comm = ctx.comm
        self.world = ctx.world
        self.staleness: list[int] = []
        self.dead: set[int] = set()  # global ranks this process found dead (survives_failures only)
        self.failures: list[dict[str, Any]] = []
        self.model: nn.Module
        self.optimizer: torch.optim.Optimizer
        self.accumulating = False  # inside job.no_sync(): a backward only accumulates gradients
        self.contributing = True  # False in a step without data (a worker that finished early): send nothing of it
        # set per step by strategies that `checks_gradients`: a bool, or a one-element bool tensor on the device (a
        # flag the step acts on there, never read back: fast.runtime.steps)
        self.gradients_were_bad: bool | torch.Tensor = False
        self.skips_step: bool | torch.Tensor = False  # every worker skips this step: one's gradients were not finite
        self.steps_of_all: int | None = None  # at the end of a lock-step run: the most steps any worker took
        self.nobody_contributed = False  # the last exchange had data from no worker (all have ended): if it knows
        self.compensation: MomentumCompensation | None = None

    def gradients_stay_local(self, step: int) -> bool:
        """Whether this step's gradients never leave the worker: a non-finite one is then left for the user's
        GradScaler to see (which skips the step and backs off), not zeroed; FAST's guard still skips the step if
        the loop steps anyway."""
        return False

    def zero_gradients_where(self, flag: torch.Tensor) -> None:
        """Zero every gradient where the device flag `flag` is set (a step skipped on the device, not read back)."""
        for p in self.model.parameters():
            if p.grad is not None:
                zero_where(p.grad, flag)

    def make_codec(self) -> Codec | None:
        """This worker's codec from `[codec]` (fast.exchange.allreduce.worker_codec), or None for dense."""
        codec = self.ctx.config.codec
        return worker_codec(codec.name, codec.options(), self.ctx.rank) if codec.name != "none" else None

    # -- processes -----------------------------------------------------------------------------------------
    @classmethod
    def server_count(cls, options: StrategyOptions, workers: int) -> int:
        """Processes this strategy needs beyond the workers (parameter servers, masters)."""
        return 0

    @classmethod
    def check(cls, options: StrategyOptions, config: Config) -> None:
        """Raise ConfigError for option combinations that cannot work with this config."""

    @classmethod
    def refuses_shards(cls, options: StrategyOptions, config: Config) -> str | None:
        """Why this strategy cannot run with these options on sharded replicas (`run.shards` > 1), or None."""
        return None if cls.takes_shards else cls.shards_why

    def setup_server(self, layout: ModelLayout) -> None:
        """Called once on a server process before the common start barrier (create the same process groups
        as the workers' `setup`, in the same order); `serve` follows the barrier."""

    def serve(self) -> None:
        """The loop of a server process (rank >= workers); only strategies with servers implement it."""
        raise NotImplementedError(f"strategy {self.name} has no server processes")

    # -- lifecycle hooks --------------------------------------------------------------------------------------
    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Called once before training: every worker starts from rank 0's weights."""
        self.model, self.optimizer = model, optimizer
        if getattr(self.options, "momentum_compensation", False):
            self.compensation = MomentumCompensation(optimizer)
        if self.ctx.config.run.live:  # a live membership heals every member from member 0 instead
            return
        with self.comm.unmetered():
            for tensor in model.state_dict().values():
                if tensor.is_floating_point() or tensor.dtype in (torch.int64, torch.int32):
                    self.comm.broadcast(tensor.data, src=self.comm.ranks[0])

    def before_step(self, step: int) -> None:
        """Before the forward pass of global step `step` (0-based, counted per worker)."""

    def after_backward(self, step: int) -> None:
        """Gradients are in `p.grad`; the optimizer has not stepped yet."""

    def after_optimizer_step(self, step: int) -> None:
        """The optimizer has updated the replica."""

    def before_optimizer_step(self) -> None:
        """The job calls it before each optimizer step: asynchrony-aware momentum, where the options ask for it."""
        if self.compensation is not None:
            self.compensation.update(self.staleness)

    def end_of_run(self) -> None:
        """After the last step, before the final model is chosen (flush, stop threads, tell servers)."""

    def change_point(self, step: int) -> bool:
        """Whether the membership may change before step `step` (0-based): the base, any step."""
        return True

    def sits_out_from(self, step: int, resuming: bool = False) -> int | None:
        """A joiner entering at change point `step` while its state comes in the background sits out steps `step`
        up to the one returned (excluded), taking part in their exchanges without data (fast.runtime.live);
        `UNTIL_STATE_COMES`: every step until its state is in, whose averaged gradients it then applies as the
        others did (a strategy that averages gradients every step); None: a joiner takes its whole state before
        the others go on (the base). `resuming`: a joiner whose state's line a re-form cut, at any step."""
        return None

    def sat_out_to(self, step: int) -> None:
        """A joiner's state is in at `step`, the steps before it sat out (fast.runtime.live): the base, nothing."""

    def kept_by_now(self, step: int) -> int:
        """A count of what a joiner sitting out keeps, on this member at step `step`: one per step (its averaged
        gradients), the base; the periodic family's, one per round's mean that went through here. Between two of a
        member's counts lies what a joiner that sat out from the first to the second kept, if it kept the same."""
        return step

    def shared_state(self) -> Any:
        """What every member of a live membership holds alike at a change point: a member whose copy differs (a
        round that failed on some members and not on others) is healed. Replicas that stay identical: the model
        and optimizer; replicas that differ: the strategy's own state (θ, outer momentum, counters)."""
        if not self.replicas_differ:
            return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
        return {k: v for k, v in self.state_dict().items() if k != "codec"}

    def catch_up(self) -> None:
        """A worker of a strategy that `joins_alone` takes the live state from its servers (a joiner's catch-up)."""
        raise NotImplementedError(f"strategy {self.name} does not join alone")

    def regroup(self) -> None:
        """The membership changed (`self.comm` is the new group's): re-make what was built on the old group."""

    def abandon(self) -> None:
        """A collective of this step failed (a peer is gone): give up what is still pending of the step."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def summary(self) -> dict[str, Any]:
        """Strategy-specific figures added to summary.json."""
        return {}

    def lost(self, peer: int, step: int | None, how: str) -> None:
        """Record that global rank `peer` was found dead, and how; `step` is this process's step when it
        noticed (a server gives the dead worker's last step it applied). Goes to summary.json `failures`."""
        if peer in self.dead:
            return
        self.dead.add(peer)
        self.failures.append(
            {"worker": peer, "step": step, "unix_time": timing.wall(), "how": how, "noticed_by": self.ctx.rank}
        )
        self.ctx.log(f"worker {self.ctx.rank}: worker {peer} is gone ({how}); going on without it")

    def score(self, model: nn.Module) -> float:
        """A replica's validation score for `final_model = "best"`."""
        if self.ctx.score is None:
            raise ConfigError(
                '`strategy.final_model` = "best" needs a validation score: call job.validate_with(fn), fn(model) -> '
                'a number, higher is better (fast train scores on 1,000 training samples), or choose "average"'
            )
        return float(self.ctx.score(model))

    # -- the reported model -----------------------------------------------------------------------------------
    def flat_parameters(self, model: nn.Module | None = None) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in (model or self.model).parameters()])

    def average_model(self) -> nn.Module:
        """A copy of the replica holding the average of all workers' weights (measurement-only traffic)."""
        import copy

        average = copy.deepcopy(self.model)
        with self.comm.unmetered(), torch.no_grad():
            for tensor in average.state_dict().values():
                if tensor.is_floating_point():
                    self.comm.all_reduce(tensor, op="mean")
        return average

    def divergence(self) -> float:
        """Mean over workers of ||w_i - w_mean|| / ||w_mean|| (measurement only; collective)."""
        with self.comm.unmetered(), torch.no_grad():
            mine = self.flat_parameters()
            mean = mine.clone()
            self.comm.all_reduce(mean, op="mean")
            ratio = torch.tensor([float((mine - mean).norm() / mean.norm().clamp_min(1e-12))])
            self.comm.all_reduce(ratio, op="mean")
        return float(ratio.item())

    def eval_model(self) -> nn.Module:
        """The model evaluated during training: collective unless `collective_eval` is False, in which case
        only rank 0 calls it (default: its own replica) so that asynchronous workers never wait."""
        return self.final_model() if self.collective_eval else self.model

    def final_model(self, choice: Literal["average", "best"] | str | None = None) -> nn.Module:
        """The model the run reports (collective). Synchronous strategies return the replica itself."""
        if not self.replicas_differ:
            return self.model

        def scores() -> list[float]:
            return [float(s) for s in self.comm.all_gather(torch.tensor([self.score(self.model)]))]

        src = pick_replica(choice or self.options.final_model, self.comm.ranks, self.comm.size, scores)
        if src is None:
            return self.average_model()
        import copy

        chosen = copy.deepcopy(self.model)
        with self.comm.unmetered():
            for tensor in chosen.state_dict().values():
                self.comm.broadcast(tensor.data, src=src)
        return chosen
