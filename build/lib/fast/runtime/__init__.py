"""The runtime: the job API both loops stand on (a user's own loop, and `fast train`'s pre-defined one).

`fast.init` joins the run and returns a `Job`; `prepare` hooks the strategy into the user's model and optimizer;
`loader` hands each worker its shard; `log` and `evaluate` record; `finish` ends the run and writes its outputs.
"""

from fast.runtime.job import Job, init

__all__ = ["Job", "init"]
