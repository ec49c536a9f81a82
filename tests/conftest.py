"""Shared test set-up: quiet progress output, one thread per process, and a process-table check.

`FAST_TEST_SEED=k` makes every `fast.train` and `fast.run` of the tests use run.seed = k (unless the test sets one), and
`FAST_SPREAD_LOG=FILE` appends each run's final accuracy there: `bench/accuracy_spread.py` uses both to
measure the spread of the nondeterministic tests' accuracies over seeds, from which their bars are set.
"""

import contextlib
import json
import os
import signal

import psutil
import pytest
import torch

import fast

os.environ.setdefault("FAST_PROGRESS", "0")
os.environ.setdefault("FAST_PRELOAD", "sklearn.datasets")  # examples/ported imports it in every worker
torch.set_num_threads(1)
# started in the background (`make test &`), a shell hands its children SIGINT ignored; the Ctrl-C tests need it
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


# the files whose real multi-process runs take longest (about 1 to 4 minutes each on 2 cores), longest first: run
# first, so that the two processes of `make test` (each taking whole files) end together
LONGEST_FIRST = ["test_membership.py", "test_package_trust.py", "test_ddp_port.py", "test_jax.py", "test_lifetime.py",
                 "test_churn.py", "test_pack.py", "test_sharded_runs.py", "test_bad_inputs.py", "test_loop_api.py",
                 "test_bench_gpu.py", "test_host_reads.py", "test_sharded_membership.py"]  # fmt: skip


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: LONGEST_FIRST.index(item.path.name) if item.path.name in LONGEST_FIRST else 99)


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "nondeterministic: asserts an accuracy bar on a run whose result depends on timing (asynchrony, threads); "
        "its bar comes from `bench/accuracy_spread.py`",
    )


@pytest.fixture(autouse=True)
def _seeded_runs(request, monkeypatch):
    """Under FAST_TEST_SEED / FAST_SPREAD_LOG: every run of the test seeded alike, and its accuracy logged."""
    seed, log = os.environ.get("FAST_TEST_SEED"), os.environ.get("FAST_SPREAD_LOG")
    if seed is None and log is None:
        yield
        return
    calls = [0]

    def seeded(run):
        def seeded_run(*args, **overrides):
            if seed is not None and "resume" not in overrides:
                overrides.setdefault("run__seed", int(seed))
            summary = run(*args, **overrides) or {}
            if log is not None:
                calls[0] += 1
                record = {"test": request.node.nodeid, "call": calls[0], "seed": seed}
                record["accuracy"] = summary.get("final_test_accuracy")
                with open(log, "a") as f:
                    f.write(json.dumps(record) + "\n")
            return summary

        return seeded_run

    monkeypatch.setattr(fast, "train", seeded(fast.train))
    monkeypatch.setattr(fast, "run", seeded(fast.run))
    yield


def _helper(p: psutil.Process) -> bool:
    """multiprocessing's own long-lived helpers (the fork server and resource tracker), not workers."""
    command = " ".join(p.cmdline())
    return "resource_tracker" in command or "forkserver" in command


def fast_children() -> list[psutil.Process]:
    """Live processes started by this test process (workers that should have ended), not counting
    multiprocessing's fork server and resource tracker; workers forked by the fork server do count."""
    try:
        me = psutil.Process()
        helpers = {c.pid for c in me.children() if _helper(c)}
        return [
            p
            for p in me.children(recursive=True)
            if p.pid not in helpers and p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        ]
    except psutil.Error:
        return []


@pytest.fixture
def no_orphans():
    yield
    import time

    deadline = time.time() + 10
    while fast_children() and time.time() < deadline:
        time.sleep(0.2)
    children = fast_children()
    left = [(p.pid, " ".join(p.cmdline())[:200]) for p in children]
    for child in children:  # killed once named: the test that left them fails, not every test after it
        with contextlib.suppress(psutil.Error):
            child.kill()
    assert not left, f"processes left behind: {left}"
