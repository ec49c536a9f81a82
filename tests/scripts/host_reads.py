"""A user's loop that counts the reads of a tensor's value FAST's own code makes in steady-state steps.

Each worker patches the Tensor methods that read a value to the host (item, tolist, numpy, cpu, bool, float, int,
index, an array, nonzero; and torch.equal), counts the calls whose nearest caller outside torch
is in FAST's package, and writes (steps, reads, sites) for the steps FIRST..LAST to OUT/host-reads-RANK.json. On a
GPU each such read on the training thread is a stall: the host waits for the device to drain its queue before it
launches anything more. Reads on FAST's other threads (a compressed exchange's, which stages its frames through host
memory) hold up no launch: they are counted apart (`elsewhere`).

    fast run --workers 2 host_reads.py OUT FIRST LAST
"""

import json
import os
import sys
import threading
from collections import Counter
from pathlib import Path

import torch

import fast

FAST_DIR = os.path.dirname(fast.__file__) + os.sep
TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
READS = ["item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__", "__index__", "__array__", "nonzero"]
counting = False
sites: Counter = Counter()  # the training thread's
elsewhere: Counter = Counter()  # FAST's other threads'


def _site() -> str | None:
    """FAST's file:line that made the read, or None when the nearest caller outside torch is not FAST's."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(TORCH_DIR):
        frame = frame.f_back
    if frame is None or not frame.f_code.co_filename.startswith(FAST_DIR):
        return None
    return f"{frame.f_code.co_filename[len(FAST_DIR) :]}:{frame.f_lineno}"


def _counted(name, original):
    def read(*args, **kwargs):
        if counting:
            site = _site()
            if site is not None:
                training = threading.current_thread() is threading.main_thread()
                (sites if training else elsewhere)[f"{site} {name}"] += 1
        return original(*args, **kwargs)

    return read


for method in READS:
    setattr(torch.Tensor, method, _counted(method, getattr(torch.Tensor, method)))
torch.equal = _counted("torch.equal", torch.equal)

out, first, last = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
job = fast.init(None, out=out)
generator = torch.Generator().manual_seed(0)
x = torch.randn(8000, 32, generator=generator)
y = (x[:, :10].argmax(1) + (x[:, 10] > 1).long()) % 10
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
model, optimizer = job.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
loader = job.loader(torch.utils.data.TensorDataset(x, y), batch_size=16)
for _ in job.epochs(1):
    for xb, yb in loader:
        loss = torch.nn.functional.cross_entropy(model(xb), yb)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        job.log(loss=loss)
        if job.step == first:
            counting = True
        elif job.step == last and counting:
            counting = False
            if job.is_worker:
                record = {"steps": last - first, "reads": sum(sites.values()), "sites": dict(sites.most_common()),
                          "elsewhere": dict(elsewhere.most_common())}  # fmt: skip
                (out / f"host-reads-{job.rank}.json").write_text(json.dumps(record))
job.finish()
