"""What FAST's JAX front end costs: a JAX job alone against the same job under FAST with one worker, and the
crossings between JAX and torch for the model's parameters.

    .venv/bin/python bench/jax_frontend.py [--steps 400] [--rounds 3]

The job is examples/jax's: a 784-256-10 perceptron on Fashion-MNIST, batches of 64, Adam. Both sides run in this
process, in alternating rounds, the same jitted gradient function on the same batches: "alone" is the plain loop
(Optax's update, then apply_updates, as examples/jax/plain.py writes it); "FAST" is `job.prepare(params, adam)`
and `optimizer.step(grads)` under `sync` with one worker (fast.init without a launcher), the loader included.
Printed: samples/s of each (median over rounds, warm-up steps left out), their ratio, and the median microseconds
of each crossing of one step (fast.jax): the gradients handed to torch (DLPack views), the weights handed to
Optax (a DLPack view of the flat tensor), the new weights written back (one copy) and given to the user (one copy).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import timeit
from pathlib import Path

os.environ.setdefault("FAST_PROGRESS", "0")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import torch  # noqa: E402

import fast  # noqa: E402
from fast.jax import ParameterTree, to_jax  # noqa: E402
from fast.jobs.datasets import load_dataset  # noqa: E402

BATCH, WARMUP = 64, 20


def init(key: jax.Array, sizes: tuple[int, ...] = (784, 256, 10)) -> list[dict[str, jax.Array]]:
    keys = jax.random.split(key, len(sizes) - 1)
    return [{"w": jax.random.normal(k, (m, n)) * np.sqrt(2 / m), "b": jnp.zeros(n)}
            for k, m, n in zip(keys, sizes[:-1], sizes[1:], strict=True)]  # fmt: skip


def loss_fn(params: list[dict[str, jax.Array]], x: jax.Array, y: jax.Array) -> jax.Array:
    h = jax.nn.relu(x @ params[0]["w"] + params[0]["b"])
    return optax.softmax_cross_entropy_with_integer_labels(h @ params[1]["w"] + params[1]["b"], y).mean()


grad_fn = jax.jit(jax.value_and_grad(loss_fn))


def alone(x: np.ndarray, y: np.ndarray, steps: int) -> float:
    """Samples/s of the plain loop (after WARMUP steps)."""
    params = init(jax.random.key(0))
    transformation = optax.adam(1e-3)
    state = transformation.init(params)
    started = 0.0
    for step in range(WARMUP + steps):
        if step == WARMUP:
            jax.block_until_ready(params)
            started = time.perf_counter()
        index = slice(step * BATCH, (step + 1) * BATCH)
        loss, grads = grad_fn(params, x[index], y[index])
        updates, state = transformation.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        float(loss)  # (the FAST loop logs it)
    jax.block_until_ready(params)
    return steps * BATCH / (time.perf_counter() - started)


def under_fast(x: np.ndarray, y: np.ndarray, steps: int, folder: str) -> float:
    """Samples/s of the same loop on FAST, one worker (after WARMUP steps)."""
    job = fast.init({"run": {"workers": 1, "max_steps": WARMUP + steps, "batch_size": BATCH}}, out=folder)
    params, optimizer = job.prepare(init(jax.random.key(0)), optax.adam(1e-3))
    started = 0.0
    for _ in job.epochs(1):
        for xb, yb in job.loader((x, y), shuffle=False):
            if job.step == WARMUP:
                started = time.perf_counter()
            loss, grads = grad_fn(params, xb, yb)
            params = optimizer.step(grads)
            job.log(loss=loss)
    jax.block_until_ready(params)
    seconds = time.perf_counter() - started
    job.finish()
    return steps * BATCH / seconds


def crossings(x: np.ndarray, y: np.ndarray) -> dict[str, float]:
    """Median µs of each crossing of one step, for this model's parameters."""
    params = init(jax.random.key(0))
    tree = ParameterTree(params)
    _, grads = grad_fn(params, x[:BATCH], y[:BATCH])
    leaves = jax.tree_util.tree_leaves(jax.block_until_ready(grads))
    new = jax.block_until_ready(jnp.concatenate([leaf.reshape(-1) for leaf in jax.tree_util.tree_leaves(params)]))
    jax.block_until_ready(tree.tree())

    def median_us(fn, number: int = 200) -> float:
        return 1e6 * statistics.median(timeit.repeat(fn, number=number, repeat=5)) / number

    return {
        "gradients to torch (DLPack views)": median_us(lambda: [torch.from_dlpack(leaf) for leaf in leaves]),
        "weights to Optax (a DLPack view)": median_us(lambda: to_jax(tree.leaves())),
        "new weights into torch (one copy)": median_us(lambda: tree.write(new)),
        "weights to the user (one copy)": median_us(lambda: jax.block_until_ready(tree.tree())),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400, help="timed steps of each side, each round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    data = load_dataset("fashion-mnist")
    needed = (WARMUP + args.steps) * BATCH
    x = data.x_train[:needed].reshape(needed, -1).numpy()
    y = data.y_train[:needed].numpy().astype(np.int32)
    sides: dict[str, list[float]] = {"alone": [], "FAST": []}
    with tempfile.TemporaryDirectory() as folder:
        for round_ in range(args.rounds):
            sides["alone"].append(alone(x, y, args.steps))
            sides["FAST"].append(under_fast(x, y, args.steps, str(Path(folder) / f"round{round_}")))
            print(
                f"round {round_}: alone {sides['alone'][-1]:,.0f} samples/s, FAST {sides['FAST'][-1]:,.0f}", flush=True
            )
    plain, on_fast = statistics.median(sides["alone"]), statistics.median(sides["FAST"])
    spread = {k: f"{min(v):,.0f}-{max(v):,.0f}" for k, v in sides.items()}
    print(
        f"\nsamples/s (median of {args.rounds} rounds of {args.steps} steps): alone {plain:,.0f} ({spread['alone']}), "
        f"FAST with one worker {on_fast:,.0f} ({spread['FAST']}): FAST/alone = {on_fast / plain:.2f}"
    )
    parameters = sum(leaf.size for leaf in jax.tree_util.tree_leaves(init(jax.random.key(0))))
    print(f"crossings of one step, {parameters:,} parameters ({4 * parameters / 1e6:.2f} MB):")
    for name, us in crossings(x, y).items():
        print(f"  {name:<36} {us:>8.1f} µs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
