"""The loop API: a user's own PyTorch loop made distributed with a handful of lines, on any data and model."""

from __future__ import annotations

import difflib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import fast
from fast.jobs.code import first_samples
from fast.jobs.datasets import load_dataset, partition
from fast.jobs.models import build_model
from fast.runtime.loader import epoch_order
from fast.tools.cli import main

ROOT = Path(__file__).resolve().parents[1]
PORTED = ROOT / "examples" / "ported"
SCRIPTS = Path(__file__).parent / "scripts"
FAST = str(Path(sys.executable).with_name("fast"))


def test_the_ported_script_is_six_lines_from_plain_pytorch():
    plain = (PORTED / "plain.py").read_text().splitlines()
    ported = (PORTED / "fast_version.py").read_text().splitlines()
    changed = [line for line in difflib.ndiff(plain, ported) if line.startswith("+ ") and line[2:].strip()]
    assert len(changed) <= 6, changed
    assert any("fast.init" in line for line in changed) and any("job.prepare" in line for line in changed)


FAMILIES = [
    pytest.param({"strategy.name": "sync"}, 3, id="sync"),
    pytest.param({"strategy.name": "ssp", "strategy.staleness": 1}, 3, id="ssp"),
    pytest.param({"strategy.name": "local-sgd", "strategy.period": 4}, 3, id="local-sgd"),
    pytest.param({"strategy.name": "diloco", "strategy.period": 4}, 3, id="diloco"),
    pytest.param({"strategy.name": "gossip", "strategy.topology": "ring"}, 3, id="gossip"),
    pytest.param({"strategy.name": "async-ps"}, 2, id="async-ps", marks=pytest.mark.nondeterministic),
    pytest.param(
        {"strategy.name": "easgd", "strategy.variant": "async"}, 2, id="easgd-async", marks=pytest.mark.nondeterministic
    ),  # fmt: skip
    pytest.param({"strategy.name": "ea-wild"}, 2, id="ea-wild", marks=pytest.mark.nondeterministic),
    pytest.param({"strategy.name": "ad-psgd"}, 3, id="ad-psgd", marks=pytest.mark.nondeterministic),
    pytest.param({"strategy.name": "push-sum"}, 3, id="push-sum", marks=pytest.mark.nondeterministic),
    pytest.param({"strategy.name": "async-broadcast"}, 3, id="async-broadcast", marks=pytest.mark.nondeterministic),
    pytest.param({"strategy.name": "hogwild"}, 2, id="hogwild", marks=pytest.mark.nondeterministic),
]


@pytest.mark.parametrize(("strategy", "workers"), FAMILIES)
def test_the_ported_script_trains_breast_cancer_data_under_every_strategy_family(
    tmp_path, no_orphans, strategy, workers
):
    overrides = {key.replace(".", "__"): value for key, value in strategy.items()}
    summary = fast.run(str(PORTED / "fast_version.py"), workers=workers, out=str(tmp_path), **overrides)
    assert summary["strategy"] == strategy["strategy.name"] and summary["workers"] == workers
    assert summary["final_test_accuracy"] > 0.9  # the majority class alone is 0.63
    assert (tmp_path / "model.pt").is_file() and (tmp_path / "metrics.jsonl").is_file()
    state = torch.load(tmp_path / "model.pt", weights_only=True)
    assert set(state) == {"0.weight", "0.bias", "2.weight", "2.bias"}  # loads into the user's own class
    losses = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert any("loss" in record for record in losses)


LOOP = """
import sys, torch
import fast
from fast.jobs.datasets import load_dataset
from fast.jobs.models import build_model
from torch.utils.data import TensorDataset as LabelledTensors

job = fast.init(None, out=sys.argv[1])
data = load_dataset("digits")
torch.manual_seed(0)
model = build_model("mlp", data.input_shape, data.num_classes)
model, optimizer = job.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
loader = job.loader(LabelledTensors(data.x_train, data.y_train), batch_size=16)
for epoch in job.epochs(1):
    for x, y in loader:
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        job.log(loss=0.0)
job.finish()
"""


