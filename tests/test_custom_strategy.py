"""A strategy defined outside FAST (examples/custom_strategy.py) registers on import and trains."""

import fast
from examples.custom_strategy import RingAverage
from fast.data import load_dataset
from fast.models import build_model
from fast.strategies import strategy_class


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
