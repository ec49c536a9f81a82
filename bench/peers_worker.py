"""One worker of bench/peers.py: the same job under DDP, FAST, torchft or hivemind, in its own network namespace.

    torchrun ... peers_worker.py ddp|fast STRATEGY JOB STEPS OUT          (DDP: sync; FAST: any strategy)
    REPLICA=r peers_worker.py torchft STRATEGY JOB STEPS OUT LIGHTHOUSE HOST
    REPLICA=r peers_worker.py hivemind local-sgd JOB STEPS OUT HOST
    (PEERS_SEED=s in the environment: the initial weights and the data order; default 0)

JOB `lenet`: Fashion-MNIST LeNet, batch 64 a worker, SGD (lr 0.05, momentum 0.9) inside, test accuracy. JOB `lm`:
the language model of examples/lm (width 96, 2 layers), 16 windows of 128 bytes a worker, AdamW (lr 0.002, betas
0.9/0.95, weight decay 0.1) inside, validation perplexity. Both: a fixed permutation of the training set split by
rank, read in order; the same initial weights everywhere; rounds every 16 steps; DiLoCo's outer optimizer SGD with
Nesterov momentum (0.7, 0.9); streaming: 2 fragments, τ = 1, α = 0.5.

hivemind (its Optimizer with local updates) averages the parameters each time the two peers have together taken
as many samples as 16 steps of both, synchronously (`delay_state_averaging` off, as FAST's and torchft's local SGD);
tuned for a small job on two machines: matchmaking 0.5 s, progress refreshed every 0.05–0.5 s, groups of 2.

Writes OUT/result<rank>.json: the training seconds (from the end of the first step to the last; connecting and the
first step left out), the steps, the seconds of the system's own end of run apart (hivemind: its shutdown; FAST: a
periodic strategy's last round), and on rank 0 the final metric (and FAST's own count of the bytes it sent).
"""

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

system, strategy, job_name, steps, out = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
SEED = int(os.environ.get("PEERS_SEED", "0"))  # the initial weights and the data order
PERIOD, WORKERS = 16, 2
STREAMING = {"fragments": 2, "delay": 1, "alpha": 0.5}
torch.set_num_threads(1)
torch.manual_seed(SEED)

if job_name == "lenet":
    from fast.jobs.datasets import load_dataset
    from fast.jobs.models import build_model

    BATCH = 64
    data = load_dataset("fashion-mnist")
    x_train, y_train = data.x_train, data.y_train
    model = build_model("lenet", data.input_shape, data.num_classes)
    inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def loss_of(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(net(x), y)

    @torch.no_grad()
    def metric(net: nn.Module) -> dict:
        net.eval()
        predicted = torch.cat([net(x).argmax(1) for x in data.x_test.split(1000)])
        return {"metric": "accuracy", "value": float((predicted == data.y_test).float().mean())}
else:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "lm"))
    import lm

    BATCH = 16
    train, validation = lm.corpus(context=128)
    x_train, y_train = train.tensors
    model = lm.transformer(width=96, layers=2, heads=4, context=128)
    inner = torch.optim.AdamW(model.parameters(), lr=0.002, betas=(0.9, 0.95), weight_decay=0.1)
    loss_of = lm.next_byte_loss

    def metric(net: nn.Module) -> dict:
        return {"metric": "perplexity", "value": lm.perplexity(net, validation)["perplexity"]}


def fragments_of(net: nn.Module) -> list[nn.Module]:
    """torchft's fragments for streaming DiLoCo: FAST's cut of the parameter list (fast.strategies.streaming_diloco),
    in the order FAST syncs them; torchft syncs its first fragment H/P steps into the period, FAST at its start."""
    from fast.strategies.streaming_diloco import fragment_bounds

    params = list(net.parameters())
    bounds = fragment_bounds([p.numel() for p in params], STREAMING["fragments"])
    holders = []
    for start, end in bounds:
        holder = nn.Module()
        holder.params = nn.ParameterList(params[start:end])  # the model's own tensors, not copies
        holders.append(holder)
    return holders[1:] + holders[:1]


evaluated, stepper, end_of_run = model, inner, None
if system == "ddp":
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = DistributedDataParallel(model)
elif system == "fast":
    import fast

    options = {"strategy__period": PERIOD} if strategy != "sync" else {}
    if strategy == "diloco" or strategy == "streaming-diloco":
        options |= {"strategy__outer_lr": 0.7, "strategy__outer_momentum": 0.9}
    if strategy == "streaming-diloco":
        options |= {f"strategy__{key}": value for key, value in STREAMING.items()}
    # two machines on one host's two cores: no shared-memory sums between them, one thread each (as every system
    # here); a round's all-reduce in pieces of 256 KiB, which the capped link's queue (100 ms: 125 KB at 10 Mbit/s)
    # takes without dropping their tails
    job = fast.init(out=f"{out}/fast-run", strategy__name=strategy, run__workers=WORKERS, run__seed=SEED,
                    run__shared_memory=False, run__threads_per_worker=1, run__allreduce_piece_kb=256,
                    **options)  # fmt: skip
    rank = job.rank
    model, stepper = job.prepare(model, inner)
    end_of_run = job.finish  # the run's end: a periodic strategy's last round, every replica on θ
