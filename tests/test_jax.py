"""The JAX front end (fast.jax): a JAX job (a pytree and an Optax optimizer) under the strategies a PyTorch job uses,
over real processes: sync equal to one worker with the combined batch, the other families training the digits job,
a codec's exact bytes, resume, the learning-rate schedule, and what a JAX job cannot take."""

from __future__ import annotations

import difflib
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import fast
from fast.codecs import build_codec
from fast.errors import ConfigError
from fast.runtime.launch import WorkerFailed
from fast.runtime.loader import tensor_dataset

if importlib.util.find_spec("jax") is None or importlib.util.find_spec("optax") is None:
    pytest.skip("JAX and Optax are not installed (make test installs them: .[jax])", allow_module_level=True)
# JAX itself runs in the runs' processes and tests/scripts' only: its threads never live in this process, which forks

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).parent / "scripts" / "jax_digits.py"
EXAMPLE = ROOT / "examples" / "jax"
JOB = {"optimizer__lr": 0.05, "run__epochs": 3, "run__eval_every": 0, "run__threads_per_worker": 1}


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return torch.load(run / "model.pt", weights_only=True)


def test_the_fast_version_of_the_plain_jax_script_changes_at_most_8_lines():
    plain = (EXAMPLE / "plain.py").read_text().splitlines()
    ported = (EXAMPLE / "fast_version.py").read_text().splitlines()
    changed = [line for line in difflib.ndiff(plain, ported) if line.startswith("+ ") and line[2:].strip()]
    assert len(changed) <= 8, changed
    assert any("fast.init" in line for line in changed) and any("job.prepare" in line for line in changed)


def test_sync_on_two_workers_equals_one_worker_with_the_combined_batch(tmp_path, no_orphans):
    workers, batch, steps = 2, 16, 12
    fast.run(str(SCRIPT), "--check-reported", workers=workers, out=str(tmp_path), **{**JOB, "run__max_steps": steps})
    weights = _weights(tmp_path)
    reference = tmp_path / "reference.npz"
    subprocess.run([sys.executable, str(SCRIPT.parent / "jax_combined_batch.py"), str(workers), str(steps), str(batch),
                    str(reference)], check=True, timeout=300)  # fmt: skip
    for key, value in np.load(reference).items():
        np.testing.assert_allclose(weights[key].numpy(), value, rtol=1e-4, atol=1e-5, err_msg=key)


ADAM = ("--optimizer", "adam")  # DiLoCo's inner optimizer (with SGD and momentum 0.9, a PyTorch job reads 0.68 too)


@pytest.mark.parametrize(
    ("strategy", "workers", "args"),
    [
        pytest.param({"strategy__name": "local-sgd", "strategy__period": 4}, 2, (), id="local-sgd"),
        pytest.param({"strategy__name": "diloco", "strategy__period": 4, "optimizer__lr": 0.003}, 2, ADAM, id="diloco"),
        pytest.param(
            {"strategy__name": "gossip", "strategy__topology": "ring"}, 3, (), id="gossip", marks=pytest.mark.slow
        ),
        pytest.param(
            {"strategy__name": "async-ps"}, 2, (), id="async-ps", marks=[pytest.mark.nondeterministic, pytest.mark.slow]
        ),
    ],
)
def test_a_jax_job_trains_the_digits_under_each_family(tmp_path, no_orphans, strategy, workers, args):
    summary = fast.run(str(SCRIPT), *args, "--evaluate-every", "40", workers=workers, out=str(tmp_path),
                       **{**JOB, **strategy})  # fmt: skip
    assert [e["step"] for e in summary["evaluations"]][:2] == [40, 80]  # mid-run, on the pytree of the run's model
    assert summary["strategy"] == strategy["strategy__name"] and summary["workers"] == workers
    assert summary["final_test_accuracy"] > 0.9  # the same script under sync: 0.98; chance 0.1
    assert summary["samples"] == workers * summary["steps_per_worker"] * 16 or strategy["strategy__name"] == "async-ps"


