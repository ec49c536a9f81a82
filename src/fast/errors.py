"""Errors FAST raises on purpose: each carries a one-line message that names the problem and the fix."""

import sys
from typing import TextIO


class FastError(Exception):
    """Base of every error FAST reports to the user as a one-line message (exit code 1)."""

    exit_code = 1


class ConfigError(FastError):
    """A configuration key is missing, unknown, of the wrong type, out of range or inconsistent (exit code 2)."""

    exit_code = 2


class UnknownKey(ConfigError):
    """A key that no table of the config has: wrong whatever else the config says (exit code 2)."""


class UsageError(FastError):
    """The job API was used out of order or with the wrong kind of argument (exit code 2)."""

    exit_code = 2


class PackageError(FastError):
    """A packed job (`fast pack`) cannot be made, or is refused: altered, unsigned, truncated, too new (exit code 2)."""

    exit_code = 2


class DataError(FastError):
    """A data set is not installed or cannot be read."""

    exit_code = 2


class CommError(FastError):
    """A communication operation failed: a peer vanished, a frame was corrupt, a deadline passed."""


class CommTimeout(CommError):
    """A blocking communication operation passed its deadline."""


class FrameError(CommError):
    """Bytes received on the wire do not form a valid frame (bad magic, version, length or checksum)."""


def first_line(error: BaseException) -> str:
    """What `error` says, in one line (its type's name where it says nothing)."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def say(line: str, stream: TextIO | None = None) -> None:
    """Write `line` to `stream` (default stderr) in one write: a run's processes share their stderr, and print's two
    writes (the text, then the newline) interleave with another process's where Python's output is unbuffered
    (PYTHONUNBUFFERED), joining two workers' lines into one."""
    stream = stream or sys.stderr
    stream.write(line + "\n")
    stream.flush()
