"""`run.max_samples`: training ends once the workers together have trained on so many samples, whoever the workers
are: a fixed world's steps, a live run's members (at the first membership boundary that reaches it), a detached
run's work queue."""

import pytest

import fast
from fast.errors import ConfigError

BATCH, WORKERS = 16, 2
JOB = {
    "data__name": "digits",
    "model__name": "mlp",
    "run__workers": WORKERS,
    "run__epochs": 1000,
    "run__batch_size": BATCH,
    "run__eval_every": 0,
    "run__log_every": 1,
    "run__max_samples": 5 * WORKERS * BATCH + 1,  # one sample past 5 steps of both workers
}


@pytest.mark.parametrize("live", [False, True], ids=["fixed", "live"])
@pytest.mark.parametrize(("strategy", "steps"), [("sync", 6), ("local-sgd", 8), ("async-ps", 6)])
def test_a_run_ends_at_the_first_step_its_workers_reach_max_samples_together(tmp_path, no_orphans, live,
                                                                              strategy, steps):  # fmt: skip
    options = {"strategy__name": strategy, "run__membership": "live" if live else "fixed"}
    if strategy == "local-sgd":
        options["strategy__period"] = 4
    summary = fast.train(None, out=str(tmp_path), **JOB, **options)
    if strategy == "async-ps" and live:  # the work queue: batches, whichever worker took them
        assert summary["samples"] == 11 * BATCH
        return
    if strategy == "local-sgd" and not live:  # a fixed world counts steps: its rounds need not end there
        steps = 6
    assert summary["steps_per_worker"] == steps
    assert summary["samples"] == steps * WORKERS * BATCH


def test_a_bad_max_samples_is_a_one_line_error():
    with pytest.raises(ConfigError, match=r"run\.max_samples"):
        fast.train(None, **{**JOB, "run__max_samples": 0})
