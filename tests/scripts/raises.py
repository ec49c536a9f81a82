"""A user script whose own code raises in the middle of training."""

import torch

import fast

job = fast.init(None, data__name="digits")
net = torch.nn.Linear(4, 2)
net, optimizer = job.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
for step in range(3):
    net(torch.randn(8, 4)).sum().backward()
    optimizer.step()
    if step == 1:
        raise ValueError("the user's own bug, on line 14")
