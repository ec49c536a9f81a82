"""The end of a run that survives failures: point to point to rank 0, which reports what the survivors hold.

A collective over the world cannot finish once a process is dead, so when the strategy `survives_failures`
every live process sends rank 0 its figures (and a worker its replica) with `send_bytes`; rank 0 receives
from every process it does not know to be dead, within the deadline, and records a failed receive as a
death. It then builds the final model from the replicas it holds (the strategy's `final_model` choice),
evaluates it on the whole test set, writes the outputs with a `failures` list, and answers each survivor,
which may then exit.
"""

from __future__ import annotations

import copy
import io
import json
import time
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fast.errors import CommError
from fast.evaluate import accuracy, evaluate
from fast.results import _own_figures, summarize, write_outputs

if TYPE_CHECKING:
    from fast.worker import Worker

END_TAG = 7_001  # apart from every strategy's tags


def _pack(value: Any) -> torch.Tensor:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def _unpack(payload: torch.Tensor) -> Any:
    return torch.load(io.BytesIO(payload.numpy().tobytes()), weights_only=True)


def gather_from_survivors(worker: Worker) -> dict[str, Any] | None:
    """Every live process: hand the run's end to rank 0 (which returns the summary; the others None)."""
    world, strategy = worker.world, worker.strategy
    figures = {**_own_figures(worker), "failures": strategy.failures}
    replica = None if worker.is_server else {k: v.detach().cpu() for k, v in worker.model.state_dict().items()}
    if worker.rank != 0:
        with world.unmetered():
            world.send_bytes(_pack(json.dumps(figures)), 0, tag=END_TAG)
            world.send_bytes(_pack(replica), 0, tag=END_TAG)
            # rank 0 may first wait on every other process, then evaluate and write: a longer deadline
            patient = copy.copy(world)
            patient.deadline_s = world.deadline_s * (world.size + 2)
            patient.recv(torch.zeros(1), 0, tag=END_TAG)
        return None
    everyone, replicas = [figures], [replica]
    with world.unmetered():
        for rank in range(1, world.size):
            if rank in strategy.dead:
                continue
            try:
                everyone.append(json.loads(_unpack(world.recv_bytes(rank, tag=END_TAG)[1])))
                theirs = _unpack(world.recv_bytes(rank, tag=END_TAG)[1])
            except CommError as e:
                strategy.lost(rank, worker.total_steps, f"end of run: {e}")
                continue
            if theirs is not None:
                replicas.append(theirs)
    model = _final_model(worker, replicas)
    _final_evaluation(worker, model, replicas)
    summary = summarize(worker, everyone)
    start = time.time() - worker.clock.now()
    summary["failures"] = [
        {**failure, "time_s": round(failure["unix_time"] - start, 3)}
        for failure in _first_notices([f for p in everyone for f in p["failures"]] + strategy.failures)
    ]
    summary = write_outputs(worker, everyone, model, summary)
    with world.unmetered():
        for p in everyone[1:]:
            try:
                world.send(torch.ones(1), p["rank"], tag=END_TAG)
            except CommError:
                pass  # it died after handing in its part: nothing left to tell it
    return summary


def _first_notices(failures: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per dead process: the first time anyone noticed it."""
    first: dict[int, dict[str, Any]] = {}
    for failure in sorted(failures, key=lambda f: f["unix_time"]):
        first.setdefault(failure["worker"], failure)
    return sorted(first.values(), key=lambda f: f["unix_time"])


def _final_model(worker: Worker, replicas: list[dict[str, torch.Tensor]]) -> nn.Module:
    """The reported model from the survivors' replicas (rank 0's first), as the strategy's final_model says:
    the average; the replica of worker K (the average if K is gone); the best on the validation split. A
    strategy whose replicas agree (not decentralised) only has its floating buffers (batch norm) averaged."""
    strategy = worker.strategy
    model = copy.deepcopy(worker.model)
    choice = strategy.options.final_model if strategy.decentralised else "buffers"
    if choice.startswith("worker:"):
        ranks = [0] + [r for r in range(1, worker.workers) if r not in strategy.dead]
        wanted = int(choice[7:]) % worker.workers
        choice = "average" if wanted not in ranks else choice
    if choice.startswith("worker:"):
        model.load_state_dict(replicas[ranks.index(wanted)])
    elif choice == "best":
        x, y = strategy.ctx.validation
        scores = []
        for replica in replicas:
            model.load_state_dict(replica)
            scores.append(accuracy(model, x, y, worker.device))
        model.load_state_dict(replicas[max(range(len(scores)), key=scores.__getitem__)])
    else:
        averaged = {name for name, _ in model.named_buffers()} if choice == "buffers" else None
        with torch.no_grad():
            for name, tensor in model.state_dict().items():
                if tensor.is_floating_point() and (averaged is None or name in averaged):
                    tensor.copy_(torch.stack([r[name] for r in replicas]).mean(0).to(tensor.device))
    return model


def _final_evaluation(worker: Worker, model: nn.Module, replicas: list[dict[str, torch.Tensor]]) -> None:
    """Rank 0 evaluates the final model on the whole test set and records it as the run's last evaluation."""
    with worker.clock.pause():
        correct, loss, n = evaluate(model, worker.data.x_test, worker.data.y_test, worker.device)
    result: dict[str, float] = {
        "step": worker.total_steps,
        "time_s": round(worker.clock.now(), 4),
        "test_accuracy": correct / n,
        "test_loss": loss / n,
    }
    if worker.strategy.decentralised:
        names = [name for name, _ in worker.model.named_parameters()]
        flats = torch.stack([torch.cat([r[name].reshape(-1).float() for name in names]) for r in replicas])
        mean = flats.mean(0)
        result["divergence"] = float(((flats - mean).norm(dim=1) / mean.norm().clamp_min(1e-12)).mean())
    worker.evals.append(result)
    extra = {k: v for k, v in result.items() if k not in ("step", "time_s")}
    worker._record(worker.total_steps, None, kind="eval", **extra)