elif system == "torchft":
    from torchft.local_sgd import DiLoCo, LocalSGD
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    rank, lighthouse, host = int(os.environ["REPLICA"]), sys.argv[6], sys.argv[7]
    store = torch.distributed.TCPStore(host, 0, is_master=True, wait_for_workers=False)
    manager = Manager(pg=ProcessGroupGloo(), load_state_dict=None, state_dict=None, min_replica_size=WORKERS,
                      replica_id=str(rank), store_addr=host, store_port=store.port, rank=0, world_size=1,
                      lighthouse_addr=lighthouse, hostname=host, timeout=timedelta(seconds=60),
                      use_async_quorum=False, init_sync=False)  # fmt: skip
    if strategy == "local-sgd":
        context = LocalSGD(manager, model, inner, sync_every=PERIOD)
    else:
        fragments = [model] if strategy == "diloco" else fragments_of(model)
        outer = [torch.optim.SGD(f.parameters(), lr=0.7, momentum=0.9, nesterov=True) for f in fragments]
        streaming = {"fragment_sync_delay": STREAMING["delay"], "fragment_update_alpha": STREAMING["alpha"]}
        context = DiLoCo(manager, fragments, inner, outer, sync_every=PERIOD,
                         **(streaming if strategy == "streaming-diloco" else {}))  # fmt: skip
    context.__enter__()

    def end_of_run() -> None:
        context.__exit__(None, None, None)
        manager.shutdown(wait=True)
else:
    import hivemind

    rank, host = int(os.environ["REPLICA"]), sys.argv[6]
    address_file = Path(out) / "hivemind-peer0.json"
    if rank == 0:
        dht = hivemind.DHT(host_maddrs=[f"/ip4/{host}/tcp/0"], start=True)
        address_file.write_text(json.dumps([str(a) for a in dht.get_visible_maddrs()]))
    else:
        while not address_file.exists():
            time.sleep(0.05)
        dht = hivemind.DHT(host_maddrs=[f"/ip4/{host}/tcp/0"], initial_peers=json.loads(address_file.read_text()),
                           start=True)  # fmt: skip
    stepper = hivemind.Optimizer(
        dht=dht, run_id="peers", optimizer=inner, batch_size_per_step=BATCH, target_batch_size=WORKERS * BATCH * PERIOD,
        use_local_updates=True, delay_state_averaging=False, matchmaking_time=0.5, averaging_timeout=30.0,
        tracker_opts={"min_refresh_period": 0.05, "max_refresh_period": 0.5, "default_refresh_period": 0.1},
        averager_opts={"target_group_size": WORKERS, "request_timeout": 0.25},
        verbose=bool(os.environ.get("HIVEMIND_VERBOSE")),
    )  # fmt: skip
    (Path(out) / f"hivemind-ready{rank}").touch()  # both peers in before the first step, as a rendezvous
    while not all((Path(out) / f"hivemind-ready{r}").exists() for r in range(WORKERS)):
        time.sleep(0.01)

    def end_of_run() -> None:
        stepper.shutdown()
        dht.shutdown()


order = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(SEED))[rank::WORKERS]
started = None
for step in range(steps):
    index = order[(step * BATCH) % (len(order) - BATCH) :][:BATCH]
    loss = loss_of(model, x_train[index], y_train[index])
    stepper.zero_grad()
    loss.backward()
    stepper.step()
    if step == 0:
        started = time.perf_counter()
seconds = time.perf_counter() - started
result = {"system": system, "strategy": strategy, "rank": rank, "seconds": seconds, "steps": steps - 1}
if system == "hivemind":
    result["averaging_rounds"] = stepper.local_epoch  # the epochs the collaboration went through
ending = time.perf_counter()
if end_of_run is not None:
    end_of_run()
result["end_s"] = time.perf_counter() - ending
if system == "fast" and rank == 0:
    summary = json.loads(open(f"{out}/fast-run/summary.json").read())
    result["fast_bytes_sent"], result["fast_bytes_unmetered"] = summary["bytes_sent"], summary["bytes_sent_unmetered"]
if rank == 0:
    result |= metric(evaluated)
with open(f"{out}/result{rank}.json", "w") as f:
    json.dump(result, f)
if system == "ddp":
    dist.destroy_process_group()
