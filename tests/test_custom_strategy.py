"""A strategy defined outside FAST (examples/custom_strategy.py) registers on import and trains, and config
validation and `fast predict` use what it declares (codec capabilities, a cost model)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import tomli_w

import fast
from examples.custom_strategy import RingAverage
from fast.assemble import load_config
from fast.errors import ConfigError
from fast.jobs.datasets import load_dataset
from fast.jobs.models import build_model
from fast.perfmodel import Link, allreduce_cost
from fast.strategies import strategy_class
from fast.tools.predict import predict_variants
from fast.units import format_bytes

ROOT = Path(__file__).resolve().parents[1]


def test_the_example_strategy_registers_and_averages_the_replicas_with_a_ring_all_reduce(tmp_path, no_orphans):
    assert strategy_class("ring-average") is RingAverage
    workers, every = 3, 4
    summary = fast.train(
        {"data": {"name": "digits"}, "model": {"name": "mlp"}},
        out=tmp_path / "ring",
        run__workers=workers,
        run__epochs=4,
        run__batch_size=16,
        run__eval_every=0,
        strategy__name="ring-average",
        strategy__every=every,
    )
    steps = summary["steps_per_worker"]
    assert steps % every == 0, "the last step should be an averaging step"
    assert summary["final_test_accuracy"] >= 0.9
    assert summary["replica_divergence"] < 1e-6  # just averaged: every replica holds the same weights
    data = load_dataset("digits")
    numel = sum(p.numel() for p in build_model("mlp", data.input_shape, data.num_classes).parameters())
    # a ring all-reduce moves the whole model around the ring twice: 2 (N - 1) model sizes in all
    assert summary["bytes_sent"] == steps // every * 2 * (workers - 1) * numel * 4


def _ring_config(tmp_path, codec: str, workers: int = 4, every: int = 5) -> dict:
    return {
        "data": {"name": "digits"},
        "model": {"name": "mlp"},
        "run": {"workers": workers, "batch_size": 16},
        "strategy": {"name": "ring-average", "module": "examples.custom_strategy", "every": every},
        "codec": {"name": codec},
        "network": {"latency": "5ms", "bandwidth": "100Mbit"},
    }


def test_config_validation_asks_an_outside_strategy_which_codecs_it_takes():
    """RingAverage takes summable codecs without error feedback: the casts, not the sparsifiers or quantisers."""
    load_config(_ring_config(None, "fp16"))
    with pytest.raises(ConfigError) as error:
        load_config(_ring_config(None, "topk"))
    message = str(error.value)
    assert "`codec.name` = 'topk' does not work with strategy 'ring-average'" in message
    assert "can use 'none', 'fp16', 'bf16': change codec.name" in message
    with pytest.raises(ConfigError, match="module 'no_such_module' does not import"):
        load_config({"strategy": {"name": "ring-average", "module": "no_such_module"}})


def test_fast_predict_prices_an_outside_strategy_with_its_own_cost_model(tmp_path):
    """`fast predict` in a fresh process imports `strategy.module`, and its step time is RingAverage.cost's."""
    config = tmp_path / "ring.toml"
    config.write_text(tomli_w.dumps(_ring_config(tmp_path, "fp16")))
    shown = subprocess.run([sys.executable, "-m", "fast", "predict", str(config)], capture_output=True, text=True,
                           cwd=ROOT, env={**os.environ, "COLUMNS": "200"}, timeout=300)  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    row = next(line for line in shown.stdout.splitlines() if "ring-average" in line)
    [prediction] = predict_variants(_ring_config(tmp_path, "fp16"))
    link = Link(latency_s=5e-3, bandwidth_Bps=100e6 / 8)
    expected = RingAverage.cost(prediction.message_bytes, 4, link, prediction.cost.compute_s, {"every": 5})
    assert prediction.cost == expected
    seconds, nbytes = allreduce_cost(prediction.message_bytes, 4, link)
    assert prediction.bytes_per_step == pytest.approx(4 * nbytes / 5)
    assert prediction.message_bytes < 2 * 4 * prediction.parameters / 3  # fp16 frames: about half of float32
    assert format_bytes(prediction.bytes_per_step) in row


@pytest.mark.nondeterministic
def test_the_example_server_strategy_trains_on_the_server_protocol(tmp_path, no_orphans):
    """examples/server_average.py: three workers average asynchronously through a server written on the protocol."""
    from examples.server_average import ServerAverage

    assert strategy_class("server-average") is ServerAverage
    workers, period = 3, 4
    summary = fast.train(
        {"data": {"name": "digits"}, "model": {"name": "mlp"}},
        out=tmp_path / "server",
        run__workers=workers,
        run__epochs=4,
        run__batch_size=16,
        strategy__name="server-average",
        strategy__period=period,
    )
    assert summary["final_test_accuracy"] >= 0.9
    assert summary["server_updates"] == workers * (summary["steps_per_worker"] // period)
    assert summary["replica_divergence"] < 1e-6  # every worker ends holding the server's model
