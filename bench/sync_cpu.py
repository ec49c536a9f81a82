"""CPU time per step of FAST's `sync` strategy against DDP's reducer, both hooked into the same bare loop.

    .venv/bin/python bench/sync_cpu.py [--rounds 5] [--steps 1000] [--models mlp lenet] [--workers 2 4]

`bench/sync_vs_ddp.py` compares whole runs by samples per second. On a machine with fewer cores than workers their
throughput is set by the CPU every process spends on a step, and wall-clock time moves with the machine's load;
this bench measures that CPU directly (every thread of the process: autograd, gloo's, the strategy's) and the wall
time beside it, with nothing else in the loop: a fixed random batch, no data loading, no records. The sides:

- `sync`: the strategy built from a config and driven as FAST's worker drives it (`before_step`, backward with its
  hooks, `after_backward`, the optimizer's step), its buckets summed by gloo as DDP's are
  (`run.shared_memory = false`: this bench weighs FAST's bucketing against DDP's C++ reducer on one
  transport; `bench/shared_sum.py` weighs the transports);
- `ddp`: the model under torch.nn.parallel.DistributedDataParallel (its defaults);
- `none`: the same loop without communication: the compute both others share.

The sides alternate within a round, the order rotating from round to round; the table gives medians over rounds of
the mean over workers, and sync/ddp ratios of those medians (below 1.0: sync spends less).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from fast.assemble import load_config
from fast.comm import Comm
from fast.jobs.models import build_model
from fast.runtime.launch import launch_group
from fast.strategies import StrategyContext, build_strategy

SIDES = ("sync", "ddp", "none")
BATCH, WARMUP_STEPS = 64, 50


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def steps_of(comm: Comm, side: str, model_name: str, steps: int) -> tuple[float, float]:
    """One process: (CPU seconds, wall seconds) per step after a warm-up."""
    torch.manual_seed(0)
    model = build_model(model_name, (1, 28, 28), 10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    strategy, net = None, model
    if side == "sync":
        config = load_config(None, run__workers=comm.size, run__shared_memory=False)
        ctx = StrategyContext(comm=comm, world=comm, config=config, device=torch.device("cpu"), workers=comm.size,
                              rank=comm.rank, generator=torch.Generator(), steps_per_epoch=10**9)  # fmt: skip
        strategy = build_strategy(config, ctx)
        strategy.setup(model, optimizer)
    elif side == "ddp":
        net = DistributedDataParallel(model)
    x, y = torch.randn(BATCH, 1, 28, 28), torch.randint(0, 10, (BATCH,))
    for n in (WARMUP_STEPS, steps):
        comm.barrier()
        cpu, wall = cpu_seconds(), time.perf_counter()
        for step in range(n):
            if strategy is not None:
                strategy.before_step(step)
            optimizer.zero_grad(set_to_none=False)
            F.cross_entropy(net(x), y).backward()
            if strategy is not None:
                strategy.after_backward(step)
                strategy.before_optimizer_step()
            optimizer.step()
        cpu, wall = cpu_seconds() - cpu, time.perf_counter() - wall
    return cpu / steps, wall / steps


def measure(side: str, model_name: str, workers: int, steps: int) -> tuple[float, float]:
    """Mean over the workers of (CPU, wall) seconds per step."""
    out = launch_group(steps_of, workers, side, model_name, steps)
    return statistics.fmean(c for c, _ in out.values()), statistics.fmean(w for _, w in out.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--models", nargs="+", default=["mlp", "lenet"])
    parser.add_argument("--workers", nargs="+", type=int, default=[2, 4])
    args = parser.parse_args()
    print(f"{args.steps} steps, {args.rounds} rounds, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}")
    print(f"{'model':6} {'workers':>7} " + " ".join(f"{s + ' cpu us':>12} {s + ' wall us':>13}" for s in SIDES)
          + f" {'cpu sync/ddp':>13} {'wall sync/ddp':>14}")  # fmt: skip
    for model_name in args.models:
        for workers in args.workers:
            runs: dict[str, list[tuple[float, float]]] = {side: [] for side in SIDES}
            for r in range(args.rounds):
                for side in SIDES[r % len(SIDES) :] + SIDES[: r % len(SIDES)]:
                    runs[side].append(measure(side, model_name, workers, args.steps))
            cpu = {side: statistics.median(c for c, _ in v) * 1e6 for side, v in runs.items()}
            wall = {side: statistics.median(w for _, w in v) * 1e6 for side, v in runs.items()}
            print(f"{model_name:6} {workers:>7} " + " ".join(f"{cpu[s]:>12.0f} {wall[s]:>13.0f}" for s in SIDES)
                  + f" {cpu['sync'] / cpu['ddp']:>13.3f} {wall['sync'] / wall['ddp']:>14.3f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
