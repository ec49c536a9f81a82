"""Fashion-MNIST with a two-layer perceptron in plain JAX and Optax (plain.py), and the same script on FAST
(fast_version.py); `diff plain.py fast_version.py` shows the lines between them.

    python examples/jax/plain.py
    fast run --workers 4 examples/jax/fast_version.py                                   # sync on 4 local workers
    fast run --workers 4 --set strategy.name=diloco --set strategy.period=20 examples/jax/fast_version.py
"""

import gzip
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

DATA = Path(os.environ.get("FAST_DATA_DIR", "/usr/share/datasets/fashion-mnist"))


def images(kind: str) -> tuple[np.ndarray, np.ndarray]:
    with gzip.open(DATA / f"{kind}-images-idx3-ubyte.gz") as f:
        x = np.frombuffer(f.read(), np.uint8, offset=16).reshape(-1, 784)
    with gzip.open(DATA / f"{kind}-labels-idx1-ubyte.gz") as f:
        y = np.frombuffer(f.read(), np.uint8, offset=8)
    return (x / 255.0).astype(np.float32), y.astype(np.int32)


def init(key: jax.Array, sizes: tuple[int, ...] = (784, 256, 10)) -> list[dict[str, jax.Array]]:
    keys = jax.random.split(key, len(sizes) - 1)
    return [{"w": jax.random.normal(k, (m, n)) * np.sqrt(2 / m), "b": jnp.zeros(n)}
            for k, m, n in zip(keys, sizes[:-1], sizes[1:], strict=True)]  # fmt: skip


def logits(params: list[dict[str, jax.Array]], x: jax.Array) -> jax.Array:
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]


def loss_fn(params: list[dict[str, jax.Array]], x: jax.Array, y: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits(params, x), y).mean()


grad_fn = jax.jit(jax.value_and_grad(loss_fn))
accuracy = jax.jit(lambda params, x, y: (logits(params, x).argmax(1) == y).mean())


def evaluate(params: list[dict[str, jax.Array]]) -> dict[str, float]:
    return {"accuracy": float(accuracy(params, x_test, y_test))}


(x_train, y_train), (x_test, y_test) = images("train"), images("t10k")
params = init(jax.random.key(0))
optimizer = optax.adam(1e-3)
opt_state = optimizer.init(params)
for epoch in range(2):
    order = np.random.default_rng(epoch).permutation(len(x_train))
    for x, y in ((x_train[i], y_train[i]) for i in np.split(order[: len(order) // 64 * 64], len(order) // 64)):
        loss, grads = grad_fn(params, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    print(f"epoch {epoch}: {evaluate(params)}")
