"""bench/gpu.py runs: its --dry-run form on the CPU (a tiny model, a few steps, one round) goes through every side
(the plain loop, FAST at one worker and two, DDP under torchrun) and prints their samples/s and the ratios with their
targets. Timings are printed, never asserted."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "gpu.py"


@pytest.mark.slow  # (a bench's own check: every GPU session runs bench/gpu.py itself)
def test_the_gpu_bench_runs_every_side_on_the_cpu_in_its_dry_run(tmp_path, no_orphans):
    out = tmp_path / "runs.json"
    done = subprocess.run([sys.executable, str(BENCH), "--dry-run", "--out", str(out)], capture_output=True, text=True,
                          timeout=600, cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    for side in ("plain", "fast x1", "ddp x2", "fast x2"):
        assert re.search(rf"^{side} +\d+$", done.stdout, re.MULTILINE), done.stdout
    assert re.search(r"^fast x1 / plain +\d+\.\d+ +target >= 0\.97", done.stdout, re.MULTILINE), done.stdout
    assert re.search(r"^fast x2 / ddp x2 +\d+\.\d+ +target >= 1\.0", done.stdout, re.MULTILINE), done.stdout
    assert out.is_file() and "fast x2" in out.read_text()
