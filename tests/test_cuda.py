"""On a GPU (`pytest -m cuda`; skipped without one): every strategy trains on CUDA, two workers sharing one GPU
over gloo and one worker alone over NCCL; bf16, a GradScaler with fp16 autocast as DDP does it, a user's loop whose
model it placed on the GPU itself, a package, and the language model of examples/lm."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fast
from fast.comm.bootstrap import backend_for
from fast.jobs.datasets import FASHION_MNIST_DEBIAN_DIR
from fast.strategies import registry

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).parent / "scripts"
BIN = Path(sys.executable).parent
FAST, TORCHRUN = str(BIN / "fast"), str(BIN / "torchrun")
ENV = {**os.environ, "FAST_PROGRESS": "0", "OMP_NUM_THREADS": "1"}
DIGITS = {"data__name": "digits", "model__name": "mlp", "run__workers": 2, "run__epochs": 3, "run__batch_size": 32,
          "run__eval_every": 0.0, "optimizer__lr": 0.05, "run__device": "cuda"}  # fmt: skip
ON_THE_CPU_ONLY = {"hogwild"}  # shares CPU memory between processes; refused on CUDA in one line (tested)


def _run(command: list[str], cwd: Path) -> subprocess.CompletedProcess:
    done = subprocess.run(command, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_workers_sharing_a_gpu_get_gloo_and_one_per_gpu_nccl(monkeypatch):
    gpus = torch.cuda.device_count()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(gpus))
    assert backend_for(torch.device("cuda")) == "nccl"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(gpus + 1))
    assert backend_for(torch.device("cuda")) == "gloo"
    assert backend_for(torch.device("cpu")) == "gloo"


@pytest.mark.parametrize("strategy", sorted(set(registry()) - {"none"} - ON_THE_CPU_ONLY))
def test_every_strategy_trains_on_cuda(tmp_path, no_orphans, strategy):
    summary = fast.train(None, out=str(tmp_path), strategy__name=strategy, **DIGITS)
    assert summary["config"]["run"]["device"] == "cuda"
    assert summary["final_test_accuracy"] > 0.7, summary["final_test_accuracy"]
    state = torch.load(tmp_path / "model.pt", weights_only=True)  # saved from the GPU, loads on the CPU
    assert all(t.device.type == "cpu" and bool(t.isfinite().all()) for t in state.values())


def test_cuda_and_the_cpu_train_sync_to_the_same_accuracy(tmp_path, no_orphans):
    cuda = fast.train(None, out=str(tmp_path / "cuda"), **DIGITS)
    cpu = fast.train(None, out=str(tmp_path / "cpu"), **{**DIGITS, "run__device": "cpu"})
    assert cuda["final_test_accuracy"] == pytest.approx(cpu["final_test_accuracy"], abs=0.03)
    assert cuda["bytes_sent"] == cpu["bytes_sent"]


def test_one_worker_per_gpu_trains_over_nccl(tmp_path, no_orphans):
    summary = fast.train(None, out=str(tmp_path), **{**DIGITS, "run__workers": torch.cuda.device_count()})
    assert summary["final_test_accuracy"] > 0.85


def test_two_workers_on_one_gpu_are_told_they_share_it(tmp_path, no_orphans):
    if torch.cuda.device_count() > 1:
        pytest.skip("this machine has a GPU per worker")
    settings = ["data.name=digits", "model.name=mlp", "run.workers=2", "run.max_steps=20", "run.device=cuda"]
    done = _run([FAST, "train", *(f"--set={s}" for s in settings), "--out", str(tmp_path / "run")], tmp_path)
    assert "2 workers share 1 GPU(s) on this machine: gloo carries their tensors" in done.stderr


def test_hogwild_on_cuda_is_refused_in_one_line(tmp_path):
    done = subprocess.run([FAST, "train", "--set", "strategy.name=hogwild", "--set", "run.device=cuda",
                           "--set", "data.name=digits"], cwd=tmp_path, env=ENV, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1
    assert "hogwild shares CPU memory" in done.stderr


def test_bf16_autocast_trains_on_cuda(tmp_path, no_orphans):
    summary = fast.train(None, out=str(tmp_path), run__precision="bf16", **DIGITS)
    assert summary["final_test_accuracy"] > 0.8


@pytest.mark.skipif(not (FASHION_MNIST_DEBIAN_DIR.is_dir() or os.environ.get("FAST_DATA_DIR")),
                    reason="Fashion-MNIST is not installed")  # fmt: skip
def test_lenet_trains_fashion_mnist_on_cuda(tmp_path, no_orphans):
    summary = fast.train(None, out=str(tmp_path), data__name="fashion-mnist", model__name="lenet", run__workers=2,
                         run__max_steps=300, run__batch_size=64, run__eval_every=0.0, run__device="cuda")  # fmt: skip
    assert summary["final_test_accuracy"] > 0.7, summary["final_test_accuracy"]


def _overflow(tmp_path: Path, mode: str, at: str, *extra: str) -> list[dict]:
    out = tmp_path / mode
    out.mkdir()
    script = [str(SCRIPTS / "overflow.py"), mode, str(out), at, "--cuda", *extra]
    if mode == "ddp":
        _run([TORCHRUN, "--nproc-per-node", "2", "--log-dir", str(tmp_path / "torchrun-logs"), *script], tmp_path)
    else:
        _run([FAST, "run", "--workers", "2", "--out", str(tmp_path / "run"), *script], tmp_path)
    return [torch.load(out / f"rank{rank}.pt", weights_only=True) for rank in (0, 1)]


def test_a_cuda_gradscaler_with_fp16_autocast_skips_an_overflow_on_every_rank_as_ddp_does(tmp_path, no_orphans):
    ddp, ported = _overflow(tmp_path, "ddp", "5"), _overflow(tmp_path, "fast", "5")
    for rank in (0, 1):
        assert ported[rank]["scales"] == ddp[rank]["scales"] == [2.0**16] * 5 + [2.0**15] * 7
        for name, tensor in ddp[0]["state"].items():
            torch.testing.assert_close(ported[rank]["state"][name], tensor, rtol=0, atol=1e-6)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps_skipped_by_the_loop"] == 1 and summary["skipped_steps"] == 0


@pytest.mark.parametrize("strategy", ["sync", "diloco", "async-ps", "gossip"])
def test_a_users_loop_trains_where_it_placed_its_model(tmp_path, no_orphans, strategy):
    """The model on the GPU by the script's own `.to("cuda")` and no run.device: the job follows the model."""
    out = tmp_path / "states"
    out.mkdir()
    _run([FAST, "run", "--workers", "2", "--set", f"strategy.name={strategy}", "--out", str(tmp_path / "run"),
          str(SCRIPTS / "overflow.py"), "fast", str(out), "", "--cuda"], tmp_path)  # fmt: skip
    states = [torch.load(out / f"rank{rank}.pt", weights_only=True) for rank in (0, 1)]
    for name, tensor in states[0]["state"].items():
        assert bool(tensor.isfinite().all()), name
        if strategy == "sync":
            assert torch.equal(states[1]["state"][name], tensor), name
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps_per_worker"] == 12 and summary["bytes_sent"] > 0


