"""Optimizers and learning-rate schedules from the config: any `torch.optim` optimizer by name with its keyword
arguments, and schedules (constant, linear warm-up then cosine, step, or any `torch.optim.lr_scheduler` by name).

    [optimizer]                 [schedule]
    name = "AdamW"              name = "warmup-cosine"
    lr = 3e-4                   warmup_steps = 100
    betas = [0.9, 0.95]         min_lr = 3e-5            # total_steps: the run's, unless given
    weight_decay = 0.1
    clip_norm = 1.0             # gradient clipping (by global norm), applied after the strategy's averaging

A schedule steps once per optimizer step and depends on the step alone, so it is the same on every worker.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch

from fast.errors import ConfigError

# the config's own keys; everything else in [optimizer] is a keyword argument of the optimizer
OPTIMIZER_KEYS = ("name", "lr", "momentum", "weight_decay", "nesterov", "clip_norm")
SGD_LIKE = ("momentum", "nesterov")  # passed only to optimizers that take them
SCHEDULES = ("constant", "warmup-cosine", "warmup-linear", "step")


def optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    """The torch.optim optimizer called `name` (any case: "sgd", "AdamW", "rmsprop")."""
    found = {
        cls_name.lower(): cls
        for cls_name, cls in vars(torch.optim).items()
        if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer) and cls is not torch.optim.Optimizer
    }
    if name.lower() not in found:
        known = ", ".join(sorted(c.__name__ for c in found.values()))
        raise ConfigError(f"`optimizer.name` = {name!r} is not a torch.optim optimizer: choose one of {known}")
    return found[name.lower()]


def optimizer_arguments(cfg: Any) -> dict[str, Any]:
    """The keyword arguments `cfg` (the [optimizer] table) gives its optimizer; ConfigError naming a key the
    optimizer does not take."""
    cls = optimizer_class(cfg.name)
    accepted = inspect.signature(cls.__init__).parameters
    given = set(cfg.model_fields_set) | set(cfg.model_extra or {})
    arguments: dict[str, Any] = {"lr": cfg.lr}
    for key in ("weight_decay", *SGD_LIKE):
        if key in accepted:
            arguments[key] = getattr(cfg, key)
        elif key in given and getattr(cfg, key) != type(cfg).model_fields[key].default:
            raise ConfigError(f"`optimizer.{key}`: {cls.__name__} takes no {key}; remove it")
    if "nesterov" in arguments:
        arguments["nesterov"] = bool(cfg.nesterov and cfg.momentum > 0)
    for key, value in (cfg.model_extra or {}).items():
        if key not in accepted or key in ("self", "params"):
            valid = ", ".join(k for k in accepted if k not in ("self", "params"))
            raise ConfigError(f"unknown key `optimizer.{key}`: {cls.__name__} takes {valid}")
        arguments[key] = tuple(value) if isinstance(value, list) else value
    return arguments


def build_optimizer(cfg: Any, params: Any) -> torch.optim.Optimizer:
    """The optimizer the [optimizer] table configures, over `params`."""
    cls = optimizer_class(cfg.name)
    try:
        return cls(params, **optimizer_arguments(cfg))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"[optimizer] {cls.__name__}: {e}; fix the value in [optimizer]") from None


def check_optimizer(cfg: Any) -> None:
    """ConfigError for an optimizer or keyword argument that cannot work, before anything starts."""
    build_optimizer(cfg, [torch.nn.Parameter(torch.zeros(1))])


# -- schedules ------------------------------------------------------------------------------------------------
def _warmup_then(kind: str, warmup: int, total: int, floor: float) -> Any:
    """lr factor at step t: linear from 1/warmup up to 1 over `warmup` steps, then cosine or linear to `floor`."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        decay = 0.5 * (1 + math.cos(math.pi * progress)) if kind == "cosine" else 1 - progress
        return floor + (1 - floor) * decay

    return factor


def schedule_arguments(cfg: Any) -> dict[str, Any]:
    """A torch scheduler's keyword arguments: the table's extra keys and the ones it set that the class takes."""
    accepted = inspect.signature(getattr(torch.optim.lr_scheduler, cfg.name).__init__).parameters
    named = {key: getattr(cfg, key) for key in cfg.model_fields_set if key != "name" and key in accepted}
    return {**named, **(cfg.model_extra or {})}


def build_schedule(cfg: Any, optimizer: torch.optim.Optimizer, total_steps: int | None) -> Any:
    """The LR scheduler the [schedule] table configures (stepped once per optimizer step), or None."""
    if cfg is None or cfg.name == "constant":
        return None
    if cfg.name in ("warmup-cosine", "warmup-linear"):
        total = cfg.total_steps or total_steps
        if total is None:
            raise ConfigError(
                f"`schedule.name` = {cfg.name!r} needs the run's length: set schedule.total_steps, or call "
                "job.epochs(n) (or run.epochs) before the first step"
            )
        first = optimizer.param_groups[0]
        base = first.get("initial_lr", first["lr"])  # (an optimizer resumed or healed has its schedule's rate now)
        floor = cfg.min_lr / base if base > 0 else 0.0
        kind = cfg.name.removeprefix("warmup-")
        return torch.optim.lr_scheduler.LambdaLR(optimizer, _warmup_then(kind, cfg.warmup_steps, total, floor))
    if cfg.name == "step":
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=cfg.step_size, gamma=cfg.gamma)
    cls = getattr(torch.optim.lr_scheduler, cfg.name, None)
    try:
        return cls(optimizer, **schedule_arguments(cfg))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"[schedule] {cfg.name}: {e}; fix its keys in [schedule]") from None


def check_schedule(cfg: Any) -> None:
    """ConfigError for a schedule that does not exist or whose keys do not fit, before anything starts."""
    if cfg is None:
        return
    if cfg.name in SCHEDULES:
        extra = sorted(cfg.model_extra or {})
        if extra:
            raise ConfigError(
                f"unknown key `schedule.{extra[0]}`: schedule {cfg.name!r} takes warmup_steps, total_steps, "
                "min_lr (warm-up ones) or step_size, gamma (step)"
            )
        return
    cls = getattr(torch.optim.lr_scheduler, cfg.name, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.lr_scheduler.LRScheduler)):
        raise ConfigError(
            f"`schedule.name` = {cfg.name!r} is not a schedule: choose one of {', '.join(SCHEDULES)} or a class "
            "of torch.optim.lr_scheduler (e.g. OneCycleLR)"
        )
    accepted = inspect.signature(cls.__init__).parameters
    for key in cfg.model_extra or {}:
        if key not in accepted or key in ("self", "optimizer"):
            raise ConfigError(f"unknown key `schedule.{key}`: {cfg.name} does not take it")
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    build_schedule(cfg, optimizer, None)
