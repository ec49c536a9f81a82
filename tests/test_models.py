"""Tests for fast.jobs.models: output shapes on small and large inputs, determinism, and that training learns."""

import pytest
import torch
from torch import nn

from fast.errors import ConfigError
from fast.jobs.datasets import load_dataset
from fast.jobs.models import MODELS, build_model


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("shape", [(1, 8, 8), (1, 28, 28), (3, 12, 10)])
def test_forward_gives_one_logit_per_class(name, shape):
    model = build_model(name, shape, 7)
    logits = model(torch.randn(5, *shape))
    assert logits.shape == (5, 7)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("name", MODELS)
def test_same_seed_same_weights_and_different_seed_different_weights(name):
    def weights(seed):
        torch.manual_seed(seed)
        return nn.utils.parameters_to_vector(build_model(name, (1, 28, 28), 10).parameters())

    assert torch.equal(weights(0), weights(0))
    assert not torch.equal(weights(0), weights(1))


def test_lenet_matches_lenet5_layer_sizes_on_28x28():
    model = build_model("lenet", (1, 28, 28), 10)
    linear_shapes = [tuple(layer.weight.shape) for layer in model.modules() if isinstance(layer, nn.Linear)]
    conv_shapes = [tuple(layer.weight.shape) for layer in model.modules() if isinstance(layer, nn.Conv2d)]
    assert conv_shapes == [(6, 1, 5, 5), (16, 6, 5, 5)]
    assert linear_shapes == [(120, 16 * 5 * 5), (84, 120), (10, 84)]


def test_lstm_reads_rows_as_time_steps_through_a_128_wide_transform():
    model = build_model("lstm", (1, 28, 28), 10)
    assert model.input_transform.weight.shape == (128, 28)
    assert model.lstm.hidden_size == 128 and model.lstm.input_size == 128
    # The prediction depends on the last row (the last time step), not only on the first ones.
    images = torch.randn(2, 1, 28, 28)
    changed = images.clone()
    changed[:, :, -1] += 5
    assert not torch.allclose(model(images), model(changed))


@pytest.mark.parametrize("name", MODELS)
def test_unknown_or_malformed_requests_are_config_errors(name):
    with pytest.raises(ConfigError, match="resnet8"):
        build_model("vgg16", (1, 28, 28), 10)
    with pytest.raises(ConfigError, match="input_shape"):
        build_model(name, (28, 28), 10)


@pytest.mark.parametrize("name", ["mlp", "lenet", "resnet8", "lstm"])
def test_a_few_sgd_steps_on_digits_reduce_the_loss(name):
    dataset = load_dataset("digits", seed=0)
    torch.manual_seed(0)
    model = build_model(name, dataset.input_shape, dataset.num_classes)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    x, y = dataset.x_train[:256], dataset.y_train[:256]

    def loss() -> float:
        model.eval()
        with torch.no_grad():
            value = loss_fn(model(x), y).item()
        model.train()
        return value

    before = loss()
    generator = torch.Generator().manual_seed(0)
    for _ in range(60):
        batch = torch.randint(0, len(x), (32,), generator=generator)
        optimizer.zero_grad()
        loss_fn(model(x[batch]), y[batch]).backward()
        optimizer.step()
    assert loss() < 0.5 * before
