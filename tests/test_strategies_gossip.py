"""The gossip family: D-PSGD mixing, AD-PSGD, push-sum's conserved weights, Statement 1 (async broadcast)."""

import pytest
import torch

import fast
from fast.assemble import load_config
from fast.comm import Comm
from fast.errors import ConfigError
from fast.strategies import StrategyContext, build_strategy, strategy_options
from fast.strategies.peers import rounds_for
from fast.topology.rounds import Rounds
from tests.distributed import run_distributed

DIGITS = {
    "data": {"name": "digits"},
    "model": {"name": "mlp"},
    "run": {"workers": 4, "batch_size": 16, "epochs": 4, "eval_every": 0, "seed": 3},
}


def config_with(strategy: dict, workers: int = 4, **sections: dict):
    data = {**DIGITS, **sections, "strategy": strategy}
    data["run"] = {**DIGITS["run"], "workers": workers, **sections.get("run", {})}
    return load_config(data)


# -- options ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["gossip", "ad-psgd", "push-sum"])
@pytest.mark.parametrize("topology", ["torus:3x3", [[0, 1], [1, 2]], [[0, 1], [1, 2], [2, 3], [3, 4]]])
def test_a_topology_that_does_not_fit_the_workers_is_an_error_naming_the_key(name, topology):
    with pytest.raises(ConfigError, match=r"strategy\.topology"):
        config_with({"name": name, "topology": topology})


@pytest.mark.parametrize(
    "strategy, key",
    [
        ({"name": "gossip", "topology": "ring", "schedule": "random-matchings"}, "strategy.topology"),
        (
            {"name": "push-sum", "peers_per_round": 2, "schedule": "random-matchings"},
            "strategy.peers_per_round",
        ),
        (
            {"name": "gossip", "schedule": "exponential-one-peer", "send_probability": 0.5},
            "strategy.send_probability",
        ),
        ({"name": "ad-psgd", "send_probability": 1.5}, "strategy.send_probability"),
        ({"name": "gossip", "topology": "random-regular:3", "weights": "uniform"}, "strategy.topology"),
        ({"name": "async-broadcast", "max_delay_ms": -1}, "strategy.max_delay_ms"),
    ],
)
def test_options_that_cannot_work_are_errors_naming_the_key(strategy, key):
    workers = 5 if "random-regular" in str(strategy) else 4
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        config_with(strategy, workers)


# -- D-PSGD rounds: what both ends of every channel agree on ------------------------------------------------
def round_matrix(rounds: Rounds, size: int, r: int) -> torch.Tensor:
    w = torch.zeros(size, size, dtype=torch.float64)
    for i in range(size):
        plan = rounds.plan(i, r)
        w[i, i] = plan.keep
        for j, weight in plan.takes.items():
            w[i, j] = weight
            assert i in rounds.plan(j, r).sends, f"round {r}: {i} takes from {j}, which does not send to it"
    return w


@pytest.mark.parametrize(
    "strategy, symmetric",
    [
        ({"topology": "torus:3x3", "send_probability": 0.5}, True),
        ({"topology": "complete", "peers_per_round": 1, "weights": "uniform"}, True),
        ({"topology": "exponential", "peers_per_round": 2, "send_probability": 0.7}, True),
        ({"schedule": "random-matchings", "send_probability": 0.6}, True),
        ({"schedule": "exponential-one-peer"}, False),
    ],
)
def test_every_round_mixes_with_a_doubly_stochastic_matrix_and_partial_rounds_drop_channels(strategy, symmetric):
    config = config_with({"name": "gossip", **strategy}, workers=9)
    rounds = rounds_for(strategy_options(config), 9, seed=3)
    ones = torch.ones(9, dtype=torch.float64)
    links_per_round = []
    for r in range(40):
        w = round_matrix(rounds, 9, r)
        torch.testing.assert_close(w.sum(dim=0), ones)
        torch.testing.assert_close(w.sum(dim=1), ones)
        assert (w >= 0).all()
        if symmetric:
            torch.testing.assert_close(w, w.T)
        links = {(i, j) for i in range(9) for j in range(i + 1, 9) if w[i, j] > 0 or w[j, i] > 0}
        if rounds.topology is not None:
            assert links <= rounds.topology.edges
        links_per_round.append(len(links))
    if rounds.topology is not None:
        share = sum(links_per_round) / (40 * len(rounds.topology.edges))
        assert 0 < share < 0.8  # every option here drops channels, but not all of them
    else:
        full = 4 if rounds.schedule.symmetric else 9  # pairs in a matching of 9; one-way links of a one-peer round
        mean = sum(links_per_round) / 40
        assert (0 < mean < full) if strategy.get("send_probability", 1) < 1 else mean == full


# -- D-PSGD over real processes: with lr = 0 every replica reaches the mean of the initial replicas ----------
def _mix_to_consensus(comm: Comm, strategies: list[dict]) -> list[dict]:
    out = []
    for strategy in strategies:
        config = config_with({"name": "gossip", **strategy})
        ctx = StrategyContext(
            comm=comm,
            world=comm,
            config=config,
            device=torch.device("cpu"),
            workers=comm.size,
            rank=comm.rank,
            generator=torch.Generator().manual_seed(comm.rank),
            steps_per_epoch=1,
        )
        gossip = build_strategy(config, ctx)
        model = torch.nn.Linear(5, 3)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        gossip.setup(model, optimizer)  # every replica starts from rank 0's weights: make them differ
        torch.manual_seed(100 + comm.rank)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn_like(p) * (comm.rank + 1))
        initial = gossip.flat_parameters().clone()
        mean = initial.clone()
        comm.all_reduce(mean, op="mean")
        for step in range(100):
            gossip.before_step(step)
            gossip.after_backward(step)
            gossip.before_optimizer_step()
            optimizer.step()
            gossip.after_optimizer_step(step)
        final = gossip.flat_parameters()
        out.append(
            {
                "moved": float((initial - mean).abs().max()),
                "error": float((final - mean).abs().max()),
                "peers_per_step": gossip.summary()["mean_peers_per_step"],
            }
        )
    return out


