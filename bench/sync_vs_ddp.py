"""FAST `sync` against PyTorch DDP and against no communication at all, on the same job.

    .venv/bin/python bench/sync_vs_ddp.py [--rounds 3] [--steps 150] [--models lenet mlp] [--workers 2 4]
                                          [--quick] [--out results.json]

For each model and worker count, three sides train the same model (fast.jobs.models) on the same data shards
(Fashion-MNIST if installed, else mnist5k; iid partition), with the same batch per worker, optimizer
(SGD lr 0.05, momentum 0.9), number of steps and torch threads per process (cores // workers):

- `sync`: `fast.train(strategy.name="sync")`, FAST's bucketed all-reduce overlapped with backward, as a user
  gets it: with every worker on this machine's CPU, the buckets are summed through shared memory;
- `sync-gloo`: the same with `run.shared_memory = false`, the buckets summed by gloo's all-reduce as DDP's
  are (FAST's bucketing against DDP's C++ reducer on one transport);
- `ddp`:  the same step loop as FAST's worker under torch.nn.parallel.DistributedDataParallel (its
  defaults), started by FAST's launcher on a gloo group made by fast.comm.bootstrap;
- `none`: `fast.train(strategy.name="none")`, no communication at all: the upper bound.

Each side's samples/s is steps x batch x workers over the slowest worker's time from the common start
barrier to its last step (FAST's summary leaves evaluation out of the clock; DDP times only the steps).
The sides alternate within a round, and the order rotates from round to round, so a load change on the
machine hits every side alike; the table reports medians over rounds and the ratios of those medians, and the
range of sync/ddp within single rounds (how much one round can say on this machine).
Targets: sync/ddp >= 1.0 (on CPU and GPU) and, on a GPU, sync/none >= 0.9.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import fast
from fast.comm import bootstrap as engine
from fast.jobs.datasets import FASHION_MNIST_DEBIAN_DIR, load_dataset, partition
from fast.jobs.models import build_model
from fast.runtime.launch import launch

SIDES = ("sync", "sync-gloo", "ddp", "none")
BATCH = 64
LR, MOMENTUM = 0.05, 0.9
SEED = 0
TARGET_VS_DDP, TARGET_VS_NONE = 1.0, 0.9


def dataset_name() -> str:
    folder = Path(os.environ.get("FAST_DATA_DIR") or FASHION_MNIST_DEBIAN_DIR)
    return "fashion-mnist" if folder.is_dir() else "mnist5k"


def threads_per_process(workers: int) -> int:
    """What FAST gives each worker when run.threads_per_worker is 0."""
    return max(1, (os.cpu_count() or 1) // workers)


def ddp_worker(model_name: str, data_name: str, workers: int, steps: int, threads: int) -> float:
    """One DDP process: FAST's step loop (same shard, batch order, model, optimizer); returns seconds."""
    rank = int(os.environ["RANK"])
    torch.set_num_threads(threads)
    engine.start(rank, workers, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), torch.device("cpu"), 60.0)
    try:
        return ddp_steps(model_name, data_name, workers, steps, rank)
    finally:
        # DDP's reducer is gone by now: had it held the last reference to the process group, freeing it (with
        # the GIL held) would join gloo threads that wait for the GIL, and the process would never exit
        gc.collect()
        engine.stop()


def ddp_steps(model_name: str, data_name: str, workers: int, steps: int, rank: int) -> float:
    data = load_dataset(data_name, seed=SEED)
    shards = partition(data.y_train, workers, "iid", seed=SEED)
    per_epoch = max(1, min(len(s) for s in shards) // BATCH)  # the smallest shard decides, as in FAST
    x, y = data.x_train[shards[rank]], data.y_train[shards[rank]]
    torch.manual_seed(SEED)
    model = DistributedDataParallel(build_model(model_name, data.input_shape, data.num_classes))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    torch.distributed.barrier()
    start = time.perf_counter()
    order, order_epoch = None, -1
    for step in range(steps):
        epoch, i = divmod(step, per_epoch)
        if epoch != order_epoch:  # the worker's data order: a permutation per (seed, epoch, rank)
            g = torch.Generator().manual_seed(SEED * 1_000_003 + epoch * 7919 + rank)
            order, order_epoch = torch.randperm(len(x), generator=g), epoch
        idx = order[i * BATCH : (i + 1) * BATCH]
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x[idx]), y[idx])
        loss.backward()
        optimizer.step()
        float(loss.detach())  # FAST's worker reads the loss every step too
    return time.perf_counter() - start


