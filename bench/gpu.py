"""FAST on a GPU against a plain PyTorch loop and against DDP, on the language model of examples/lm made bigger.

    .venv/bin/python bench/gpu.py [--rounds 3] [--steps 100] [--timed 80] [--out results.json]
    .venv/bin/python bench/gpu.py --dry-run      # on the CPU: a tiny model, a few steps, one round (a test runs it)

The model is examples/lm's transformer at width 512, 8 layers (8 heads), context 256, batch 32 per process, AdamW,
on the corpus of examples/lm; every side runs `--steps` steps of which the last `--timed` are timed between two
`torch.cuda.synchronize()` (the GPU drained), and reports samples/s (the slowest process's time). The sides:

- `plain`: one process, the plain PyTorch loop;
- `fast x1`: the same loop made a FAST job (job.prepare, job.loader, job.log), `fast run --workers 1
  --set run.device=cuda`, strategy `sync`;
- `ddp x2`: torchrun, 2 processes sharing the GPU over gloo, DistributedDataParallel with its defaults;
- `fast x2`: `fast run --workers 2`, the 2 workers sharing the GPU (gloo);
- with several GPUs, `ddp xN` and `fast xN`: one process per GPU over NCCL.

The sides alternate within a round and the order rotates from round to round; the table gives medians over rounds
and their ratios. Targets: fast/plain >= 0.97 at one worker, fast/ddp >= 1.0 at each world size.
(Internally the script is also each side's process: `--side plain|ddp|fast`.)
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "lm"))
from lm import corpus, next_byte_loss, transformer  # noqa: E402

BIN = Path(sys.executable).parent
FAST, TORCHRUN = str(BIN / "fast"), str(BIN / "torchrun")
FULL = {"width": 512, "layers": 8, "heads": 8, "context": 256, "batch": 32, "megabytes": 4.0}
TINY = {"width": 32, "layers": 1, "heads": 2, "context": 16, "batch": 4, "megabytes": 0.2}
TARGET_VS_PLAIN, TARGET_VS_DDP = 0.97, 1.0
SEED = 0


# -- one side's process ----------------------------------------------------------------------------------------------
def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches: Iterator, steps: int, timed: int,
                device: torch.device, log: Callable[[torch.Tensor], None] | None = None) -> float:  # fmt: skip
    """The loop every side runs: seconds of its last `timed` steps of `steps`, between two synchronizes."""
    start = 0.0
    for step, (x, y) in enumerate(batches):
        if step == steps - timed:
            synchronize(device)
            start = time.perf_counter()
        loss = next_byte_loss(model, x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if log is not None:
            log(loss)
        if step + 1 == steps:
            break
    synchronize(device)
    return time.perf_counter() - start


def shuffled_batches(data: torch.utils.data.TensorDataset, batch: int, device: torch.device, rank: int) -> Iterator:
    """The plain loop's batches: a seeded order per pass, each batch copied to the device as such a loop does."""
    x, y = data.tensors
    epoch = 0
    while True:
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(SEED + 7919 * epoch + rank))
        for i in range(len(order) // batch):
            index = order[i * batch : (i + 1) * batch]
            yield x[index].to(device, non_blocking=True), y[index].to(device, non_blocking=True)
        epoch += 1


def model_and_optimizer(size: dict, device: torch.device) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(SEED)
    model = transformer(size["width"], size["layers"], size["heads"], size["context"]).to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, betas=(0.9, 0.95))


def side_process(args: argparse.Namespace) -> None:
    """One process of one side: trains, and writes its timed seconds to RESULT.RANK.json."""
    size = json.loads(args.size)
    train_set, _ = corpus(context=size["context"], megabytes=size["megabytes"])
    if args.side == "fast":
        import fast

        job = fast.init(None, run__max_steps=args.steps)
        model, optimizer = model_and_optimizer(size, job.device)
        model, optimizer = job.prepare(model, optimizer)
        loader = job.loader(train_set, batch_size=size["batch"])
        batches = (batch for _ in job.epochs() for batch in loader)
        seconds = timed_steps(model, optimizer, batches, args.steps, args.timed, job.device, lambda loss: job.log(loss))
        rank = job.rank
        job.finish()
    else:
        rank = int(os.environ.get("RANK", "0"))
        device = torch.device(args.device if args.device == "cpu" else f"cuda:{args.gpu_of_rank * rank}")
        model, optimizer = model_and_optimizer(size, device)
        if args.side == "ddp":
            torch.distributed.init_process_group(args.backend)
            ids = [device.index] if device.type == "cuda" else None
            model = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
            torch.distributed.barrier()
        world = int(os.environ.get("WORLD_SIZE", "1"))
        x, y = train_set.tensors
        shard = torch.utils.data.TensorDataset(x[rank::world], y[rank::world])
        batches = shuffled_batches(shard, size["batch"], device, rank)
        seconds = timed_steps(model, optimizer, batches, args.steps, args.timed, device)
        if args.side == "ddp":
            # DDP's reducer goes first: had it held the last reference to the process group, freeing it (with the GIL
            # held) would join gloo threads that wait for the GIL, and the process would never exit
            del model, optimizer
            gc.collect()
            torch.distributed.destroy_process_group()
    Path(f"{args.result}.{rank}.json").write_text(json.dumps({"seconds": seconds}))