def test_a_package_trains_on_cuda(tmp_path, no_orphans):
    job = {"data": {"name": "digits"}, "model": {"name": "lenet"}, "run": {"workers": 2, "max_steps": 60,
           "batch_size": 32, "eval_every": 0}}  # fmt: skip
    archive = fast.pack(job, tmp_path / "lenet.fastjob")
    summary = fast.train(str(archive), out=str(tmp_path / "run"), data__name="digits", run__device="cuda",
                         package__unsigned=True)  # fmt: skip
    assert summary["config"]["run"]["device"] == "cuda"
    assert summary["steps_per_worker"] == 60 and summary["final_test_loss"] < 2.0  # untrained: ln 10 = 2.303


@pytest.mark.parametrize("strategy", ["sync", "diloco"])
def test_the_language_model_trains_on_cuda_in_fasts_loop_and_in_the_users(tmp_path, no_orphans, strategy):
    lm = ROOT / "examples" / "lm"
    small = ["--set", "run.workers=2", "--set", "run.max_steps=60", "--set", "model.width=64", "--set",
             "model.layers=2", "--set", "data.megabytes=0.5", "--set", "run.device=cuda", "--set",
             f"strategy.name={strategy}", "--set", "strategy.period=10"]  # fmt: skip
    if strategy == "sync":
        small = small[:-2]
    _run([FAST, "train", str(lm / "lm.toml"), *small, "--out", str(tmp_path / "fast")], lm)
    _run([FAST, "run", "--workers", "2", *small, "--out", str(tmp_path / "user"), str(lm / "train.py")], lm)
    for loop in ("fast", "user"):
        summary = json.loads((tmp_path / loop / "summary.json").read_text())
        assert summary["steps_per_worker"] == 60
        assert summary["final_test_perplexity"] < 40, (loop, summary["final_test_perplexity"])  # uniform: 256


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("strategy", ["sync", "diloco"])
def test_steady_state_steps_never_make_the_host_wait_for_the_gpu(tmp_path, no_orphans, strategy, workers):
    """Under torch.cuda.set_sync_debug_mode: "error" where each worker has its GPU; where two share one, gloo's own
    threads synchronise (they stage the tensors through host memory) and only the training thread's are errors."""
    mode = "training-thread" if workers > torch.cuda.device_count() else "error"
    out = tmp_path / "checked"
    out.mkdir()
    period = ["--set", "strategy.period=4"] if strategy == "diloco" else []
    _run([FAST, "run", "--workers", str(workers), "--set", f"strategy.name={strategy}", *period, "--out",
          str(tmp_path / "run"), str(SCRIPTS / "no_sync.py"), str(out), mode], tmp_path)  # fmt: skip
    assert [(out / f"checked-{rank}.txt").read_text() for rank in range(workers)] == ["40"] * workers