def test_gossip_with_lr_zero_brings_every_replica_to_the_mean_of_the_initial_ones():
    strategies = [
        {"topology": "ring"},
        {"topology": "torus:2x2", "weights": "uniform"},
        {"topology": "complete", "send_probability": 0.5, "peers_per_round": 1},
        {"schedule": "random-matchings", "send_probability": 0.7},
        {"schedule": "exponential-one-peer"},
    ]
    out = run_distributed(_mix_to_consensus, 4, strategies)
    for k, strategy in enumerate(strategies):
        for rank in range(4):
            result = out[rank][k]
            assert result["moved"] > 0.5, "the replicas did not start apart"
            assert result["error"] < 1e-4, f"{strategy}: worker {rank} is {result['error']:.2g} from the mean"
    assert out[0][0]["peers_per_step"] == 2
    assert 0 < out[0][2]["peers_per_step"] < 2  # 1 called + answering calls, half of them dropped
    assert 0 < out[0][3]["peers_per_step"] < 1


# -- training on digits --------------------------------------------------------------------------------------
def train(tmp_path, name: str, workers: int = 4, **strategy):
    overrides = {f"strategy__{k}": v for k, v in strategy.items()}
    config = {**DIGITS, "run": {**DIGITS["run"], "workers": workers}}
    return fast.train(config, out=tmp_path / name, strategy__name=name, **overrides)


def test_gossip_with_partial_communication_trains_digits(tmp_path, no_orphans):
    summary = train(tmp_path, "gossip", topology="torus:2x2", send_probability=0.7, peers_per_round=1)
    assert summary["final_test_accuracy"] >= 0.9
    assert min(summary["worker_test_accuracy"]) >= 0.85
    assert 0 < summary["mean_peers_per_step"] < 2  # torus:2x2 has two neighbours; some exchanges were dropped
    assert summary["topology"] == "torus:2x2" and summary["bytes_sent"] > 0


def test_gossip_on_a_lossy_link_keeps_the_lost_shares_and_still_trains_digits(tmp_path, no_orphans):
    lossy = {"network__bandwidth": "1Gbit", "network__latency": "1ms", "network__loss": 0.2}
    summary = fast.train(
        {**DIGITS}, out=tmp_path, strategy__name="gossip", strategy__topology="ring", run__epochs=2, **lossy
    )
    heard = 2 * summary["steps_per_worker"]  # rank 0 (whose figures these are) hears both ring neighbours
    assert 0.1 * heard < summary["lost_messages"] < 0.3 * heard
    assert summary["mean_peers_per_step"] == pytest.approx(2 * 0.8, abs=0.15)
    assert summary["final_test_accuracy"] >= 0.85


@pytest.mark.nondeterministic
def test_ad_psgd_trains_digits_and_records_its_staleness(tmp_path, no_orphans):
    summary = train(tmp_path, "ad-psgd", workers=3, send_probability=0.8)
    assert summary["final_test_accuracy"] >= 0.9
    assert summary["replica_divergence"] < 0.1
    assert sum(summary["staleness_histogram"].values()) == 3 * summary["steps_per_worker"]
    assert summary["averagings_started"] > 0 and summary["averagings_answered"] > 0


@pytest.mark.nondeterministic
def test_push_sum_weights_sum_to_one_after_draining_and_it_trains_digits(tmp_path, no_orphans):
    summary = train(tmp_path, "push-sum", workers=3, send_probability=0.5)
    weights = summary["push_sum_weights"]
    assert len(weights) == 3 and all(w > 0 for w in weights)
    assert weights != [1 / 3] * 3, "no push ever happened"
    assert sum(weights) == pytest.approx(1.0, abs=1e-12)
    assert summary["pushes"] > 0
    assert summary["final_test_accuracy"] >= 0.9


@pytest.mark.nondeterministic
def test_statement_1_once_every_delayed_update_is_delivered_all_replicas_agree(tmp_path, no_orphans):
    summary = fast.train(
        {**DIGITS, "run": {**DIGITS["run"], "workers": 3}},
        out=tmp_path / "async-broadcast",
        strategy__name="async-broadcast",
        strategy__max_delay_ms=30,
        optimizer__momentum=0.0,
        optimizer__lr=0.1,
    )
    steps = summary["steps_per_worker"]
    assert summary["updates_per_replica"] == 3 * steps
    assert summary["max_staleness"] > 0, "no update was ever late: the replicas never disagreed"
    assert summary["replica_divergence"] < 1e-5
    accuracies = summary["worker_test_accuracy"]
    assert max(accuracies) - min(accuracies) <= 1 / 359  # the same weights up to the order of additions
    assert summary["final_test_accuracy"] >= 0.75


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, topology",
    [("gossip", "torus:2x4"), ("gossip", "torus:3x3"), ("ad-psgd", "torus:3x3"), ("push-sum", "torus:2x4")],
)
def test_eight_and_nine_workers_on_a_torus_run_to_completion(tmp_path, no_orphans, name, topology):
    workers = 8 if topology == "torus:2x4" else 9
    summary = fast.train(
        {**DIGITS, "run": {**DIGITS["run"], "workers": workers, "epochs": 10, "max_steps": 40}},
        out=tmp_path / name,
        strategy__name=name,
        strategy__topology=topology,
    )
    assert summary["steps_per_worker"] == 40 and len(summary["worker_test_accuracy"]) == workers
    assert summary["final_test_accuracy"] > 0.5
