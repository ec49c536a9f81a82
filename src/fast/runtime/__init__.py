"""The runtime: the job API both loops stand on (a user's own loop, and `fast train`'s pre-defined one).

`fast.init` joins the run and returns a `Job`; `prepare` hooks the strategy into the user's model and optimizer;
`loader` hands each worker its shard; `log` and `evaluate` record; `finish` ends the run and writes its outputs.

`Job` and `init` are imported on first use, so that a module beside the runtime may take one of its leaves (fast.shards
writes its checkpoints through fast.runtime.files) without the job, which imports it back.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Job", "init"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from fast.runtime import job

        return getattr(job, name)
    raise AttributeError(f"module 'fast.runtime' has no attribute {name!r}")
