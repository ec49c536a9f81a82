"""Values the steps leave on the device, read back to the host together at the boundaries the user asked for.

A read of a tensor's value makes the host wait until the device has drained its queue: on a GPU, which runs ahead
of the host, that is a stall. So the steps read nothing: the losses `job.log` is given, the values it is given as
tensors and the flags of steps whose gradients were not finite stay where they are until a boundary (a metric
record, the workers' periodic check, a checkpoint, the end of the run), where one read brings them all back.
"""

from __future__ import annotations

import torch


def read_together(*groups: list[torch.Tensor]) -> list[list[float]]:
    """The values of one-element tensors (each group a list of them), in one read back to the host per device."""
    tensors = [t.detach().reshape(()).float() for group in groups for t in group]
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    values = [0.0] * len(tensors)
    for places in by_device.values():
        for i, value in zip(places, torch.stack([tensors[i] for i in places]).tolist(), strict=True):
            values[i] = value
    out, start = [], 0
    for group in groups:
        out.append(values[start : start + len(group)])
        start += len(group)
    return out


class BadSteps:
    """Each step's flag "its gradients were not finite" (a device tensor, or a bool known on the host), kept as
    noted and counted at a boundary: how many there were, and the longest run of them in a row."""

    def __init__(self) -> None:
        self.noted: list[torch.Tensor | bool] = []  # since the last count, in step order
        self.total = 0  # bad steps counted so far
        self.in_a_row = 0  # bad steps in a row at the last one counted

    def note(self, flag: torch.Tensor | bool) -> None:
        self.noted.append(flag)

    def flags(self) -> list[torch.Tensor]:
        """The device flags noted since the last count, to read with other values (`read_together`)."""
        return [flag for flag in self.noted if isinstance(flag, torch.Tensor)]

    def count(self, values: list[float] | None = None) -> int:
        """Count the steps noted, from `values` (their `flags()` as read) or read now; returns the longest run of bad
        steps in a row that this count saw (one that began before it included)."""
        if values is None:
            (values,) = read_together(self.flags())
        read = iter(values)
        longest = 0
        for flag in self.noted:
            if flag if isinstance(flag, bool) else next(read):
                self.total += 1
                self.in_a_row += 1
                longest = max(longest, self.in_a_row)
            else:
                self.in_a_row = 0
        self.noted = []
        return longest
