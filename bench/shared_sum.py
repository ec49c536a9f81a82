"""A sum through shared memory against gloo's all-reduce, for the processes of one machine (what `sync` sums with).

    .venv/bin/python bench/shared_sum.py [--workers 2 4] [--sizes 1000 30000 300000 3000000] [--rounds 5]
                                         [--calls 200] [--out results.json]

For each worker count, the processes (FAST's launcher, one torch thread each) time `calls` back-to-back sums
of a float32 buffer of each size through `fast.comm.shared_memory.sum_buffer`, once in shared memory and once
by gloo (`shared_memory=False`, the backend's all-reduce that DDP uses on the CPU), alternating the two in
every round. A call is timed from `start()` to the end of `wait()` on the slowest process; the table gives the
median over rounds of microseconds per sum, gloo/shared (above 1: shared memory is faster), and the latency
and bandwidth of the ring model (2(N-1) hops of latency, 2(N-1)/N of the buffer over the bandwidth) that fits
the shared-memory times by least squares: what `fast.pricing.SHARED_MEMORY` is set from.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from fast.comm import Comm
from fast.comm.shared_memory import sum_buffer
from fast.runtime.launch import launch_group

TRANSPORTS = {"shared memory": True, "gloo": False}


def timed_sums(comm: Comm, sizes: list[int], calls: int, shared: bool) -> dict[int, float]:
    """Seconds per sum of each size on this process (after a few untimed ones)."""
    seconds = {}
    for size in sizes:
        summed = sum_buffer(comm, size, shared)
        assert (summed.transport == "shared memory") == shared, summed.transport
        summed.tensor.fill_(1.0)
        for _ in range(5):
            summed.start().wait()
        comm.barrier()
        start = time.perf_counter()
        for _ in range(calls):
            summed.start().wait()
        seconds[size] = (time.perf_counter() - start) / calls
    return seconds


def measure(workers: int, sizes: list[int], calls: int, shared: bool) -> dict[int, float]:
    per_rank = launch_group(timed_sums, workers, sizes, calls, shared)
    return {size: max(r[size] for r in per_rank.values()) for size in sizes}


def ring_fit(workers: int, times: dict[int, float]) -> tuple[float, float]:
    """(latency s, bandwidth B/s) of the ring model t = 2(N-1) a + 2(N-1)/N 4n / b fitted to `times`."""
    hops, share = 2 * (workers - 1), 2 * (workers - 1) / workers
    xs, ys = [share * 4 * n for n in times], list(times.values())
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / sum((x - mean_x) ** 2 for x in xs)
    return max(0.0, (mean_y - slope * mean_x) / hops), 1 / slope if slope > 0 else float("inf")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--sizes", nargs="+", type=int, default=[1000, 30_000, 300_000, 3_000_000])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=200, help="sums timed per size, transport and round")
    parser.add_argument("--out", help="write the measurements as JSON to this file")
    args = parser.parse_args()
    print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}", flush=True)
    rows = []
    for workers in args.workers:
        runs: dict[str, list[dict[int, float]]] = {name: [] for name in TRANSPORTS}
        for r in range(args.rounds):
            names = list(TRANSPORTS)[r % 2 :] + list(TRANSPORTS)[: r % 2]
            for name in names:
                runs[name].append(measure(workers, args.sizes, args.calls, TRANSPORTS[name]))
        median = {name: {n: statistics.median(run[n] for run in rs) for n in args.sizes} for name, rs in runs.items()}
        latency, bandwidth = ring_fit(workers, median["shared memory"])
        rows.append({"workers": workers, "seconds_per_sum": median, "shared_latency_s": latency,
                     "shared_bandwidth_Bps": bandwidth})  # fmt: skip
        print(f"\n{workers} workers ({args.rounds} rounds of {args.calls} sums; medians, microseconds per sum)")
        print(f"{'floats':>10} {'shared':>10} {'gloo':>10} {'gloo/shared':>12}")
        for n in args.sizes:
            shared, gloo = median["shared memory"][n], median["gloo"][n]
            print(f"{n:>10,} {shared * 1e6:>10.0f} {gloo * 1e6:>10.0f} {gloo / shared:>12.2f}")
        fitted = f"latency {latency * 1e6:.1f} us, bandwidth {bandwidth / 1e9:.2f} GB/s"
        print(f"ring model fitted to shared memory: {fitted}")
    print(f"load average now {os.getloadavg()[0]:.1f}")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