def samples_per_s(side: str, model_name: str, data_name: str, workers: int, steps: int, out: Path) -> float:
    threads = threads_per_process(workers)
    if side == "ddp":
        args = (model_name, data_name, workers, steps, threads)
        seconds = launch(ddp_worker, workers, args, port=engine.free_port(), threads=threads)
        return steps * BATCH * workers / max(seconds.values())
    summary = fast.train(
        None,
        out=str(out / f"{model_name}-{workers}-{side}"),
        run__name=f"bench-{side}",
        run__seed=SEED,
        run__workers=workers,
        run__batch_size=BATCH,
        run__max_steps=steps,
        run__epochs=1000,  # max_steps decides
        run__eval_every=0,
        run__threads_per_worker=threads,
        data__name=data_name,
        data__partition="iid",
        model__name=model_name,
        optimizer__name="sgd",
        optimizer__lr=LR,
        optimizer__momentum=MOMENTUM,
        strategy__name="sync" if side == "sync-gloo" else side,
        run__shared_memory=side != "sync-gloo",
    )
    assert summary["steps_per_worker"] == steps, summary["steps_per_worker"]
    return float(summary["samples_per_s"])


def bench(models: list[str], workers_list: list[int], rounds: int, steps: int, out: Path) -> list[dict]:
    data_name = dataset_name()
    print(
        f"data {data_name}, batch {BATCH} per worker, {steps} steps, {rounds} rounds, {os.cpu_count()} cores, "
        f"load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    rows = []
    for model_name in models:
        for workers in workers_list:
            runs: dict[str, list[float]] = {side: [] for side in SIDES}
            for r in range(rounds):
                order = SIDES[r % len(SIDES) :] + SIDES[: r % len(SIDES)]
                for side in order:
                    runs[side].append(samples_per_s(side, model_name, data_name, workers, steps, out))
                print(
                    f"  {model_name} x{workers} round {r + 1}: " + ", ".join(f"{s} {runs[s][-1]:.0f}" for s in SIDES),
                    flush=True,
                )
            median = {side: statistics.median(v) for side, v in runs.items()}
            rows.append(
                {
                    "model": model_name,
                    "workers": workers,
                    "samples_per_s": runs,
                    "median": median,
                    "sync_vs_ddp": median["sync"] / median["ddp"],
                    "sync_gloo_vs_ddp": median["sync-gloo"] / median["ddp"],
                    "sync_vs_none": median["sync"] / median["none"],
                    "load_average": os.getloadavg()[0],
                }
            )
    return rows


def print_table(rows: list[dict]) -> bool:
    """The table of medians (gloo: `sync-gloo`); True when sync/ddp >= 1.0 everywhere (the target on CPU;
    sync/none >= 0.9 is the issue's target on a GPU, where an idle device can hide communication, and is reported
    beside it)."""
    print(f"\n{'model':6} {'workers':>7} {'sync/s':>9} {'gloo/s':>9} {'ddp/s':>9} {'none/s':>9} {'sync/ddp':>9} "
          f"{'gloo/ddp':>9} {'sync/none':>10} {'sync/ddp by round (min-max)':>28}")  # fmt: skip
    for row in rows:
        m = row["median"]
        paired = [s / d for s, d in zip(row["samples_per_s"]["sync"], row["samples_per_s"]["ddp"], strict=True)]
        spread = f"{min(paired):.3f}-{max(paired):.3f}"
        mark = "" if row["sync_vs_ddp"] >= TARGET_VS_DDP else "  below DDP"
        print(
            f"{row['model']:6} {row['workers']:>7} {m['sync']:>9.0f} {m['sync-gloo']:>9.0f} {m['ddp']:>9.0f} "
            f"{m['none']:>9.0f} {row['sync_vs_ddp']:>9.3f} {row['sync_gloo_vs_ddp']:>9.3f} "
            f"{row['sync_vs_none']:>10.3f} {spread:>28}{mark}"
        )
    vs_ddp = sum(1 for r in rows if r["sync_vs_ddp"] >= TARGET_VS_DDP)
    vs_none = sum(1 for r in rows if r["sync_vs_none"] >= TARGET_VS_NONE)
    print(
        f"sync/ddp >= {TARGET_VS_DDP} in {vs_ddp} of {len(rows)} configurations; sync/none >= {TARGET_VS_NONE} (the "
        f"GPU target) in {vs_none} of {len(rows)} (ratios of medians over rounds); load average now "
        f"{os.getloadavg()[0]:.1f}"
    )
    return vs_ddp == len(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=150, help="steps per worker in every run")
    parser.add_argument("--models", nargs="+", default=["lenet", "mlp"])
    parser.add_argument("--workers", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--quick", action="store_true", help="1 round of 40 steps, to check that it runs")
    parser.add_argument("--out", help="write the measurements as JSON to this file")
    args = parser.parse_args()
    rounds, steps = (1, 40) if args.quick else (args.rounds, args.steps)
    os.environ["FAST_PROGRESS"] = "0"
    with tempfile.TemporaryDirectory(prefix="fast-sync-vs-ddp-") as tmp:
        rows = bench(args.models, args.workers, rounds, steps, Path(tmp))
    print_table(rows)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
