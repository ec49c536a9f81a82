"""A loop with (or without) a GradScaler in which worker 1's loss overflows at chosen iterations, under DDP or FAST:
    python overflow.py ddp|fast OUT_DIR ITERATIONS [--no-scaler] [--cuda]   (ITERATIONS: comma-separated, on worker 1)
--cuda: the model on the GPU, its forward under fp16 autocast, torch's CUDA GradScaler. Each rank saves its weights
and the scaler's scale after every iteration to OUT_DIR/rank<r>.pt."""

import sys

import torch
import torch.nn.functional as F

mode, out, overflows = sys.argv[1], sys.argv[2], {int(i) for i in sys.argv[3].split(",") if i}
use_scaler = "--no-scaler" not in sys.argv
device = "cuda" if "--cuda" in sys.argv else "cpu"
if mode == "fast":
    import fast

    job = fast.init()
    rank = job.rank
else:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo")  # on CUDA too: two ranks share one GPU in the tests
    rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2)).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
scaler = torch.amp.GradScaler(device, init_scale=2.0**16, growth_interval=1000, enabled=use_scaler)
if mode == "fast":
    model, optimizer = job.prepare(model, optimizer)
else:
    model = DDP(model)
generator = torch.Generator().manual_seed(rank)
scales = []
for it in range(12):
    x = torch.randn(16, 8, generator=generator).to(device)
    with torch.autocast(device, dtype=torch.float16, enabled=device == "cuda"):
        loss = F.cross_entropy(model(x), (x.sum(1) > 0).long())
    if rank == 1 and it in overflows:
        loss = loss * float("inf")
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
    scales.append(scaler.get_scale() if use_scaler else 1.0)
state = {name: t.cpu() for name, t in (model.module if mode == "ddp" else model).state_dict().items()}
torch.save({"state": state, "scales": scales}, f"{out}/rank{rank}.pt")
if mode == "fast":
    job.finish()
else:  # both ranks past their last save before either tears gloo down: a rank that tore it down first
    dist.barrier()  # once aborted the other's exit (SIGABRT, "terminate called without an active exception")
    dist.destroy_process_group()
