"""Who decides each key of a packed job's config: its author, who made the job, or the data owner, who runs it.

The single rule, read by `fast pack` and by every load of a package:

- the owner's data, machines, links and run folder are always the owner's (OWNER);
- the model and the loss come from the package's graphs: no config can name them (PACKAGED);
- the training recipe, the optimizer, the schedule and how long and in what batches it trains, is the author's
  (AUTHOR) unless the author opened a key (`fast pack --open KEY`);
- everything else, the deployment (the strategy and its options, the codec, the workers, shared memory, deadlines),
  is the owner's unless the author fixed a key (`fast pack --fix KEY`): an owner can try `gossip` on a package
  without asking its author.

Keys are dotted (`strategy.topology`); a pattern may end in `.*` for a whole table.
"""

from __future__ import annotations

import fnmatch
from typing import Any

from fast.errors import ConfigError, PackageError

OWNER = ("data.*", "package.*", "network.*", "compute.*", "faults.*", "eval.batch_size", "eval.samples",
         "run.name", "run.device", "run.master_addr", "run.master_port", "run.threads_per_worker",
         "run.deadline_s", "run.log_every", "run.eval_every", "run.targets", "run.tensorboard", "run.trace",
         "run.checkpoint_every", "run.max_restarts")  # fmt: skip
# the owner's keys that describe the owner's machines: where the run listens, its devices and threads, its links
MACHINE = ("network.*", "compute.*", "faults.*", "run.device", "run.master_addr", "run.master_port",
           "run.threads_per_worker", "run.max_restarts")  # fmt: skip
PACKAGED = ("model.*", "step.*", "eval.factory")
AUTHOR = ("optimizer.*", "schedule.*", "run.epochs", "run.max_steps", "run.max_samples", "run.batch_size",
          "run.accumulate", "run.precision")  # fmt: skip
TABLES = ("run", "data", "model", "step", "eval", "optimizer", "schedule", "strategy", "codec", "network", "compute",
          "faults", "package")  # fmt: skip
# the tables a package's config never holds: the author's code and data (not in the package), the owner's trust
NOT_PACKED = ("model", "step", "eval", "data", "package")


def _matches(key: str, patterns: tuple[str, ...] | list[str]) -> bool:
    return any(fnmatch.fnmatchcase(key, pattern) for pattern in patterns)


def owner_may_set(key: str, opened: list[str], fixed: list[str]) -> bool:
    """Whether the data owner may give config `key` a value other than the package's (`opened` and `fixed`:
    the author's patterns, e.g. "strategy.*")."""
    if _matches(key, OWNER):
        return True
    if _matches(key, PACKAGED):
        return False
    if _matches(key, fixed):
        return False
    return not _matches(key, AUTHOR) or _matches(key, opened)


def check_owner_keys(changed: dict[str, object], opened: list[str], fixed: list[str]) -> None:
    """ConfigError, naming the first key, when the owner's config changes a key that is not theirs to change
    (`changed`: dotted keys whose values differ from the package's)."""
    for key in changed:
        if _matches(key, PACKAGED):
            raise ConfigError(f"`{key}`: a packed job's model and loss come from its package; drop the key")
        if not owner_may_set(key, opened, fixed):
            who = "fixed by the package's author" if _matches(key, fixed) else "the package author's training recipe"
            raise ConfigError(f"`{key}` is {who} (open keys: {', '.join(opened) or 'none'}; fixed keys: "
                              f"{', '.join(fixed) or 'none'}); drop it from the config")  # fmt: skip


def owners_config(package_config: dict[str, Any], schema: dict[str, Any], owner: dict[str, Any]) -> dict[str, Any]:
    """A packed job's config (`package_config`, of its `schema`) with the owner's keys (`owner`) on top: ConfigError
    for a key that is not the owner's to change; the package's values for the owner's machine keys dropped."""
    base = without_machine_keys(package_config)
    packed = flat(base)
    changed = {key: value for key, value in flat(owner).items() if value != packed.get(key)}
    check_owner_keys(changed, schema["open"], schema["fixed"])
    merged = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    for key, value in owner.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            named = packed.get(f"{key}.name")
            # another strategy or codec than the package's takes none of the package's options for it
            replaced = key in ("strategy", "codec") and value.get("name", named) != named
            value = value if replaced else {**merged[key], **value}
        merged[key] = value
    return merged


def flat(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config dict as dotted keys."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def without_machine_keys(config: dict[str, object]) -> dict[str, object]:
    """A package's config without the owner's keys of the owner's machines (MACHINE): a value an author put there
    would be a default the owner never chose (`run.master_addr = "0.0.0.0"`, emulated faults). The author's other
    suggestions for the owner's keys (targets, how often to log and evaluate) stay as defaults."""
    kept: dict[str, object] = {}
    for table, keys in config.items():
        if _matches(f"{table}.*", MACHINE):
            continue
        kept[table] = {k: v for k, v in keys.items() if not _matches(f"{table}.{k}", MACHINE)} if isinstance(
            keys, dict) else keys  # fmt: skip
    return kept


def holds_only_packed_tables(config: dict[str, object]) -> bool:
    """Whether a package's config.toml holds only tables a package may hold (`fast pack` writes no others: a
    [package] table would decide the owner's trust and limits)."""
    return all(table in TABLES and table not in NOT_PACKED for table in config)


def check_patterns(opened: tuple[str, ...], fixed: tuple[str, ...]) -> None:
    """PackageError for an author's --open or --fix pattern that names no table of the config, names a key that
    is always the owner's (--fix) or never anyone's (--open), or is both opened and fixed."""
    for flag, patterns in (("--open", opened), ("--fix", fixed)):
        for pattern in patterns:
            if pattern.split(".")[0] not in TABLES or "." not in pattern:
                raise PackageError(f"{flag} {pattern!r} is not a config key: give one like strategy.name or "
                                   f"strategy.* (tables: {', '.join(TABLES)})")  # fmt: skip
            if _matches(pattern, PACKAGED) or pattern in PACKAGED:
                raise PackageError(f"{flag} {pattern!r}: the model and loss are the package's graphs, not keys")
            if flag == "--fix" and (_matches(pattern, OWNER) or pattern in OWNER):
                raise PackageError(f"--fix {pattern!r}: the owner's data, machines and run folder are always theirs")
    both = set(opened) & set(fixed)
    if both:
        raise PackageError(f"{sorted(both)[0]!r} is both opened and fixed: give it to one of --open and --fix")
