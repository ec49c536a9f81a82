"""Parse and format the physical quantities users write in configs: bandwidths, durations, byte counts.

Prefixes are decimal SI (1 Mbit = 1e6 bits, 1 MB/s = 1e6 bytes/s); the binary ones (Ki, Mi, Gi, Ti)
are accepted too and mean powers of 1024. Prefixes ignore case ('mbit' is a megabit: nothing is
measured in millibits per second); the byte unit needs its capital B ('MB/s'). As in network specs,
``bps`` is *bits* per second (unlike Linux ``tc``, where it means bytes). A plain number is bytes per
second or seconds.
"""

import math
import re

from fast.errors import ConfigError

_DECIMAL_PREFIXES = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_BINARY_PREFIXES = {"ki": 2.0**10, "mi": 2.0**20, "gi": 2.0**30, "ti": 2.0**40}

# A number, optional spaces, then a unit made of letters, '/' and 'µ'.
_QUANTITY = re.compile(r"^\s*(?P<number>[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*(?P<unit>[A-Za-zµ/]*)\s*$")
# Bandwidth units: prefix, then 'bit', 'bps' or 'bit/s' (bits) or 'B/s' (bytes; the capital B is required).
_BANDWIDTH_UNIT = re.compile(r"^(?P<prefix>(?:[kKmMgGtT]i?)?)(?P<base>bit|bps|bit/s|B/s)$")

_SECONDS_PER_DURATION_UNIT = {"": 1.0, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "min": 60.0, "h": 3600.0}

_BANDWIDTH_HINT = "expected e.g. '10Mbit' or '1Gbit'"
_DURATION_HINT = "expected seconds, or a number with us, ms, s, min or h: e.g. '50ms', '1s' or '2h'"


def _split_quantity(text: str) -> tuple[float, str] | None:
    match = _QUANTITY.match(text)
    if match is None:
        return None
    return float(match["number"]), match["unit"]


def _plain_number(value: object) -> float | None:
    """A non-string number given directly (int or float, not bool), else None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def parse_bandwidth(value: str | float) -> float:
    """Bytes per second from a string such as '10Mbit', '1Gbit', '100kbit', '8bps', '5MB/s' or '125000'."""
    number = _plain_number(value)
    if number is None:
        if not isinstance(value, str) or (parts := _split_quantity(value)) is None:
            raise ConfigError(f"bad bandwidth {value!r}: {_BANDWIDTH_HINT}")
        number, unit = parts
        if unit:
            unit_match = _BANDWIDTH_UNIT.match(unit)
            if unit_match is None:
                raise ConfigError(f"bad bandwidth unit in {value!r}: {_BANDWIDTH_HINT}")
            prefix = unit_match["prefix"].lower()
            scale = _BINARY_PREFIXES[prefix] if prefix.endswith("i") else _DECIMAL_PREFIXES[prefix]
            bytes_per_unit = 1.0 if unit_match["base"] == "B/s" else 1.0 / 8.0
            number *= scale * bytes_per_unit
    if not math.isfinite(number) or number <= 0:
        raise ConfigError(f"bandwidth {value!r} must be positive and finite: {_BANDWIDTH_HINT}")
    return number


def parse_duration(value: str | float) -> float:
    """Seconds from a string such as '50ms', '200us', '1.5s', '2min', '2h' or '0.05'."""
    number = _plain_number(value)
    if number is None:
        if not isinstance(value, str) or (parts := _split_quantity(value)) is None:
            raise ConfigError(f"bad duration {value!r}: {_DURATION_HINT}")
        number, unit = parts
        if unit not in _SECONDS_PER_DURATION_UNIT:
            raise ConfigError(f"bad duration unit in {value!r}: {_DURATION_HINT}")
        number *= _SECONDS_PER_DURATION_UNIT[unit]
    if not math.isfinite(number) or number < 0:
        raise ConfigError(f"duration {value!r} must be non-negative and finite: {_DURATION_HINT}")
    return number


def _three_significant_digits(value: float) -> str:
    return f"{value:.3g}"


def format_bytes(nbytes: float) -> str:
    """A byte count for reports, in decimal units with three significant digits: '512 B', '1.5 MB'."""
    if not math.isfinite(nbytes):
        return f"{nbytes} B"
    sign = "-" if nbytes < 0 else ""
    magnitude = abs(float(nbytes))
    for unit in ("B", "kB", "MB", "GB"):
        # Compare after rounding so that 999_999 bytes reads '1 MB', not '1e+03 kB'.
        text = _three_significant_digits(magnitude)
        if float(text) < 1000:
            return f"{sign}{text} {unit}"
        magnitude /= 1000
    text = _three_significant_digits(magnitude)
    return f"{sign}{text if float(text) < 1000 else f'{magnitude:.0f}'} TB"


def format_seconds(seconds: float) -> str:
    """A duration for reports: '250 us', '12.5 ms', '3.2 s', '4 min 05 s', '2 h 03 min'."""
    if not math.isfinite(seconds):
        return f"{seconds} s"
    sign = "-" if seconds < 0 else ""
    magnitude = abs(float(seconds))
    if magnitude == 0:
        return "0 s"
    for unit, scale, limit in (("us", 1e-6, 1000), ("ms", 1e-3, 1000), ("s", 1.0, 60)):
        scaled = _three_significant_digits(magnitude / scale)
        if float(scaled) < limit:
            return f"{sign}{scaled} {unit}"
    whole_seconds = round(magnitude)
    if whole_seconds < 3600:
        minutes, rest = divmod(whole_seconds, 60)
        return f"{sign}{minutes} min {rest:02d} s"
    whole_minutes = round(magnitude / 60)
    hours, minutes = divmod(whole_minutes, 60)
    return f"{sign}{hours} h {minutes:02d} min"