def test_a_codec_on_sync_sends_exactly_its_frames(tmp_path, no_orphans):
    summary = fast.run(str(SCRIPT), workers=2, out=str(tmp_path), codec__name="topk", **{**JOB, "run__max_steps": 20})
    parameters = 64 * 32 + 32 + 32 * 10 + 10
    frame = build_codec("topk").encoded_size((parameters,))  # a sparsifier encodes the bucket whole
    assert summary["bytes_sent"] == 2 * 20 * (8 + frame)  # one bucket a step, all-gathered by 2 workers
    assert summary["bytes_sent_uncompressed"] == 2 * 20 * 4 * (parameters + 1)  # (+ the count of contributors)


@pytest.mark.slow
def test_an_interrupted_jax_run_resumes_to_exactly_the_uninterrupted_weights(tmp_path, monkeypatch, no_orphans):
    """The Optax state (momentum) and the weights are in the checkpoint of step 15."""
    job = {**JOB, "run__max_steps": 30, "run__checkpoint_every": 5, "strategy__name": "diloco",
           "strategy__period": 4}  # fmt: skip
    whole = fast.run(str(SCRIPT), "--optimizer", "adam", workers=2, out=str(tmp_path / "whole"), **job)
    monkeypatch.setenv("CRASH_AT", "17")
    with pytest.raises(WorkerFailed, match="worker 0 exited with code 9"):
        fast.run(str(SCRIPT), "--optimizer", "adam", workers=2, out=str(tmp_path / "cut"), **job)
    monkeypatch.delenv("CRASH_AT")
    resumed = fast.run(str(SCRIPT), "--optimizer", "adam", workers=2, resume=str(tmp_path / "cut"))
    for key, value in _weights(tmp_path / "whole").items():
        torch.testing.assert_close(_weights(tmp_path / "cut")[key], value, rtol=0, atol=0)
    assert resumed["bytes_sent"] == whole["bytes_sent"]


