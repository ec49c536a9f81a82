"""A Hugging Face GPT-2 (built from a small config, no weights downloaded) trained in a user's own loop on FAST:
character windows of the standard library's source, the model's own loss from `labels=`."""

import textwrap

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import fast

job = fast.init()
torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=32, n_embd=64, n_layer=2, n_head=2))
model, optimizer = job.prepare(model, torch.optim.AdamW(model.parameters(), lr=3e-3))
data = torch.tensor(list(open(textwrap.__file__, "rb").read()), dtype=torch.long)
generator = torch.Generator().manual_seed(job.rank)
for _ in range(40):
    starts = torch.randint(len(data) - 33, (8,), generator=generator).tolist()
    x = torch.stack([data[s : s + 32] for s in starts])
    loss = model(input_ids=x, labels=x).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    job.log(loss=loss)
job.finish()
