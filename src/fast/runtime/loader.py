"""This worker's shard of any dataset, batch by batch, in an order that depends only on (seed, epoch, worker).

Map-style datasets are cut into disjoint shards, `iid` (a seeded permutation) or `dirichlet` (label skew; the
labels from `labels=`, else `dataset.targets`); every worker runs the same number of batches per epoch (the
smallest shard decides), so synchronous strategies stay in step. Tensor datasets are indexed a batch at a time;
other datasets go through a `torch.utils.data.DataLoader` (worker processes). On CUDA, batches are made in pinned
host memory and moved to the GPU one step ahead on a stream of their own (fast.runtime.prefetch): the step never
waits for its batch's copy, nor does the host. An
`IterableDataset` is split by position (worker k takes items k, k + N, ...); under a strategy whose workers move
in step, the workers agree after each batch whether all of them have one, so they end an epoch together.

Each pass over the loader is the next epoch. After a resume the first pass skips the batches already done.

A sharded run's workers are replicas of K processes (`run.shards`, fast.shards): the data is cut by replica, each
replica's order is the one an unsharded worker of its index would have, and each of its K processes takes its slice
of every batch (the batch size is the replica's; process k of its replica takes rows k·b/K to (k+1)·b/K).

A live run (`run.membership = "live"`) has no shards: its members share one cursor through each epoch's order (a seeded
permutation of the whole dataset), and at each step the member of rank r of n takes the r-th of the next n
batches, so that members may come and go without a sample lost or seen twice (fast.runtime.live). A sharded live
run's members are replicas: the replica r of n takes the r-th batch, each of its K processes its slice.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator
from typing import Any, Protocol

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

from fast.config import Config
from fast.errors import ConfigError
from fast.runtime.prefetch import pinned_rows, prefetched, to_device
from fast.runtime.sharding import partition


class Host(Protocol):
    """What a loader asks of the job it serves (fast.runtime.job.Job)."""

    config: Config
    rank: int
    workers: int
    is_worker: bool
    replica_index: int  # this worker's replica (its rank, unsharded)
    shard_index: int  # this process's shard of its replica (0, unsharded)
    shards: int
    device: torch.device
    step: int
    stopped: bool
    loader_position: tuple[int, int] | None
    loaders: list[Any]

    def _settle(self) -> None: ...

    def _all_have(self, has_batch: bool) -> bool: ...

    def _loader_created(self, loader: Any) -> None: ...


def labels_of(dataset: Any, labels: Any = None) -> torch.Tensor:
    """The labels the dirichlet partition splits by: `labels`, else `dataset.targets`; ConfigError otherwise."""
    found = labels if labels is not None else getattr(dataset, "targets", None)
    if found is None:
        raise ConfigError(
            "`data.partition` = 'dirichlet' needs the labels of the dataset: give job.loader(..., labels=...) or a "
            "dataset with a `targets` attribute, or set data.partition = 'iid'"
        )
    found = torch.as_tensor(found)
    if found.dim() != 1 or len(found) != len(dataset):
        raise ConfigError(f"the labels for `data.partition` = 'dirichlet' must be one per sample ({len(dataset)})")
    return found


def tensor_dataset(arrays: tuple[Any, ...]) -> TensorDataset:
    """A tuple of equally long arrays (tensors, or anything NumPy reads: NumPy's, JAX's) as a TensorDataset."""
    tensors = [a if isinstance(a, torch.Tensor) else torch.as_tensor(np.array(a)) for a in arrays]
    if not tensors or any(t.dim() == 0 or len(t) != len(tensors[0]) for t in tensors):
        lengths = ", ".join(str(len(t)) if t.dim() else "a scalar" for t in tensors) or "nothing"
        raise ConfigError(f"job.loader: a tuple of arrays must hold equally long arrays (samples first), got {lengths}")
    return TensorDataset(*tensors)


def epoch_order(size: int, seed: int, epoch: int, rank: int) -> torch.Tensor:
    """The order a worker visits its shard in an epoch: a function of (seed, epoch, rank) only."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch * 7919 + rank)
    return torch.randperm(size, generator=generator)


@functools.lru_cache(maxsize=2)
def _whole(size: int) -> torch.Tensor:
    """0 .. size - 1: a live run's shard, the whole data set (one tensor for every member of a process: read it)."""
    return torch.arange(size)


@functools.lru_cache(maxsize=4)
def _shared_order(size: int, seed: int, epoch: int) -> torch.Tensor:
    """A live run's order through an epoch, the same for every member (made once for every member of a process, a
    simulated run's thousand: read it)."""
    return _whole(size)[epoch_order(size, seed, epoch, 0)]


