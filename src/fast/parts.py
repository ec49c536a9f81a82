"""A job resolved once: its config, or its package, made into the parts that FAST's loop and a user's job receive.

    parts = resolve("job.toml", strategy__name="gossip")   # in the launcher, before any process starts

`parts.data`, `parts.model`, `parts.step` and `parts.evaluation` say what the job's code is: the user's own functions
(`[data] factory`, `[model] factory`, `[step] factory`, `[eval] factory`, found and imported here, or Python's
`model_fn` and `step_fn`), a built-in by name, or a packed job's programs; FAST's loop builds them
(fast.jobs.code). `parts.optimizer` is the optimizer and its schedule, `parts.strategy` and `parts.options` the
strategy, `parts.deployment` how many processes run where and how they start, and what else their launcher needs
(a live run's bounds, whether it needs worker 0, its churn). Below this module nobody reads `[data]`, `[model]`,
`[step]`, `[eval]`, `[optimizer]`, `[schedule]`, `[strategy]` or `[package]` again; the runtime reads `[run]`, its
own keys, from `parts.config`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fast.assemble import load_config
from fast.config import Config
from fast.factories import load_factory
from fast.strategies import Strategy, StrategyOptions, strategy_for, strategy_options
from fast.units import parse_duration

ModelFn = Callable[[tuple[int, ...], int], Any]
StepFn = Callable[..., Any]


@dataclass
class UserCode:
    """What a Python user may replace: the model factory and the per-batch step (both picklable)."""

    model_fn: ModelFn | None = None
    step_fn: StepFn | None = None
    # unpickling the class in a worker process imports its module, which registers a strategy defined
    # outside fast.strategies (e.g. in the user's script) there too
    strategy_class: type | None = None

    @property
    def in_python(self) -> bool:
        """Whether it replaces the model or the step: code no other process (a joiner) can start from the config."""
        return self.model_fn is not None or self.step_fn is not None


@dataclass(frozen=True)
class Packed:
    """A packed job, as the owner's config names it: where it is, the key that verified it (fast.archive reads and
    checks it once per process), the bytes one node of its programs may allocate."""

    path: str
    trusted_key: str | None
    node_bytes: int


@dataclass(frozen=True)
class DataPart:
    """Where the samples come from: `factory(**options)`, else the built-in data set `name`; a packed job's data is
    checked against its schema."""

    factory: Callable[..., Any] | None
    options: dict[str, Any]
    name: str
    folder: str | None
    synthetic: tuple[int, int]  # training and test samples of the synthetic data set
    seed: int
    packed: Packed | None
    partition: str  # how the workers' shards are cut: "iid" or "dirichlet" (fast.runtime.sharding)
    alpha: float  # the dirichlet partition's concentration
    loader_workers: int  # DataLoader processes per worker (generic datasets)

    @property
    def key(self) -> str:
        """What makes two processes' data the same (a simulation's workers share one copy)."""
        return repr((self.factory, sorted(self.options.items()), self.name, self.folder, self.synthetic, self.seed,
                     self.packed))  # fmt: skip


@dataclass(frozen=True)
class ModelPart:
    """How the model is built (seeded, the same on every worker): Python's `model_fn`, `factory(**options)`, the
    built-in `name`, or the package's programs."""

    function: ModelFn | None
    factory: Callable[..., Any] | None
    options: dict[str, Any]
    name: str
    seed: int
    packed: Packed | None


@dataclass(frozen=True)
class StepPart:
    """The loss of one batch: `function(model, *batch, **options)` (Python's step_fn, `step.factory`'s), cross-entropy
    when there is none, or the package's training program."""

    function: StepFn | None
    options: dict[str, Any]
    from_factory: bool  # its first result is checked to be a loss
    packed: Packed | None


@dataclass(frozen=True)
class EvaluationPart:
    """How a model is evaluated: `factory(model, test_dataset, **options)`, accuracy and loss, or the package's
    metrics; during the run on the first `samples` of the test set (0: all); a replica's score for
    `final_model = "best"` by `score_metric`."""

    factory: Callable[..., Any] | None
    options: dict[str, Any]
    batch_size: int
    samples: int
    score_metric: str
    replicas: int | None  # the replicas evaluated at the end (eval.replicas; None: the runtime's default)
    packed: Packed | None


@dataclass(frozen=True)
class OptimizerPart:
    """The optimizer ([optimizer]), its gradient clipping, and its learning-rate schedule ([schedule])."""

    config: Any  # [optimizer]
    schedule: Any  # [schedule], or None

    @property
    def clip_norm(self) -> float | None:
        return self.config.clip_norm


@dataclass(frozen=True)
class ChurnPlan:
    """`[faults] churn`, resolved: how a member leaves ("kill" or "term"), the means of the exponential stay and
    absence in seconds, and the seed of the draws (fast.runtime.churn)."""

    leave: str
    lifetime_s: float
    absence_s: float
    seed: int


