"""FAST's steps read nothing back to the host: a user's loop under `fast run --workers 2`, counted in each worker.

On a GPU a read of a tensor's value (`.item()`, `float(t)`, `bool(t)`, `.tolist()`, `.cpu()`, ...) makes the host
wait for the device to drain its queue. tests/scripts/host_reads.py counts the reads FAST's own code makes on the
training thread in steady-state steps, with `run.shared_memory = false` (the path a GPU takes). The boundaries the
user asked for stay in: a metric record every 20 steps (`run.log_every`), which reads the losses and the bad-step
flags at once; the workers' periodic check is set to come seldom (`run.check_interval`), as its rate in steps
depends on the machine's speed. At most one read per ten steps.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fast

SCRIPT = Path(__file__).parent / "scripts" / "host_reads.py"
FIRST, LAST = 20, 120
CODECS = ["fp16", "bf16", "powersgd", "uint8", "qsgd", "terngrad", "sign", "signum", "topk", "randomk", "dgc",
          "chunk-topk", "dct-topk"]  # fmt: skip
DGC = {"optimizer__momentum": 0.0}  # (DGC carries the momentum itself)
CASES = [
    pytest.param({"strategy__name": "sync"}, id="sync"),
    pytest.param({"strategy__name": "local-sgd", "strategy__period": 4}, id="local-sgd"),
    pytest.param({"strategy__name": "diloco", "strategy__period": 4}, id="diloco"),
    pytest.param({"strategy__name": "streaming-diloco", "strategy__period": 4}, id="streaming-diloco"),
    pytest.param({"strategy__name": "gossip", "strategy__topology": "ring"}, id="gossip"),
    *(pytest.param({"codec__name": c, **(DGC if c == "dgc" else {})}, id=f"sync+{c}") for c in CODECS),
]


@pytest.mark.parametrize("overrides", CASES)
def test_steady_state_steps_read_at_most_one_value_per_ten_steps(tmp_path, no_orphans, overrides):
    fast.run(str(SCRIPT), str(tmp_path), str(FIRST), str(LAST), workers=2, out=str(tmp_path),
             run__shared_memory=False, run__max_steps=LAST + 5, run__check_interval="10min", **overrides)  # fmt: skip
    for rank in (0, 1):
        counted = json.loads((tmp_path / f"host-reads-{rank}.json").read_text())
        sites = "\n".join(f"  {n:5d}  {site}" for site, n in counted["sites"].items())
        assert counted["steps"] == LAST - FIRST
        assert counted["reads"] <= counted["steps"] / 10, (
            f"worker {rank}: {counted['reads']} reads of a tensor's value in {counted['steps']} steps, at:\n{sites}"
        )


@pytest.mark.parametrize("strategy", ["sync", "local-sgd"])
@pytest.mark.parametrize("optimizer", ["fused", "plain"])
def test_a_step_with_a_nan_is_skipped_on_the_device_and_counted_at_the_end(tmp_path, strategy, optimizer):
    """Decided on the device: an optimizer that takes found_inf (fused Adam) skips the step exactly, weights and
    state; a plain one steps with zero gradients (its moments move it a little). No NaN reaches the weights."""
    script = Path(__file__).parent / "scripts" / "skipped_step.py"
    done = subprocess.run([sys.executable, str(script), strategy, optimizer, str(tmp_path)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    saved = torch.load(tmp_path / "steps.pt", weights_only=False)
    before, after = saved["after"][1], saved["after"][2]  # around the third step, whose loss was NaN
    assert saved["skipped"] == 1
    assert all(bool(w.isfinite().all()) for steps in saved["after"] for w in steps["weights"])
    same = [torch.equal(a, b) for a, b in zip(before["weights"], after["weights"], strict=True)]
    state = [(before["state"][k][n], after["state"][k][n]) for k in before["state"] for n in before["state"][k]]
    same += [torch.equal(a, b) for a, b in state]
    assert all(same) if optimizer == "fused" else not any(same)