class _Batches(torch.utils.data.Sampler):
    """A fixed list of index batches, as a DataLoader batch sampler."""

    def __init__(self, batches: list[list[int]]) -> None:
        self.batches = batches

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


class ShardedLoader:
    """Iterate over it once per epoch; see the module docstring."""

    def __init__(
        self,
        job: Host,
        dataset: Dataset,
        batch_size: int,
        *,
        shuffle: bool = True,
        labels: Any = None,
        num_workers: int | None = None,
        collate_fn: Any = None,
        device_placement: bool = True,
    ) -> None:
        if batch_size < 1:
            raise ConfigError(f"job.loader: batch_size must be at least 1, got {batch_size}")
        shards = getattr(job, "shards", 1)
        if batch_size % shards:
            raise ConfigError(f"job.loader: batch size {batch_size} does not split into run.shards = {shards} "
                              f"equal slices (a replica's batch, each shard a slice): use a multiple of "
                              f"{shards}")  # fmt: skip
        self.slice = batch_size // shards  # this process's part of its replica's batch
        self.part = getattr(job, "shard_index", 0) * self.slice
        self.replica = getattr(job, "replica_index", job.rank)  # (the worker's rank, unsharded)
        self.job, self.dataset, self.batch_size, self.shuffle = job, dataset, batch_size, shuffle
        self.collate_fn = collate_fn
        self.device = job.device if device_placement else None
        config, data = job.config, job.parts.data
        self.num_workers = data.loader_workers if num_workers is None else num_workers
        self.streaming = isinstance(dataset, IterableDataset)
        self.steps_per_epoch: int | None = None
        if self.streaming and getattr(job, "live", False):
            raise ConfigError("run.membership = 'live' needs a map-style dataset (its members share one cursor "
                              "through it): an IterableDataset cannot be taken up where a leaving worker "
                              "stood")  # fmt: skip
        if getattr(job, "live", False):
            self.shard = _whole(len(dataset))
            planned = config.run.workers * batch_size  # the run's length is planned for the workers it starts with
            if len(dataset) < planned:
                raise ConfigError(f"the dataset has {len(dataset)} samples, fewer than one batch of {batch_size} for "
                                  f"each of the {config.run.workers} workers: use a smaller batch")  # fmt: skip
            self.steps_per_epoch = len(dataset) // planned
        elif not self.streaming:
            workers, seed = job.workers, config.run.seed
            if len(dataset) < workers:
                raise ConfigError(f"the dataset has {len(dataset)} samples for {workers} workers: use fewer workers")
            if data.partition == "dirichlet":
                cut = partition(labels_of(dataset, labels), workers, "dirichlet", alpha=data.alpha, seed=seed)
            else:
                cut = partition(torch.zeros(len(dataset)), workers, "iid", seed=seed)
            self.shard = cut[min(self.replica, workers - 1)] if job.is_worker else cut[0][:0]
            smallest = min(len(s) for s in cut)
            if batch_size > smallest:
                raise ConfigError(
                    f"batch size {batch_size} (run.batch_size, or job.loader's) is larger than the smallest worker's "
                    f"shard, {smallest} of the {len(dataset)} samples: use a batch of at most {smallest}, or fewer "
                    "workers"
                )
            self.steps_per_epoch = smallest // batch_size
        self.tensors = getattr(dataset, "tensors", None) if collate_fn is None else None
        self.epoch: int | None = None  # the epoch of the last pass
        self.taken = 0  # batches of it handed out
        job._loader_created(self)

    def __len__(self) -> int:
        if self.steps_per_epoch is None:
            raise TypeError("a loader over an IterableDataset has no length")
        return self.steps_per_epoch

    def __iter__(self) -> Iterator[Any]:
        frontend = getattr(self.job, "frontend", None)  # a JAX job's: its arrays, and the step begins with the batch
        for batch in self._batches():
            yield frontend.batch(batch) if frontend is not None else batch

    def _batches(self) -> Iterator[Any]:
        job = self.job
        if getattr(job, "detached", False):
            yield from self._queue()
            return
        if getattr(job, "live", False):
            yield from self._cursor()
            return
        self.epoch, skip = self._start()
        self.taken = skip
        if self.streaming:
            yield from self._stream()
            return
        order = self.shard
        if self.shuffle:
            order = order[epoch_order(len(order), job.config.run.seed, self.epoch, self.replica)]
        b, first = self.batch_size, self.part
        batches = [order[i * b + first : i * b + first + self.slice] for i in range(skip, self.steps_per_epoch)]
        for batch in self._fetch(batches):
            job._settle()  # the workers' check owed after the last step, before this batch is used
            if job.stopped:
                return
            self.taken += 1
            yield batch

    def _cursor(self) -> Iterator[Any]:
        """One pass of a live run: this member's batch of each step, from the cursor the members share."""
        job, b = self.job, self.batch_size
        self.epoch = job.data_epoch
        order = _shared_order(len(self.shard), job.config.run.seed, self.epoch) if self.shuffle else self.shard
        self.taken = 0
        job._epoch_samples = len(order)
        while not job.stopped:
            job._membership_boundary()  # the members switch (and heal) before the batch is chosen
            if job.stopped or job.data_epoch != self.epoch:
                return
            if job._epoch_over(len(order)):  # for every member at once
                return
            start = job.data_cursor + job.data_place * b + self.part  # (a shard's slice)
            self.taken += 1
            yield next(self._fetch([order[start : start + self.slice]]))

    def _queue(self) -> Iterator[Any]:
        """One pass of a live run's detached workers (fast.runtime.detached): the batches this worker takes
        from the run's work queue, through the epoch's order, until the queue moves to the next epoch."""
        job, b = self.job, self.batch_size
        self.epoch, per_epoch = job.data_epoch, len(self.shard) // b
        order = _shared_order(len(self.shard), job.config.run.seed, self.epoch) if self.shuffle else self.shard
        self.taken = 0
        while (taken := job._take_batch(per_epoch)) is not None:
            epoch, index = taken
            if epoch != self.epoch:  # the queue is past this epoch: the next pass takes the batch
                job.data_epoch = epoch
                return
            job._batch_taken()
            self.taken += 1
            yield next(self._fetch([order[index * b : (index + 1) * b]]))

    def _start(self) -> tuple[int, int]:
        """(epoch, batches to skip) of this pass: the next epoch, or where a resumed run stopped."""
        if self.epoch is not None:
            return self.epoch + 1, 0
        job = self.job
        if job.loader_position is not None and job.loaders and job.loaders[0] is self:
            epoch, skip = job.loader_position
        elif self.steps_per_epoch:
            epoch, skip = divmod(job.step * job.config.run.accumulate, self.steps_per_epoch)
        else:
            epoch, skip = 0, 0
        if self.steps_per_epoch and skip >= self.steps_per_epoch:
            epoch, skip = epoch + 1, 0
        return epoch, skip

    def _fetch(self, batches: list[torch.Tensor]) -> Iterator[Any]:
        if self.device is not None and self.device.type == "cuda":  # each batch's copy behind the step before it
            yield from prefetched(self._on_host(batches), self.device)
            return
        for batch in self._on_host(batches):
            yield self._place(batch)

    def _on_host(self, batches: list[torch.Tensor]) -> Iterator[Any]:
        """The batches of these indices as the dataset gives them (in pinned memory for a GPU)."""
        pinned = self.device is not None and self.device.type == "cuda"
        if self.tensors is not None:  # a batch is one indexing of each tensor
            for index in batches:
                yield tuple(pinned_rows(t, index) if pinned and not t.is_cuda else t[index] for t in self.tensors)
            return
        loader = DataLoader(
            self.dataset,
            batch_sampler=_Batches([index.tolist() for index in batches]),
            num_workers=self.num_workers,
            collate_fn=self.collate_fn,
            pin_memory=pinned,
            persistent_workers=False,
        )
        yield from loader

    def _stream(self) -> Iterator[Any]:
        job = self.job
        mine = _Slice(self.dataset, self.replica, job.workers, self.part // self.slice, self.batch_size // self.slice,
                      self.slice)  # fmt: skip
        batches = iter(DataLoader(mine, batch_size=self.slice, drop_last=True, collate_fn=self.collate_fn))
        while not job.stopped:
            batch = next(batches, None)
            if not job._all_have(batch is not None):
                return
            self.taken += 1
            yield self._place(batch)

    def _place(self, batch: Any) -> Any:
        if self.device is None:
            return batch
        return to_device(batch, self.device, non_blocking=self.device.type == "cuda")


class _Slice(IterableDataset):
    """Worker `rank` of `workers`'s part of a stream: items rank, rank + workers, ...; of those, a sharded replica's
    shard `part` of `parts` takes the `part`-th run of `run` items of every `parts` runs (its slice of each batch)."""

    def __init__(self, dataset: IterableDataset, rank: int, workers: int, part: int = 0, parts: int = 1,
                 run: int = 1) -> None:  # fmt: skip
        self.dataset, self.rank, self.workers = dataset, rank, workers
        self.part, self.parts, self.run = part, parts, run

    def __iter__(self) -> Iterator[Any]:
        mine = itertools.islice(iter(self.dataset), self.rank, None, self.workers)
        if self.parts == 1:
            return mine
        return (item for i, item in enumerate(mine) if (i // self.run) % self.parts == self.part)