def test_a_schedule_sets_the_learning_rate_of_an_injected_optax_optimizer(tmp_path, no_orphans):
    job = {**JOB, "run__max_steps": 40, "run__log_every": 10}
    fast.run(str(SCRIPT), "--optimizer", "scheduled", workers=2, out=str(tmp_path / "constant"), **job)
    fast.run(str(SCRIPT), "--optimizer", "scheduled", workers=2, out=str(tmp_path / "cosine"),
             schedule__name="warmup-cosine", **job)  # fmt: skip
    records = [json.loads(line) for line in (tmp_path / "cosine" / "metrics.jsonl").read_text().splitlines()]
    lrs = [r["lr"] for r in records if r.get("worker") == 0 and "loss" in r]
    assert lrs[0] < 0.05 and lrs == sorted(lrs, reverse=True) and lrs[-1] < 0.01
    # Optax stepped with it: the weights differ from those of the same run at the constant rate
    cosine, constant = _weights(tmp_path / "cosine"), _weights(tmp_path / "constant")
    assert all(not torch.allclose(cosine[key], constant[key]) for key in cosine)
    with pytest.raises(WorkerFailed, match="Optax optimizer whose learning rate FAST cannot set"):
        fast.run(str(SCRIPT), workers=1, out=str(tmp_path / "plain"), schedule__name="warmup-cosine", **JOB)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"run__precision": "bf16"}, "run.precision = 'bf16' with a JAX job"),
        pytest.param({"run__accumulate": 2}, "run.accumulate = 2 with a JAX job", marks=pytest.mark.slow),
    ],
)
def test_what_a_jax_job_cannot_take_is_refused_in_one_line(tmp_path, options, message):
    result = subprocess.run(
        [str(Path(sys.executable).with_name("fast")), "run", "--workers", "1", "--out", str(tmp_path), *[
            arg for key, value in options.items() for arg in ("--set", f"{key.replace('__', '.')}={value}")],
         str(SCRIPT)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr


DEVICE_CASES = [
    (["cuda"], "cpu", False, "cuda"),  # run.device left as it was: it follows the arrays onto the GPU
    (["cpu"], "cpu", False, "cpu"),
    (["cuda"], "cuda", True, "cuda"),
    (["cuda"], "cpu", True, "run.device = 'cpu' but the JAX parameters are on a GPU: set run.device = 'cuda', or put "
                             "them on the CPU (jax.device_put(params, jax.devices('cpu')[0]))"),
    (["cpu"], "cuda", True, "run.device = 'cuda' but the JAX parameters are on the CPU: set run.device = 'cpu', or "
                            "put them on a GPU (jax.device_put(params, jax.devices('gpu')[0]))"),
    (["tpu"], "cpu", False, "job.prepare: the parameters are on tpu, where FAST does not train"),
    (["cpu", "cuda"], "cpu", False, "job.prepare: the parameters are on cpu and cuda: put them all on one device"),
]  # fmt: skip
DECIDE = """
import json, sys
from fast.errors import ConfigError
from fast.jax import run_device
out = []
for platforms, configured, explicit, _ in json.loads(sys.argv[1]):
    try:
        out.append(run_device(set(platforms), configured, explicit))
    except ConfigError as e:
        out.append(str(e))
print(json.dumps(out))
"""


def test_a_jax_job_trains_where_its_arrays_are_and_a_run_device_elsewhere_is_refused_in_one_line_naming_the_fix():
    """The decision on the kinds of device (only a CPU here): never a traceback from torch about a gradient's device."""
    done = subprocess.run([sys.executable, "-c", DECIDE, json.dumps(DEVICE_CASES)], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    for (platforms, configured, explicit, expected), got in zip(DEVICE_CASES, json.loads(done.stdout), strict=True):
        assert got.startswith(expected) and "\n" not in got, (platforms, configured, explicit, got)


PYTORCH_JOB = """
import sys, torch, fast
job = fast.init({"run": {"max_steps": 2}})
model = torch.nn.Linear(2, 2)
model, optimizer = job.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
for x, y in job.loader((torch.randn(8, 2), torch.randn(8, 2)), batch_size=4):
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()
job.finish()
print("imported:", "jax" in sys.modules, "optax" in sys.modules)
"""


def test_the_pytorch_path_does_not_import_jax(tmp_path):
    script = tmp_path / "torch_job.py"
    script.write_text(PYTORCH_JOB)
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert "imported: False False" in result.stdout, result.stderr


def test_a_tuple_of_arrays_is_a_dataset_and_unequal_lengths_are_refused():
    x, y = np.arange(40, dtype=np.float32).reshape(20, 2), np.arange(20)
    dataset = tensor_dataset((x, y))
    assert len(dataset) == 20 and torch.equal(dataset[3][0], torch.tensor([6.0, 7.0])) and int(dataset[3][1]) == 3
    with pytest.raises(ConfigError, match="equally long arrays"):
        tensor_dataset((x, y[:10]))


def test_fast_compare_runs_a_jax_script_under_three_strategies_and_writes_the_report(tmp_path, no_orphans):
    variants = tmp_path / "variants.toml"
    variants.write_text(
        '[run]\nworkers = 2\nmax_steps = 30\neval_every = 0\n\n'
        '[[variant]]\nname = "sync"\nstrategy.name = "sync"\n\n'
        '[[variant]]\nname = "local-sgd"\nstrategy = { name = "local-sgd", period = 4 }\n\n'
        '[[variant]]\nname = "gossip"\nstrategy = { name = "gossip", topology = "ring" }\n'
    )  # fmt: skip
    result = subprocess.run(
        [str(Path(sys.executable).with_name("fast")), "compare", str(variants), "--script", str(SCRIPT),
         "--out", str(tmp_path / "out"), "--", "--optimizer", "adam"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert "3 of 3 variants finished" in result.stdout
    for name in ("sync", "local-sgd", "gossip"):
        summary = json.loads((tmp_path / "out" / name / "summary.json").read_text())
        assert summary["strategy"] == name and summary["steps_per_worker"] == 30
    report = (tmp_path / "out" / "report.html").read_text()
    assert all(name in report for name in ("sync", "local-sgd", "gossip"))
