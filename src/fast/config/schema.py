"""The run configuration's schema: TOML in, typed and validated sections out, every error one line naming the key.

This is a leaf: it knows no strategy or codec. `fast.assemble.load_config` checks a config against the strategy
and codec registries as well (their options, and which codecs a strategy can use).
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any, Literal

import tomli_w
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from fast.config.deployment import ComputeConfig, FaultsConfig, NetworkConfig
from fast.errors import ConfigError
from fast.targets import Target, parse_target
from fast.units import parse_duration


def _simulated_seconds(value: str | float) -> float | None:
    """A simulated time: "free" = 0 s, "auto" = None (timed on the host), else the duration in seconds."""
    words = {"free": 0.0, "auto": None}
    return words[value] if value in words else parse_duration(value)


# the most workers a run takes: a run of processes starts one OS process (and its own torch, some 300 MB) per worker;
# the simulated engine holds every worker in one process, a thread, a replica and its optimizer each: 1,024 live LeNet
# workers took about 5 GB (docs/simulated.md), so 4,096 fit in 24 GB
PROCESS_WORKERS, SIMULATED_WORKERS = 256, 4096


class Section(BaseModel):
    """A config table: unknown keys are errors, values are checked, not coerced from strings."""

    model_config = ConfigDict(extra="forbid", strict=False, validate_assignment=True, allow_inf_nan=False)


class RunConfig(Section):
    name: str = "fast"
    seed: int = Field(0, ge=0, le=2**32 - 1)
    workers: int = Field(
        4,
        ge=1,
        le=SIMULATED_WORKERS,
        description='training processes, at most 256, or with run.engine = "simulated" simulated workers, at most '
        "4,096 (the servers of `async-ps`, asynchronous `easgd` and `ea-wild` come on top)",
    )
    shards: int = Field(
        1,
        ge=1,
        le=PROCESS_WORKERS,
        description="processes per worker: each of run.workers replicas is this many processes that shard its model, "
        "gradients and optimizer state with FSDP2, FAST's strategies running between replicas shard by shard "
        "(docs/sharded.md)",
    )
    epochs: float = Field(3, gt=0)
    batch_size: int = Field(64, ge=1)
    eval_every: float = Field(0.5, ge=0, description="epochs between test evaluations; 0 = only at the end")
    device: Literal["cpu", "cuda"] = "cpu"
    shared_memory: bool = Field(
        True,
        description="on one machine's CPU (no [network]), all-reduces go through shared memory instead of gloo",
    )
    targets: list[float | str] = Field(
        default_factory=lambda: [0.80, 0.85],
        description='test accuracies, or "metric >= value" / "metric <= value", timed in time_to_target_s',
    )
    allreduce_piece_kb: int = Field(
        0,
        ge=0,
        description="on real links, all-reduces of more than this many KiB go as consecutive pieces of it "
        "(each pays the link's latency): a slow link whose queue drops a burst's tail then loses nothing; 0 = whole",
    )
    log_every: int = Field(20, ge=1, description="steps between metric records")
    max_steps: int | None = Field(None, ge=1, description="stop after this many steps per worker")
    max_samples: int | None = Field(
        None,
        ge=1,
        description="stop once the workers together have trained on this many samples (a language model's: "
        "sequences), at the first step (a round, for the periodic family in a live run) that reaches it",
    )
    max_time: str | float | None = Field(
        None, description='stop training after this much training time, e.g. "5min" or "12h" (evaluation off the clock)'
    )
    check_interval: str | float = Field(
        "1s",
        description="workers in step check together (has the time run out, has a worker stopped) after their first "
        "step, then about this often, at a step they agree on, and at each epoch's end",
    )
    checkpoint_every: int = Field(0, ge=0, description="steps between checkpoints; 0 = none")
    max_restarts: int = Field(0, ge=0, description="restart every worker from the last checkpoint this often")
    membership: Literal["fixed", "live"] = Field(
        "fixed",
        description='"live": workers leave and join the running job (`fast join`), healed from a peer; "fixed": the '
        "workers it starts with, to the end",
    )
    min_workers: int = Field(
        1, ge=1, le=SIMULATED_WORKERS, description="live membership: the run fails when fewer workers remain"
    )
    max_workers: int = Field(
        0, ge=0, le=SIMULATED_WORKERS, description="live membership: joiners beyond this many workers wait; 0 = 256"
    )
    deadline_s: float = Field(
        60.0, gt=0, le=1e6, description="deadline of every blocking communication call (gloo counts it in 32 bits)"
    )
    max_bad_steps: int = Field(10, ge=1, description="stop after this many NaN/Inf steps in a row on a worker")
    threads_per_worker: int = Field(
        0, ge=0, le=1024, description="torch threads per worker; 0 = the machine's cores / its processes of the run"
    )
    accumulate: int = Field(1, ge=1, description="micro-batches per optimizer step (gradient accumulation)")
    precision: Literal["fp32", "bf16"] = Field("fp32", description='"bf16": forward and loss under bf16 autocast')
    tensorboard: bool = Field(False, description="TensorBoard event files in <run>/tensorboard")
    trace: bool = Field(False, description="a Chrome/Perfetto trace of every worker's spans in <run>/trace.json")
    master_addr: str = "127.0.0.1"
    master_port: int = Field(0, ge=0, le=65535, description="0 = pick a free port")
    engine: Literal["processes", "simulated"] = Field(
        "processes", description='"simulated": every worker in this one process, in virtual time (CPU only)'
    )
    step_time: str | float = Field(
        "auto",
        description='one step\'s compute, e.g. "20ms": the simulated engine charges it in virtual time; a run of '
        "processes waits out what a step's own work left of it, as for a device of that speed (its steps then take "
        'as long however many workers share this machine\'s cores); "auto" = the simulated engine times it on this '
        "host in the first steps (give a duration for runs that repeat exactly), a run of processes takes what its "
        "steps take",
    )
    step_time_spread: float = Field(
        0.0,
        ge=0,
        description="simulated engine: the coefficient of variation of a step's compute, each worker's steps drawn "
        "independently around step_time (log-normal, same mean); a real run's summary gives its own as "
        "step_compute_spread",
    )
    eval_time: str | float = Field(
        "free",
        description="simulated engine: how long an evaluation holds up the worker that runs it, as in a real run, "
        'where its peers may wait for it; "free" = no time, "auto" = its time on this host, or a duration',
    )
    server_time: str | float = Field(
        "free",
        description="simulated engine: how long a server works on one request (applying a push, answering a pull) "
        'before its answer goes out; "free" = no time, "auto" = its time on this host, or a duration',
    )

    form_time: str | float = Field(
        "free",
        description="simulated engine, a live run: how long forming a generation's group holds up each member (a "
        "real one meets at the run's store and connects to every other; its re-formed records give form_s); "
        '"free" = no time, or a duration',
    )

    @field_validator("max_time", "check_interval")
    @classmethod
    def _positive_duration(cls, value: str | float | None, info: ValidationInfo) -> str | float | None:
        if value is not None:
            try:
                seconds = parse_duration(value)
            except ConfigError as e:
                raise ValueError(str(e)) from None
            if seconds <= 0:
                hint = "; leave it out for no limit" if info.field_name == "max_time" else ""
                raise ValueError(f'must be a positive duration such as "5min"{hint}')
        return value

    @field_validator("step_time", "eval_time", "server_time", "form_time")
    @classmethod
    def _simulated_time(cls, value: str | float, info: ValidationInfo) -> str | float:
        words = {"step_time": ("auto",), "form_time": ("free",)}.get(info.field_name, ("free", "auto"))
        if value not in words:
            alternatives = " or ".join(f'"{w}"' for w in words)
            try:
                seconds = parse_duration(value)
            except ConfigError as e:
                raise ValueError(f"{e}, or {alternatives}") from None
            if seconds < 0:
                raise ValueError(f'must be a duration such as "20ms", or {alternatives}')
        return value

    @model_validator(mode="after")
    def _workers_of_the_engine(self) -> RunConfig:
        """A run of processes takes at most PROCESS_WORKERS workers; the simulated engine SIMULATED_WORKERS."""
        if self.engine == "processes":
            for key in ("workers", "min_workers", "max_workers"):
                if getattr(self, key) > PROCESS_WORKERS:
                    raise ConfigError(
                        f"`run.{key}` = {getattr(self, key)}: a run of processes takes at most {PROCESS_WORKERS} "
                        f'workers (a process each): set run.engine = "simulated" for up to {SIMULATED_WORKERS} in '
                        "one process, or fewer workers"
                    )
        return self

    @property
    def live(self) -> bool:
        """Whether the run's membership is live (workers leave and join while it runs)."""
        return self.membership == "live"

    @property
    def max_time_s(self) -> float | None:
        return parse_duration(self.max_time) if self.max_time is not None else None

    @property
    def check_interval_s(self) -> float:
        return parse_duration(self.check_interval)

    @property
    def step_time_s(self) -> float | None:
        """One step's compute (`step_time`); None: the host's own."""
        return _simulated_seconds(self.step_time)

    @property
    def eval_time_s(self) -> float | None:
        """The simulated time of one evaluation; None: timed on the host."""
        return _simulated_seconds(self.eval_time)

    @property
    def server_time_s(self) -> float | None:
        """The simulated time of a server's work on one request; None: timed on the host."""
        return _simulated_seconds(self.server_time)

    @property
    def form_time_s(self) -> float:
        """The simulated time of forming a live run's group."""
        return _simulated_seconds(self.form_time) or 0.0

    @field_validator("targets")
    @classmethod
    def _targets(cls, targets: list[float | str]) -> list[float | str]:
        for t in targets:
            try:
                parse_target(t)
            except ConfigError as e:
                raise ValueError(str(e).removeprefix("`run.targets`: ")) from None
        return targets

    @property
    def parsed_targets(self) -> list[Target]:
        return [parse_target(t) for t in self.targets]


