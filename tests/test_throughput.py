"""Achieved TFLOP/s and MFU: the peaks of known GPUs by name, and the figures of a run whose peak is given (on the CPU
there are none unless FAST_PEAK_TFLOPS gives one)."""

import json
from pathlib import Path

import pytest
import torch

import fast
from fast.errors import ConfigError
from fast.perfmodel.peak import peak_tflops, peak_tflops_of
from fast.runtime.progress import Progress

SCRIPT = Path(__file__).parent / "scripts" / "host_reads.py"  # a user's loop: Linear(32, 64), ReLU, Linear(64, 10)
TRAINING_FLOPS = 3 * 2 * (32 * 64 + 64 * 10)  # a sample's forward and backward: 2 FLOPs a multiply-add, 3 passes


@pytest.mark.parametrize(
    ("name", "tflops"),
    [
        ("NVIDIA H100 80GB HBM3", 989.5),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H100 NVL", 835.0),
        ("NVIDIA H200", 989.5),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA A10G", 70.0),
        ("NVIDIA L4", 121.0),
        ("NVIDIA L40S", 362.0),
        ("NVIDIA RTX A1000", None),  # not an A10
        ("NVIDIA GeForce RTX 4090", None),
    ],
)
def test_a_gpus_peak_comes_from_its_name_and_an_unknown_one_has_none(name, tflops):
    assert peak_tflops_of(name) == tflops


def test_the_cpu_has_no_peak_unless_one_is_given(monkeypatch):
    monkeypatch.delenv("FAST_PEAK_TFLOPS", raising=False)
    assert peak_tflops(torch.device("cpu")) is None
    monkeypatch.setenv("FAST_PEAK_TFLOPS", "2.5")
    assert peak_tflops(torch.device("cpu")) == 2.5
    monkeypatch.setenv("FAST_PEAK_TFLOPS", "fast")
    with pytest.raises(ConfigError, match="FAST_PEAK_TFLOPS='fast' is not a number"):
        peak_tflops(torch.device("cpu"))


def test_a_run_gives_its_achieved_tflops_and_mfu_in_each_record_and_the_summary(tmp_path, monkeypatch, no_orphans):
    monkeypatch.setenv("FAST_PEAK_TFLOPS", "0.5")
    summary = fast.run(str(SCRIPT), str(tmp_path), "0", "1000", workers=2, out=str(tmp_path), run__max_steps=60)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if "tflops" in r]
    assert len(records) == 6  # every 20 steps on each worker
    for r in records:
        assert r["tflops"] == pytest.approx(TRAINING_FLOPS * r["samples"] / r["time_s"] / 1e12, rel=0.05)
        assert r["mfu"] == pytest.approx(r["tflops"] / 0.5, rel=1e-3)
    assert summary["tflops"] > 0 and summary["mfu"] == pytest.approx(summary["tflops"] / 1.0, rel=1e-3)  # 2 peaks
    monkeypatch.delenv("FAST_PEAK_TFLOPS")
    plain = fast.run(str(SCRIPT), str(tmp_path / "cpu"), "0", "1000", workers=2, out=str(tmp_path / "cpu"),
                     run__max_steps=20)  # fmt: skip
    assert "tflops" not in plain and "mfu" not in plain


def test_the_progress_line_shows_them(capsys):
    progress = Progress("lm", 100, 10, 64)
    progress.update({"step": 10, "time_s": 1.0, "loss": 2.0, "tflops": 412.3, "mfu": 0.4167})
    assert "412 TFLOP/s  MFU 41.7%" in capsys.readouterr().out