# -- the bench --------------------------------------------------------------------------------------------------------
def run_side(name: str, processes: int, backend: str, device: str, size: dict, steps: int, timed: int,
             folder: Path) -> float:  # fmt: skip
    """samples/s of one side: `processes` x `timed` steps x the batch over the slowest process's seconds."""
    result = folder / name.replace(" ", "-")
    common = ["--size", json.dumps(size), "--steps", str(steps), "--timed", str(timed), "--result", str(result),
              "--device", device]  # fmt: skip
    env = {**os.environ, "FAST_PROGRESS": "0"}
    if name == "plain":
        command = [sys.executable, __file__, "--side", "plain", *common]
    elif name.startswith("ddp"):
        gpu_of_rank = "1" if backend == "nccl" else "0"  # one GPU each, or all on GPU 0
        command = [TORCHRUN, "--standalone", f"--nproc-per-node={processes}", __file__, "--side", "ddp",
                   "--backend", backend, "--gpu-of-rank", gpu_of_rank, *common]  # fmt: skip
    else:
        command = [FAST, "run", "--workers", str(processes), "--set", f"run.device={device}", "--set",
                   "strategy.name=sync", "--out", str(folder / f"{result.name}-run"), __file__, "--side", "fast",
                   *common]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=folder, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"bench/gpu.py: side {name!r} failed:\n{done.stderr[-3000:]}")
    seconds = [json.loads(Path(f"{result}.{rank}.json").read_text())["seconds"] for rank in range(processes)]
    return processes * timed * size["batch"] / max(seconds)


def sides(device: str) -> list[tuple[str, int, str]]:
    """(name, processes, backend) of every side this machine can run."""
    found = [("plain", 1, ""), ("fast x1", 1, ""), ("ddp x2", 2, "gloo"), ("fast x2", 2, "gloo")]
    gpus = torch.cuda.device_count() if device == "cuda" else 0
    if gpus > 1:
        found += [(f"ddp x{gpus}", gpus, "nccl"), (f"fast x{gpus}", gpus, "nccl")]
    return found


def bench(device: str, size: dict, rounds: int, steps: int, timed: int, folder: Path) -> dict[str, list[float]]:
    runs: dict[str, list[float]] = {name: [] for name, _, _ in sides(device)}
    order = sides(device)
    for r in range(rounds):
        rotated = order[r % len(order) :] + order[: r % len(order)]
        for name, processes, backend in rotated:
            runs[name].append(run_side(name, processes, backend, device, size, steps, timed, folder))
        print(f"  round {r + 1}: " + ", ".join(f"{name} {runs[name][-1]:.0f}" for name, _, _ in order), flush=True)
    return runs


def ratios(median: dict[str, float]) -> list[tuple[str, float, float]]:
    """(what, ratio, target): FAST against the plain loop at one worker, against DDP at each world size."""
    out = [("fast x1 / plain", median["fast x1"] / median["plain"], TARGET_VS_PLAIN)]
    for name in median:
        if name.startswith("ddp"):
            world = name.split()[1]
            out.append((f"fast {world} / ddp {world}", median[f"fast {world}"] / median[name], TARGET_VS_DDP))
    return out


def machine(device: str) -> str:
    what = torch.cuda.get_device_name() if device == "cuda" else f"CPU, {os.cpu_count()} cores"
    return f"{what}, torch {torch.__version__}, {datetime.date.today().isoformat()}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--timed", type=int, default=80, help="the last steps of each run, timed")
    parser.add_argument("--dry-run", action="store_true", help="on the CPU: a tiny model, 10 steps, one round")
    parser.add_argument("--out", help="write the measurements as JSON to this file")
    parser.add_argument("--side", choices=["plain", "ddp", "fast"], help=argparse.SUPPRESS)
    parser.add_argument("--size", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    parser.add_argument("--backend", default="gloo", help=argparse.SUPPRESS)
    parser.add_argument("--gpu-of-rank", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side is not None:
        side_process(args)
        return
    device, size, rounds, steps, timed = "cuda", FULL, args.rounds, args.steps, args.timed
    if args.dry_run:
        device, size, rounds, steps, timed = "cpu", TINY, 1, 10, 8
    elif not torch.cuda.is_available():
        raise SystemExit("bench/gpu.py needs a CUDA device (--dry-run runs it on the CPU, tiny)")
    print(f"{machine(device)}; width {size['width']}, {size['layers']} layers, context {size['context']}, batch "
          f"{size['batch']} per process, AdamW; {steps} steps, the last {timed} timed; {rounds} rounds")  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="fast-bench-gpu-") as tmp:
        runs = bench(device, size, rounds, steps, timed, Path(tmp))
    median = {name: statistics.median(values) for name, values in runs.items()}
    print(f"\n{'side':12} {'samples/s':>10}   (median of {rounds})")
    for name, value in median.items():
        print(f"{name:12} {value:>10.0f}")
    print()
    for what, ratio, target in ratios(median):
        print(f"{what:18} {ratio:6.3f}   target >= {target}{'' if ratio >= target else '  BELOW'}")
    if args.out:
        Path(args.out).write_text(json.dumps({"machine": machine(device), "size": size, "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
