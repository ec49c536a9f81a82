"""One replica of a small job trained by FAST or by torchft, to hold one implementation against the other:
    python peer_replica.py fast OUT_DIR STRATEGY                     (under fast run --workers 2)
    python peer_replica.py torchft OUT_DIR STRATEGY REPLICA LIGHTHOUSE
STRATEGY: diloco, local-sgd or streaming-diloco. The same model and initial weights, the same inner optimizer
(AdamW), the same batches for replica r under either system, H = 4 steps a round, 3 rounds; DiLoCo's outer optimizer
is SGD with Nesterov momentum (lr 0.7, 0.9). Streaming: 2 fragments (the model's two layers: the sizes put FAST's
cut between them), no delay, α = 0; torchft's first fragment syncs H/P steps in and FAST's at step 0 of the period,
so torchft gets FAST's fragment 1 first. Each replica saves its weights after every H steps to OUT_DIR/replica<r>.pt."""

import sys
from datetime import timedelta

import torch
import torch.nn.functional as F

system, out, strategy = sys.argv[1], sys.argv[2], sys.argv[3]
PERIOD, ROUNDS = 4, 3

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8))
STREAMING = {"fragments": 2, "delay": 0, "alpha": 0.0}
inner = torch.optim.AdamW(model.parameters(), lr=0.01)

if system == "fast":
    import fast

    options = {"period": PERIOD, **(STREAMING if strategy == "streaming-diloco" else {})}
    job = fast.init(strategy__name=strategy, **{f"strategy__{key}": value for key, value in options.items()})
    replica = job.rank
    model, inner = job.prepare(model, inner)
    context = None
else:
    from torchft.local_sgd import DiLoCo, LocalSGD
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    replica, lighthouse = int(sys.argv[4]), sys.argv[5]
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(),
        load_state_dict=lambda state: (model.load_state_dict(state["model"]), inner.load_state_dict(state["inner"])),
        state_dict=lambda: {"model": model.state_dict(), "inner": inner.state_dict()},
        min_replica_size=2,
        replica_id=str(replica),
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=lighthouse,
        timeout=timedelta(seconds=30),
        use_async_quorum=False,  # DiLoCo asks for it; LocalSGD takes it
        # the replicas start alike (FAST's start): else the first quorum heals replica 1 from replica 0, and a
        # replica that heals sits out that round's average (torchft's rule)
        init_sync=False,
    )
    if strategy in ("diloco", "streaming-diloco"):
        fragments = [model] if strategy == "diloco" else [model[2], model[0]]
        outer = [torch.optim.SGD(f.parameters(), lr=0.7, momentum=0.9, nesterov=True) for f in fragments]
        context = DiLoCo(manager, fragments, inner, outer, sync_every=PERIOD, fragment_sync_delay=0,
                         fragment_update_alpha=0.0)  # fmt: skip
    else:
        context = LocalSGD(manager, model, inner, sync_every=PERIOD)
    context.__enter__()

generator = torch.Generator().manual_seed(100 + replica)
rounds = []
for step in range(PERIOD * ROUNDS):
    x = torch.randn(16, 8, generator=generator)
    loss = F.cross_entropy(model(x), (x[:, :4].argmax(1) + (x[:, 4] > 0).long()) % 4)
    inner.zero_grad()
    loss.backward()
    inner.step()
    if (step + 1) % PERIOD == 0:
        rounds.append({name: t.detach().clone() for name, t in model.state_dict().items()})
torch.save(rounds, f"{out}/replica{replica}.pt")
if system == "fast":
    job.finish()
    torch.save(model.state_dict(), f"{out}/replica{replica}-final.pt")  # after the run's end: what the user keeps
else:
    context.__exit__(None, None, None)
    manager.shutdown(wait=False)
