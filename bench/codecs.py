"""Codec speed: encode+decode throughput per codec and size, and the time codecs add to a LeNet step.

    .venv/bin/python bench/codecs.py [--sizes 10000 1000000 10000000] [--threads 1] [--clock wall|cpu]
                                     [--out results.json]

Throughput is MB/s of fp32 input through encode followed by decode (frames included: packing, header,
CRC-32 on both sides), the median of several repetitions after one warm-up call. The LeNet part times a
forward+backward pass of a batch of 64 1x28x28 images, then one encode+decode of every gradient with
each codec, and reports the codec time as a fraction of the step; also for all gradients flattened
into one bucket (per-call overhead dominates LeNet's small tensors). Codecs run with their defaults
(topk/randomk ratio 0.01; dgc after its warm-up, ratio 0.001; qsgd 7 levels, buckets of 512),
except threshold, whose value is set to keep the 1% largest magnitudes of the input.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from fast.codecs import CODECS, DGC, build_codec

MATRIX_SHAPES = {10_000: (100, 100), 1_000_000: (1000, 1000), 10_000_000: (1000, 10_000)}


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
clock = time.perf_counter


def median_seconds(work: Callable[[], object], repetitions: int) -> float:
    work()  # warm-up: allocations, lazy initialisation, per-key state
    times = []
    for _ in range(repetitions):
        start = clock()
        work()
        times.append(clock() - start)
    return statistics.median(times)


def make_codec(name: str, sample: torch.Tensor):
    """The codec with its defaults; threshold's value keeps the top 1% of |sample| (like topk)."""
    options = {}
    if name == "threshold":
        magnitudes = sample.abs().reshape(-1)
        options["value"] = float(magnitudes.kthvalue(max(1, int(0.99 * magnitudes.numel()))).values)
    codec = build_codec(name, **options)
    if isinstance(codec, DGC):
        codec.set_epoch(codec.warmup_epochs)
    return codec


def throughput(sizes: list[int]) -> list[dict]:
    rows = []
    for numel in sizes:
        shape = MATRIX_SHAPES.get(numel, (numel,))  # matrices, so that powersgd compresses them
        x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
        repetitions = max(3, min(30, 30_000_000 // (numel * 10)))
        for name in CODECS:
            codec = make_codec(name, x)
            frame = codec.encode(x, key="x")
            encode = median_seconds(lambda codec=codec, x=x: codec.encode(x, key="x"), repetitions)
            decode = median_seconds(lambda codec=codec, frame=frame: codec.decode(frame), repetitions)
            megabytes = x.numel() * 4 / 1e6
            rows.append(
                {
                    "codec": name,
                    "elements": numel,
                    "encode_ms": encode * 1e3,
                    "decode_ms": decode * 1e3,
                    "mb_per_s": megabytes / (encode + decode),
                    "compression": x.numel() * 4 / frame.numel(),
                }
            )
            print(
                f"{name:>10} {numel:>10} {encode * 1e3:>10.2f} {decode * 1e3:>10.2f} "
                f"{rows[-1]['mb_per_s']:>10.1f} {rows[-1]['compression']:>8.1f}x",
                flush=True,
            )
    return rows


def lenet() -> nn.Module:
    try:
        from fast.jobs.models import build_model

        return build_model("lenet", (1, 28, 28), 10)
    except ImportError:
        return nn.Sequential(
            nn.Conv2d(1, 6, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
            nn.Linear(16 * 5 * 5, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(), nn.Linear(84, 10),
        )  # fmt: skip


def lenet_step_fraction(repetitions: int = 30) -> tuple[float, list[dict]]:
    generator = torch.Generator().manual_seed(0)
    model = lenet()
    images = torch.randn(64, 1, 28, 28, generator=generator)
    labels = torch.randint(0, 10, (64,), generator=generator)

    def step():
        model.zero_grad()
        nn.functional.cross_entropy(model(images), labels).backward()

    step_seconds = median_seconds(step, repetitions)
    gradients = {name: parameter.grad.clone() for name, parameter in model.named_parameters()}
    input_bytes = sum(g.numel() * 4 for g in gradients.values())
    flat = torch.cat([g.reshape(-1) for g in gradients.values()])
    rows = []
    for name in CODECS:
        codec = make_codec(name, flat)
        bucketed = make_codec(name, flat)

        def per_tensor(codec=codec):
            return sum(codec.decode(codec.encode(g, key=key)).numel() for key, g in gradients.items())

        def one_bucket(codec=bucketed):
            return codec.decode(codec.encode(flat, key="all")).numel()

        codec_seconds = median_seconds(per_tensor, repetitions)
        # a flat bucket is 1-D, which powersgd sends raw: no bucket figure for it
        bucket_seconds = math.nan if name == "powersgd" else median_seconds(one_bucket, repetitions)
        frame_bytes = sum(codec.encode(g, key=key).numel() for key, g in gradients.items())
        rows.append(
            {
                "codec": name,
                "codec_ms": codec_seconds * 1e3,
                "fraction_of_step": codec_seconds / step_seconds,
                "compression": input_bytes / frame_bytes,
                "one_bucket_ms": bucket_seconds * 1e3,
                "one_bucket_fraction_of_step": bucket_seconds / step_seconds,
            }
        )
        print(
            f"{name:>10} {codec_seconds * 1e3:>10.2f} {codec_seconds / step_seconds:>10.3f} "
            f"{rows[-1]['compression']:>8.1f}x {bucket_seconds * 1e3:>10.2f} {bucket_seconds / step_seconds:>10.3f}",
            flush=True,
        )
    return step_seconds, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 1_000_000, 10_000_000])
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="wall",
        help="wall: elapsed seconds; cpu: this process's CPU seconds (steadier on a shared machine, 1 thread)",
    )
    parser.add_argument("--out", help="also write the results to this JSON file")
    arguments = parser.parse_args()
    global clock
    clock = CLOCKS[arguments.clock]
    torch.set_num_threads(arguments.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), {arguments.clock} clock")
    print(f"{'codec':>10} {'elements':>10} {'encode ms':>10} {'decode ms':>10} {'MB/s':>10} {'ratio':>9}")
    rows = throughput(arguments.sizes)
    print("\nLeNet (batch 64, 1x28x28): every gradient encoded and decoded once per step, tensor by tensor,")
    print("and (last two columns) all gradients flattened into one bucket and encoded and decoded once")
    print(f"{'codec':>10} {'codec ms':>10} {'/ step':>10} {'ratio':>9} {'bucket ms':>10} {'/ step':>10}")
    step_seconds, lenet_rows = lenet_step_fraction()
    print(f"forward+backward: {step_seconds * 1e3:.2f} ms")
    if arguments.out:
        with open(arguments.out, "w") as file:
            results = {"throughput": rows, "lenet_step_ms": step_seconds * 1e3, "lenet": lenet_rows}
            json.dump(results, file, indent=1)


if __name__ == "__main__":
    main()
