"""A small character-level language model trained with PyTorch's DistributedDataParallel, in the shape most DDP
scripts have: the world found through RANK, `DDP(model)`, gradient accumulation through
`require_backward_grad_sync`, a GradScaler, optional `torch.compile`, a warm-up-cosine schedule of its own, grad
clipping, and evaluation and checkpoints on rank 0. `train_fast.py` is the same script on FAST: `diff` them.

    python examples/ported_ddp/train_ddp.py                            # one process
    torchrun --nproc-per-node 2 examples/ported_ddp/train_ddp.py       # DDP on 2 processes
"""

import argparse
import math
import os
import textwrap

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

parser = argparse.ArgumentParser()
parser.add_argument("--iters", type=int, default=200)
parser.add_argument("--batch", type=int, default=8)
parser.add_argument("--accum", type=int, default=2, help="micro-batches per optimizer step")
parser.add_argument("--block", type=int, default=32)
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--warmup", type=int, default=20)
parser.add_argument("--eval-every", type=int, default=50)
parser.add_argument("--compile", action="store_true")
parser.add_argument("--out", default="out-lm")
parser.add_argument("--seed", type=int, default=1337)
args = parser.parse_args()

ddp = int(os.environ.get("RANK", -1)) != -1  # started by torchrun?
if ddp:
    dist.init_process_group(backend="gloo")
rank, world = (dist.get_rank(), dist.get_world_size()) if ddp else (0, 1)
master = rank == 0
os.makedirs(args.out, exist_ok=True)

text = open(textwrap.__file__, "rb").read()  # the standard library's own source as the corpus
data = torch.tensor(list(text), dtype=torch.long)
split = int(0.9 * len(data))
train_data, val_data = data[:split], data[split:]
generator = torch.Generator().manual_seed(args.seed + rank)  # each rank draws its own windows


def get_batch(source: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.randint(len(source) - args.block - 1, (args.batch,), generator=generator)
    x = torch.stack([source[s : s + args.block] for s in starts.tolist()])
    y = torch.stack([source[s + 1 : s + 1 + args.block] for s in starts.tolist()])
    return x, y


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 256, dim: int = 64, block: int = 32) -> None:
        super().__init__()
        self.embed, self.position = nn.Embedding(vocab, dim), nn.Embedding(block, dim)
        self.layer = nn.TransformerEncoderLayer(dim, 4, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
        self.head = nn.Linear(dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) + self.position(torch.arange(x.shape[1]))
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        return self.head(self.layer(h, src_mask=mask, is_causal=True))


def lr_at(it: int) -> float:
    if it < args.warmup:
        return args.lr * (it + 1) / args.warmup
    progress = (it - args.warmup) / max(1, args.iters - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def evaluate(model: nn.Module) -> float:
    model.eval()
    losses = []
    for _ in range(10):
        x, y = get_batch(val_data)
        losses.append(F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item())
    model.train()
    return sum(losses) / len(losses)


torch.manual_seed(args.seed)  # the same initial weights on every rank
model = TinyLM(block=args.block)
optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
scaler = torch.amp.GradScaler("cpu")  # on a GPU without bf16: torch.amp.GradScaler("cuda") with fp16 autocast
if args.compile:
    model = torch.compile(model)
model = DDP(model) if ddp else model
raw_model = model.module if ddp else model

for it in range(args.iters):
    for group in optimizer.param_groups:
        group["lr"] = lr_at(it)
    for micro in range(args.accum):
        if ddp:  # all-reduce only at the last micro-step
            model.require_backward_grad_sync = micro == args.accum - 1
        x, y = get_batch(train_data)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten()) / args.accum
        scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    if master and ((it + 1) % args.eval_every == 0 or it + 1 == args.iters):
        print(f"iter {it + 1}: train loss {loss.item() * args.accum:.4f}, val loss {evaluate(raw_model):.4f}")
        checkpoint = {"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(), "iter": it + 1}
        torch.save(checkpoint, os.path.join(args.out, "ckpt.pt"))

if ddp:
    dist.barrier()  # rank 0 evaluates and saves last: nobody tears the group down under it
    dist.destroy_process_group()
