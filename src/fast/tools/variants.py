"""The variants of a comparison: a base job plus `[[variant]]` tables, each overriding any of its keys.

A variant table has a `name` and keys as nested tables (`strategy = { name = "ssp", staleness = 2 }`) or
dotted keys (`strategy.name = "ssp"`); they override the base job, which is the rest of the file. As with
`--set`, naming another strategy or codec drops the base's options for the old one.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from fast.config import apply_overrides, load_dict
from fast.errors import ConfigError

VARIANT_TABLE = "variant"


def variants(path_or_dict: str | Path | dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(name, full config dict) per variant in file order: the base merged with the variant's overrides.

    Raises ConfigError if `variant` is not an array of tables or a variant has no string `name`; the merged
    dicts are not validated here (load_config does that).
    """
    raw = load_dict(path_or_dict) if not isinstance(path_or_dict, dict) else path_or_dict
    base = {key: value for key, value in raw.items() if key != VARIANT_TABLE}
    tables = raw.get(VARIANT_TABLE, [])
    if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
        raise ConfigError("`variant` must be an array of tables: write each one as [[variant]] with a name")
    found = []
    for number, table in enumerate(tables, start=1):
        name = table.get("name")
        if not isinstance(name, str) or not name:
            raise ConfigError(f'[[variant]] number {number} has no `name`: add name = "..." to it')
        overrides = dotted({key: value for key, value in table.items() if key != "name"})
        # A new strategy or codec name must come first: it clears the options the base gave the old one.
        ordered = sorted(overrides.items(), key=lambda item: not item[0].endswith(".name"))
        try:
            config = apply_overrides(copy.deepcopy(base), dict(ordered))
        except ConfigError as error:
            raise ConfigError(f"variant {name!r}: {error}") from None
        found.append((name, config))
    return found


def dotted(table: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested tables as dotted keys: {"strategy": {"name": "ssp"}} -> {"strategy.name": "ssp"}."""
    flat: dict[str, Any] = {}
    for key, value in table.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat |= dotted(value, f"{name}.")
        else:
            flat[name] = value
    return flat