class _Host:
    """What a loader asks of its job (fast.runtime.loader.Host), for one worker on `device`."""

    def __init__(self, device: str) -> None:
        from fast.assemble import load_config

        self.config, self.device = load_config(None, run__workers=1), torch.device(device)
        self.rank, self.workers, self.is_worker, self.step, self.stopped = 0, 1, True, 0, False
        self.loader_position, self.loaders = None, []

    def _settle(self) -> None:
        pass

    def _all_have(self, has_batch: bool) -> bool:
        return has_batch

    def _loader_created(self, loader) -> None:
        pass


class _Listed(torch.utils.data.Dataset):
    """A map-style dataset that is not a TensorDataset: it goes through a DataLoader."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


@pytest.mark.parametrize("kind", ["tensors", "dataloader"])
def test_the_loader_moves_each_batch_to_the_gpu_a_step_ahead_and_never_waits(kind):
    from fast.runtime.loader import ShardedLoader

    x, y = torch.randn(256, 8), torch.arange(256)
    data = torch.utils.data.TensorDataset(x, y) if kind == "tensors" else _Listed(x, y)
    on_cpu = list(ShardedLoader(_Host("cpu"), data, 32))
    torch.cuda.set_sync_debug_mode("error")
    try:
        on_gpu = [tuple(t * 1 for t in batch) for batch in ShardedLoader(_Host("cuda"), data, 32)]  # used on the GPU
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert len(on_gpu) == len(on_cpu) == 8
    for gpu, cpu in zip(on_gpu, on_cpu, strict=True):
        assert all(t.is_cuda for t in gpu)
        assert all(torch.equal(g.cpu(), c) for g, c in zip(gpu, cpu, strict=True))
