"""`fast predict`: the cost model fed from the config (links, message size, compute, deployment), per variant."""

import pytest
from rich.console import Console

from fast.assemble import load_config
from fast.codecs import build_codec
from fast.jobs.datasets import load_dataset
from fast.jobs.models import build_model
from fast.perfmodel import Link
from fast.pricing import LOOPBACK, SHARED_MEMORY, effective_compute_s, expected_maximum_factor
from fast.tools.cli import main
from fast.tools.predict import (
    config_for_prediction,
    measure_compute_s,
    oversubscription,
    predict,
    print_predictions,
)

BASE = {
    "run": {"workers": 4, "batch_size": 32, "threads_per_worker": 1},
    "data": {"name": "digits"},
    "model": {"name": "mlp"},
    "network": {"bandwidth": "20Mbit", "latency": "20ms"},
}
MLP_BYTES = 4 * 50826  # the mlp on 8x8 digits, float32
LINK = Link(0.02, 2.5e6)


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


def _config(**overrides):
    return load_config(BASE, **overrides)


def test_sync_is_compute_plus_a_ring_all_reduce_on_the_network_link(digits):
    p = predict(_config(), dataset=digits, compute_s=0.01)
    ring = 2 * 3 * LINK.message_time(MLP_BYTES / 4)
    assert p.link == LINK and p.message_bytes == MLP_BYTES
    assert p.cost.time_s == pytest.approx(0.01 + ring)
    assert p.bytes_per_step == pytest.approx(2 * 3 * MLP_BYTES)  # 2(N-1)/N of n, sent by each of N workers
    assert p.steps_per_epoch == (1438 // 4) // 32
    assert p.epoch_s == pytest.approx(p.cost.time_s * p.steps_per_epoch)
    assert p.cc_ratio == pytest.approx(2 * 50432 / 50826)  # 2 FLOPs per weight of the forward pass / params


def test_local_sgd_pays_its_all_reduce_once_per_period(digits):
    config = config_for_prediction({**BASE, "strategy": {"name": "local-sgd", "period": 8}})
    p = predict(config, dataset=digits, compute_s=0.01)
    assert p.cost.time_s == pytest.approx(0.01 + 2 * 3 * LINK.message_time(MLP_BYTES / 4) / 8)


def test_gossip_sends_to_each_neighbour_of_its_topology_and_overlaps_compute(digits):
    config = _config(strategy__name="gossip", strategy__topology="torus:2x2", run__workers=4)
    p = predict(config, dataset=digits, compute_s=0.01)
    degree = 2  # torus 2x2: the two neighbours are each other's twice over
    assert p.cost.comm_s == pytest.approx(degree * LINK.message_time(MLP_BYTES))
    assert p.cost.time_s == pytest.approx(max(0.01, p.cost.comm_s))  # posted before forward, awaited after


def test_a_codec_shrinks_the_message_to_its_frames(digits):
    p = predict(_config(codec__name="topk", codec__ratio=0.01), dataset=digits, compute_s=0.01)
    codec = build_codec("topk", ratio=0.01)
    model = build_model("mlp", digits.input_shape, digits.num_classes)
    assert p.message_bytes == sum(codec.encoded_size(tuple(q.shape)) for q in model.parameters())
    assert p.message_bytes < MLP_BYTES / 20


def test_native_runs_use_the_loopback_link_or_shared_memory_and_unpriced_strategies_say_why(digits):
    native = {k: v for k, v in BASE.items() if k != "network"}
    assert predict(load_config(native), dataset=digits, compute_s=0.01).link == SHARED_MEMORY  # sync on the CPU
    for overrides in ({"run__shared_memory": False}, {"strategy__hierarchical": 2}, {"codec__name": "fp16"}):
        assert predict(load_config(native, **overrides), dataset=digits, compute_s=0.01).link == LOOPBACK, overrides
    for strategy, link in [("local-sgd", SHARED_MEMORY), ("gossip", LOOPBACK), ("streaming-diloco", LOOPBACK)]:
        config = load_config(native, strategy__name=strategy)
        assert predict(config, dataset=digits, compute_s=0.01).link == link, strategy
    p = predict(_config(strategy__name="hogwild"), dataset=digits, compute_s=0.01)
    assert p.cost is None and "hogwild" in p.problem


def test_sites_price_the_wan_between_them(digits):
    config = _config(network__sites={"a": [0, 1], "b": [2, 3]}, network__wan={"bandwidth": "5Mbit"})
    p = predict(config, dataset=digits, compute_s=0.01)
    assert p.link == Link(0.02, 625e3)


def test_compute_slowdowns_and_stragglers_in_expectation():
    config = _config(compute__slowdown=[1, 1, 1, 4], compute__straggler_probability=0.1)
    barrier = 0.1 * 4 * 1 + 0.2 * (1 - 0.9**4)
    assert effective_compute_s(config, 0.1) == pytest.approx(barrier)
    no_barrier = _config(strategy__name="async-ps", compute__slowdown=[1, 1, 1, 4], compute__straggler_probability=0.1)
    assert effective_compute_s(no_barrier, 0.1) == pytest.approx(0.4 + 0.2 * 0.1)


def test_the_heavy_tail_expectation_matches_the_closed_form_for_one_worker():
    shape, cap = 1.5, 20.0
    closed = 1 + (cap ** (1 - shape) - 1) / (1 - shape)  # E[min(X, cap)], X ~ Pareto(shape, 1)
    assert expected_maximum_factor(shape, cap, 1) == pytest.approx(closed, rel=1e-3)
    assert expected_maximum_factor(shape, cap, 8) > expected_maximum_factor(shape, cap, 1)


def test_measured_compute_counts_workers_sharing_cores(digits, monkeypatch):
    config = load_config({**BASE, "run": {**BASE["run"], "workers": 2}})
    monkeypatch.setattr("os.cpu_count", lambda: 1)
    assert oversubscription(config) == 2.0
    assert 0 < measure_compute_s(config, digits) < 10


def test_predict_prints_every_variant_and_names_the_first(tmp_path, capsys):
    path = tmp_path / "job.toml"
    path.write_text(
        """
[run]
workers = 4
batch_size = 32
[data]
name = "digits"
[model]
name = "mlp"
[network]
bandwidth = "20Mbit"
latency = "20ms"
[[variant]]
name = "all-reduce"
strategy = { name = "sync" }
[[variant]]
name = "rarely"
strategy = { name = "local-sgd", period = 64 }
"""
    )
    console = Console(record=True, width=140)
    predictions = print_predictions(path, console)
    text = console.export_text()
    assert [p.name for p in predictions] == ["all-reduce", "rarely"]
    assert "all-reduce" in text and "rarely" in text and "computation/communication ratio" in text
    assert "first to the target, if all need as many epochs: rarely" in text
    assert main(["predict", str(tmp_path / "missing.toml")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_fast_predict_takes_a_package_as_fast_train_does(tmp_path, capsys):
    import fast

    job = {"data": {"name": "digits"}, "model": {"name": "mlp"}, "run": {"workers": 2, "batch_size": 32},
           "network": {"bandwidth": "20Mbit", "latency": "20ms"}}  # fmt: skip
    archive = fast.pack(job, tmp_path / "mlp.fastjob", open_keys=("strategy.*",))
    source = predict(load_config(job), dataset=load_dataset("digits"))
    assert main(["predict", str(archive), "--unsigned", "--set", "data.name=digits"]) == 0
    out = capsys.readouterr().out
    assert "model packed (mlp.fastjob): 50,826 parameters" in out and " sync " in out
    # the links are the owner's machines: a package's own [network] is not a default (fast.ownership)
    links = {"network__bandwidth": "20Mbit", "network__latency": "20ms"}
    packed = print_predictions(str(archive), Console(width=200), data__name="digits", strategy__name="local-sgd",
                               package__unsigned=True, **links)  # fmt: skip
    assert packed[0].strategy == "local-sgd" and packed[0].message_bytes == source.message_bytes == MLP_BYTES
    assert packed[0].link == source.link == LINK
    # the package was made for 8x8 digits, not the synthetic data's 28x28
    assert main(["predict", str(archive), "--unsigned", "--set", "data.name=synthetic"]) == 2
    assert "the package was made for float32 of shape (1, 8, 8)" in capsys.readouterr().err
    assert main(["predict", str(tmp_path / "missing.toml"), "--set", "run.workers=3"]) == 2
