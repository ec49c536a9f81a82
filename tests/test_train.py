"""End to end: `fast.train` on real data with real processes, its output contract, and clean failures."""

import json
import os

import pytest
import torch

import fast
from fast.runtime.launch import WorkerFailed

DIGITS = {
    "data__name": "digits",
    "model__name": "mlp",
    "run__workers": 2,
    "run__epochs": 3,
    "run__batch_size": 32,
    "run__eval_every": 1.0,
    "run__log_every": 5,
    "optimizer__lr": 0.05,
}


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    return fast.train(None, out=str(out), run__name="digits-sync", **DIGITS), out


def test_sync_trains_digits_and_writes_the_documented_outputs(digits_run):
    summary, out = digits_run
    assert summary["final_test_accuracy"] > 0.85
    on_disk = json.loads((out / "summary.json").read_text())
    for key in (
        "name",
        "strategy",
        "workers",
        "epochs",
        "final_test_accuracy",
        "final_test_loss",
        "best_test_accuracy",
        "wall_time_s",
        "samples_per_s",
        "bytes_sent",
        "time_to_accuracy_s",
        "config",
        "env",
    ):
        assert key in on_disk, key
    assert on_disk["name"] == "digits-sync" and on_disk["strategy"] == "sync" and on_disk["workers"] == 2
    assert set(on_disk["time_to_accuracy_s"]) == {"0.8", "0.85"}
    assert on_disk["time_to_accuracy_s"]["0.8"] is not None
    assert on_disk["env"]["torch_version"] == torch.__version__
    assert 'name = "digits"' in (out / "config.toml").read_text()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert {r["worker"] for r in records} == {0, 1}
    for field in ("step", "epoch", "time_s", "samples", "bytes_sent", "bytes_received"):
        assert all(field in r for r in records), field
    evals = [r for r in records if "test_accuracy" in r]
    assert len(evals) >= 3 and evals[-1]["test_accuracy"] == on_disk["final_test_accuracy"]
    state = torch.load(out / "model.pt", weights_only=True)
    assert set(state) == {name for name, _ in fast.jobs.models.build_model("mlp", (1, 8, 8), 10).state_dict().items()}


def test_bytes_sent_are_what_ring_all_reduce_moves(digits_run):
    summary, _ = digits_run
    params = sum(p.numel() for p in fast.jobs.models.build_model("mlp", (1, 8, 8), 10).parameters())
    steps = summary["steps_per_worker"]
    # 2 workers: each sends 2(N-1)/N = 1x the gradient per step, plus one count element per bucket (one here)
    assert summary["bytes_sent"] == 2 * steps * (params + 1) * 4


@pytest.mark.parametrize("strategy", ["sync", "local-sgd"])
def test_shared_memory_and_gloo_train_to_the_same_weights(tmp_path, strategy):
    job = {**DIGITS, "run__epochs": 1, "strategy__name": strategy}
    shared = fast.train(None, out=str(tmp_path / "shared"), **job)
    gloo = fast.train(None, out=str(tmp_path / "gloo"), run__shared_memory=False, **job)
    assert shared["all_reduce"] == "shared memory"
    assert gloo.get("all_reduce", "backend") == "backend"  # sync names it; local-sgd's job kept no sums
    # two workers: a + b either way, so every replica ends with the same bits
    assert shared["final_test_loss"] == gloo["final_test_loss"]
    assert shared["bytes_sent"] == gloo["bytes_sent"]
    first, second = (torch.load(tmp_path / side / "model.pt", weights_only=True) for side in ("shared", "gloo"))
    assert all(torch.equal(first[name], second[name]) for name in first)


def _fail_on_rank_1(model, x, y):
    if os.environ["RANK"] == "1":
        raise RuntimeError("boom in the user step")
    return torch.nn.functional.cross_entropy(model(x), y)


def _die_on_rank_1(model, x, y):
    if os.environ["RANK"] == "1":
        os._exit(3)
    return torch.nn.functional.cross_entropy(model(x), y)


@pytest.mark.parametrize(
    ("step_fn", "message"),
    [(_fail_on_rank_1, "worker 1 failed: RuntimeError: boom"), (_die_on_rank_1, "worker 1 exited with code 3")],
)
def test_a_crashed_worker_ends_the_run_with_a_clear_error_and_no_orphan(tmp_path, no_orphans, step_fn, message):
    with pytest.raises(WorkerFailed, match=message):
        fast.train(None, out=str(tmp_path), step_fn=step_fn, **DIGITS)


def test_custom_model_and_dirichlet_partition(tmp_path):
    summary = fast.train(
        None,
        out=str(tmp_path),
        model_fn=_tiny_model,
        data__partition="dirichlet",
        data__alpha=0.5,
        **{**DIGITS, "run__epochs": 1},
    )
    assert summary["final_test_accuracy"] > 0.3
    assert set(torch.load(tmp_path / "model.pt", weights_only=True)) == {"1.weight", "1.bias"}


def _tiny_model(input_shape, classes):
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, classes))


def _nan_on_rank_1(model, x, y):
    loss = torch.nn.functional.cross_entropy(model(x), y)
    bad = os.environ["RANK"] == "1" and int(os.environ.get("NAN_STEPS", "1000")) > _nan_on_rank_1.calls
    _nan_on_rank_1.calls += 1
    return loss * float("nan") if bad else loss


_nan_on_rank_1.calls = 0


def test_nan_on_one_worker_is_skipped_counted_and_never_reaches_the_other(tmp_path, monkeypatch):
    monkeypatch.setenv("NAN_STEPS", "3")  # the first three steps of worker 1 produce NaN
    summary = fast.train(None, out=str(tmp_path), step_fn=_nan_on_rank_1, **{**DIGITS, "run__epochs": 1})
    assert summary["skipped_steps"] == 3
    assert summary["final_test_accuracy"] > 0.5
    state = torch.load(tmp_path / "model.pt", weights_only=True)
    assert all(bool(torch.isfinite(v).all()) for v in state.values())


def test_nan_for_max_bad_steps_in_a_row_stops_the_run_with_a_clear_message(tmp_path, no_orphans):
    with pytest.raises(WorkerFailed, match=r"worker 1: NaN or Inf .* for 4 steps in a row \(run.max_bad_steps\)"):
        fast.train(None, out=str(tmp_path), step_fn=_nan_on_rank_1, run__max_bad_steps=4, **DIGITS)