class FactorySection(BaseModel):
    """A table that names built-in code (`name`) or the user's (`factory = "package.module:function"`); with a
    factory, the table's other keys are the function's keyword arguments."""

    model_config = ConfigDict(extra="allow", validate_assignment=True)
    factory: str | None = Field(None, description='"package.module:function" of your own')

    @field_validator("factory")
    @classmethod
    def _importable_name(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"[\w.]+:[\w.]+", value):
            raise ValueError('must look like "package.module:function"')
        return value

    @model_validator(mode="after")
    def _extras_need_a_factory(self) -> FactorySection:
        if self.factory is None and self.model_extra:
            raise ValueError(f"unknown key `{next(iter(self.model_extra))}`")
        return self

    def arguments(self) -> dict[str, Any]:
        """The factory's keyword arguments: the table's keys beyond its own."""
        return dict(self.model_extra or {})


class DataConfig(FactorySection):
    name: Literal["fashion-mnist", "mnist5k", "digits", "synthetic"] = "fashion-mnist"
    partition: Literal["iid", "dirichlet"] = "iid"
    alpha: float = Field(0.5, gt=0)
    dir: str | None = Field(None, description="folder of the idx files; default $FAST_DATA_DIR or the Debian one")
    synthetic_train: int = Field(2048, ge=16, le=1_000_000)
    synthetic_test: int = Field(512, ge=16, le=1_000_000)
    loader_workers: int = Field(0, ge=0, le=64, description="DataLoader worker processes per worker (generic datasets)")


