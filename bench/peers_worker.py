"""One worker of bench/peers.py: the same job under DDP, FAST or torchft, in its own network namespace.

    torchrun ... peers_worker.py ddp|fast STRATEGY STEPS OUT           (DDP: sync; FAST: any strategy)
    REPLICA=r peers_worker.py torchft local-sgd|diloco STEPS OUT LIGHTHOUSE HOST

Fashion-MNIST LeNet, batch 64 a worker, SGD (lr 0.05, momentum 0.9) inside; a fixed permutation of the training set
split by rank, read in order; the same initial weights everywhere; rounds every 16 steps; DiLoCo's outer optimizer
SGD with Nesterov momentum (0.7, 0.9). Writes OUT/result<rank>.json: the training seconds (from the end of the
first step to the last; connecting and the first step left out), the steps, and on rank 0 the final test accuracy
(and FAST's own count of the bytes it sent).
"""

import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.nn.functional as F

from fast.jobs.datasets import load_dataset
from fast.jobs.models import build_model

system, strategy, steps, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
BATCH, PERIOD, WORKERS = 64, 16, 2
torch.set_num_threads(1)

data = load_dataset("fashion-mnist")
torch.manual_seed(0)
model = build_model("lenet", data.input_shape, data.num_classes)
inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
evaluated = model

if system == "ddp":
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = DistributedDataParallel(model)
elif system == "fast":
    import fast

    # two machines: no shared-memory sums between them (namespaces share the host's memory)
    job = fast.init(out=f"{out}/fast-run", strategy__name=strategy, run__workers=WORKERS, run__shared_memory=False,
                    **({"strategy__period": PERIOD} if strategy != "sync" else {}))  # fmt: skip
    rank = job.rank
    model, inner = job.prepare(model, inner)
else:
    from torchft.local_sgd import DiLoCo, LocalSGD
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    rank, lighthouse, host = int(os.environ["REPLICA"]), sys.argv[5], sys.argv[6]
    store = torch.distributed.TCPStore(host, 0, is_master=True, wait_for_workers=False)
    manager = Manager(pg=ProcessGroupGloo(), load_state_dict=None, state_dict=None, min_replica_size=WORKERS,
                      replica_id=str(rank), store_addr=host, store_port=store.port, rank=0, world_size=1,
                      lighthouse_addr=lighthouse, hostname=host, timeout=timedelta(seconds=60),
                      use_async_quorum=False, init_sync=False)  # fmt: skip
    if strategy == "diloco":
        outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        context = DiLoCo(manager, [model], inner, outer, sync_every=PERIOD)
    else:
        context = LocalSGD(manager, model, inner, sync_every=PERIOD)
    context.__enter__()

order = torch.randperm(len(data.x_train), generator=torch.Generator().manual_seed(0))[rank::WORKERS]
started = None
for step in range(steps):
    index = order[(step * BATCH) % (len(order) - BATCH) :][:BATCH]
    loss = F.cross_entropy(model(data.x_train[index]), data.y_train[index])
    inner.zero_grad()
    loss.backward()
    inner.step()
    if step == 0:
        started = time.perf_counter()
seconds = time.perf_counter() - started
result = {"system": system, "strategy": strategy, "rank": rank, "seconds": seconds, "steps": steps - 1}
if system == "fast":
    job.finish()  # the run's end: a periodic strategy's last round, every replica on θ
    if rank == 0:
        result["fast_bytes_sent"] = json.loads(open(f"{out}/fast-run/summary.json").read())["bytes_sent"]
elif system == "torchft":
    context.__exit__(None, None, None)
torch.save(evaluated.state_dict(), f"{out}/weights{rank}.pt")
if rank == 0:
    with torch.no_grad():
        evaluated.eval()
        predicted = torch.cat([evaluated(x).argmax(1) for x in data.x_test.split(1000)])
        result["accuracy"] = float((predicted == data.y_test).float().mean())
with open(f"{out}/result{rank}.json", "w") as f:
    json.dump(result, f)
if system == "ddp":
    dist.destroy_process_group()
elif system == "torchft":
    manager.shutdown(wait=False)
