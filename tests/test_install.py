"""FAST installs as libraries do: a wheel built from the repository, installed into a fresh virtual environment
outside the checkout, gives the `fast` command and package, and runs a user's script on 2 workers from there."""

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = """
import torch, fast
job = fast.init()
model = torch.nn.Linear(4, 2)
model, optimizer = job.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
for _ in range(5):
    model(torch.randn(8, 4)).sum().backward(); optimizer.step(); optimizer.zero_grad()
summary = job.finish()
if job.is_main:
    print("trained by", fast.__file__)
"""


def _run(command: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "FAST_PROGRESS": "0"}
    env.pop("PYTHONPATH", None)
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done


def test_a_wheel_installed_outside_the_checkout_runs_fast_run_on_a_users_script(tmp_path):
    source, wheels = tmp_path / "source", tmp_path / "wheels"  # built from a copy: the checkout gets no build/
    shutil.copytree(ROOT / "src" / "fast", source / "src" / "fast", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels),
          str(source)], tmp_path)  # fmt: skip
    (wheel,) = wheels.glob("fast_training-*.whl")  # the distribution's name: PyPI's "fast" is another project's
    env = tmp_path / "env"
    _run([sys.executable, "-m", "venv", "--without-pip", str(env)], tmp_path)
    python = env / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)], tmp_path)
    # the dependencies (torch and the rest) from this environment's site-packages, after the wheel's own files;
    # the checkout itself is not on the path (this environment's editable install is not read from there)
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                     tmp_path).stdout.strip())  # fmt: skip
    (site / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    where = tmp_path / "elsewhere"
    where.mkdir()
    (where / "train.py").write_text(SCRIPT)
    done = _run([str(env / "bin" / "fast"), "run", "--workers", "2", "--out", "run", "train.py"], where)
    assert f"trained by {site}" in done.stdout
    assert (where / "run" / "summary.json").is_file() and (where / "run" / "model.pt").is_file()
