"""Under sync, worker 1 stops its loop early: it must not hang the others, and the run ends with its outputs."""

import torch
from tabular import datasets, model

import fast

job = fast.init(None, run__log_every=5)
train_set, test_set = datasets()
torch.manual_seed(0)
net = model()
net, optimizer = job.prepare(net, torch.optim.SGD(net.parameters(), lr=0.05))
loader = job.loader(train_set, batch_size=16)
for _ in range(3):
    for x, y in loader:
        torch.nn.functional.cross_entropy(net(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        if job.rank == 1 and job.step == 7:
            break
    if job.rank == 1:
        break
summary = job.finish(lambda m: {"accuracy": (m(test_set.tensors[0]).argmax(1) == test_set.tensors[1]).float().mean()})
if summary:
    print(f"steps {summary['steps_per_worker']}")
