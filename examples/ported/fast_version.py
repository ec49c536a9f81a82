"""A small MLP on scikit-learn's breast-cancer data (569 real samples), twice: in plain PyTorch (plain.py) and
on FAST (fast_version.py); `diff plain.py fast_version.py` shows the 6 lines between them.

    python examples/ported/plain.py
    fast run --workers 4 examples/ported/fast_version.py                    # sync on 4 local workers
    fast run --workers 4 --set strategy.name=gossip examples/ported/fast_version.py
"""

import torch
from sklearn.datasets import load_breast_cancer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fast


def datasets() -> tuple[TensorDataset, TensorDataset]:
    features, labels = load_breast_cancer(return_X_y=True)
    x = torch.tensor(features, dtype=torch.float32)
    x = (x - x.mean(0)) / x.std(0)
    y = torch.tensor(labels)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    train, test = order[:469], order[469:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])


def evaluate(model: nn.Module) -> dict[str, float]:
    correct, loss = 0.0, 0.0
    with torch.no_grad():
        for x, y in DataLoader(test_set, batch_size=50):
            logits = model(x)
            correct += (logits.argmax(1) == y).sum().item()
            loss += nn.functional.cross_entropy(logits, y, reduction="sum").item()
    return {"accuracy": correct / len(test_set), "loss": loss / len(test_set)}


job = fast.init()  # started by `fast run`, torchrun, or alone as one worker
torch.manual_seed(0)
train_set, test_set = datasets()
model = nn.Sequential(nn.Linear(30, 64), nn.ReLU(), nn.Linear(64, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
model, optimizer = job.prepare(model, optimizer)
loader = job.loader(train_set, batch_size=16, shuffle=True)
for epoch in range(5):
    for x, y in loader:
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        job.log(loss=loss)
    print(f"epoch {epoch}: {evaluate(model)}")
summary = job.finish(evaluate)