def _combined_batch_reference(workers: int, steps: int, batch: int) -> dict[str, torch.Tensor]:
    """One process, one model: each step on the workers' batches put together (equal sizes, so the mean
    gradient is the mean of the workers')."""
    data = load_dataset("digits")
    shards = partition(torch.zeros(len(data.y_train)), workers, "iid", seed=0)
    torch.manual_seed(0)
    model = build_model("mlp", data.input_shape, data.num_classes)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    orders = [shard[epoch_order(len(shard), 0, 0, rank)] for rank, shard in enumerate(shards)]
    for step in range(steps):
        index = torch.cat([order[step * batch : (step + 1) * batch] for order in orders])
        optimizer.zero_grad()
        F.cross_entropy(model(data.x_train[index]), data.y_train[index]).backward()
        optimizer.step()
    return model.state_dict()


def test_the_loop_api_and_fast_train_reach_the_same_weights_as_one_worker_with_the_combined_batch(tmp_path):
    workers, batch, steps = 2, 16, 12
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    common = {"run__seed": 0, "run__max_steps": steps, "run__workers": workers, "optimizer__lr": 0.05}
    fast.run(str(script), str(tmp_path / "loop"), workers=workers, out=str(tmp_path / "loop"), **common)
    fast.train(
        None, out=str(tmp_path / "train"), data__name="digits", model__name="mlp", run__batch_size=batch,
        run__epochs=1, **common,
    )  # fmt: skip
    loop = torch.load(tmp_path / "loop" / "model.pt", weights_only=True)
    train = torch.load(tmp_path / "train" / "model.pt", weights_only=True)
    reference = _combined_batch_reference(workers, steps, batch)
    for key, value in reference.items():
        torch.testing.assert_close(loop[key], train[key], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(loop[key], value, rtol=1e-4, atol=1e-5)


def test_a_worker_that_stops_early_under_sync_ends_with_the_others(tmp_path, no_orphans):
    summary = fast.run(str(SCRIPTS / "uneven.py"), workers=2, out=str(tmp_path), run__log_every=5)
    assert summary["steps_per_worker"] >= 7 and (tmp_path / "model.pt").is_file()


def test_the_toml_factories_train_under_fast_train_and_fast_compare(tmp_path, no_orphans):
    (tmp_path / "tabular.py").write_text((SCRIPTS / "tabular.py").read_text())
    (tmp_path / "job.toml").write_text(
        """
[run]
workers = 2
epochs = 4
batch_size = 16
eval_every = 1.0
targets = ["error <= 0.1", "accuracy >= 0.9"]
[data]
factory = "tabular:datasets"
test_size = 120
[model]
factory = "tabular:model"
hidden = 32
[step]
factory = "tabular:smoothed_step"
smoothing = 0.05
[eval]
factory = "tabular:error_rate"
[optimizer]
name = "AdamW"
lr = 0.01
betas = [0.9, 0.95]
[schedule]
name = "warmup-cosine"
warmup_steps = 5
[[variant]]
name = "sync"
[[variant]]
name = "local-sgd"
strategy = { name = "local-sgd", period = 4 }
"""
    )
    base = tmp_path / "base.toml"
    base.write_text(
        "\n".join(line for line in (tmp_path / "job.toml").read_text().split("[[variant]]")[0].splitlines())
    )
    summary = fast.train(str(base), out=str(tmp_path / "train"))
    assert summary["final_test_error"] < 0.1 and summary["final_test_accuracy"] > 0.9
    assert summary["time_to_target_s"]["error <= 0.1"] is not None
    state = torch.load(tmp_path / "train" / "model.pt", weights_only=True)
    assert state["0.weight"].shape == (32, 30)  # [model] hidden reached the factory
    comparison = fast.compare(str(tmp_path / "job.toml"), str(tmp_path / "compare"))
    assert not comparison.failed and comparison.report.is_file()
    assert "error" in comparison.report.read_text()


def test_evaluations_during_the_run_take_eval_samples_of_the_test_set_and_the_final_one_all(tmp_path):
    (tmp_path / "counting.py").write_text(
        "def samples(model, test):\n    return {'accuracy': 0.5, 'samples': float(len(test))}\n"
    )
    (tmp_path / "job.toml").write_text(
        '[data]\nname = "digits"\n[model]\nname = "mlp"\n[eval]\nfactory = "counting:samples"\nsamples = 100\n'
        '[run]\nworkers = 2\nepochs = 1\neval_every = 0.25\nengine = "simulated"\n'
    )
    summary = fast.train(str(tmp_path / "job.toml"), out=str(tmp_path / "run"))
    counts = [evaluation["test_samples"] for evaluation in summary["evaluations"]]
    assert counts == [100.0, 100.0, 100.0, float(len(load_dataset("digits", seed=0).y_test))]


def test_first_samples_are_the_same_first_ones_of_every_kind_of_dataset():
    x, y = torch.arange(10.0), torch.arange(10)
    tensors = torch.utils.data.TensorDataset(x, y)

    class Listed(torch.utils.data.Dataset):
        def __len__(self):
            return 10

        def __getitem__(self, i):
            return x[i], y[i]

    class Streamed(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(zip(x, y, strict=True))

    for dataset in (tensors, Listed(), Streamed()):
        first = [int(label) for _, label in first_samples(dataset, 4)]
        assert first == [0, 1, 2, 3], type(dataset)
    assert len(first_samples(tensors, 50)) == 10


def test_warmup_cosine_gives_the_expected_learning_rate_on_every_worker(tmp_path):
    warmup, lr, floor = 4, 0.1, 0.01
    summary = fast.train(
        None, out=str(tmp_path), data__name="digits", model__name="mlp", run__workers=2, run__epochs=1,
        run__log_every=1, run__eval_every=0, optimizer__lr=lr, schedule__name="warmup-cosine",
        schedule__warmup_steps=warmup, schedule__min_lr=floor,
    )  # fmt: skip
    total = summary["steps_per_worker"]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for worker in (0, 1):
        seen = {r["step"]: r["lr"] for r in records if r["worker"] == worker and "loss" in r}
        # the lr a record shows is the one the next step will use
        assert seen[1] == pytest.approx(lr * 2 / warmup)
        assert seen[warmup - 1] == pytest.approx(lr)
        assert seen[warmup] == pytest.approx(lr)  # the cosine's first value
        middle = warmup + (total - warmup) // 2
        cosine = floor + (lr - floor) * 0.5 * (
            1 + torch.cos(torch.tensor(torch.pi * (middle - warmup) / (total - warmup)))
        )
        assert seen[middle] == pytest.approx(float(cosine), rel=1e-6)
        assert seen[total] == pytest.approx(floor)


def test_optimizer_keyword_arguments_from_toml_reach_the_optimizer(tmp_path):
    from fast.assemble import load_config
    from fast.optim import build_optimizer

    path = tmp_path / "job.toml"
    path.write_text('[optimizer]\nname = "AdamW"\nlr = 0.003\nbetas = [0.8, 0.95]\neps = 1e-6\nweight_decay = 0.1\n')
    config = load_config(path)
    optimizer = build_optimizer(config.optimizer, torch.nn.Linear(2, 2).parameters())
    group = optimizer.param_groups[0]
    assert isinstance(optimizer, torch.optim.AdamW)
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (0.003, (0.8, 0.95), 1e-6, 0.1)
    summary = fast.train(str(path), out=str(tmp_path / "run"), data__name="digits", model__name="mlp",
                         run__workers=2, run__epochs=1)  # fmt: skip
    assert summary["config"]["optimizer"]["betas"] == [0.8, 0.95] and summary["final_test_accuracy"] > 0.5


def _cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """The `fast` command in a process of its own, as a user runs it (a few seconds: it imports torch)."""
    return subprocess.run([FAST, *args], capture_output=True, text=True, cwd=cwd, timeout=120)


def _cli_here(capfd: pytest.CaptureFixture, *args: str) -> tuple[int, str]:
    """`fast.tools.cli.main`, the `fast` command's own code, run here (its workers start from this process's warm
    fork server): (exit code, what the command and its workers wrote to stderr)."""
    capfd.readouterr()
    code = main(list(args))
    return code, capfd.readouterr().err


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ('[model]\nfactory = "no_such_module:build"', "`model.factory` = 'no_such_module:build': module"),
        (
            '[model]\nfactory = "tabular:not_a_model"',
            "`model.factory` returned a str: it must return a torch.nn.Module",
        ),
        ('[data]\nfactory = "tabular:unlabelled"\npartition = "dirichlet"', "`data.partition` = 'dirichlet' needs"),
        ('[run]\ntargets = ["perplexity <= 40"]', "`run.targets` names 'perplexity <= 40'"),
    ],
    ids=["does-not-import", "wrong-type", "dirichlet-without-labels", "unknown-metric"],
)
def test_bad_user_code_in_toml_is_one_line_and_exit_code_2(tmp_path, no_orphans, capfd, table, message):
    (tmp_path / "tabular.py").write_text((SCRIPTS / "tabular.py").read_text())
    job = "[run]\nworkers = 2\nepochs = 1\n" if "[run]" not in table else ""
    data = '[data]\nfactory = "tabular:datasets"\n' if "[data]" not in table else ""
    model = '[model]\nfactory = "tabular:model"\n' if "[model]" not in table else ""
    (tmp_path / "job.toml").write_text(f"{job}{data}{model}{table}\n")
    args = ("train", str(tmp_path / "job.toml"), "--out", str(tmp_path / "run"))
    if "no_such_module" in table:  # once as the user runs it, in a process of its own
        done = _cli(*args, cwd=tmp_path)
        code, err = done.returncode, done.stderr
    else:
        code, err = _cli_here(capfd, *args)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], err
    assert "Traceback" not in err


