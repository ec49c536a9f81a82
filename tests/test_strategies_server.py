"""async-ps, ea-wild and hogwild: exact algorithms against one-process references, exact bytes, clean exits."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import fast
from fast.assemble import load_config
from fast.comm import Comm
from fast.comm.shared_memory import SHARED_DIR
from fast.errors import ConfigError
from fast.jobs.models import build_model
from fast.strategies import StrategyContext, build_strategy, strategy_class, strategy_options
from fast.strategies.async_ps import compensated_gradient, shard_bounds
from fast.strategies.base import ModelLayout
from tests.distributed import run_distributed

STEPS, BATCH, LR = 6, 16, 0.1


def _batches() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(STEPS, BATCH, 1, 8, 8, generator=g), torch.randint(0, 10, (STEPS, BATCH), generator=g)


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _drive(world: Comm, workers: int, overrides: dict) -> torch.Tensor | None:
    """What the job does with a strategy that has servers, on hand-made batches: returns worker 0's final
    flat weights (None on servers)."""
    config = load_config(None, run__workers=workers, optimizer__lr=LR, **overrides)
    comm = world.subgroups([list(range(workers)), list(range(workers, world.size))])
    torch.manual_seed(0)
    model = build_model("mlp", (1, 8, 8), 10)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=config.optimizer.momentum)
    ctx = StrategyContext(
        comm=comm,
        world=world,
        config=config,
        device=torch.device("cpu"),
        workers=workers,
        rank=world.rank,
        generator=torch.Generator(),
        steps_per_epoch=STEPS,
    )
    strategy = build_strategy(config, ctx)
    if world.rank >= workers:
        strategy.setup_server(ModelLayout.of(model))
        world.barrier()
        strategy.serve()
        return None
    strategy.setup(model, optimizer)
    world.barrier()
    x, y = _batches()
    for step in range(STEPS):
        strategy.before_step(step)
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x[step]), y[step]).backward()
        strategy.after_backward(step)
        strategy.before_optimizer_step()
        optimizer.step()
        strategy.after_optimizer_step(step)
    strategy.end_of_run()
    return _flat(strategy.final_model())


def _reference(momentum: float, elastic: float | None = None) -> torch.Tensor:
    """One process: SGD on the same batches; with `elastic` = ηρ, Algorithm 1 of paper 004 with one worker,
    returning the center."""
    torch.manual_seed(0)
    model = build_model("mlp", (1, 8, 8), 10)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=momentum)
    center = [p.detach().clone() for p in model.parameters()]
    x, y = _batches()
    for step in range(STEPS):
        optimizer.zero_grad()
        F.cross_entropy(model(x[step]), y[step]).backward()
        sent = [p.detach().clone() for p in model.parameters()]
        optimizer.step()
        if elastic is not None:
            with torch.no_grad():
                for p, w, c in zip(model.parameters(), sent, center, strict=True):
                    p.sub_(elastic * (w - c))
                    c.add_(elastic * (w - c))
    if elastic is not None:
        return torch.cat([c.reshape(-1) for c in center])
    return _flat(model)


def _one_worker_runs(world: Comm) -> dict[str, torch.Tensor | None]:
    """Both server strategies with one worker and one server process, one after the other."""
    return {
        "async-ps": _drive(world, 1, {"strategy__name": "async-ps", "strategy__server_momentum": 0.9}),
        "ea-wild": _drive(world, 1, {"strategy__name": "ea-wild", "strategy__rho": 2.0, "optimizer__momentum": 0.0}),
    }


def test_with_one_worker_async_ps_is_sgd_on_the_server_and_ea_wild_is_algorithm_1():
    out = run_distributed(_one_worker_runs, 2)[0]
    torch.testing.assert_close(out["async-ps"], _reference(momentum=0.9))
    torch.testing.assert_close(out["ea-wild"], _reference(momentum=0.0, elastic=LR * 2.0))


# -- async-ps -------------------------------------------------------------------------------------------------
def test_server_gradient_divides_by_staleness_and_compensates_delay():
    g, now, backup = torch.tensor([1.0, -2.0]), torch.tensor([0.5, 0.5]), torch.tensor([0.0, 1.0])
    assert compensated_gradient(g, now, backup, staleness=4, staleness_lr=False, dc_lambda=0).tolist() == [1, -2]
    assert compensated_gradient(g, now, backup, staleness=4, staleness_lr=True, dc_lambda=0).tolist() == [
        0.25,
        -0.5,
    ]
    # DC-ASGD: g + λ g⊙g⊙(w_now − w_backup) = [1 + 0.5*1*0.5, -2 + 0.5*4*(-0.5)]
    dc = compensated_gradient(g, now, backup, staleness=0, staleness_lr=True, dc_lambda=0.5)
    assert dc.tolist() == [1.25, -3.0]


def test_shards_are_contiguous_and_cover_the_vector():
    assert shard_bounds(10, 3) == [(0, 3), (3, 7), (7, 10)]
    assert shard_bounds(5, 1) == [(0, 5)]


def test_async_ps_options_are_checked():
    config = load_config(None, run__workers=4, strategy__name="async-ps", strategy__servers=3)
    assert strategy_class("async-ps").server_count(strategy_options(config), 4) == 3
    with pytest.raises(ConfigError, match="more servers than workers"):
        load_config(None, run__workers=2, strategy__name="async-ps", strategy__servers=3)
    with pytest.raises(ConfigError, match="strategy.push_every"):
        load_config(None, strategy__name="async-ps", strategy__push_every=0)


def _mlp_numel() -> int:
    return sum(p.numel() for p in build_model("mlp", (1, 8, 8), 10).parameters())


@pytest.mark.nondeterministic
def test_async_ps_run_sends_exact_bytes_records_staleness_and_exits(tmp_path, no_orphans):
    workers, servers = 2, 2
    summary = fast.train(
        None,
        out=tmp_path,
        data__name="digits",
        model__name="mlp",
        run__workers=workers,
        run__epochs=3,
        run__batch_size=32,
        strategy__name="async-ps",
        strategy__servers=servers,
        strategy__staleness_lr=True,
    )
    steps, n = summary["steps_per_worker"], _mlp_numel()
    assert summary["servers"] == servers and summary["server_updates"] == workers * steps
    # a worker sends per step one 16-byte header and its gradient slice to each server, then "done" headers;
    # the servers answer every push with their weights, and send the final weights once
    worker_bytes = steps * (servers * 16 + 4 * n) + servers * 16
    server_bytes = (steps + 1) * 4 * n
    assert summary["bytes_sent"] == workers * (worker_bytes + server_bytes)
    assert sum(summary["staleness_histogram"].values()) == servers * workers * steps
    assert summary["max_staleness"] >= 1  # two workers interleave
    assert summary["server_request_s"] > 0  # the servers' own work on a request, timed
    assert summary["final_test_accuracy"] > 0.8


@pytest.mark.nondeterministic
def test_async_ps_on_a_lossy_link_skips_lost_pushes_keeps_its_weights_on_lost_pulls_and_still_learns(
    tmp_path, no_orphans
):
    """A lost push is an update the server skips, a lost pull leaves the replica as it was: neither is a death."""
    job = {
        "data__name": "digits",
        "model__name": "mlp",
        "run__workers": 2,
        "run__epochs": 3,
        "run__batch_size": 16,
        "strategy__name": "async-ps",
        "strategy__servers": 1,
        "network__bandwidth": "1Gbit",
        "network__latency": "1ms",
    }
    clean = fast.train(None, out=tmp_path / "clean", **job, network__loss=0.0)
    lossy = fast.train(None, out=tmp_path / "lossy", **job, network__loss=0.2)
    messages = 2 * lossy["steps_per_worker"]  # each worker pushes and pulls every step
    assert clean["lost_pushes"] == clean["lost_pulls"] == 0 and clean["server_updates"] == messages
    assert lossy["failures"] == []
    assert lossy["pushes"] == lossy["pulls"] == messages
    assert 0.1 < lossy["lost_pushes"] / messages < 0.3 and 0.1 < lossy["lost_pulls"] / messages < 0.3
    assert lossy["server_updates"] == messages - lossy["lost_pushes"]
    assert lossy["final_test_accuracy"] > max(0.85, clean["final_test_accuracy"] - 0.08)


# -- ea-wild --------------------------------------------------------------------------------------------------
def test_ea_wild_options_are_checked():
    with pytest.raises(ConfigError, match="group_size"):
        load_config(None, run__workers=4, strategy__name="ea-wild", strategy__group_size=3)
    with pytest.raises(ConfigError, match="must be below 1"):
        load_config(None, optimizer__lr=0.5, strategy__name="ea-wild", strategy__rho=2.0)


@pytest.mark.nondeterministic
def test_ea_wild_groups_run_sends_exact_bytes_and_exits(tmp_path, no_orphans):
    workers, group, tau = 4, 2, 2
    summary = fast.train(
        None,
        out=tmp_path,
        data__name="digits",
        model__name="mlp",
        run__workers=workers,
        run__epochs=3,
        run__batch_size=32,
        strategy__name="ea-wild",
        strategy__group_size=group,
        strategy__tau=tau,
    )
    steps, n = summary["steps_per_worker"], _mlp_numel()
    exchanges = -(-steps // tau)
    groups = workers // group
    assert summary["servers"] == 1 and summary["center_updates"] == groups * exchanges
    assert sum(summary["staleness_histogram"].values()) == groups * exchanges
    leader = exchanges * (8 + 4 * n) + 8  # header and weights per exchange, then "done"
    master = (exchanges + 1) * 4 * n  # the center per exchange, then the final center
    gradients = workers * steps * 4 * n  # ring all-reduce inside a group of 2 sends the whole vector
    center_in_group = (exchanges + 1) * 4 * n  # each leader broadcasts each center to its one member
    assert summary["bytes_sent"] == groups * (leader + master + center_in_group) + gradients
    assert summary["final_test_accuracy"] > 0.8


# -- hogwild --------------------------------------------------------------------------------------------------
def test_hogwild_refuses_runs_that_span_machines(monkeypatch):
    with pytest.raises(ConfigError, match="master_addr"):
        load_config(None, strategy__name="hogwild", run__master_addr="10.0.0.5")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ConfigError, match="one machine"):
        load_config(None, strategy__name="hogwild")


@pytest.mark.nondeterministic
def test_hogwild_trains_one_shared_model_with_no_bytes_on_the_wire_and_leaves_no_file(tmp_path, no_orphans):
    before = set(SHARED_DIR.glob("fast-hogwild-*"))
    summary = fast.train(
        None,
        out=tmp_path,
        data__name="digits",
        model__name="mlp",
        run__workers=2,
        run__epochs=2,
        strategy__name="hogwild",
    )
    assert summary["bytes_sent"] == 0 and summary["wire"].startswith("none")
    assert summary["shared_memory_bytes"] == 8 * 2 + 4 * _mlp_numel()
    assert sum(summary["staleness_histogram"].values()) == 2 * summary["steps_per_worker"]
    assert summary["final_test_accuracy"] > 0.75
    assert set(SHARED_DIR.glob("fast-hogwild-*")) <= before
    assert Path(tmp_path, "model.pt").is_file()
