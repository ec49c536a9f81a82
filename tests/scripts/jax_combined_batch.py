"""The reference for tests/test_jax.py, in a process of its own (so that JAX's threads never live in the test
process, which forks): tests/scripts/jax_digits.py's perceptron in plain JAX and Optax, each step on the workers'
batches put together (the same size each, so the mean gradient is the mean of the workers').

    python tests/scripts/jax_combined_batch.py WORKERS STEPS BATCH OUT.npz
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch

from fast.jobs.datasets import load_dataset, partition
from fast.runtime.loader import epoch_order

workers, steps, batch = (int(arg) for arg in sys.argv[1:4])
data = load_dataset("digits", seed=0)
x_all, y_all = data.x_train.reshape(len(data.x_train), -1).numpy(), data.y_train.numpy()
shards = partition(torch.zeros(len(y_all)), workers, "iid", seed=0)
orders = [shard[epoch_order(len(shard), 0, 0, rank)] for rank, shard in enumerate(shards)]
keys = jax.random.split(jax.random.key(0), 2)
sizes = (64, 32, 10)
params = {f"layer{i}": {"w": jax.random.normal(k, (m, n)) / np.sqrt(m), "b": jnp.zeros(n)}
          for i, (k, m, n) in enumerate(zip(keys, sizes[:-1], sizes[1:], strict=True))}  # fmt: skip


def loss_fn(params, x, y):
    h = jnp.tanh(x @ params["layer0"]["w"] + params["layer0"]["b"])
    return optax.softmax_cross_entropy_with_integer_labels(h @ params["layer1"]["w"] + params["layer1"]["b"], y).mean()


transformation = optax.sgd(0.05, momentum=0.9)
state = transformation.init(params)
for step in range(steps):
    index = torch.cat([order[step * batch : (step + 1) * batch] for order in orders]).numpy()
    grads = jax.grad(loss_fn)(params, x_all[index], y_all[index])
    updates, state = transformation.update(grads, state, params)
    params = optax.apply_updates(params, updates)
np.savez(sys.argv[4], **{f"layer{i}/{k}": np.asarray(params[f"layer{i}"][k]) for i in range(2) for k in ("w", "b")})
