"""One worker's loop whose third step has a NaN loss: the weights and optimizer state after every step, and the
skipped steps the summary counts, saved to OUT/steps.pt.
    python skipped_step.py STRATEGY fused|plain OUT"""

import copy
import sys
from pathlib import Path

import torch

import fast

strategy, fused, out = sys.argv[1], sys.argv[2] == "fused", Path(sys.argv[3])
job = fast.init(None, out=out, strategy__name=strategy)
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
optimizer = torch.optim.Adam(model.parameters(), lr=0.1, fused=fused)
model, optimizer = job.prepare(model, optimizer)
x, y = torch.randn(8, 4), torch.randn(8, 2)
after = []
for step in range(5):
    loss = ((model(x) - y) ** 2).mean()
    if step == 2:
        loss = loss * float("nan")
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    job.log(loss=loss)
    after.append({"weights": [p.detach().clone() for p in model.parameters()],
                  "state": copy.deepcopy(optimizer.state_dict()["state"])})  # fmt: skip
summary = job.finish()
torch.save({"after": after, "skipped": summary["skipped_steps"]}, out / "steps.pt")
