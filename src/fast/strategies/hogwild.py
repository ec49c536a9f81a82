"""`hogwild`: every local worker process updates one shared-memory model without locks (Niu et al. 2011).

Rank 0 writes the model's parameters and floating-point buffers into a file in /dev/shm and broadcasts its
name; every worker maps the same memory and rebinds its parameters to it, so each worker's own optimizer (any
torch.optim optimizer; its state, e.g. momentum, stays private to the worker) steps directly on the shared
weights while the others read and write them. The file is unlinked as soon as every worker has mapped it,
so nothing is left behind even if a worker dies. No bytes cross the wire: `bytes_sent` is 0 and the summary
reports the size of the shared memory instead.

One machine only: the run must use a loopback `run.master_addr`, and under torchrun all ranks must be local.
Staleness: each worker counts its updates in a shared slot; an update's staleness is how many updates the
other workers applied between this worker reading the weights (before its forward pass) and its step.
"""

from __future__ import annotations

import ipaddress
import os
from typing import Any

import torch
from torch import nn

from fast.comm.shared_memory import SHARED_DIR, new_shared_file, share_path
from fast.config import Config
from fast.errors import ConfigError
from fast.strategies.base import Strategy, StrategyOptions


def is_loopback(addr: str) -> bool:
    if addr == "localhost":
        return True
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


def shared_tensors(model: nn.Module) -> list[torch.Tensor]:
    """What the workers share: parameters and floating-point buffers (batch-norm statistics)."""
    return [t for t in model.state_dict(keep_vars=True).values() if t.is_floating_point()]


class Hogwild(Strategy):
    name = "hogwild"
    Options = StrategyOptions
    replicas_differ = False  # there is one model
    collective_eval = False
    stops_alone = True
    takes_shards = False
    shards_why = "its workers update one whole model in shared memory"
    priced = False  # nothing crosses a link; the α-β model cannot price the workers' contention on one memory

    @classmethod
    def check(cls, options: StrategyOptions, config: Config) -> None:
        if not is_loopback(config.run.master_addr):
            raise ConfigError(
                f"`run.master_addr` = {config.run.master_addr!r}: hogwild shares memory between the "
                f"processes of one machine; use 127.0.0.1 and run every worker on this machine"
            )
        local, world = os.environ.get("LOCAL_WORLD_SIZE"), os.environ.get("WORLD_SIZE")
        if local is not None and world is not None and local != world:
            raise ConfigError(
                f"hogwild under torchrun needs every rank on one machine (LOCAL_WORLD_SIZE {local} != "
                f"WORLD_SIZE {world}): use --nnodes 1, or a strategy that communicates"
            )
        if config.run.device != "cpu":
            raise ConfigError('`run.device` = "cuda": hogwild shares CPU memory; use run.device = "cpu"')

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().setup(model, optimizer)
        tensors = shared_tensors(model)
        numel = sum(t.numel() for t in tensors)
        workers = self.comm.size
        self.shared_bytes = 8 * workers + 4 * numel
        first = self.comm.index() == 0
        if first:
            self.path = new_shared_file("hogwild", self.shared_bytes)
            if self.path is not None:
                weights = self._map(workers, numel)
                torch.cat([t.detach().reshape(-1) for t in tensors], out=weights)
        with self.comm.unmetered():  # the weights are in the file before anyone learns its name
            path = share_path(self.comm, self.path if first else None)
        if path is None:
            raise ConfigError(f"hogwild shares its model through {SHARED_DIR}, which has no room for "
                              f"{self.shared_bytes:,} bytes: free some, or give the machine or container more "
                              "shared memory (docker run --shm-size)")  # fmt: skip
        if not first:
            self.path = path
            weights = self._map(workers, numel)
        offset = 0
        for t in tensors:
            t.data = weights[offset : offset + t.numel()].view_as(t)
            offset += t.numel()
        self.comm.barrier()  # everyone has mapped the file: it can go (the memory stays until all exit)
        if first:
            self.path.unlink(missing_ok=True)
        self.me = self.comm.index()

    def _map(self, workers: int, numel: int) -> torch.Tensor:
        """Map the shared file: one int64 update counter per worker, then the float32 weights."""
        storage = torch.UntypedStorage.from_file(str(self.path), shared=True, nbytes=self.shared_bytes)
        self.updates = torch.empty(0, dtype=torch.int64).set_(storage, 0, (workers,))
        return torch.empty(0, dtype=torch.float32).set_(storage, 2 * workers, (numel,))

    def before_step(self, step: int) -> None:
        self.read_at = int(self.updates.sum())

    def after_optimizer_step(self, step: int) -> None:
        others = int(self.updates.sum()) - self.read_at
        self.staleness.append(others)
        self.updates[self.me] += 1  # only this worker writes its slot

    def end_of_run(self) -> None:
        self.comm.barrier()  # nobody evaluates the final model while another worker still steps
        self.path.unlink(missing_ok=True)

    def summary(self) -> dict[str, Any]:
        return {"shared_memory_bytes": self.shared_bytes, "wire": "none: workers share one model in memory"}
