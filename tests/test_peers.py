"""FAST held against an independent implementation of the same strategy: torchft's DiLoCo (one fragment, and two
streamed), and LocalSGD (the `peers` extra, installed by `make test`), real processes on both sides (torchft's
lighthouse, its managers over gloo; FAST's workers under `fast run`), the same job (tests/scripts/peer_replica.py)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

lighthouse = pytest.importorskip("torchft._torchft", reason="no peers extra: pip install -e '.[peers]'")

SCRIPT = Path(__file__).parent / "scripts" / "peer_replica.py"
FAST = str(Path(sys.executable).parent / "fast")
ENV = {**os.environ, "FAST_PROGRESS": "0", "OMP_NUM_THREADS": "1"}


def _torchft(out: Path, strategy: str) -> list[list[dict]]:
    server = lighthouse.LighthouseServer(bind="[::]:0", min_replicas=2)
    try:
        replicas = [subprocess.Popen([sys.executable, str(SCRIPT), "torchft", str(out), strategy, str(r),
                                      server.address()], env=ENV, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True) for r in (0, 1)]  # fmt: skip
        for replica in replicas:
            _, err = replica.communicate(timeout=180)
            assert replica.returncode == 0, err[-3000:]
    finally:
        server.shutdown()
    return [torch.load(out / f"replica{r}.pt", weights_only=True) for r in (0, 1)]


def _fast(out: Path, strategy: str) -> list[list[dict]]:
    done = subprocess.run([FAST, "run", "--workers", "2", "--out", str(out / "run"), str(SCRIPT), "fast", str(out),
                           strategy], env=ENV, capture_output=True, text=True, timeout=180)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return [torch.load(out / f"replica{r}.pt", weights_only=True) for r in (0, 1)]


@pytest.mark.parametrize(
    "strategy",
    [
        "diloco",
        pytest.param("local-sgd", marks=pytest.mark.slow),
        pytest.param("streaming-diloco", marks=pytest.mark.slow),
    ],
)
def test_fast_and_torchft_train_to_the_same_weights_bit_for_bit(tmp_path, no_orphans, strategy):
    (tmp_path / "torchft").mkdir()
    (tmp_path / "fast").mkdir()
    theirs, ours = _torchft(tmp_path / "torchft", strategy), _fast(tmp_path / "fast", strategy)
    for replica in (0, 1):
        for round_, (mine, other) in enumerate(zip(ours[replica], theirs[replica], strict=True)):
            for name, tensor in other.items():
                assert torch.equal(mine[name], tensor), (replica, round_, name)
    if strategy != "streaming-diloco":  # (streamed, one fragment's round ends at a time)
        for name, tensor in ours[0][-1].items():  # the round ends with every replica on the same weights
            assert torch.equal(ours[1][-1][name], tensor)
