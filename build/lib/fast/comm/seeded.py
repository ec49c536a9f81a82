"""Deterministic random draws keyed by what they decide (seed, rank, step, message number...).

Each draw depends only on its key, never on how many draws other threads made before it, so emulated
jitter, losses and stragglers repeat exactly for the same seed however the threads of a run interleave.
"""

from __future__ import annotations

import hashlib
import struct


def uniform(*key: int | str) -> float:
    """A number in [0, 1) that is a fixed function of `key`."""
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return (struct.unpack("<Q", digest)[0] >> 11) / float(1 << 53)
