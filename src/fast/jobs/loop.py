"""The pre-defined worker node of `fast train`: a training loop written on the job API, as a user would write it,
on the parts of a job resolved once (fast.parts), its code built in this process (fast.jobs.code)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fast.jobs.code import StepFn, evaluation, evaluation_during, load_data, make_model, step_of, validation_score
from fast.optim import build_optimizer
from fast.parts import JobParts
from fast.runtime import init
from fast.runtime.job import FAST_LOOP


def _call(step: StepFn, model: nn.Module, batch: Any) -> torch.Tensor:
    return step(model, *batch) if isinstance(batch, tuple | list) else step(model, batch)


def train_worker(parts: JobParts, run_dir: Path, resume: bool = False) -> dict[str, Any] | None:
    """One process of `fast train`: the whole training loop on the job API (servers serve inside init)."""
    FAST_LOOP.set(True)
    job = init(parts, out=run_dir, resume=run_dir if resume else None)
    parts, run = job.parts, job.parts.config.run  # (torchrun's world may have set run.workers)
    train, test = load_data(parts.data)
    # everything but the model first: training time counts from job.prepare's common start
    loader = job.loader(train, run.batch_size)
    step = step_of(parts.step)
    evaluate = evaluation(parts.evaluation, test, job.device)
    # the evaluations during the run: on the first eval.samples of the test set
    evaluate_during = evaluation_during(parts.evaluation, test, job.device) or evaluate
    score = validation_score(parts.evaluation, train, job.device)
    model = make_model(parts.model, train)
    model, optimizer = job.prepare(model, build_optimizer(parts.optimizer.config, model.parameters()))
    if score is not None:
        job.validate_with(score)
    # Dropout and other training randomness: seeded apart from how the model was built (source or package).
    torch.manual_seed(run.seed * 7919 + 1 + job.rank)
    accumulate = run.accumulate
    every = round(run.eval_every * job.steps_per_epoch) if job.steps_per_epoch else 0
    for _ in job.epochs(run.epochs):
        for i, batch in enumerate(loader):
            last = (i + 1) % accumulate == 0
            with contextlib.nullcontext() if last else job.no_sync():
                loss = _call(step, model, batch)
                (loss / accumulate).backward()
            if not last:
                continue
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            job.log(loss=loss)
            if evaluate is not None and every and job.step % every == 0 and not job.stopped:
                job.evaluate(evaluate_during)
    return job.finish(evaluate)
