"""The files a run writes: whole or not at all, and a one-line error naming the file when the disk refuses one.

Outputs and checkpoints are written to a temporary name beside their place, flushed to disk and renamed, so that a
reader finds the old file or the new one, never half of one; a write that fails (a full disk, a read-only one)
leaves the old file and no temporary one, and raises OutputError naming the file and the reason. The temporary
name has a random suffix and is created anew (O_EXCL) without following a link (O_NOFOLLOW): a file or link that
someone else put there is never written through, and a private file (a run's secret) is its owner's alone from its
first byte. Tensors are
serialised in memory first, so that what reaches the disk is plain bytes and its errors the system's own.
"""

from __future__ import annotations

import io
import os
import secrets
from pathlib import Path
from typing import Any

import torch

from fast.errors import FastError


class OutputError(FastError):
    """A file of the run could not be written (the disk is full or read-only); what was written before is kept."""


def _refused(path: Path, error: OSError) -> OutputError:
    reason = error.strerror or str(error)
    return OutputError(f"cannot write {path}: {reason}: free space there (or write the run elsewhere with --out); "
                       "the run's other files are kept")  # fmt: skip


def write_bytes(path: Path, data: bytes, *, private: bool = False) -> None:
    """`data` at `path`, atomically (see the module); readable by its owner alone if `private`; OutputError when
    the disk refuses it."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(8)}")
    created = False
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
        descriptor = os.open(tmp, flags, 0o600 if private else 0o666)
        created = True
        with open(descriptor, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        if created:  # never a file of someone else's that happened to be at the name
            tmp.unlink(missing_ok=True)
        raise _refused(path, e) from None
    except BaseException:
        if created:
            tmp.unlink(missing_ok=True)
        raise


def write_text(path: Path, text: str, *, private: bool = False) -> None:
    write_bytes(path, text.encode(), private=private)


def save(obj: Any, path: Path) -> None:
    """torch.save of `obj` at `path`, atomically."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    write_bytes(path, buffer.getvalue())


def append_line(path: Path, line: str) -> None:
    """`line` and a newline at the end of `path` (a record of the run's)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write(line + "\n")
    except OSError as e:
        raise _refused(path, e) from None
