"""A JAX job for the tests: a perceptron in plain JAX and Optax on scikit-learn's 8x8 digits (FAST's `digits`).

    fast run --workers 2 tests/scripts/jax_digits.py [--optimizer sgd|adam|scheduled] [--evaluate-every N]

With CRASH_AT=k in the environment, rank CRASH_RANK (default 0) exits at its k-th step in its first life.
"""

from __future__ import annotations

import argparse
import os

import jax
import optax
from jax_perceptron import init, logits, loss_fn

import fast
from fast.jobs.datasets import load_dataset

parser = argparse.ArgumentParser()
parser.add_argument("--optimizer", default="sgd", choices=["sgd", "adam", "scheduled"])
parser.add_argument("--evaluate-every", type=int, default=0, help="steps between mid-run evaluations; 0: none")
parser.add_argument("--check-reported", action="store_true", help="job.model_for_eval() is the parameters' pytree")
args = parser.parse_args()

job = fast.init({"data": {"name": "digits"}, "run": {"batch_size": 16}})
data = load_dataset("digits", seed=job.config.run.seed)
x_train, y_train = data.x_train.reshape(len(data.x_train), -1).numpy(), data.y_train.numpy()
x_test, y_test = data.x_test.reshape(len(data.x_test), -1).numpy(), data.y_test.numpy()


grad_fn = jax.jit(jax.value_and_grad(loss_fn))


def evaluate(params: dict[str, dict[str, jax.Array]]) -> dict[str, float]:
    predicted = logits(params, x_test).argmax(1)
    return {"accuracy": float((predicted == y_test).mean()), "loss": float(loss_fn(params, x_test, y_test))}


lr = job.config.optimizer.lr
transformation = {
    "sgd": lambda: optax.sgd(lr, momentum=0.9),
    "adam": lambda: optax.adam(lr),
    "scheduled": lambda: optax.inject_hyperparams(optax.sgd)(learning_rate=lr, momentum=0.9),
}[args.optimizer]()
params, optimizer = job.prepare(init(jax.random.key(0)), transformation)
for _ in job.epochs():
    for x, y in job.loader((x_train, y_train)):
        loss, grads = grad_fn(params, x, y)
        params = optimizer.step(grads)
        job.log(loss=loss)
        if job.step == int(os.environ.get("CRASH_AT", "0")) and job.rank == int(os.environ.get("CRASH_RANK", "0")):
            os._exit(9)
        if args.evaluate_every and job.step % args.evaluate_every == 0 and not job.stopped:
            job.evaluate(evaluate)
if args.check_reported:  # (collective where the replicas differ: every worker asks)
    reported = job.model_for_eval()
    assert jax.tree_util.tree_structure(reported) == jax.tree_util.tree_structure(params), reported
job.finish(evaluate)
