"""Strategies, looked up by the name in `[strategy] name = ...`.

Every module in this package is imported on first use; each `Strategy` subclass with a `name` registers
itself, so a new strategy is one new file here.
"""

from __future__ import annotations

import importlib
import pkgutil

from pydantic import ValidationError

from fast.config import Config, _describe
from fast.errors import ConfigError
from fast.strategies.base import Strategy, StrategyContext, StrategyOptions


def _all_subclasses(cls: type) -> list[type]:
    found = []
    for sub in cls.__subclasses__():
        found += [sub, *_all_subclasses(sub)]
    return found


def registry() -> dict[str, type[Strategy]]:
    """Every strategy by name (user strategies defined before this call are included)."""
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")
    return {"none": Strategy} | {cls.name: cls for cls in _all_subclasses(Strategy) if "name" in cls.__dict__}


def strategy_class(name: str) -> type[Strategy]:
    known = registry()
    if name not in known:
        raise ConfigError(f"`strategy.name` = {name!r} is not a strategy: choose one of {', '.join(sorted(known))}")
    return known[name]


def strategy_options(config: Config) -> StrategyOptions:
    cls = strategy_class(config.strategy.name)
    try:
        return cls.Options.model_validate({"name": config.strategy.name, **config.strategy.options()})
    except ValidationError as e:
        raise ConfigError(_describe(e).replace("`", "`strategy.", 1)) from None


def validate_strategy_options(config: Config) -> StrategyOptions:
    options = strategy_options(config)
    strategy_class(config.strategy.name).check(options, config)
    return options


def build_strategy(config: Config, ctx: StrategyContext) -> Strategy:
    return strategy_class(config.strategy.name)(strategy_options(config), ctx)


__all__ = ["Strategy", "StrategyContext", "StrategyOptions", "build_strategy", "registry", "strategy_class"]
