"""Sharded replicas (fast.shards) over real processes, gloo on the CPU: W = 2 replicas of K = 2 shards under FAST's own
`sync` equal DDP over 4 processes, under `diloco` equal W = 2 unsharded workers and torchft's DiLoCo over the same
FSDP2 model (where torchft is installed); the gathered state loads into the user's class; DCP checkpoints resume bit
for bit at the same K and at K = 1 from K = 2; a model the user sharded is taken as it is; under emulated links a shard
exchanges on its lane of the replica link and nothing inside a replica crosses one.

The differences are float32 summation order (FSDP2's reduce-scatter inside the replica, then the replicas' all-reduce,
add in another order than DDP's one all-reduce). Measured here on the test model as the largest over tensors of
max|a - b| / max|b|; the bounds below have margin over what was measured (in the comments).
"""

import importlib.util
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fast.assemble import load_config
from fast.comm import Comm
from fast.emulation.deployment import machine_for, network_for
from fast.emulation.links import IDEAL, EmulatedLink, LinkTable, Outage, ReplicaLinks
from fast.emulation.network import EmulatedComm
from fast.errors import ConfigError, UsageError
from fast.jobs.models import build_model
from fast.shards import Layout, ShardedReplica, blocks, form_groups
from fast.shards import checkpoint as sharded_checkpoint
from fast.strategies import StrategyContext, build_strategy
from fast.strategies.flat import FlatState
from tests.distributed import run_distributed

W, K, BATCH = 2, 2, 16  # BATCH: the global batch, BATCH / W a replica's, BATCH / (W K) a process's
SYNC_BOUND = 2e-6  # measured: 2.3e-7 after 20 AdamW steps (and K = 1 against DDP: 2.3e-7)
DILOCO_BOUND = 2e-6  # measured: 2.4e-7 after 3 rounds of 4 AdamW steps


def _net() -> nn.Module:
    """Three Linear layers (blocks), 33 rows: shards of unequal size at K = 2."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 33), nn.Tanh(), nn.Linear(33, 33), nn.Tanh(), nn.Linear(33, 5))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, 16, generator=g), torch.randint(0, 5, (BATCH,), generator=g)


def _slice(step: int, part: int, parts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Part `part` of `parts` of step `step`'s global batch: process `rank` of W×K takes part `rank` of W×K, so
    replica w (ranks wK .. wK + K - 1) takes part w of W."""
    x, y = _batch(step)
    n = BATCH // parts
    return x[part * n : (part + 1) * n], y[part * n : (part + 1) * n]


