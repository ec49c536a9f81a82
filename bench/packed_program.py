"""A packed job's training step as FAST runs it (fast.program: the graph's nodes checked, then run one by one) against
the same graph loaded by torch's own deserializer (which FAST no longer uses: it evaluates the graph's strings).

    .venv/bin/python bench/packed_program.py [--models mlp lenet resnet8 lm] [--rounds 5] [--steps 10]

Each model is packed once (`fast pack`, on the 8x8 digits; the language model of examples/lm/ at width 64), then
one process with one torch thread times `steps` forward and backward passes of the training program on a fixed
batch, FAST's runner and torch's module alternating in every round, from the same weights. The table gives the
median milliseconds per step of each and torch/FAST (above 1: FAST's runner is faster), and how long reading and
checking a graph takes. Target: FAST's runner no slower than torch's module (a ratio of at least 0.95).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from fast.archive import DTYPES, read_package
from fast.jobs.package import PackedModel
from fast.program import read_graph
from fast.tools.pack import pack

ROOT = Path(__file__).resolve().parents[1]
BATCH = {"mlp": 64, "lenet": 64, "resnet8": 32, "lm": 16}


def packed(name: str, folder: Path) -> Path:
    if name == "lm":
        sys.path.insert(0, str(ROOT / "examples" / "lm"))
        small = {"model__width": 64, "model__layers": 2, "data__megabytes": 0.2, "run__workers": 1}
        return pack(str(ROOT / "examples" / "lm" / "lm.toml"), folder / "lm.fastjob", **small)
    job = {"data": {"name": "digits"}, "model": {"name": name}, "run": {"workers": 1, "batch_size": BATCH[name]}}
    return pack(job, folder / f"{name}.fastjob")


def batch(schema: dict, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x_kind, y_kind = schema["input"], schema["label"]
    x_dtype, y_dtype = DTYPES[x_kind["dtype"]], DTYPES[y_kind["dtype"]]
    if x_dtype.is_floating_point:
        x = torch.randn(size, *x_kind["shape"], generator=generator, dtype=x_dtype)
    else:
        x = torch.randint(0, 256, (size, *x_kind["shape"]), generator=generator, dtype=x_dtype)
    y = torch.randint(0, 10 if y_kind["kind"] == "class index" else 256, (size, *y_kind["shape"]), generator=generator)
    return x, y.to(y_dtype)


def torch_module(package, state: dict[str, torch.Tensor], example: tuple) -> nn.Module:
    """The training graph through torch's own loader, as FAST loaded packages before (a package we made)."""
    from torch._export.serde.serialize import SerializedArtifact, deserialize

    artifact = SerializedArtifact(package.members["train.json"], state, {}, (example, {}))
    return deserialize(artifact).module()


def seconds_per_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        model(x, y).backward()
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "lenet", "resnet8", "lm"], choices=list(BATCH))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"{'model':<8} {'FAST ms':>9} {'torch ms':>9} {'torch/FAST':>11} {'read+check ms':>14}")
    ratios = []
    with tempfile.TemporaryDirectory() as folder:
        for name in args.models:
            package = read_package(packed(name, Path(folder)))
            started = time.perf_counter()
            read_graph(package.members["train.json"], "train.json", training=True)
            read_ms = 1000 * (time.perf_counter() - started)
            ours = PackedModel(package)
            state = {n: nn.Parameter(t.detach().clone()) if n.startswith("w") else t.detach().clone()
                     for n, t in [*ours.program.named_parameters(), *ours.program.named_buffers()]}  # fmt: skip
            x, y = batch(package.schema, BATCH[name])
            theirs = torch_module(package, state, (x[:2], y[:2]))
            models = {"FAST": ours, "torch": theirs}
            times: dict[str, list[float]] = {"FAST": [], "torch": []}
            for model in models.values():
                seconds_per_step(model, x, y, 2)  # warm-up
            for _ in range(args.rounds):
                for who, model in models.items():
                    times[who].append(seconds_per_step(model, x, y, args.steps))
            fast_s, torch_s = statistics.median(times["FAST"]), statistics.median(times["torch"])
            ratios.append(torch_s / fast_s)
            print(f"{name:<8} {1000 * fast_s:>9.2f} {1000 * torch_s:>9.2f} {torch_s / fast_s:>11.3f} {read_ms:>14.1f}")
    met = min(ratios) >= 0.95
    print(f"target (torch/FAST >= 0.95 on every model): {'met' if met else 'NOT met'} (lowest {min(ratios):.3f})")


if __name__ == "__main__":
    main()