def test_the_job_before_fast_init_is_one_line_and_exit_code_2():
    done = subprocess.run([sys.executable, str(SCRIPTS / "loader_first.py")], capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr.strip() == "fast: error: fast.init() has not been called in this process: start with " \
        "job = fast.init(...)"  # fmt: skip


def test_a_script_that_raises_shows_its_traceback_once_and_stops_the_run(tmp_path, no_orphans, capfd):
    code, err = _cli_here(capfd, "run", "--workers", "2", "--out", str(tmp_path), str(SCRIPTS / "raises.py"))
    assert code == 1
    assert err.count("Traceback") == 1 and 'raises.py", line 14' in err
    assert err.strip().splitlines()[-1].startswith("fast: error: worker")
    assert "ValueError: the user's own bug" in err.strip().splitlines()[-1]


def test_each_process_is_named_in_ps(tmp_path, no_orphans, capfd):
    code, err = _cli_here(capfd, "run", "--workers", "2", "--out", str(tmp_path), str(SCRIPTS / "title.py"))
    assert code == 0, err


def test_tensorboard_event_files_hold_a_scalar_per_metric_and_worker(tmp_path):
    fast.train(None, out=str(tmp_path), data__name="digits", model__name="mlp", run__workers=2, run__epochs=1,
               run__tensorboard=True, run__log_every=5)  # fmt: skip
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for worker in (0, 1):
        events = EventAccumulator(str(tmp_path / "tensorboard" / f"worker{worker}"))
        events.Reload()
        assert {"loss", "bytes_sent"} <= set(events.Tags()["scalars"])
    events = EventAccumulator(str(tmp_path / "tensorboard" / "worker0"))
    events.Reload()
    assert "test_accuracy" in events.Tags()["scalars"]


def test_the_language_model_example_trains_on_the_loop_api_and_reports_perplexity(tmp_path, no_orphans):
    summary = fast.run(
        str(ROOT / "examples" / "lm" / "train.py"), workers=2, out=str(tmp_path), strategy__name="diloco",
        strategy__period=5, run__max_steps=20, run__log_every=2, model__width=32, model__layers=1,
        data__megabytes=0.5,
    )  # fmt: skip
    first, last = summary["evaluations"][0]["test_perplexity"], summary["final_test_perplexity"]
    assert summary["steps_per_worker"] == 20 and last < first < 256  # a byte model guessing uniformly: 256
    assert summary["time_to_target_s"] == {"perplexity <= 6": None} and summary["outer_rounds"] == 4


def test_a_script_started_alone_trains_as_one_worker_and_writes_its_summary(tmp_path):
    """`python script.py`, no launcher: a world of one, whose end-of-run gathers hold only its own figures."""
    done = subprocess.run([sys.executable, str(PORTED / "fast_version.py")], capture_output=True, text=True,
                          cwd=tmp_path, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    (summary_file,) = tmp_path.glob("runs/*/summary.json")
    summary = json.loads(summary_file.read_text())
    assert summary["workers"] == 1 and summary["final_test_accuracy"] > 0.9