def _relative(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest over tensors of max|a - b| / max|b|."""
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max()) for k in b)


def _strategy(comm: Comm, workers: int, model: nn.Module, optimizer: torch.optim.Optimizer, name: str, **options):
    overrides = {f"strategy__{k}": v for k, v in options.items()}
    config = load_config(None, run__workers=workers, run__shared_memory=False, strategy__name=name, **overrides)
    ctx = StrategyContext(comm=comm, world=comm, config=config, device=torch.device("cpu"), workers=workers,
                          rank=comm.rank, generator=torch.Generator(), steps_per_epoch=100)  # fmt: skip
    strategy = build_strategy(config, ctx)
    strategy.setup(model, optimizer)
    return strategy


def _train(strategy, model: nn.Module, optimizer, steps: int, part: int, parts: int, replica=None) -> None:
    """The user's loop, with the strategy's hooks where the job calls them (and the gradients' bridge)."""
    for t in range(steps):
        x, y = _slice(t, part, parts)
        strategy.before_step(t)
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        if replica is not None:
            replica.gradients_in()
        strategy.after_backward(t)
        if replica is not None:
            replica.gradients_out()
        strategy.before_optimizer_step()
        optimizer.step()
        strategy.after_optimizer_step(t)


def _plain_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# -- sync: HSDP equals DDP ---------------------------------------------------------------------------------------------
def _sync_against_ddp(comm: Comm, steps: int) -> dict:
    # DDP over the 4 processes, each its quarter of the batch
    model = nn.parallel.DistributedDataParallel(_net())
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    for t in range(steps):
        x, y = _slice(t, comm.rank, W * K)
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    ddp = _plain_state(model.module)

    # K = 1: W = 2 unsharded workers under `sync`, each a replica's batch (ranks 0, 2 and 1, 3 do the same)
    pairs = comm.subgroups([[0, 2], [1, 3]])
    model = _net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    _train(_strategy(pairs, W, model, optimizer, "sync"), model, optimizer, steps, pairs.index(), W)
    unsharded = _plain_state(model)

    # W = 2 replicas of K = 2 shards under FAST's own `sync` on the local shards
    before = comm.counter.snapshot()["sent_per_peer"].get(str(comm.rank ^ 2), 0)  # (the K = 1 run's, to the same peer)
    model = _net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    replica = ShardedReplica(comm, K, model, optimizer)
    strategy = _strategy(replica.comm, W, replica.view, optimizer, "sync")
    _train(strategy, model, optimizer, steps, comm.rank, W * K, replica)
    sharded = replica.whole_state_dict(everywhere=True)
    sent = replica.comm.counter.snapshot()["sent_per_peer"]
    return {"ddp": ddp, "unsharded": unsharded, "sharded": sharded, "sent": {k: v - before for k, v in sent.items()}}


@pytest.fixture(scope="module")
def sync_runs() -> dict[int, dict]:
    return run_distributed(_sync_against_ddp, W * K, 20)


def test_sync_between_replicas_of_two_shards_equals_ddp_over_four_processes(sync_runs):
    for rank, out in sync_runs.items():
        difference = _relative(out["sharded"], out["ddp"])
        assert difference < SYNC_BOUND, f"rank {rank}: {difference:.2e}"
        assert _relative(out["sharded"], out["unsharded"]) < SYNC_BOUND
        assert all(torch.equal(out["sharded"][k], sync_runs[0]["sharded"][k]) for k in out["sharded"])


def test_a_shard_exchanges_only_its_own_shard_with_the_other_replica(sync_runs):
    """Each shard all-reduces its half of the gradients (33-row weights: 17 rows on shard 0, 16 on shard 1) over
    the replica group of two: a ring of two sends each member's whole buffer once, plus the bucket's count."""
    shapes = {k: v.shape for k, v in sync_runs[0]["sharded"].items()}
    for rank, out in sync_runs.items():
        k = rank % K
        local = sum((s[0] + 1 - k) // K * (s[1] if len(s) > 1 else 1) for s in shapes.values())
        assert out["sent"] == {str(rank ^ 2): 20 * 4 * (local + 1)}


# -- diloco on local shards equals diloco unsharded --------------------------------------------------------------------
def _diloco(comm: Comm, rounds: int, period: int) -> dict:
    options = {"period": period, "outer_lr": 0.7, "outer_momentum": 0.9}
    pairs = comm.subgroups([[0, 2], [1, 3]])
    model = _net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    strategy = _strategy(pairs, W, model, optimizer, "diloco", **options)
    _train(strategy, model, optimizer, rounds * period, pairs.index(), W)
    unsharded = _plain_state(model)

    model = _net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    replica = ShardedReplica(comm, K, model, optimizer)
    strategy = _strategy(replica.comm, W, replica.view, optimizer, "diloco", **options)
    _train(strategy, model, optimizer, rounds * period, comm.rank, W * K, replica)
    return {"unsharded": unsharded, "sharded": replica.whole_state_dict(everywhere=True), "rounds": strategy.rounds}


def test_diloco_on_local_shards_equals_diloco_on_whole_replicas():
    out = run_distributed(_diloco, W * K, 3, 4)
    for rank, each in out.items():
        assert each["rounds"] == 3
        difference = _relative(each["sharded"], each["unsharded"])
        assert difference < DILOCO_BOUND, f"rank {rank}: {difference:.2e}"


def _torchft_diloco(comm: Comm, lighthouse: str, ports: list[int]) -> dict:
    """torchft's DiLoCo over the FSDP2 model fast.shards makes (a Manager per process, replica r's own store), and
    FAST's `diloco` on the local shards, on the same data."""
    from torchft import Manager, ProcessGroupGloo
    from torchft.local_sgd import DiLoCo

    fast = _diloco(comm, 3, 4)["sharded"]
    model = _net()
    inner = torch.optim.AdamW(model.parameters(), lr=0.01)
    replica = ShardedReplica(comm, K, model, inner)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    timeout = timedelta(seconds=20)
    manager = Manager(pg=ProcessGroupGloo(timeout=timeout), min_replica_size=W, use_async_quorum=False,
                      load_state_dict=lambda state: None, state_dict=lambda: {}, replica_id=str(replica.replica),
                      store_addr="localhost", store_port=ports[replica.replica], rank=replica.shard_index,
                      world_size=K, lighthouse_addr=lighthouse, port=0, connect_timeout=timeout,
                      quorum_timeout=timeout, timeout=timeout)  # fmt: skip
    try:
        with DiLoCo(manager, [model], inner, outer, sync_every=4, backup_device=torch.device("cpu"), pin_memory=False):
            for t in range(12):
                x, y = _slice(t, comm.rank, W * K)
                inner.zero_grad()
                F.cross_entropy(model(x), y).backward()
                inner.step()
        return {"fast": fast, "torchft": replica.whole_state_dict(everywhere=True), "rounds": manager.current_step()}
    finally:
        manager.shutdown(wait=False)


def test_diloco_on_local_shards_equals_torchfts_diloco_over_the_same_fsdp2_model():
    pytest.importorskip("torchft")
    import torch.distributed as dist
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=W)
    stores = [dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False) for _ in range(W)]
    try:
        out = run_distributed(_torchft_diloco, W * K, lighthouse.address(), [s.port for s in stores])
    finally:
        lighthouse.shutdown()
    for rank, each in out.items():
        assert each["rounds"] == 3
        difference = _relative(each["torchft"], each["fast"])
        assert difference < DILOCO_BOUND, f"rank {rank}: {difference:.2e}"  # measured: 0 (bit for bit)


# -- the whole model ---------------------------------------------------------------------------------------------------
def _whole(comm: Comm) -> dict:
    model = build_model("lenet", (1, 8, 8), 10)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    replica = ShardedReplica(comm, K, model, optimizer)
    x = torch.randn(4, 1, 8, 8, generator=torch.Generator().manual_seed(replica.replica))
    with torch.no_grad():
        sharded_out = model(x)  # collective inside the replica: both shards evaluate
    state = replica.whole_state_dict()
    agreed = bool(replica.any(torch.tensor(comm.rank == 1)))  # a flag set on one shard of replica 0 only
    if replica.shard_index != 0:
        return {"state": state, "agreed": agreed}
    user = build_model("lenet", (1, 8, 8), 10)
    user.load_state_dict(state)  # strict: the user's class and names
    whole = replica.whole_model(state)
    with torch.no_grad():
        return {"state": state, "user": user(x), "whole": whole(x), "sharded": sharded_out, "cls": type(whole),
                "agreed": agreed}  # fmt: skip


def test_the_gathered_state_loads_into_the_users_class_and_computes_what_the_sharded_model_does():
    out = run_distributed(_whole, W * K)
    for rank, each in out.items():
        assert each["agreed"] == (rank // K == 0)  # every shard of a replica agrees on a device flag
        if rank % K:
            assert each["state"] == {}  # only shard 0 of each replica holds it
            continue
        assert each["cls"].__name__ == "LeNet5"
        torch.testing.assert_close(each["user"], each["sharded"], rtol=1e-5, atol=1e-6)
        assert torch.equal(each["user"], each["whole"])


# -- checkpoints -------------------------------------------------------------------------------------------------------
def _checkpoints(comm: Comm, root: str) -> dict:
    """Train 6 steps, saving after step 3; a new replica loads step 3 and trains 3 more; unsharded processes load the
    same folders (K = 1) and train 3 more on a replica's batch."""
    steps, at = 6, 3
    adam = {"lr": 0.01, "weight_decay": 0.1}

    def step(model, optimizer, t: int, part: int, parts: int) -> None:
        x, y = _slice(t, part, parts)
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()

    model = _net()
    optimizer = torch.optim.AdamW(model.parameters(), **adam)
    replica = ShardedReplica(comm, K, model, optimizer)
    folder = sharded_checkpoint.replica_folder(Path(root), replica.replica, at)
    for t in range(steps):
        step(model, optimizer, t, comm.rank, W * K)  # (no strategy: each replica trains alone)
        if t + 1 == at:
            theta = FlatState.of_parameters(replica.view).read() * 2  # a strategy's vector laid out like the shards
            replica.save(folder, extra={"step": at, "rng": torch.get_rng_state()}, flat={"theta": theta})
            saved = replica.whole_state_dict(everywhere=True)
    uninterrupted = replica.whole_state_dict(everywhere=True)

    torch.manual_seed(1)  # weights other than the saved ones, until loaded
    model = nn.Sequential(nn.Linear(16, 33), nn.Tanh(), nn.Linear(33, 33), nn.Tanh(), nn.Linear(33, 5))
    optimizer = torch.optim.AdamW(model.parameters(), **adam)
    replica = ShardedReplica(comm, K, model, optimizer)
    theta = torch.zeros_like(FlatState.of_parameters(replica.view).read())
    extra = replica.load(folder, flat={"theta": theta})
    theta_same = torch.equal(theta, FlatState.of_parameters(replica.view).read() * 2)
    for t in range(extra["step"], steps):
        step(model, optimizer, t, comm.rank, W * K)
    resumed = replica.whole_state_dict(everywhere=True)

    # K = 1: this process alone holds the replica's whole model, reading the replica's folder
    model = nn.Sequential(nn.Linear(16, 33), nn.Tanh(), nn.Linear(33, 33), nn.Tanh(), nn.Linear(33, 5))
    optimizer = torch.optim.AdamW(model.parameters(), **adam)
    theta = torch.zeros(sum(p.numel() for p in model.parameters()))
    extra = sharded_checkpoint.load(folder, model, optimizer, flat={"theta": theta})
    loaded = _plain_state(model)
    exp_avg = {n: optimizer.state[p]["exp_avg"].clone() for n, p in model.named_parameters()}
    theta_whole = torch.equal(theta, FlatState.of_parameters(model).read() * 2)
    for t in range(extra["step"], steps):
        step(model, optimizer, t, replica.replica, W)
    return {"saved": saved, "uninterrupted": uninterrupted, "resumed": resumed, "loaded": loaded, "step": extra["step"],
            "exp_avg": exp_avg, "at_one": _plain_state(model), "theta_same": theta_same,
            "theta_whole": theta_whole}  # fmt: skip


def test_a_checkpoint_resumes_bit_for_bit_at_the_same_k_and_reshards_to_k_one(tmp_path):
    out = run_distributed(_checkpoints, W * K, str(tmp_path))
    assert sharded_checkpoint.complete(tmp_path / "checkpoints" / "replica1-step3")
    for rank, each in out.items():
        assert each["step"] == 3 and each["theta_same"] and each["theta_whole"], rank
        assert all(torch.equal(each["resumed"][k], each["uninterrupted"][k]) for k in each["uninterrupted"])
        assert all(torch.equal(each["loaded"][k], each["saved"][k]) for k in each["saved"])
        # the same 3 steps from there at K = 1: the replica's batch whole, summed in another order
        assert _relative(each["at_one"], each["uninterrupted"]) < SYNC_BOUND  # measured: 2.1e-7
        assert any(v.abs().sum() > 0 for v in each["exp_avg"].values())  # AdamW's moments came back too


# -- emulated links between replicas ----------------------------------------------------------------------------------
LANE_BPS = 1e6  # the replica link: 8 Mbit, 2 lanes of 4 Mbit (one per shard index)
LINK_LATENCY_S = 0.01


def test_a_sharded_runs_processes_see_the_links_between_their_replicas_and_none_inside_one():
    table = LinkTable(3, EmulatedLink(0.02, 1e6), {(0, 2): EmulatedLink(0.1, 4e5)}, [Outage(0, 1, 5.0, 9.0)])
    links = ReplicaLinks(table, shards=2, worker_processes=6)  # replicas 0, 1, 2 of 2 processes; no server
    assert [links.named(p) for p in range(6)] == [0, 0, 1, 1, 2, 2]
    assert links.link(0, 1) == links.link(3, 2) == IDEAL  # inside a replica: no time at all
    assert links.link(1, 3) == EmulatedLink(0.02, 5e5)  # between replicas: the link's latency, half its bandwidth
    assert links.link(0, 4) == EmulatedLink(0.1, 2e5) and links.link(5, 1) == EmulatedLink(0.02, 5e5)
    assert links.up_again_at(1, 2, 6.0) == 9.0 and links.up_again_at(0, 1, 6.0) == 6.0  # outages between replicas
    with_server = ReplicaLinks(LinkTable(3, EmulatedLink(0.0, 1e6)), shards=2, worker_processes=4)
    assert with_server.named(4) == 2 and with_server.link(1, 4).bandwidth_Bps == 1e6  # (a server's lines: its own)


def test_a_sharded_replicas_processes_take_their_workers_emulated_machine():
    config = load_config(None, run__workers=2, run__shards=2, compute__slowdown=[1.0, 3.0],
                         compute__straggler_probability=0.5, faults__crash=[{"worker": 1, "step": 7}])  # fmt: skip
    plans = [machine_for(config, rank).plan for rank in range(4)]
    assert [(p.worker, p.slowdown, p.crash_step) for p in plans] == [(0, 1.0, None), (0, 1.0, None), (1, 3.0, 7),
                                                                      (1, 3.0, 7)]  # fmt: skip
    # a replica's processes pause at the same steps (their worker's draws), and the replicas at different ones
    pauses = [[step for step in range(40) if p.pause_s(step)] for p in plans]
    assert pauses[0] == pauses[1] and pauses[2] == pauses[3] and pauses[0] != pauses[2]


def _emulated_groups(comm: Comm, numel: int) -> dict:
    config = load_config(None, run__workers=W, run__shards=K, network__bandwidth=f"{LANE_BPS * K * 8:g}bit",
                         network__latency=f"{LINK_LATENCY_S * 1000:g}ms")  # fmt: skip
    network = network_for(config, W * K, comm.rank)
    groups = form_groups(EmulatedComm(network=network, deadline_s=comm.deadline_s, device="cpu"), K)
    flag = torch.ones(1)
    groups.shard.all_reduce(flag)  # inside the replica (as a step's agreement on a flag): native
    inside = network.messages
    started = time.monotonic()
    groups.replicate.all_reduce(torch.ones(numel))  # between replicas: a ring of two, on this shard's lane
    return {"kinds": (type(groups.shard).__name__, type(groups.replicate).__name__), "inside": inside,
            "between": network.messages - inside, "seconds": time.monotonic() - started,
            "sent": groups.replicate.counter.snapshot()["sent_per_peer"],
            "shard_sent": groups.shard.counter.bytes_sent}  # fmt: skip


def test_a_shard_exchanges_on_its_lane_of_the_replica_link_and_inside_its_replica_at_full_speed():
    numel = 50_000  # 200 kB a shard: two messages of 100 kB each way on a lane of 1 MB/s
    out = run_distributed(_emulated_groups, W * K, numel)
    for rank, each in out.items():
        assert each["kinds"] == ("Comm", "EmulatedReplicateComm")
        assert each["inside"] == 0 and each["between"] == 2  # no message of the replica's own on an emulated link
        assert each["sent"] == {str(rank ^ 2): numel * 4} and each["shard_sent"] == 4
        # each message takes its latency and 100 kB at 1 MB/s (half the link): 0.22 s (measured: 0.222 s); at the
        # whole link's 8 Mbit it would be 0.12 s. Never less (the emulation waits until then); the upper bound only
        # catches a hang
        assert 2 * (LINK_LATENCY_S + numel * 2 / LANE_BPS) <= each["seconds"] < 5.0, each["seconds"]


# -- a model the user sharded; bad inputs ------------------------------------------------------------------------------
def _user_sharded(comm: Comm) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (W, K), mesh_dim_names=("replicate", "shard"))  # HSDP's mesh: shard inside
    model = _net()
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    replica = ShardedReplica(comm, K, model, optimizer)
    strategy = _strategy(replica.comm, W, replica.view, optimizer, "sync")
    _train(strategy, model, optimizer, 5, comm.rank, W * K, replica)
    out: dict = {"taken": replica.model is model, "state": replica.whole_state_dict(everywhere=True)}
    world = _net()
    fully_shard(world)  # over the default mesh: all 4 processes, not a replica
    try:
        ShardedReplica(comm, K, world, torch.optim.AdamW(world.parameters()))
    except UsageError as e:
        out["refused"] = str(e)
    return out


def test_a_model_the_user_sharded_over_the_replica_is_taken_and_one_over_the_world_refused():
    out = run_distributed(_user_sharded, W * K)
    for each in out.values():
        assert each["taken"]
        assert all(torch.equal(each["state"][k], out[0]["state"][k]) for k in each["state"])
        assert "sharded over ranks [0, 1, 2, 3]" in each["refused"] and "\n" not in each["refused"]


def _example_lm():
    spec = importlib.util.spec_from_file_location("lm", Path(__file__).parents[1] / "examples" / "lm" / "lm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_layouts_and_blocks():
    layout = Layout.of([0, 1, 2, 3, 4, 5], 3)
    assert layout.shard_groups() == [[0, 1, 2], [3, 4, 5]]
    assert layout.replica_groups() == [[0, 3], [1, 4], [2, 5]]
    assert (layout.replica_of(4), layout.shard_of(4)) == (1, 1)
    with pytest.raises(ConfigError, match="do not make replicas"):
        Layout.of([0, 1, 2], 2)
    with pytest.raises(ConfigError, match="at least one process"):
        Layout.of([0, 1], 0)
    lm = _example_lm().transformer(width=32, layers=3, heads=2, context=16)
    assert blocks(lm) == list(lm.blocks)
    mlp = build_model("mlp", (1, 8, 8), 10)
    assert blocks(mlp) == [m for m in mlp.layers if isinstance(m, nn.Linear)]
    resnet = build_model("resnet8", (1, 8, 8), 10)
    assert blocks(resnet) == list(resnet.stages)
    lstm = build_model("lstm", (1, 8, 8), 10)
    assert blocks(lstm) == [lstm.input_transform, lstm.lstm, lstm.classifier]
