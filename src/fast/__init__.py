"""FAST: Flexible (A)synchronous Scalable Training of PyTorch models across many workers."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"


def train(
    config: Any = None,
    *,
    out: str | None = None,
    model_fn: Any = None,
    step_fn: Any = None,
    resume: str | None = None,
    **overrides: Any,
) -> dict[str, Any]:
    """Train with a config (TOML path, dict or Config) and dotted overrides; returns the run's summary.

    `model_fn(input_shape, num_classes) -> nn.Module` and `step_fn(model, x, y) -> loss` replace the built-in
    model and the cross-entropy step; both must be importable top-level functions (workers are processes).
    Overrides use `__` for dots: `fast.train("job.toml", run__workers=2, strategy__name="sync")`.
    """
    from fast.run import train as _train

    return _train(config, out=out, model_fn=model_fn, step_fn=step_fn, resume=resume, **overrides)


def compare(config: Any, out: str | None = None, **overrides: Any) -> Any:
    """Run every `[[variant]]` of a config (TOML path or dict) into `out`/<variant> and write report.html there;
    returns a `fast.compare.Comparison` (the report's path and how each variant ended). Overrides as in `train`."""
    from fast.compare import compare as _compare

    return _compare(config, out, **overrides)


__all__ = ["__version__", "compare", "train"]