class ModelConfig(FactorySection):
    name: Literal["mlp", "lenet", "lstm", "resnet8"] = "lenet"


class StepConfig(FactorySection):
    """`[step] factory`: the loss of one batch, `step(model, *batch)` (default: cross-entropy of model(x), y)."""


class EvalConfig(FactorySection):
    """`[eval] factory`: named metrics of a model, `evaluate(model, test_dataset)` -> {"accuracy": ..., ...}."""

    batch_size: int = Field(1000, ge=1, description="batch size of the built-in evaluation")
    samples: int = Field(
        0,
        ge=0,
        description="test samples of each evaluation during the run, the first ones (0: all); the final "
        "evaluation takes them all",
    )
    replicas: int | None = Field(
        None,
        ge=1,
        description="where replicas differ, the workers whose own replica the end evaluates (worker_test_accuracy), "
        "evenly spaced by rank, the others null; default: every worker in a run of processes (each evaluates its own, "
        "at once), at most 32 in a simulated one (its host evaluates them one after another)",
    )


class OptimizerConfig(BaseModel):
    """The workers' optimizer: any torch.optim optimizer by name; keys beyond these are its keyword arguments."""

    model_config = ConfigDict(extra="allow", validate_assignment=True)
    name: str = "sgd"
    lr: float = Field(0.05, ge=0)
    momentum: float = Field(0.9, ge=0, lt=1)
    weight_decay: float = Field(0.0, ge=0)
    nesterov: bool = False
    clip_norm: float | None = Field(None, gt=0, description="clip the gradients' global norm before each step")