@dataclass(frozen=True)
class Deployment:
    """How many processes run, where they meet and how they start: decided before any starts."""

    workers: int
    servers: int
    shards: int  # processes per worker: a replica sharded over them (run.shards, fast.shards)
    engine: str  # "processes" or "simulated"
    addr: str  # where the processes meet (run.master_addr)
    port: int  # 0: a free one, picked when they start
    threads: int  # torch threads a process; 0: the machine's cores over its processes of the run
    restarts: int  # run.max_restarts, under torch's agent
    live: bool  # live membership (fast.runtime.membership)
    min_workers: int  # a live run with fewer ends (run.min_workers)
    max_workers: int  # a live run admits no joiner past it (run.max_workers; 0: 256)
    churn: ChurnPlan | None  # [faults] churn drives the live membership
    survivable: bool  # the run goes on when a worker but worker 0 dies (in a live run, any worker)
    detached: bool  # its workers meet only its servers, forming no group (async-ps: fast.runtime.detached)

    @property
    def processes(self) -> int:
        """Every process of the run: each worker's (its replica's shards), then the servers."""
        return self.workers * self.shards + self.servers

    def threads_for(self, processes_here: int) -> int:
        """Torch threads for one of `processes_here` processes of the run on this machine."""
        return self.threads or max(1, (os.cpu_count() or 1) // processes_here)


@dataclass(frozen=True)
class JobParts:
    """A job resolved once (see the module)."""

    config: Config  # the validated config: its [run] keys are the runtime's own
    data: DataPart
    model: ModelPart
    step: StepPart
    evaluation: EvaluationPart
    optimizer: OptimizerPart
    strategy: type[Strategy]
    options: StrategyOptions
    deployment: Deployment
    packed: Packed | None
    user: UserCode = field(default_factory=UserCode)

    def with_workers(self, workers: int) -> JobParts:
        """The same job with another number of workers (torchrun's world, a script started alone)."""
        return resolve(load_config(self.config, run__workers=workers), self.user)


def deployment_of(config: Config, strategy: type[Strategy], options: StrategyOptions) -> Deployment:
    """How many processes `config` runs (with its `strategy` and `options`), where they meet and how they start: all
    a launcher needs of a job."""
    run = config.run
    churn = config.faults.churn if config.faults is not None else None
    return Deployment(
        workers=run.workers,
        servers=strategy.server_count(options, run.workers),
        shards=run.shards,
        engine=run.engine,
        addr=run.master_addr,
        port=run.master_port,
        threads=run.threads_per_worker,
        restarts=run.max_restarts,
        live=run.live,
        min_workers=run.min_workers,
        max_workers=run.max_workers,
        churn=None
        if churn is None
        else ChurnPlan(churn.leave, parse_duration(churn.lifetime), parse_duration(churn.absence), run.seed),
        survivable=strategy.survives_failures or run.live,
        detached=strategy.joins_alone,
    )


def _factory(section: Any, key: str) -> Callable[..., Any] | None:
    return load_factory(section.factory, key) if section.factory is not None else None


def resolve(config: Any, user: UserCode | None = None, **overrides: Any) -> JobParts:
    """The job's parts from a config (a TOML path, a package, a dict, a Config; dotted overrides) and what a Python
    user replaced (`user`). A factory that does not import fails here, in one line, before anything starts."""
    if isinstance(config, JobParts):
        return config if not overrides else resolve(load_config(config.config, **overrides), config.user)
    config = config if isinstance(config, Config) and not overrides else load_config(config, **overrides)
    user = user or UserCode()
    run, data, model, step, evaluation = config.run, config.data, config.model, config.step, config.eval
    package = config.package
    packed = Packed(package.path, package.trusted_key, package.node_bytes) if package is not None else None
    strategy, options = strategy_for(config), strategy_options(config)
    step_function = user.step_fn or (None if packed else _factory(step, "step.factory"))
    return JobParts(
        config=config,
        data=DataPart(
            _factory(data, "data.factory"),
            data.arguments(),
            data.name,
            data.dir,
            (data.synthetic_train, data.synthetic_test),
            run.seed,
            packed,
            data.partition,
            data.alpha,
            data.loader_workers,
        ),  # fmt: skip
        model=ModelPart(
            user.model_fn, _factory(model, "model.factory"), model.arguments(), model.name, run.seed, packed
        ),  # fmt: skip
        step=StepPart(
            step_function,
            step.arguments() if user.step_fn is None else {},
            user.step_fn is None and step_function is not None,
            packed,
        ),  # fmt: skip
        evaluation=EvaluationPart(
            _factory(evaluation, "eval.factory"),
            evaluation.arguments(),
            evaluation.batch_size,
            evaluation.samples,
            run.parsed_targets[0].metric if run.targets else "accuracy",
            evaluation.replicas,
            packed,
        ),  # fmt: skip
        optimizer=OptimizerPart(config.optimizer, config.schedule),
        strategy=strategy,
        options=options,
        deployment=deployment_of(config, strategy, options),
        packed=packed,
        user=user,
    )
