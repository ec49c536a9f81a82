"""FAST: Flexible (A)synchronous Scalable Training of PyTorch models across many workers.

Your own loop (started by `fast run SCRIPT` or torchrun):

    job = fast.init("job.toml")                        # or a dict, or None; overrides as strategy__name="gossip"
    model, optimizer = job.prepare(model, optimizer)
    loader = job.loader(train_set, batch_size=64)
    ...
    summary = job.finish()

FAST's own loop: `fast.train(config)`; several variants and a report: `fast.compare(config, out)`.
"""

from __future__ import annotations

import sys
from typing import Any

import fast.first_import  # noqa: F401 (first: it notes what the process held before FAST)
from fast.version import __version__

_excepthook = sys.excepthook


def _one_line_errors(kind: type, error: BaseException, tb: Any) -> None:
    """A FAST error that ends a script is one line and its exit code, as on the command line; a process whose
    launcher stopped the run while it was being started ends without a word; anything else goes to the hook there
    was before."""
    from fast.errors import FastError, say

    if isinstance(error, FastError):
        # the process's own stderr: torch's hook (installed by init_process_group, and calling this one) reads
        # sys.stderr into a buffer it would print after this hook returns, which sys.exit never does
        say(f"fast: error: {_which_worker()}{error}", sys.__stderr__ or sys.stderr)
        sys.exit(error.exit_code)
    if isinstance(error, FileNotFoundError) and _abandoned(tb):
        return
    _excepthook(kind, error, tb)


def _which_worker() -> str:
    """ "worker R: " in a process of a run another launcher started (torchrun), whose output mixes every rank's
    (FAST's own launcher names the worker itself)."""
    import os

    if os.environ.get("FAST_LAUNCHER") or int(os.environ.get("WORLD_SIZE", "1") or 1) <= 1:
        return ""
    return f"worker {os.environ.get('RANK', '?')}: "


def _abandoned(tb: Any) -> bool:
    """Whether the error was multiprocessing failing to rebuild a lock for a process it was starting: the lock is
    gone when the process that started this one (a launcher, torch's agent) has already stopped the run."""
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    code = tb.tb_frame.f_code if tb is not None else None
    return code is not None and code.co_name == "__setstate__" and code.co_filename.endswith("synchronize.py")


sys.excepthook = _one_line_errors


def init(config: Any = None, *, out: Any = None, resume: Any = None, **overrides: Any) -> Any:
    """Join the run and return its `fast.Job` (see fast.runtime.job). A server process never returns."""
    from fast.runtime.job import init as _init

    return _init(config, out=out, resume=resume, **overrides)


def job() -> Any:
    """The job `fast.init` started in this process (FastError if none)."""
    from fast.runtime.job import current

    return current()


def prepare(model: Any, optimizer: Any) -> Any:
    """`fast.job().prepare(model, optimizer)`."""
    return job().prepare(model, optimizer)


def loader(dataset: Any, batch_size: int | None = None, **options: Any) -> Any:
    """`fast.job().loader(dataset, batch_size, ...)`."""
    return job().loader(dataset, batch_size, **options)


def log(loss: Any = None, **values: Any) -> None:
    """`fast.job().log(loss=..., ...)`."""
    job().log(loss, **values)


def evaluate(eval_fn: Any = None) -> dict[str, float]:
    """`fast.job().evaluate(eval_fn)`."""
    return job().evaluate(eval_fn)


def finish(eval_fn: Any = None) -> dict[str, Any] | None:
    """`fast.job().finish(eval_fn)`."""
    return job().finish(eval_fn)


def pack(config: Any, out: str, **options: Any) -> Any:
    """`fast pack`: export `config`'s job (model, loss, weights, resolved config) into the archive `out`, which
    trains without its source; `sign=`, `open_keys=`, `fixed_keys=`, `metric=` and dotted overrides as in
    `fast.tools.pack.pack`. Returns the archive's path."""
    from fast.tools.pack import pack as _pack

    return _pack(config, out, **options)


def packaged(job_: Any = None) -> tuple[Any, Any]:
    """A packed job's model and its author's optimizer, for your own loop under `fast run --config JOB.fastjob`:
    `model(x, y)` returns the batch's loss (in eval mode, the loss and the package's metrics). Pass both to
    `job.prepare`."""
    from fast.jobs.code import packed_job

    return packed_job((job_ or job()).parts)


def train(
    config: Any = None,
    *,
    out: str | None = None,
    model_fn: Any = None,
    step_fn: Any = None,
    resume: str | None = None,
    **overrides: Any,
) -> dict[str, Any]:
    """Train with FAST's own loop: a config (TOML path, dict or Config) and dotted overrides; returns the summary.

    `model_fn(input_shape, num_classes) -> nn.Module` and `step_fn(model, x, y) -> loss` replace the built-in
    model and the cross-entropy step; both must be importable top-level functions (workers are processes).
    Overrides use `__` for dots: `fast.train("job.toml", run__workers=2, strategy__name="sync")`.
    """
    from fast.runtime.launch import refuse_while_starting_a_worker
    from fast.tools.start import train as _train

    refuse_while_starting_a_worker("fast.train()")
    return _train(config, out=out, model_fn=model_fn, step_fn=step_fn, resume=resume, **overrides)


def run(script: str, *args: str, workers: int | None = None, config: str | None = None, out: Any = None,
        **overrides: Any) -> dict[str, Any] | None:  # fmt: skip
    """`fast run`: your script (which calls fast.init) on `workers` local processes; returns the summary."""
    from fast.runtime.launch import refuse_while_starting_a_worker
    from fast.tools.start import run_script

    refuse_while_starting_a_worker("fast.run()")
    return run_script(script, list(args), workers=workers, config=config, out=out, **overrides)


def compare(config: Any, out: str | None = None, *, script: str | None = None, script_args: Any = None,
            **overrides: Any) -> Any:  # fmt: skip
    """Run every `[[variant]]` of a config (TOML path or dict) into `out`/<variant> and write report.html there;
    returns a `fast.tools.comparison.Comparison` (the report's path and how each variant ended). Overrides as in
    `train`. With `script`, each variant runs your own script as `fast run` does, its keys the launcher's."""
    from fast.runtime.launch import refuse_while_starting_a_worker
    from fast.tools.comparison import compare as _compare

    refuse_while_starting_a_worker("fast.compare()")
    return _compare(config, out, script=script, script_args=list(script_args or []), **overrides)


def __getattr__(name: str) -> Any:
    if name == "Job":
        from fast.runtime.job import Job

        return Job
    raise AttributeError(f"module 'fast' has no attribute {name!r}")


__all__ = [
    "__version__",
    "compare",
    "evaluate",
    "finish",
    "init",
    "job",
    "loader",
    "log",
    "pack",
    "packaged",
    "prepare",
    "run",
    "train",
]
