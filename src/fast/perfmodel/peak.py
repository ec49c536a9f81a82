"""The peak FLOP/s of a GPU, from its name: what model FLOPs utilisation (MFU) divides by.

The figures are the vendors' dense (not 2:4 sparse) 16-bit tensor-core peaks, as torchtitan's MFU uses: a run in
fp32 on TF32 tensor cores can reach half of it. A name not in the table, and the CPU, have none: the summary and the
progress line then show no MFU rather than a wrong one. `FAST_PEAK_TFLOPS` gives the peak of the machine at hand
(any device, in TFLOP/s), over the table.
"""

from __future__ import annotations

import os
import re

import torch

from fast.errors import ConfigError

PEAK_VARIABLE = "FAST_PEAK_TFLOPS"

# (a model in torch.cuda.get_device_name(), dense bf16/fp16 TFLOP/s): a model matches as a whole word ("A10" is not
# "A100"), and the first that matches wins, so the particular ones come first ("H100 NVL" before "H100")
KNOWN_GPUS: list[tuple[str, float]] = [
    ("GB200", 2500.0),
    ("B200", 2250.0),
    ("B100", 1750.0),
    ("GH200", 989.5),
    ("H200 NVL", 835.0),
    ("H200", 989.5),
    ("H100 NVL", 835.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.5),  # SXM: "NVIDIA H100 80GB HBM3"
    ("H800", 989.5),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("L40", 181.0),
    ("L4", 121.0),
    ("A10G", 70.0),
    ("A10", 125.0),
    ("RTX A6000", 154.8),
    ("V100", 125.0),
    ("T4", 65.0),
    ("MI300X", 1307.4),
    ("MI250X", 383.0),
]


def peak_tflops_of(name: str) -> float | None:
    """The dense 16-bit peak of the GPU called `name` (as torch.cuda.get_device_name says it), or None if unknown."""
    for model, tflops in KNOWN_GPUS:
        if re.search(rf"(?<![A-Za-z0-9]){re.escape(model)}(?![A-Za-z0-9])", name, re.IGNORECASE):
            return tflops
    return None


def peak_tflops(device: torch.device) -> float | None:
    """The peak of `device` in TFLOP/s: FAST_PEAK_TFLOPS if set, else the table's for a GPU, else None."""
    given = os.environ.get(PEAK_VARIABLE)
    if given:
        try:
            return float(given)
        except ValueError:
            raise ConfigError(
                f"{PEAK_VARIABLE}={given!r} is not a number: give the peak in TFLOP/s, e.g. 989"
            ) from None
    if device.type != "cuda":
        return None
    return peak_tflops_of(torch.cuda.get_device_name(device))
