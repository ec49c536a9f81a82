"""`sync` over real processes equals one worker with the combined batch (flat, bucketed, hierarchical)."""

import copy

import pytest
import torch
import torch.nn.functional as F

from fast.assemble import load_config
from fast.comm import Comm
from fast.exchange.allreduce import NONFINITE
from fast.jobs.models import build_model
from fast.strategies import StrategyContext, build_strategy
from fast.strategies.sync import Bucket

STEPS, BATCH = 5, 8


def _batches(workers: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(STEPS, workers * BATCH, 1, 8, 8, generator=g), torch.randint(
        0, 10, (STEPS, workers * BATCH), generator=g
    )


def _train(
    comm: Comm | None,
    workers: int,
    momentum: float,
    hierarchical: int = 0,
    shared_memory: bool = True,
    piece_bytes: int | None = None,
    regroups: int = 0,
) -> torch.Tensor:
    torch.manual_seed(0)
    model = build_model("mlp", (1, 8, 8), 10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
    x, y = _batches(workers)
    strategy = None
    rank, size = (0, 1) if comm is None else (comm.rank, comm.size)
    if comm is not None:
        comm.piece_bytes = piece_bytes
        config = load_config(
            None,
            run__workers=workers,
            strategy__hierarchical=hierarchical,
            strategy__bucket_mb=0.01,
            run__shared_memory=shared_memory,
            run__membership="live" if regroups else "fixed",  # (live: no broadcast of the weights at setup)
        )
        ctx = StrategyContext(
            comm=comm,
            world=comm,
            config=config,
            device=torch.device("cpu"),
            workers=workers,
            rank=rank,
            generator=torch.Generator(),
            steps_per_epoch=STEPS,
        )
        for _ in range(regroups if rank > 0 else 0):  # (making buckets is collective: as many times on every worker)
            spare = copy.deepcopy(model)
            build_strategy(config, ctx).setup(spare, torch.optim.SGD(spare.parameters(), lr=0.1))
        strategy = build_strategy(config, ctx)
        strategy.setup(model, optimizer)
        for _ in range(regroups if rank == 0 else 0):  # a live run's member re-makes them at each change, a joiner's
            strategy.regroup()  # are made fresh
    per = x.shape[1] // size
    for t in range(STEPS):
        xb, yb = x[t, rank * per : (rank + 1) * per], y[t, rank * per : (rank + 1) * per]
        optimizer.zero_grad()
        F.cross_entropy(model(xb), yb).backward()
        if strategy is not None:
            strategy.after_backward(t)
            strategy.before_optimizer_step()
        optimizer.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _variants(comm: Comm) -> dict[str, torch.Tensor]:
    n = comm.size
    return {
        "sgd": _train(comm, n, 0.0),
        "momentum": _train(comm, n, 0.9),
        "hierarchical": _train(comm, n, 0.9, hierarchical=2),
        "backend": _train(comm, n, 0.9, shared_memory=False),
        "pieces": _train(comm, n, 0.9, shared_memory=False, piece_bytes=1024),  # each 10 KB bucket in 10 pieces
    }


@pytest.mark.parametrize("workers", [2, 4])
def test_sync_with_n_workers_equals_one_worker_with_n_times_the_batch(workers):
    from tests.distributed import run_distributed

    out = run_distributed(_variants, workers)
    expected = {"sgd": _train(None, workers, 0.0), "momentum": _train(None, workers, 0.9)}
    expected["hierarchical"] = expected["backend"] = expected["pieces"] = expected["momentum"]
    for rank in range(workers):
        for name, reference in expected.items():
            torch.testing.assert_close(out[rank][name], reference, rtol=1e-5, atol=1e-6, msg=f"{name} rank {rank}")
            assert torch.equal(out[rank][name], out[0][name]), f"{name}: the replicas differ"
    assert not torch.equal(expected["sgd"], expected["momentum"])


def _regrouped(comm: Comm) -> torch.Tensor:
    return _train(comm, comm.size, 0.9, shared_memory=False, regroups=1)


def test_buckets_remade_at_a_change_of_membership_line_up_with_a_joiners_made_fresh():
    """A live run's member re-makes its buckets at each change of membership; a joiner makes them fresh. Their
    buffers must hold the same parameters at the same places, or the all-reduce sums one parameter's gradients into
    another's (it did: each re-making reversed the order within a bucket)."""
    from tests.distributed import run_distributed

    out = run_distributed(_regrouped, 2)
    reference = _train(None, 2, 0.9)
    for rank in range(2):
        torch.testing.assert_close(out[rank], reference, rtol=1e-5, atol=1e-6, msg=f"rank {rank}")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_bucket_with_one_non_finite_gradient_sends_zeros_and_every_worker_learns_it(bad):
    params = [torch.nn.Parameter(torch.zeros(3, 4)), torch.nn.Parameter(torch.zeros(5))]
    bucket = Bucket(params, torch.zeros(17))
    params[0].grad, params[1].grad = torch.ones(3, 4), torch.ones(5)
    params[1].grad[2] = bad
    assert bool(bucket.fill())  # the device flag "not finite"
    assert torch.equal(bucket.grads, torch.zeros(17)) and float(bucket.count) == NONFINITE
    bucket.buffer[-1] += 3.0  # as if three workers with finite gradients had summed into it
    assert bool(bucket.average())  # every worker's average is NaN: each skips the step (a GradScaler backs off)
    assert bool(bucket.grads.isnan().all())


def test_a_bucket_with_huge_finite_gradients_contributes_them():
    params = [torch.nn.Parameter(torch.zeros(1000))]
    bucket = Bucket(params, torch.zeros(1000))
    params[0].grad = torch.full((1000,), 3e38)  # their sum would overflow; they are still finite
    assert not bool(bucket.fill())
    assert float(bucket.count) == 1.0 and torch.equal(bucket.grads, params[0].grad)
    bucket.buffer[-1] = 4.0  # as if four workers had summed into it
    assert not bool(bucket.average())
    assert torch.equal(bucket.grads, torch.full((1000,), 3e38 / 4))
