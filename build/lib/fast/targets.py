"""Targets a run is timed against: a named metric, a direction and a value (`"accuracy >= 0.85"`).

`run.targets` lists them; a plain number means test accuracy at least that much, as it always has. An
evaluation returns named metrics (`{"accuracy": 0.9, "loss": 0.3}`, `{"perplexity": 38.0}`); a target is
reached at the first evaluation whose metric is on its side of the value.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from fast.errors import ConfigError

_TARGET = re.compile(r"^\s*(?P<metric>[A-Za-z_][A-Za-z0-9_]*)\s*(?P<op>>=|<=)\s*(?P<value>[-+0-9.eE]+)\s*$")
LOWER_IS_BETTER = ("loss", "perplexity", "error")  # metric names (or suffixes) that improve downwards


@dataclass(frozen=True)
class Target:
    metric: str
    op: str  # ">=" or "<="
    value: float

    @property
    def label(self) -> str:
        """How summaries and reports name it: "accuracy >= 0.85"."""
        return f"{self.metric} {self.op} {self.value:g}"

    def reached(self, value: float | None) -> bool:
        if value is None or not math.isfinite(value):
            return False
        return value >= self.value if self.op == ">=" else value <= self.value


def parse_target(spec: float | int | str) -> Target:
    """A Target from a number (test accuracy) or a string `"metric >= value"` / `"metric <= value"`."""
    if isinstance(spec, bool):
        raise ConfigError(f'`run.targets`: {spec!r} is not a target: write a number or "accuracy >= 0.85"')
    if isinstance(spec, int | float):
        if not 0 < spec <= 1:
            raise ConfigError(
                f"`run.targets`: a plain number is a test accuracy in (0, 1], got {spec}; "
                'for another metric write e.g. "perplexity <= 40"'
            )
        return Target("accuracy", ">=", float(spec))
    match = _TARGET.match(str(spec))
    if match is None:
        raise ConfigError(
            f'`run.targets`: {spec!r} is not a target: write "metric >= value" or "metric <= value", '
            'e.g. "accuracy >= 0.85" or "perplexity <= 40"'
        )
    try:
        value = float(match["value"])
    except ValueError:
        raise ConfigError(f"`run.targets`: {spec!r} does not end with a number") from None
    return Target(match["metric"], match["op"], value)


def lower_is_better(metric: str) -> bool:
    return metric.endswith(LOWER_IS_BETTER)


def best(metric: str, values: list[float]) -> float | None:
    """The best of a metric's values: the least for losses and perplexities, else the greatest."""
    finite = [v for v in values if v is not None and math.isfinite(v)]
    if not finite:
        return None
    return min(finite) if lower_is_better(metric) else max(finite)
