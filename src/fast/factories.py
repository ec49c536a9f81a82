"""User code named in the config (`factory = "package.module:function"`), imported with one-line errors.

The current directory and the directory of the config file (or of the script being run) are importable, so a
`mymodels.py` beside `job.toml` is found without installing anything.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable
from typing import Any

from fast.errors import ConfigError
from fast.interrupts import held_interrupts

SEARCH_PATH_VARIABLE = "FAST_CODE_PATH"  # os.pathsep-separated folders the launcher adds (a script's, a config's)


def add_search_path(folder: str) -> None:
    """Make modules in `folder` importable here and in the workers this process starts."""
    folder = os.path.abspath(folder)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    known = [p for p in os.environ.get(SEARCH_PATH_VARIABLE, "").split(os.pathsep) if p]
    if folder not in known:
        os.environ[SEARCH_PATH_VARIABLE] = os.pathsep.join([*known, folder])


def _search_paths() -> None:
    for folder in [os.getcwd(), *os.environ.get(SEARCH_PATH_VARIABLE, "").split(os.pathsep)]:
        if folder and folder not in sys.path:
            sys.path.append(folder)


def import_module(module_name: str, key: str, spec: str | None = None) -> Any:
    """The user's module `module_name`, named by config key `key` (= `spec`); ConfigError when it does not import."""
    _search_paths()
    try:
        with held_interrupts():  # an import cut short may swallow the interrupt, or leave a library half set up
            return importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(
            f"`{key}` = {spec or module_name!r}: module {module_name!r} does not import ({e}); put it in the current "
            "directory, beside the config or script, or install it"
        ) from None


def load_factory(spec: str, key: str) -> Callable[..., Any]:
    """The function `spec` ("package.module:function") names; ConfigError naming `key` when it cannot be had."""
    module_name, _, attribute = spec.partition(":")
    module = target = import_module(module_name, key, spec)
    for part in attribute.split("."):
        target = getattr(target, part, None)
        if target is None:  # (the file named: another module of that name may come first on the path)
            where = getattr(module, "__file__", None) or "built in"
            raise ConfigError(f"`{key}` = {spec!r}: {module_name} ({where}) has no {attribute!r}; check the name "
                              "after ':'")  # fmt: skip
    if not callable(target):
        raise ConfigError(f"`{key}` = {spec!r} is a {type(target).__name__}, not a function: name a function")
    return target


def call_factory(function: Callable[..., Any], key: str, available: dict[str, Any], options: dict[str, Any]) -> Any:
    """Call a factory with its config `options` and whichever of `available` (e.g. input_shape) it takes."""
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):
        parameters = {}
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    arguments = {k: v for k, v in available.items() if k in parameters or takes_any}
    unknown = [k for k in options if k not in parameters and not takes_any]
    if unknown:
        raise ConfigError(
            f"`{key.rsplit('.', 1)[0]}.{unknown[0]}` is not an argument of {getattr(function, '__name__', function)}: "
            "remove it or add the parameter"
        )
    return function(**arguments, **options)


def expect(value: Any, kinds: type | tuple[type, ...], key: str, what: str) -> Any:
    """`value` if it is one of `kinds`, else ConfigError saying what `key`'s function should return."""
    if not isinstance(value, kinds):
        raise ConfigError(f"`{key}` returned a {type(value).__name__}: it must return {what}")
    return value
