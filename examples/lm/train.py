"""Train the byte-level language model of lm.py with your own loop on FAST: any strategy, any deployment.

    fast run --workers 4 examples/lm/train.py                                   # sync, 4 local workers
    fast run --workers 4 --set strategy.name=diloco --set strategy.period=25 examples/lm/train.py
    python examples/lm/train.py                                                 # one worker

The model, data, loss and metric are the user's (lm.py); FAST shards the data, runs the strategy around
each optimizer step (with lm.toml's gradient clipping and warm-up-then-cosine schedule), records the loss
and the validation perplexity, and writes the run folder.
"""

from pathlib import Path

import torch
from lm import corpus, next_byte_loss, perplexity, transformer

import fast
from fast.optim import build_optimizer

job = fast.init(Path(__file__).with_name("lm.toml"))
train_set, validation_set = corpus(**job.config.data.arguments())  # context, megabytes from [data]
torch.manual_seed(job.config.run.seed)
model = transformer(**job.config.model.arguments())  # width, layers, heads, context from [model]
optimizer = build_optimizer(job.config.optimizer, model.parameters())  # AdamW as [optimizer] says
model, optimizer = job.prepare(model, optimizer)
loader = job.loader(train_set, batch_size=job.config.run.batch_size)
evaluate_every = job.config.run.log_every * 5
for _ in job.epochs():
    for x, y in loader:
        loss = next_byte_loss(model, x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        job.log(loss=loss)
        if job.step % evaluate_every == 0 and not job.stopped:
            job.evaluate(lambda m: perplexity(m, validation_set))
summary = job.finish(lambda m: perplexity(m, validation_set))
if summary:
    print(f"validation perplexity {summary['final_test_perplexity']:.2f}, {summary['bytes_sent'] / 1e6:.1f} MB sent")
