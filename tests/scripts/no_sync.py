"""A user's loop on CUDA whose steady-state steps (after step 5, up to step 45) run under
`torch.cuda.set_sync_debug_mode`: a call that makes the host wait for the GPU fails there. MODE "error": each worker
has a GPU of its own. MODE "training-thread": two workers share a GPU and talk over gloo, which stages CUDA tensors
through host memory on threads of its own and synchronises there, by design; the mode then warns, and the training
thread's warnings are made errors. Each worker writes the steps it checked to OUT/checked-RANK.txt.
    fast run --workers N no_sync.py OUT MODE"""

import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

import fast

out, mode = Path(sys.argv[1]), sys.argv[2]
job = fast.init(None, out=out, run__device="cuda", run__max_steps=50, run__log_every=1000,
                run__check_interval="10min")  # fmt: skip
generator = torch.Generator().manual_seed(0)
x = torch.randn(8192, 32, generator=generator)
y = x[:, :10].argmax(1)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
model, optimizer = job.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
loader = job.loader(torch.utils.data.TensorDataset(x, y), batch_size=32)
checked = 0
for _ in job.epochs(1):
    for xb, yb in loader:
        loss = F.cross_entropy(model(xb), yb)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        job.log(loss=loss)
        if job.step == 5:
            torch.cuda.set_sync_debug_mode("error" if mode == "error" else "warn")
            warnings.filterwarnings("error", message=".*synchroniz")
        elif job.step == 45:
            torch.cuda.set_sync_debug_mode(0)
            warnings.resetwarnings()
            checked = 40
(out / f"checked-{job.rank}.txt").write_text(str(checked))
job.finish()
