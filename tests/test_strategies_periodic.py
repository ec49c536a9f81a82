"""ssp, local-sgd, diloco, easgd/eamsgd over real processes: each against sync or against its update rule."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import fast
from fast.assemble import load_config
from fast.comm import Comm
from fast.config import Config
from fast.errors import ConfigError
from fast.jobs.models import build_model
from fast.strategies import Strategy, StrategyContext, build_strategy
from fast.strategies.flat import FlatState
from tests.distributed import run_distributed

STEPS, BATCH, WORKERS = 6, 8, 3


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(BATCH, 1, 8, 8, generator=g), torch.randint(0, 10, (BATCH,), generator=g)


def _context(comm: Comm, config: Config) -> StrategyContext:
    return StrategyContext(
        comm=comm,
        world=comm,
        config=config,
        device=torch.device("cpu"),
        workers=comm.size,
        rank=comm.rank,
        generator=torch.Generator(),
        steps_per_epoch=STEPS,
    )


def _train(
    comm: Comm,
    name: str,
    steps: int = STEPS,
    momentum: float = 0.9,
    slow_rank: int | None = None,
    on_step=None,
    **options,
) -> tuple[torch.Tensor, Strategy]:
    """The worker's step loop on the strategy's hooks; returns the final replica and the strategy."""
    torch.manual_seed(0)
    model = build_model("mlp", (1, 8, 8), 10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
    overrides = {f"strategy__{k}": v for k, v in options.items()}
    config = load_config(None, run__workers=comm.size, strategy__name=name, **overrides)
    strategy = build_strategy(config, _context(comm, config))
    strategy.setup(model, optimizer)
    for t in range(steps):
        if comm.rank == slow_rank:
            time.sleep(0.05)
        x, y = _batch(comm.rank, t)
        strategy.before_step(t)
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        strategy.after_backward(t)
        strategy.before_optimizer_step()
        optimizer.step()
        if on_step is not None:
            on_step(t, "before", model, strategy)
        strategy.after_optimizer_step(t)
        if on_step is not None:
            on_step(t, "after", model, strategy)
    strategy.end_of_run()
    return strategy.flat_parameters(), strategy


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _scenarios(comm: Comm) -> dict:
    out: dict = {}
    out["sync"], _ = _train(comm, "sync")
    out["ssp0"], _ = _train(comm, "ssp", staleness=0)
    out["warmup_only"], _ = _train(comm, "local-sgd", warmup_steps=STEPS, period=100)
    out["ssp2"], ssp = _train(comm, "ssp", steps=10, momentum=0.0, slow_rank=0, staleness=2)
    out["ssp2_staleness"] = list(ssp.staleness)

    seen: dict = {}

    def around_step_3(t: int, phase: str, model: torch.nn.Module, strategy: Strategy) -> None:
        if t == 0 and phase == "before" and hasattr(strategy, "theta"):
            seen["theta0"] = strategy.theta.clone()
        if t == 3:  # local-sgd averages, diloco takes its first outer step, after this step
            seen[phase] = strategy.theta.clone() if hasattr(strategy, "theta") else _flat(model)

    out["local"], local = _train(comm, "local-sgd", period=4, on_step=around_step_3)
    out["local_before"], out["local_after"] = seen["before"], seen["after"]
    out["local_final_model"] = _flat(local.final_model())
    out["local_averagings"] = local.averagings

    comm.piece_bytes = 256  # the rounds' all-reduces in pieces of 64 floats
    out["local_in_pieces"], _ = _train(comm, "local-sgd", period=4)
    comm.piece_bytes = None

    out["diloco_plain"], plain = _train(comm, "diloco", period=4, outer_lr=1.0, outer_momentum=0.0)
    out["diloco_plain_reported"] = _flat(plain.final_model())

    _, diloco = _train(comm, "diloco", period=4, on_step=around_step_3)
    out["theta0"], out["theta1"] = seen["theta0"], seen["after"]
    out["outer_state"] = diloco.state_dict()["outer"]["state"]

    torch.manual_seed(0)
    model = build_model("mlp", (1, 8, 8), 10)
    config = load_config(None, run__workers=comm.size, strategy__name="eamsgd", strategy__alpha=0.2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    easgd = build_strategy(config, _context(comm, config))
    easgd.setup(model, optimizer)
    out["nesterov"] = [g["nesterov"] for g in optimizer.param_groups]
    state = FlatState.of_model(model)
    out["center0"] = easgd.center.clone()
    state.write(state.read() + torch.randn(state.numel, generator=torch.Generator().manual_seed(comm.rank)))
    out["w_before"] = state.read()
    easgd.exchange()
    out["w_after"], out["center1"] = state.read(), easgd.center.clone()
    out["center_model"] = _flat(easgd.final_model())
    return out


@pytest.fixture(scope="module")
def scenarios() -> dict[int, dict]:
    return run_distributed(_scenarios, WORKERS)


def test_ssp_with_staleness_zero_gives_the_same_weights_as_sync(scenarios):
    for rank in range(WORKERS):
        torch.testing.assert_close(scenarios[rank]["ssp0"], scenarios[rank]["sync"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(scenarios[rank]["sync"], scenarios[0]["sync"])


def test_ssp_keeps_staleness_within_the_bound_and_applies_every_gradient_once(scenarios):
    for rank in range(WORKERS):
        assert scenarios[rank]["ssp2_staleness"] and max(scenarios[rank]["ssp2_staleness"]) <= 2
        # plain SGD: a replica is w0 minus lr/N times the sum of every gradient it applied, in any order
        torch.testing.assert_close(scenarios[rank]["ssp2"], scenarios[0]["ssp2"], rtol=1e-5, atol=1e-6)
    # worker 0 is slow: the others run ahead to the bound and apply its gradients exactly s steps late
    assert max(max(scenarios[r]["ssp2_staleness"]) for r in (1, 2)) == 2


def test_local_sgd_warmup_is_sync_and_averaging_replaces_replicas_by_their_mean(scenarios):
    for rank in range(WORKERS):
        torch.testing.assert_close(scenarios[rank]["warmup_only"], scenarios[rank]["sync"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(scenarios[rank]["local"], scenarios[0]["local"])
        torch.testing.assert_close(scenarios[rank]["local_final_model"], scenarios[0]["local"])
        assert scenarios[rank]["local_averagings"] == 2  # after step 3, and at the end of the run (step 5)
        torch.testing.assert_close(scenarios[rank]["local_in_pieces"], scenarios[rank]["local"], rtol=1e-5, atol=1e-6)
    befores = torch.stack([scenarios[r]["local_before"] for r in range(WORKERS)])
    assert not torch.allclose(befores[0], befores[1])
    for rank in range(WORKERS):
        torch.testing.assert_close(scenarios[rank]["local_after"], befores.mean(0), rtol=1e-5, atol=1e-6)


def test_diloco_with_a_plain_outer_step_is_local_sgd_and_nesterov_follows_the_paper(scenarios):
    for rank in range(WORKERS):
        torch.testing.assert_close(scenarios[rank]["diloco_plain"], scenarios[rank]["local"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(
            scenarios[rank]["diloco_plain_reported"], scenarios[rank]["local"], rtol=1e-5, atol=1e-6
        )
    # first round: θ1 = θ0 - lr (Δ + μ Δ) with Δ = θ0 - mean of the replicas after 4 local steps (Nesterov,
    # empty momentum buffer), and that mean is what local-sgd averaged at the same step
    mean = torch.stack([scenarios[r]["local_before"] for r in range(WORKERS)]).mean(0)
    theta0, theta1 = scenarios[0]["theta0"], scenarios[0]["theta1"]
    torch.testing.assert_close(theta1, theta0 - 0.7 * 1.9 * (theta0 - mean), rtol=1e-4, atol=1e-5)
    assert "momentum_buffer" in scenarios[0]["outer_state"][0]


def test_sync_easgd_exchange_follows_the_elastic_update(scenarios):
    alpha, n = 0.2, WORKERS
    c0 = scenarios[0]["center0"]
    ws = [scenarios[r]["w_before"] for r in range(n)]
    expected_center = c0 + alpha * sum(w - c0 for w in ws)
    for rank in range(n):
        assert scenarios[rank]["nesterov"] == [True]
        torch.testing.assert_close(scenarios[rank]["center1"], expected_center, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(scenarios[rank]["w_after"], ws[rank] - alpha * (ws[rank] - c0))
        numel = scenarios[rank]["center_model"].numel()
        torch.testing.assert_close(scenarios[rank]["center_model"], expected_center[:numel], rtol=1e-5, atol=1e-5)
    # the exchange moves mass between replicas and the center but keeps their sum
    before = c0 + sum(ws)
    after = scenarios[0]["center1"] + sum(scenarios[r]["w_after"] for r in range(n))
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-4)


@pytest.mark.nondeterministic
def test_ssp_trains_end_to_end_and_reports_bounded_staleness(tmp_path, no_orphans):
    summary = fast.train(
        None,
        out=tmp_path,
        data__name="digits",
        model__name="mlp",
        run__workers=3,
        run__epochs=3,
        strategy__name="ssp",
        strategy__staleness=1,
    )
    assert summary["final_test_accuracy"] > 0.65
    assert set(summary["staleness_histogram"]) <= {"0", "1"} and summary["max_staleness"] <= 1
    assert len(summary["worker_test_accuracy"]) == 3 and summary["staleness_bound"] == 1


@pytest.mark.nondeterministic
def test_async_easgd_runs_with_a_master_and_reports_the_center(tmp_path, no_orphans):
    summary = fast.train(
        None,
        out=tmp_path,
        data__name="digits",
        model__name="mlp",
        run__workers=2,
        run__epochs=4,
        strategy__name="easgd",
        strategy__variant="async",
        strategy__tau=2,
    )
    assert summary["servers"] == 1 and summary["final_model"] == "center"
    assert summary["final_test_accuracy"] > 0.85
    # an exchange every 2 steps after step 0 on each of the 2 workers, one center update per exchange
    assert summary["center_updates"] == 2 * ((summary["steps_per_worker"] - 1) // 2)
    assert summary["max_staleness"] >= 1 and summary["bytes_sent"] > 0


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"strategy__name": "easgd", "strategy__alpha": 0.1, "strategy__rho": 1.0}, "either alpha or rho"),
        ({"strategy__name": "easgd", "strategy__alpha": 0.5, "run__workers": 4}, "use α <= 1 / workers"),
        ({"strategy__name": "easgd", "strategy__rho": 40.0}, "lower `strategy.rho`"),
        ({"strategy__name": "eamsgd", "optimizer__name": "adam"}, 'set optimizer.name = "sgd"'),
        ({"strategy__name": "ssp", "strategy__staleness": -1}, "strategy.staleness"),
        ({"strategy__name": "diloco", "strategy__outer_momentum": 1.0}, "strategy.outer_momentum"),
        ({"strategy__name": "local-sgd", "strategy__period": 0}, "strategy.period"),
    ],
)
def test_impossible_options_are_config_errors_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, **overrides)


@pytest.mark.parametrize(
    "strategy",
    [
        "diloco",
        pytest.param("local-sgd", marks=pytest.mark.slow),
        pytest.param("streaming-diloco", marks=pytest.mark.slow),
    ],
)
def test_a_users_loop_that_ends_on_a_round_keeps_that_rounds_weights(tmp_path, no_orphans, strategy):
    """Workers whose loops have ended take steps without data until they agree to stop: a round in which no worker
    moved changes nothing (before, DiLoCo's outer momentum went on moving θ with zero pseudo-gradients)."""
    script = Path(__file__).parent / "scripts" / "peer_replica.py"
    fast_bin = str(Path(sys.executable).parent / "fast")
    env = {**os.environ, "FAST_PROGRESS": "0", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([fast_bin, "run", "--workers", "2", "--out", str(tmp_path / "run"), str(script), "fast",
                           str(tmp_path), strategy], env=env, capture_output=True, text=True, timeout=240)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps_per_worker"] == 12
    if strategy == "streaming-diloco":  # 2 fragments, 4 steps a round: fragment 1's last round is 2 steps before
        # the end, so the end owes it one more; none of the workers' steps without data takes a round
        assert summary["outer_rounds"] == 3 + 3 + 1
        finals = [torch.load(tmp_path / f"replica{r}-final.pt", weights_only=True) for r in (0, 1)]
        assert all(torch.equal(finals[0][name], finals[1][name]) for name in finals[0])
        return
    for replica in (0, 1):
        last_round = torch.load(tmp_path / f"replica{replica}.pt", weights_only=True)[-1]
        final = torch.load(tmp_path / f"replica{replica}-final.pt", weights_only=True)
        for name, tensor in last_round.items():
            assert torch.equal(final[name], tensor), (replica, name)
    rounds = summary["outer_rounds"] if strategy == "diloco" else summary["averagings"]
    assert rounds == 3
