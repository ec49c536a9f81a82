"""The perceptron of the JAX tests, in plain JAX and Optax: the job (jax_digits.py) and its reference
(jax_combined_batch.py) share it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax


def init(key: jax.Array, sizes: tuple[int, ...] = (64, 32, 10)) -> dict[str, dict[str, jax.Array]]:
    keys = jax.random.split(key, len(sizes) - 1)
    return {f"layer{i}": {"w": jax.random.normal(k, (m, n)) / np.sqrt(m), "b": jnp.zeros(n)}
            for i, (k, m, n) in enumerate(zip(keys, sizes[:-1], sizes[1:], strict=True))}  # fmt: skip


def logits(params: dict[str, dict[str, jax.Array]], x: jax.Array) -> jax.Array:
    layers = [params[f"layer{i}"] for i in range(len(params))]
    for layer in layers[:-1]:
        x = jnp.tanh(x @ layer["w"] + layer["b"])
    return x @ layers[-1]["w"] + layers[-1]["b"]


def loss_fn(params: dict[str, dict[str, jax.Array]], x: jax.Array, y: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits(params, x), y).mean()
