"""A small decoder-only transformer on bytes of real text, the job of examples/lm/: its data, model, loss and metric.

The corpus is the Python standard library's own source (the interpreter installs it; nothing is downloaded):
the top-level modules, sorted, every 20th file held out for validation. A sample is a window of `context` bytes
and the same window shifted by one; the model predicts each next byte. The metric is validation perplexity,
exp of the mean cross-entropy per byte.

Everything here is an ordinary function of the user's, which FAST can name from TOML:

    [data]  factory = "lm:corpus"       [model] factory = "lm:transformer"
    [step]  factory = "lm:next_byte_loss"   [eval] factory = "lm:perplexity"
"""

from __future__ import annotations

import math
import sysconfig
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

VOCAB = 256  # bytes


def _windows(data: bytes, context: int) -> TensorDataset:
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    count = (len(tokens) - 1) // context
    x = tokens[: count * context].view(count, context)
    y = tokens[1 : count * context + 1].view(count, context)
    return TensorDataset(x, y)


def corpus(context: int = 128, megabytes: float = 4.0, held_out_every: int = 20) -> tuple[TensorDataset, TensorDataset]:
    """(train, validation) windows of the standard library's top-level modules, up to `megabytes` in all."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    train, validation, size = bytearray(), bytearray(), 0
    for i, path in enumerate(files):
        text = path.read_bytes()
        (validation if i % held_out_every == 0 else train).extend(text)
        size += len(text)
        if size >= megabytes * 1e6:
            break
    return _windows(bytes(train), context), _windows(bytes(validation), context)


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=2)
        q, k, v = (t.view(batch, length, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp(self.norm2(x))


class Transformer(nn.Module):
    """Byte embeddings and learned positions, `layers` pre-norm blocks, and a head tied to the embeddings."""

    def __init__(self, width: int = 192, layers: int = 4, heads: int = 4, context: int = 128) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.position = nn.Parameter(torch.zeros(context, width))
        self.blocks = nn.Sequential(*(Block(width, heads) for _ in range(layers)))
        self.norm = nn.LayerNorm(width)
        nn.init.normal_(self.embed.weight, std=0.02)
        nn.init.normal_(self.position, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens.long()) + self.position[: tokens.shape[1]]
        return self.norm(self.blocks(x)) @ self.embed.weight.T


def transformer(width: int = 192, layers: int = 4, heads: int = 4, context: int = 128) -> Transformer:
    return Transformer(width, layers, heads, context)


def next_byte_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of each next byte."""
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, VOCAB), y.long().reshape(-1))


@torch.no_grad()
def perplexity(model: nn.Module, validation: TensorDataset, windows: int = 256, batch: int = 64) -> dict[str, float]:
    """Validation perplexity (and loss, nats per byte) on the first `windows` validation windows."""
    was_training = model.training
    model.eval()
    x, y = (t[:windows] for t in validation.tensors)
    device = next(model.parameters()).device
    total = sum(
        float(next_byte_loss(model, x[i : i + batch].to(device), y[i : i + batch].to(device))) * len(x[i : i + batch])
        for i in range(0, len(x), batch)
    )
    model.train(was_training)
    loss = total / len(x)
    return {"perplexity": math.exp(loss), "loss": loss}
