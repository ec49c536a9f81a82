"""Strategies, looked up by the name in `[strategy] name = ...`.

Every module in this package is imported on first use; each `Strategy` subclass with a `name` registers
itself (unless it sets `registered = False`: a class another one `resolve`s to), so a new strategy is one new
file, here or in the user's own code.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from pydantic import ValidationError

from fast.config import Config, _describe
from fast.errors import ConfigError
from fast.factories import import_module
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
    named = [cls for cls in _all_subclasses(Strategy) if "name" in cls.__dict__]
    return {"none": Strategy} | {cls.name: cls for cls in named if cls.__dict__.get("registered", True)}


def strategy_class(name: str) -> type[Strategy]:
    known = registry()
    if name not in known:
        raise ConfigError(
            f"`strategy.name` = {name!r} is not a strategy: choose one of {', '.join(sorted(known))} (for a strategy "
            "of your own, set `strategy.module` to the module that defines it)"
        )
    return known[name]


def strategy_options(config: Config) -> StrategyOptions:
    if config.strategy.module:  # a strategy of the user's own registers when its module is imported
        import_module(config.strategy.module, "strategy.module")
    cls = strategy_class(config.strategy.name)
    try:
        return cls.Options.model_validate({"name": config.strategy.name, **config.strategy.options()})
    except ValidationError as e:
        raise ConfigError(_describe(e).replace("`", "`strategy.", 1)) from None


def variant(registered: type[Strategy], options: dict[str, Any], codec: str) -> type[Strategy]:
    """The class that runs `registered` with these options and codec: one of its variants, or itself."""
    registry()
    variants = [cls for cls in _all_subclasses(Strategy) if cls.variant_of is registered]
    return next((cls for cls in variants if cls.chosen_when(options, codec)), registered)


def strategy_for(config: Config) -> type[Strategy]:
    """The class that runs the config's strategy: the registered one, or the variant its options choose."""
    options = strategy_options(config).model_dump()
    return variant(strategy_class(config.strategy.name), options, config.codec.name)


def validate_strategy_options(config: Config) -> StrategyOptions:
    options = strategy_options(config)
    strategy_for(config).check(options, config)
    return options


def build_strategy(config: Config, ctx: StrategyContext) -> Strategy:
    return strategy_for(config)(strategy_options(config), ctx)


__all__ = [
    "Strategy",
    "StrategyContext",
    "StrategyOptions",
    "build_strategy",
    "registry",
    "strategy_class",
    "strategy_for",
]