class ScheduleConfig(BaseModel):
    """The learning-rate schedule: "constant", "warmup-cosine", "warmup-linear", "step", or any class of
    torch.optim.lr_scheduler by name with its keyword arguments."""

    model_config = ConfigDict(extra="allow", validate_assignment=True)
    name: str = "constant"
    warmup_steps: int = Field(0, ge=0, description="linear warm-up steps (warmup-cosine, warmup-linear)")
    total_steps: int | None = Field(None, ge=1, description="steps of the whole schedule; default the run's")
    min_lr: float = Field(0.0, ge=0, description="the learning rate the decay ends at")
    step_size: int = Field(1000, ge=1, description="steps between decays (step)")
    gamma: float = Field(0.1, gt=0, description="decay factor (step)")


class OpenSection(BaseModel):
    """A table whose keys beyond `name` belong to the named component, which validates them itself."""

    model_config = ConfigDict(extra="allow")
    name: str

    def options(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class StrategyConfig(OpenSection):
    name: str = "sync"
    module: str | None = Field(
        None, description='a module to import first, which defines a strategy of your own ("mypkg.strategies")'
    )


class CodecConfig(OpenSection):
    name: str = "none"


class PackageConfig(Section):
    """A packed job from `fast pack`: its model, loss and metrics come from the archive, not from code."""

    path: str = Field(description="the .fastjob archive")
    trusted_key: str | None = Field(None, description="the author's ed25519 public key (PEM): refuse all else")
    unsigned: bool = Field(False, description="train it though no trusted key verified it (`--unsigned`)")
    max_node_gib: float = Field(4.0, gt=0, description="the GiB one node of its programs may allocate from the sizes "
                                "it is given (zeros, full, arange, expand, ...)")  # fmt: skip

    @property
    def node_bytes(self) -> int:
        return int(self.max_node_gib * (1 << 30))


# what FAST's own loop builds from the config, and a user's own loop does for itself
USER_LOOP_SECTIONS = ("data", "model", "step", "eval", "optimizer", "schedule")
USER_LOOP_RUN_KEYS = ("batch_size", "epochs", "accumulate", "eval_every")


class Config(Section):
    run: RunConfig = Field(default_factory=RunConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    step: StepConfig = Field(default_factory=StepConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig | None = Field(None, description="learning-rate schedule; none = constant")
    strategy: StrategyConfig = Field(default_factory=StrategyConfig)
    codec: CodecConfig = Field(default_factory=CodecConfig)
    network: NetworkConfig | None = Field(None, description="emulated links; none = native communication")
    compute: ComputeConfig | None = Field(None, description="emulated compute: slowdowns and stragglers")
    faults: FaultsConfig | None = Field(None, description="injected faults: crashes and links down")
    package: PackageConfig | None = Field(None, description="a packed job (fast pack); none = the config's code")

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude_none=True)

    def as_used(self, fast_loop: bool) -> dict[str, Any]:
        """What a run's records say it used: all of it for FAST's own loop (or a package); for the user's own
        loop, of the parts FAST's loop would build (data, model, optimizer...) only the keys the user set."""
        used = self.to_dict()
        if fast_loop or self.package is not None:
            return used
        for name in USER_LOOP_SECTIONS:
            section = getattr(self, name)
            kept = section.model_dump(mode="json", exclude_none=True, exclude_unset=True) if section else {}
            used.pop(name, None)
            if kept:
                used[name] = kept
        for key in USER_LOOP_RUN_KEYS:
            if key not in self.run.model_fields_set:
                used["run"].pop(key, None)
        return used

    def as_used_toml(self, fast_loop: bool) -> str:
        return tomli_w.dumps(self.as_used(fast_loop))

    def to_toml(self) -> str:
        return tomli_w.dumps(self.to_dict())


# keys that were renamed: what to write instead
RENAMED = {"run.elastic": 'run.membership = "live" (or "fixed")'}


def check_renamed(data: dict[str, Any]) -> None:
    """ConfigError naming the new key for a key of an older FAST (RENAMED)."""
    for old, new in RENAMED.items():
        table, key = old.split(".")
        if isinstance(data.get(table), dict) and key in data[table]:
            raise ConfigError(f"`{old}` is now `{new}`: write that instead")


def without_renamed(data: dict[str, Any]) -> dict[str, Any]:
    """`data` without the keys of an older FAST (a package written before a rename)."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in data.items()}
    for old in RENAMED:
        table, key = old.split(".")
        if isinstance(out.get(table), dict):
            out[table].pop(key, None)
    return out


def _describe(error: ValidationError) -> str:
    errors = error.errors()
    first = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])  # an unknown key goes first
    key = ".".join(str(p) for p in first["loc"] if p != "__root__") or "config"
    kind = first["type"]
    if kind == "extra_forbidden":
        return f"unknown key `{key}`: remove it or check its spelling (see docs/configuration.md)"
    if kind == "missing":
        return f"missing key `{key}`: add it to the config"
    if kind == "literal_error":
        allowed = first.get("ctx", {}).get("expected", "")
        return f"`{key}` = {first['input']!r} is not valid: expected {allowed}"
    message = first["msg"].removeprefix("Value error, ")
    if message.startswith("unknown key `"):  # a table's own check (FactorySection): name the key in full
        name = message.removeprefix("unknown key `").split("`")[0]
        return (
            f"unknown key `{key}.{name}`: remove it or check its spelling, or name your own code with "
            f'{key}.factory = "package.module:function" to pass it keys'
        )
    return f"`{key}`: {message} (got {first.get('input')!r}); fix the value in the config or --set"


def parse_value(text: str) -> Any:
    """Read a --set value as TOML (numbers, booleans, strings, lists); bare words stay strings."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_overrides(data: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Set dotted keys (`run.workers`, `strategy.staleness`) in a nested dict, creating tables as needed. A new
    strategy or codec `name` drops the old one's options, and a new optimizer `name` the old one's own keyword
    arguments (AdamW's betas; lr, weight_decay and clip_norm stay), so names go first: the options given with it
    stay."""
    names_first = sorted(overrides.items(), key=lambda item: not item[0].endswith(".name"))
    for dotted, value in names_first:
        parts = dotted.split(".")
        if len(parts) < 2 or not all(parts):
            raise ConfigError(f"override `{dotted}` must name a table and a key, e.g. run.workers=4")
        table = data
        for part in parts[:-1]:
            table = table.setdefault(part, {})
            if not isinstance(table, dict):
                raise ConfigError(f"override `{dotted}`: `{part}` is a value, not a table")
        if parts[-1] == "name" and table.get("name") != value and parts[0] in ("strategy", "codec"):
            table.clear()  # switching strategy or codec drops the old one's options
        if dotted == "optimizer.name" and str(table.get("name", "")).lower() != str(value).lower():
            for key in set(table) - set(OptimizerConfig.model_fields):
                del table[key]
        table[parts[-1]] = value
    return data


def load_dict(path: str | Path) -> dict[str, Any]:
    """A TOML file's tables; ConfigError, in one line, for a path that is not a readable UTF-8 TOML file."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"config {path} is a folder: give the path of a TOML file")
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist: give the path of a TOML file")
    try:
        return tomllib.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path} is not UTF-8 text (byte {e.start} is not): TOML files are UTF-8; save it as "
                          "UTF-8") from None  # fmt: skip
    except OSError as e:
        raise ConfigError(f"config file {path} cannot be read ({e.strerror}): give a file you can read") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path} is not valid TOML: {e}") from None
