"""A device tensor's value brought to the host behind the work queued before it, and looked at once it has landed.

A read of a tensor on a GPU makes the host wait until the device has drained its queue. Some news a strategy
carries on the device is needed on the host only eventually (gossip's list of the dead): `Landing.send` copies
the tensor into pinned host memory without waiting (on the CPU, at once), and `Landing.landed` gives the host's
copy, as NumPy values, once the copy is done (a CUDA event says so), or None while it is still on its way. The
host never waits, and the news arrives a step late at most.
"""

from __future__ import annotations

import numpy as np
import torch


class Landing:
    """One tensor's host copy, of the shape and dtype of `like`; see the module docstring."""

    def __init__(self, like: torch.Tensor) -> None:
        self.host = torch.zeros(like.shape, dtype=like.dtype, pin_memory=like.is_cuda)
        self.values = self.host.numpy()  # a view of the host copy (made once)
        self.event: torch.cuda.Event | None = None

    def send(self, tensor: torch.Tensor) -> None:
        """Start bringing `tensor`'s value to the host (a copy that was not looked at is overwritten)."""
        if not tensor.is_cuda:
            self.host.copy_(tensor)
            return
        self.host.copy_(tensor, non_blocking=True)
        self.event = torch.cuda.Event()
        self.event.record()

    def landed(self) -> np.ndarray | None:
        """The values of the last tensor sent, once on the host; None while the copy is under way."""
        if self.event is not None:
            if not self.event.query():
                return None
            self.event = None
        return self.values
