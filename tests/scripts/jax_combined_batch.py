"""The reference for tests/test_jax.py, in a process of its own (so that JAX's threads never live in the test
process, which forks): the perceptron of tests/scripts/jax_perceptron.py in plain JAX and Optax, each step on the
workers' batches put together (the same size each, so the mean gradient is the mean of the workers').

    python tests/scripts/jax_combined_batch.py WORKERS STEPS BATCH OUT.npz
"""

from __future__ import annotations

import sys

import jax
import numpy as np
import optax
import torch
from jax_perceptron import init, loss_fn

from fast.jobs.datasets import load_dataset, partition
from fast.runtime.loader import epoch_order

workers, steps, batch = (int(arg) for arg in sys.argv[1:4])
data = load_dataset("digits", seed=0)
x_all, y_all = data.x_train.reshape(len(data.x_train), -1).numpy(), data.y_train.numpy()
shards = partition(torch.zeros(len(y_all)), workers, "iid", seed=0)
orders = [shard[epoch_order(len(shard), 0, 0, rank)] for rank, shard in enumerate(shards)]
params = init(jax.random.key(0))

transformation = optax.sgd(0.05, momentum=0.9)
state = transformation.init(params)
for step in range(steps):
    index = torch.cat([order[step * batch : (step + 1) * batch] for order in orders]).numpy()
    grads = jax.grad(loss_fn)(params, x_all[index], y_all[index])
    updates, state = transformation.update(grads, state, params)
    params = optax.apply_updates(params, updates)
np.savez(sys.argv[4], **{f"layer{i}/{k}": np.asarray(params[f"layer{i}"][k]) for i in range(2) for k in ("w", "b")})
