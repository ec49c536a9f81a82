"""`fast train`: resolve the config, prepare the run folder, start the workers (or join torchrun's job)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from fast import engine
from fast.config import Config, load_config
from fast.data import load_dataset
from fast.errors import ConfigError
from fast.launch import Interrupted, launch, launch_elastic
from fast.strategies import strategy_class
from fast.worker import UserCode, server_count, worker_main


def default_run_dir(config: Config) -> Path:
    stamp = os.environ.get("TORCHELASTIC_RUN_ID") if engine.under_torchrun() else None
    return Path("runs") / f"{config.run.name}-{stamp or time.strftime('%Y%m%d-%H%M%S')}"


def prepare(
    config: Any = None, *, out: str | Path | None = None, resume: str | Path | None = None, **overrides: Any
) -> tuple[Config, Path]:
    """The validated config and its run folder (with config.toml written); nothing is started."""
    if resume is not None:
        run_dir = Path(resume)
        if not (run_dir / "config.toml").is_file():
            raise ConfigError(f"--resume {run_dir}: no config.toml there; give the folder of an earlier run")
        config = load_config(config if config is not None else run_dir / "config.toml", **overrides)
    else:
        config = load_config(config, **overrides)
        run_dir = Path(out) if out is not None else default_run_dir(config)
    load_dataset(
        config.data.name,
        seed=config.run.seed,
        data_dir=config.data.dir,
        synthetic_train=config.data.synthetic_train,
        synthetic_test=config.data.synthetic_test,
    )
    run_dir.mkdir(parents=True, exist_ok=True)
    if resume is None:  # a fresh run in a used folder starts clean
        for stale in [*run_dir.glob("workers/metrics-*.jsonl"), *run_dir.glob("checkpoints/*.pt")]:
            stale.unlink()
    (run_dir / "config.toml").write_text(config.to_toml())
    return config, run_dir


def train(
    config: Any = None,
    *,
    out: str | Path | None = None,
    model_fn: Any = None,
    step_fn: Any = None,
    resume: str | Path | None = None,
    **overrides: Any,
) -> dict[str, Any]:
    """Run one training job to the end; returns the summary (on rank 0; {} on other torchrun ranks)."""
    config, run_dir = prepare(config, out=out, resume=resume, **overrides)
    user = UserCode(model_fn=model_fn, step_fn=step_fn, strategy_class=strategy_class(config.strategy.name))
    if engine.under_torchrun():
        expected = config.run.workers + server_count(config)
        if int(os.environ["WORLD_SIZE"]) != expected:
            raise ConfigError(
                f"torchrun started {os.environ['WORLD_SIZE']} processes but the config needs "
                f"{expected} (run.workers plus servers): set --nproc-per-node/--nnodes to match"
            )
        return worker_main(config, run_dir, user, resume is not None) or {}
    nprocs = config.run.workers + server_count(config)
    addr = config.run.master_addr
    port = config.run.master_port or engine.free_port(addr)
    threads = config.run.threads_per_worker or max(1, (os.cpu_count() or 1) // nprocs)
    args = (config, run_dir, user, resume is not None)
    try:
        if config.run.max_restarts:
            outputs = launch_elastic(
                worker_main, nprocs, args, addr=addr, port=port, threads=threads, max_restarts=config.run.max_restarts
            )
        else:
            survivable = strategy_class(config.strategy.name).survives_failures
            outputs = launch(worker_main, nprocs, args, addr=addr, port=port, threads=threads, survivable=survivable)
    except Interrupted as e:
        if any(run_dir.glob("checkpoints/*.pt")):
            raise Interrupted(f"{e}; continue with: fast train --resume {run_dir}") from None
        raise
    summary = outputs[0]
    summary["run_dir"] = str(run_dir)
    return summary
