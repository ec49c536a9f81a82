"""Memory per process of a replica sharded over K processes (fast.shards), at K = 1, 2 and 4.

    .venv/bin/python bench/shards_memory.py [--width 2048] [--layers 12] [--steps 3] [--batch 8] [--glibc-default]
                                            [--out results.json]

The model is a stack of `layers` Linear(width, width) layers with ReLU between (at the defaults 50.4M parameters,
201 MB in float32), trained with AdamW, so that parameters, gradients and AdamW's two moments make 4 model-sized
copies (806 MB) at K = 1. K = 1 is an unsharded worker, as FAST runs today; K = 2 and 4 are one replica of K processes
(fast.shards.ShardedReplica, FSDP2 over gloo on this machine's CPU), each with its slice of the batch. Two figures per
process, the largest over the replica's processes reported:

- state: the bytes of the tensors a process holds after a step (its local shards of the parameters, of their
  gradients and of AdamW's state), counted exactly;
- peak: the process's peak resident memory over the steps (VmHWM, its high-water mark reset after the model is made
  and sharded) less its resident memory before the model was made (torch, the process groups): what training adds,
  with FSDP2's gathered blocks, its communication buffers, activations and the allocator's slack.

Each process has glibc hand every allocation of 1 MB or more back to the system when it is freed (mallopt's
M_MMAP_THRESHOLD; `--glibc-default` leaves glibc's own rule). By default glibc raises that threshold to the size of
the largest block freed, up to 32 MB, and then keeps freed blocks below it in its heap: FSDP2 gathers each block into
new memory at every forward and backward and frees it after, and on the CPU the heap then grows by what was freed,
so that the peak of a sharded process says more about the allocator than about what it holds (measured at the
defaults: K = 2 1.5x K = 1 with glibc's rule, 0.58x with the fixed threshold). A GPU's caching allocator reuses the
gathered blocks' memory instead.

Target: K = 2 at most 0.6x K = 1 (both figures).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import re
from pathlib import Path

import torch
from torch import nn

from fast.comm import Comm
from fast.runtime.launch import launch_group
from fast.shards import ShardedReplica
from fast.shards.local import local_tensor

SHARDS = (1, 2, 4)
TARGET_K2 = 0.6
MB = 2**20
M_MMAP_THRESHOLD = -3  # mallopt's parameter (malloc.h)


def _resident_kb(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def _settle() -> None:
    """Freed memory back to the system, so that resident memory is what is held."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def _state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    tensors = [local_tensor(p.data) for p in model.parameters()]
    tensors += [local_tensor(p.grad) for p in model.parameters() if p.grad is not None]
    tensors += [local_tensor(t) for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    return sum(t.numel() * t.element_size() for t in tensors)


def measure(
    comm: Comm, shards: int, width: int, layers: int, steps: int, batch: int, glibc_default: bool
) -> dict[str, float]:
    """One process of a replica of `shards`: its state and its peak above the memory before the model."""
    if not glibc_default:
        ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 1 << 20)
    _settle()
    before_kb = _resident_kb("VmRSS")
    torch.manual_seed(0)
    stack: list[nn.Module] = []
    for _ in range(layers):
        stack += [nn.Linear(width, width), nn.ReLU()]
    model = nn.Sequential(*stack)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    replica = ShardedReplica(comm, shards, model, optimizer) if shards > 1 else None
    _settle()
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark from here on
    generator = torch.Generator().manual_seed(comm.rank)
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=False)
        x = torch.randn(batch // shards, width, generator=generator)
        model(x).square().mean().backward()
        if replica is not None:
            replica.gradients_in()  # (where a strategy's after_backward goes)
            replica.gradients_out()
        optimizer.step()
    return {"state_mb": _state_bytes(model, optimizer) / MB, "peak_mb": (_resident_kb("VmHWM") - before_kb) / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8, help="the replica's batch (split over its K processes)")
    parser.add_argument("--glibc-default", action="store_true", help="glibc's own rule for returning freed memory")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    parameters = args.layers * (args.width**2 + args.width)
    print(f"{args.layers} x Linear({args.width}, {args.width}): {parameters / 1e6:.1f}M parameters, "
          f"{4 * parameters / MB:.0f} MB in float32; AdamW; {args.steps} steps")  # fmt: skip
    results: dict[int, dict[str, float]] = {}
    for k in SHARDS:
        each = launch_group(measure, k, k, args.width, args.layers, args.steps, args.batch, args.glibc_default,
                            deadline_s=600.0)  # fmt: skip
        results[k] = {key: max(r[key] for r in each.values()) for key in ("state_mb", "peak_mb")}
        print(f"K = {k}: state {results[k]['state_mb']:8.1f} MB   peak above start {results[k]['peak_mb']:8.1f} MB")
    for key, what in (("state_mb", "state"), ("peak_mb", "peak")):
        ratios = "   ".join(f"K={k}/K=1 {results[k][key] / results[1][key]:.2f}x" for k in SHARDS[1:])
        verdict = "met" if results[2][key] / results[1][key] <= TARGET_K2 else "NOT met"
        print(f"{what:5}: {ratios}   (target K=2 <= {TARGET_K2}x K=1: {verdict})")
    if args.out is not None:
        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "results": results}, indent=2))


if __name__ == "__main__":
    main()
