"""A real DDP script ported to FAST (examples/ported_ddp): a handful of lines, torchrun's world, DDP's accumulation
flag, GradScaler's overflow semantics, truthful records; all in real processes, DDP itself as the reference."""

import difflib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PORTED = ROOT / "examples" / "ported_ddp"
SCRIPTS = Path(__file__).parent / "scripts"
BIN = Path(sys.executable).parent
FAST, TORCHRUN = str(BIN / "fast"), str(BIN / "torchrun")
ENV = {**os.environ, "FAST_PROGRESS": "0", "OMP_NUM_THREADS": "1"}
SHORT = ["--iters", "30", "--eval-every", "15"]


def _code(path: Path) -> list[str]:
    """The script's lines after its docstring."""
    text = path.read_text()
    return text[text.index('"""', 3) + 3 :].splitlines()


def _run(command: list[str], cwd: Path, env: dict[str, str] = ENV) -> subprocess.CompletedProcess:
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def _torchrun(script: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return _run([*_torchrun_in(cwd), str(script), *args], cwd)


def _torchrun_in(folder: Path) -> list[str]:
    """torchrun with 2 processes, its agent's logs in `folder` (by default, a folder of /tmp left there)."""
    return [TORCHRUN, "--nproc-per-node", "2", "--log-dir", str(folder / "torchrun-logs")]


def _summary(folder: Path) -> dict:
    return json.loads((folder / "summary.json").read_text())


def test_the_fast_version_differs_from_the_ddp_script_by_a_handful_of_lines():
    diff = list(difflib.ndiff(_code(PORTED / "train_ddp.py"), _code(PORTED / "train_fast.py")))
    added = [line for line in diff if line.startswith("+ ") and line[2:].strip()]
    removed = [line for line in diff if line.startswith("- ") and line[2:].strip()]
    assert len(added) <= 8 and len(removed) <= 8, (added, removed)
    assert any("fast.init()" in line for line in added) and any("job.prepare" in line for line in added)
    # DDP's accumulation flag, the GradScaler, rank 0's evaluation and checkpoint stay as the script had them
    assert not any("require_backward_grad_sync" in line or "scaler" in line for line in added + removed)


def test_under_torchrun_the_port_equals_ddp_bit_for_bit_and_all_reduces_once_per_step(tmp_path):
    _torchrun(PORTED / "train_ddp.py", *SHORT, "--out", "ddp", cwd=tmp_path)
    # (a check of the workers together at the last step, which a check each second may be, ends them with no
    # empty step: checked once, at the first step, the workers run out together and say so in one)
    checked_once = {**ENV, "FAST_OVERRIDES": json.dumps({"run.check_interval": "1h"})}
    printed = _run([*_torchrun_in(tmp_path), str(PORTED / "train_fast.py"), *SHORT, "--out", "fast"], tmp_path,
                   checked_once).stdout  # fmt: skip
    ddp, ported = (torch.load(tmp_path / name / "ckpt.pt", weights_only=True) for name in ("ddp", "fast"))
    assert ddp["iter"] == ported["iter"] == 30
    for name, tensor in ddp["model"].items():  # (x + y) * 0.5 is x / 2 + y / 2 exactly: bitwise, not allclose
        assert torch.equal(ported["model"][name], tensor), name
    for index, state in ddp["optimizer"]["state"].items():  # AdamW's moments too
        assert all(torch.equal(ported["optimizer"]["state"][index][key], value) for key, value in state.items())
    assert "ran out of steps" not in printed
    (run,) = (tmp_path / "runs").iterdir()  # torchrun's world (2), not the config's default (4)
    summary = _summary(run)
    assert summary["workers"] == 2 and summary["steps_per_worker"] == 30
    assert summary["samples"] == 2 * 30 * 2 * 8  # workers x iterations x micro-batches x batch, as drawn
    assert summary["empty_steps"] == 1  # every worker ran out together: one exchange without data says so
    # require_backward_grad_sync honoured: one all-reduce per optimizer step, as many bytes as with --accum 1
    per_step = (summary["bytes_sent"] - summary["bytes_sent_in_empty_steps"]) / 30
    assert summary["bytes_sent_in_empty_steps"] == pytest.approx(per_step, rel=0.01)
    # the run's records name no data set, model or optimizer the script did not take from FAST
    recorded = (run / "config.toml").read_text()
    assert "[data]" not in recorded and "[model]" not in recorded and "[optimizer]" not in recorded
    assert not {"data", "model", "optimizer"} & set(summary["config"])
    assert set(torch.load(run / "model.pt", weights_only=True)) == set(ddp["model"])


@pytest.mark.parametrize("strategy", ["diloco", pytest.param("gossip", marks=pytest.mark.slow)])
def test_the_port_runs_another_strategy_with_one_set(tmp_path, no_orphans, strategy):
    run = tmp_path / "run"
    _run([FAST, "run", "--workers", "2", "--out", str(run), "--set", f"strategy.name={strategy}",
          str(PORTED / "train_fast.py"), *SHORT, "--out", "own"], tmp_path)  # fmt: skip
    summary = _summary(run)
    assert summary["strategy"] == strategy and summary["steps_per_worker"] == 30
    losses = [r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert losses and losses[-1] < losses[0]
    assert (tmp_path / "own" / "ckpt.pt").is_file()  # the script's own checkpoint, where it writes it


def test_alone_the_port_trains_as_one_worker_in_its_own_folder(tmp_path):
    done = _run([sys.executable, str(PORTED / "train_fast.py"), "--iters", "5", "--eval-every", "5"], tmp_path)
    assert "fast:" not in done.stderr  # the config's default of 4 workers was never the user's
    (run,) = (tmp_path / "runs").iterdir()
    assert _summary(run)["workers"] == 1


def _overflow(tmp_path: Path, mode: str, at: str, *extra: str) -> list[dict]:
    out = tmp_path / mode
    out.mkdir()
    if mode == "ddp":
        _torchrun(SCRIPTS / "overflow.py", mode, str(out), at, *extra, cwd=tmp_path)
    else:
        _run([FAST, "run", "--workers", "2", "--out", str(tmp_path / "run"), str(SCRIPTS / "overflow.py"), mode,
              str(out), at, *extra], tmp_path)  # fmt: skip
    return [torch.load(out / f"rank{rank}.pt", weights_only=True) for rank in (0, 1)]


def test_a_gradscaler_overflow_on_one_rank_is_skipped_by_every_rank_as_with_ddp(tmp_path, no_orphans):
    ddp, ported = _overflow(tmp_path, "ddp", "5"), _overflow(tmp_path, "fast", "5")
    for rank in (0, 1):  # every rank's scaler saw the overflow at step 5 and backed off
        assert ported[rank]["scales"] == ddp[rank]["scales"] == [2.0**16] * 5 + [2.0**15] * 7
        for name, tensor in ddp[0]["state"].items():
            assert torch.equal(ported[rank]["state"][name], tensor), name
    summary = _summary(tmp_path / "run")
    assert summary["steps_skipped_by_the_loop"] == 1 and summary["skipped_steps"] == 0
    assert summary["steps_per_worker"] == 11


@pytest.mark.slow
def test_without_a_scaler_an_overflow_is_fasts_bad_step_on_every_rank_in_the_users_terms(tmp_path, no_orphans):
    ported = _overflow(tmp_path, "fast", "5", "--no-scaler")
    for name, tensor in ported[0]["state"].items():  # skipped on both ranks: the replicas agree, all finite
        assert torch.equal(ported[1]["state"][name], tensor) and bool(tensor.isfinite().all())
    assert _summary(tmp_path / "run")["skipped_steps"] == 1  # counted on the worker it came from
    command = [FAST, "run", "--workers", "2", "--set", "run.max_bad_steps=3", "--out", str(tmp_path / "bad"),
               str(SCRIPTS / "overflow.py"), "fast", str(tmp_path), "3,4,5,6", "--no-scaler"]  # fmt: skip
    failed = subprocess.run(command, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=240)
    assert failed.returncode == 1
    assert failed.stderr.strip().splitlines()[-1] == (
        "fast: error: worker 1 failed: worker 1: NaN or Inf in the loss or gradients for 3 steps in a row "
        "(run.max_bad_steps): lower your optimizer's learning rate or check the data and the loss (a GradScaler "
        "would skip such steps and back off)"
    )


USER_SCRIPT = """
import sys, torch, fast
{before}
job = fast.init({init})
model = torch.nn.Linear(4, 2)
{wrap}
model, optimizer = job.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
for _ in range(3):
    model(torch.randn(8, 4)).sum().backward(); optimizer.step(); optimizer.zero_grad()
job.finish()
"""


@pytest.mark.parametrize(
    ("before", "init", "wrap", "message"),
    [
        ("import torch.distributed as dist; dist.init_process_group('gloo')", "", "",
         "fast.init: the default process group is already initialised (the script's "
         "init_process_group): remove that call and its destroy_process_group; fast.init forms the group itself, "
         "and job.finish() ends it"),
        ("", "", "model = torch.nn.parallel.DistributedDataParallel(model)",
         "job.prepare: the model is wrapped in DistributedDataParallel, which would average its "
         "gradients a second time: give prepare the module itself (drop DDP(...), or pass model.module)"),
        ("", "run__workers=3", "",
         "torchrun started 2 processes but the config's run.workers = 3 needs 3: leave run.workers "
         "out to take torchrun's world, or start 3 (--nproc-per-node/--nnodes)"),
    ],
    ids=["process-group-already-there", "ddp-wrapped-model", "torchrun-world-differs"],
)  # fmt: skip
def test_what_a_ddp_script_keeps_by_mistake_is_one_line_with_the_fix(tmp_path, before, init, wrap, message):
    script = tmp_path / "script.py"
    script.write_text(USER_SCRIPT.format(before=before, init=init, wrap=wrap))
    done = subprocess.run([*_torchrun_in(tmp_path), str(script)], cwd=tmp_path, env=ENV, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode != 0
    # each rank says it, named; torchrun stops the other rank once one has failed, so only the first is sure to
    said = [f"fast: error: worker {rank}: {message}" in done.stderr for rank in (0, 1)]
    assert any(said), done.stderr[-2000:]


DEADLINE_SCRIPT = """
import os, signal, sys, time, torch, fast
job = fast.init(run__deadline_s=3)
model = torch.nn.Linear(4, 2)
model, optimizer = job.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
for it in range(10):
    model(torch.randn(8, 4)).sum().backward(); optimizer.step(); optimizer.zero_grad()
    if it == 5 and job.rank == 0:
        if sys.argv[1] == "evaluates":
            time.sleep(8)  # a long evaluation on rank 0 alone
        else:
            os.kill(os.getpid(), signal.SIGSTOP)  # frozen: alive, but neither computing nor communicating
job.finish()
"""


def _deadline_script(tmp_path: Path, launcher: str, rank_0: str) -> subprocess.CompletedProcess:
    script = tmp_path / "script.py"
    script.write_text(DEADLINE_SCRIPT)
    start = _torchrun_in(tmp_path) if launcher == "torchrun" else [FAST, "run", "--workers", "2"]
    return subprocess.run([*start, str(script), rank_0], cwd=tmp_path, env=ENV, capture_output=True, text=True,
                          timeout=180)  # fmt: skip


def test_an_evaluation_on_rank_0_longer_than_the_deadline_is_waited_for(tmp_path, no_orphans):
    done = _deadline_script(tmp_path, "fast run", "evaluates")
    assert done.returncode == 0, done.stderr[-2000:]
    assert ("fast: worker 1: worker 0 computed past run.deadline_s (3s) while this one waited (an evaluation on one "
            "rank?): waiting on, up to 1800s") in done.stderr  # fmt: skip


@pytest.mark.parametrize("launcher", [pytest.param("torchrun", marks=pytest.mark.slow), "fast run"])
def test_a_deadline_on_worker_1_is_reported_as_worker_1s(tmp_path, no_orphans, launcher):
    done = _deadline_script(tmp_path, launcher, "freezes")
    assert done.returncode != 0
    said = "worker 1: " if launcher == "torchrun" else "worker 1 failed: "
    assert f"fast: error: {said}all_reduce with the group [0, 1] passed its 3s deadline" in done.stderr, done.stderr


def test_a_compiled_models_file_loads_into_its_own_class(tmp_path):
    script = tmp_path / "compiled.py"
    script.write_text(
        "import torch, fast\n"
        "job = fast.init(out='run')\n"
        "model = torch.compile(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)), backend='eager')\n"
        "model, optimizer = job.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))\n"
        "for _ in range(3):\n"
        "    model(torch.randn(8, 4)).sum().backward(); optimizer.step(); optimizer.zero_grad()\n"
        "job.finish()\n"
    )
    _run([sys.executable, str(script)], tmp_path)
    state = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)).load_state_dict(state)  # no _orig_mod.


@pytest.mark.parametrize("strategy", ["sync", pytest.param("diloco", marks=pytest.mark.slow)])
def test_a_hugging_face_gpt2_trains_in_a_users_loop(tmp_path, no_orphans, strategy):
    pytest.importorskip("transformers", reason="the transformers extra: pip install -e '.[transformers]'")
    run = tmp_path / "run"
    _run([FAST, "run", "--workers", "2", "--out", str(run), "--set", f"strategy.name={strategy}",
          str(SCRIPTS / "hf_gpt2.py")], tmp_path)  # fmt: skip
    summary = _summary(run)
    assert summary["strategy"] == strategy and summary["steps_per_worker"] == 40
    assert summary["samples"] == 2 * 40 * 8  # counted from input_ids, a keyword argument
    losses = [r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert losses[-1] < 0.9 * losses[0]  # (3.71 to 3.06 under sync, the first record at step 20)


@pytest.mark.parametrize(
    "strategy",
    [pytest.param(["strategy.name=diloco", "strategy.period=4"], marks=pytest.mark.slow), ["strategy.name=async-ps"]],
    ids=["diloco", "async-ps"],
)
def test_where_gradients_are_not_averaged_an_overflow_reaches_only_that_workers_scaler(tmp_path, no_orphans, strategy):
    out = tmp_path / "fast"
    out.mkdir()
    _run([FAST, "run", "--workers", "2", "--out", str(tmp_path / "run"), *(f"--set={s}" for s in strategy),
          str(SCRIPTS / "overflow.py"), "fast", str(out), "5"], tmp_path)  # fmt: skip
    ranks = [torch.load(out / f"rank{rank}.pt", weights_only=True) for rank in (0, 1)]
    # its gradients stay on the worker until its optimizer steps (diloco: for the period; async-ps: the push to
    # the servers is made then, unscaled): its own scaler skips the step and backs off, the other's goes on
    assert ranks[1]["scales"] == [2.0**16] * 5 + [2.0**15] * 7 and ranks[0]["scales"] == [2.0**16] * 12
    assert all(bool(t.isfinite().all()) for r in ranks for t in r["state"].values())
    assert _summary(tmp_path / "run")["steps_skipped_by_the_loop"] == 1


def test_two_backwards_into_one_step_are_accumulation_not_a_skipped_step(tmp_path):
    script = tmp_path / "accumulate.py"
    script.write_text(
        "import torch, fast\n"
        "job = fast.init(out='run')\n"
        "model = torch.nn.Linear(4, 2)\n"
        "model, optimizer = job.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))\n"
        "for _ in range(3):\n"
        "    for _ in range(2):  # no zero_grad between: the gradients add up\n"
        "        model(torch.randn(8, 4)).sum().backward()\n"
        "    optimizer.step(); optimizer.zero_grad()\n"
        "job.finish()\n"
    )
    _run([sys.executable, str(script)], tmp_path)
    summary = _summary(tmp_path / "run")
    assert summary["steps_per_worker"] == 3 and summary["steps_skipped_by_the_loop"] == 0
    assert summary["samples"] == 3 * 2 * 8
