"""`[faults] churn` and live membership where runs are compared: real processes on emulated links, the simulated
engine (deterministic by seed), the report's membership timeline and `fast predict`'s price of a catch-up."""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import fast
from fast.assemble import load_config
from fast.comm import timing
from fast.comm.scheduler import Simulation
from fast.emulation.wire import ideal_links, start
from fast.jobs.datasets import load_dataset
from fast.jobs.models import build_model
from fast.perfmodel import Link
from fast.runtime.churn import STANDBY_GRACE_S
from fast.runtime.launch import WorkerFailed
from fast.runtime.simulated_membership import SimulatedMembership
from fast.tools.predict import price_catch_up
from fast.tools.report.html import build_report

FAST = str(Path(sys.executable).with_name("fast"))
JOB = {
    "data__name": "digits",
    "model__name": "mlp",
    "run__membership": "live",
    "run__batch_size": 16,
    "run__eval_every": 0,
    "run__log_every": 5,
    "run__checkpoint_every": 0,
}
SIMULATED = {**JOB, "run__engine": "simulated", "run__workers": 8, "run__epochs": 3, "run__step_time": "5ms",
             "network__bandwidth": "100Mbit", "network__latency": "5ms", "faults__churn__lifetime": "0.6s",
             "faults__churn__absence": "0.1s"}  # fmt: skip
# (every member may leave, worker 0 too: a member leaves every 75 ms on average; faster, every member that holds the
# run's state may be gone before a joiner is healed, and the run cannot go on)


def _healed_records(run: Path) -> list[dict]:
    return [r for f in sorted((run / "workers").glob("metrics-*.jsonl")) for line in f.read_text().splitlines()
            if (r := json.loads(line)).get("kind") == "healed"]  # fmt: skip


def _changes(summary: dict) -> tuple[int, int]:
    """(leaves, joins) over the run's membership changes."""
    changes = summary["membership"][1:]
    return sum(len(c["left"]) for c in changes), sum(len(c["joined"]) for c in changes)


CHURNED_SCRIPT = """
import os, pathlib, sys
import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import TensorDataset
import fast

job = fast.init()
pathlib.Path(sys.argv[1], str(job.rank)).touch()  # (each process of the script says so, joiners too)
features, labels = load_digits(return_X_y=True)
data = TensorDataset(torch.tensor(features, dtype=torch.float32) / 16, torch.tensor(labels))
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10))
model, optimizer = job.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
for epoch in job.epochs():
    for x, y in job.loader(data, batch_size=16, shuffle=True):
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        job.log(loss=loss)
job.finish()
"""


def test_churn_in_a_script_run_on_emulated_links_heals_joiners_that_run_the_script(tmp_path, no_orphans):
    """`fast run SCRIPT` under churn: churn's standby gets ready once the script's first worker has written the run's
    config, each joiner runs the script (not FAST's loop) and is healed from a live peer over the emulated links, and
    the joiners still in at the end end with the run, on their own (not stopped by the standby's end)."""
    # (alone here, the first leave came 2.5 s into training and the first join 0.5 s later, churn's standby joiner
    # being ready by then; beside another test's processes, the standby took over 20 s to get ready: 40 s)
    run, script, marks = tmp_path / "run", tmp_path / "churned.py", tmp_path / "marks"
    script.write_text(CHURNED_SCRIPT)
    marks.mkdir()
    options = {"run.membership": "live", "run.workers": 3, "run.epochs": 10000, "run.max_time": "40s",
               "run.log_every": 5, "run.checkpoint_every": 0, "network.bandwidth": "100Mbit", "network.latency": "5ms",
               "faults.churn.lifetime": "3s", "faults.churn.absence": "1s"}  # fmt: skip
    sets = [arg for key, value in options.items() for arg in ("--set", f"{key}={value}")]
    done = subprocess.run([FAST, "run", "--out", str(run), *sets, str(script), str(marks)], capture_output=True,
                          text=True, env={**os.environ, "FAST_PROGRESS": "0"}, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    summary = json.loads((run / "summary.json").read_text())
    leaves, joins = _changes(summary)
    assert leaves >= 1 and joins >= 1, summary["membership"]
    joiners = {member for change in summary["membership"] for member in change["joined"]}
    assert joiners <= {int(mark.name) for mark in marks.iterdir()}, "a joiner did not run the script"
    healed = [r for r in _healed_records(run) if r["generation"] > 0]
    assert healed and all(r["fingerprint"] == r["source_fingerprint"] for r in healed)
    assert summary["catch_up_bytes"] > 0
    said = {f: f.read_text() for f in (run / "workers").glob("*.err")}
    assert not any("does not exist" in text or "Traceback" in text for text in said.values()), said  # (the standby)
    # a joiner still ending at the run's end is given STANDBY_GRACE_S before SIGTERM (at once, before the fix)
    ended = (run / "summary.json").stat().st_mtime
    stopped = [f.stat().st_mtime - ended for f, text in said.items() if "interrupted" in text]
    assert all(after > STANDBY_GRACE_S - 1 for after in stopped), (stopped, said)


def test_churn_takes_async_workers_out_and_brings_new_ones_in_on_their_own_lines(tmp_path, no_orphans):
    """async-ps under churn (real links: its lines have no emulated ones): the servers forget each worker that goes
    and serve each that comes, every joiner catches up from them, and the run ends with what is left."""
    run = tmp_path / "run"
    summary = fast.train(out=str(run), **{**JOB, "strategy__name": "async-ps", "run__workers": 3, "run__epochs": 10000,
                                          "run__max_time": "40s", "faults__churn__lifetime": "3s",
                                          "faults__churn__absence": "1s"})  # fmt: skip
    leaves, joins = _changes(summary)
    assert leaves >= 1 and joins >= 1, summary["membership"]
    healed = [r for r in _healed_records(run) if r["generation"] > 0]
    assert healed and all(r["from"] == "servers" for r in healed)
    digits = load_dataset("digits", seed=0)
    parameters = sum(p.numel() for p in build_model("mlp", digits.input_shape, digits.num_classes).parameters())
    assert all(r["catch_up_bytes"] == 4 * parameters for r in healed)  # the weights, pulled once
    assert summary["final_test_accuracy"] > 0.8
    config = load_config(run / "config.toml")
    model = build_model("mlp", digits.input_shape, digits.num_classes)
    assert price_catch_up(config, model, digits, Link(0.0, 1e9)).nbytes == 4 * parameters  # as fast predict prices it


STRATEGIES = {"gossip": {"strategy__name": "gossip"}, "diloco": {"strategy__name": "diloco", "strategy__period": 4}}


@pytest.mark.parametrize("strategy", STRATEGIES.values(), ids=STRATEGIES.keys())
def test_churn_in_the_simulated_engine_is_deterministic_by_seed(tmp_path, strategy):
    runs = [tmp_path / "a", tmp_path / "b"]
    summaries = [fast.train(out=str(run), **{**SIMULATED, **strategy}) for run in runs]
    leaves, joins = _changes(summaries[0])
    assert leaves >= 3 and joins >= 3, summaries[0]["membership"]
    assert all(r["fingerprint"] == r["source_fingerprint"] for r in _healed_records(runs[0]) if r["generation"])
    assert summaries[0]["membership"] == summaries[1]["membership"]
    first, second = (torch.load(run / "model.pt", weights_only=True) for run in runs)
    assert all(torch.equal(first[name], second[name]) for name in first)
    assert summaries[0]["final_test_accuracy"] == summaries[1]["final_test_accuracy"]
    # the samples of every member count, those of the members gone by the end too, as each reported them at the
    # boundary after: at most each generation's members from the step it took over, less, for each member that
    # left, what it trained since its last boundary (its unfinished round, and the step it died in)
    events, batch = summaries[0]["membership"], SIMULATED["run__batch_size"]
    # the run's time, whichever member writes the summary (a joiner's own clock began when it joined)
    assert summaries[0]["wall_time_s"] >= events[-1]["unix_time"] - events[0]["unix_time"]
    steps = [e["step"] for e in events] + [summaries[0]["steps_per_worker"]]
    most = batch * sum(len(e["members"]) * (steps[i + 1] - steps[i]) for i, e in enumerate(events))
    round_ = (strategy.get("strategy__period", 1) + 1) * batch
    short = leaves * round_
    # (give or take one round: a member that died inside a membership round leaves its peers' counts of that round
    # unequal, and any of them may write the summary now that worker 0 may die too)
    assert most - short <= summaries[0]["samples"] <= most + round_

    report = build_report(runs[:1], tmp_path / "report" / "report.html").read_text()
    assert "Workers in the run vs wall time (live membership)" in report
    assert "joined: " in report and "healed from worker" in report


def test_fast_predict_prices_a_catch_up_as_a_run_sends_it(tmp_path):
    options = {**SIMULATED, "strategy__name": "diloco", "strategy__period": 4}
    summary = fast.train(out=str(tmp_path / "run"), **options)
    sent = [(c["catch_up_bytes"], len(c["healed"])) for c in summary["membership"][1:] if c["joined"]]
    assert sent
    measured = sent[0][0] / sent[0][1]

    config = load_config(None, **{k.replace("__", "."): v for k, v in options.items()})
    dataset = load_dataset("digits", seed=0)
    model = build_model("mlp", dataset.input_shape, dataset.num_classes)
    link = Link(latency_s=0.005, bandwidth_Bps=100e6 / 8)
    price = price_catch_up(config, model, dataset, link)
    assert price.nbytes == pytest.approx(measured, rel=0.05)
    assert price.seconds == pytest.approx(0.005 + price.nbytes / link.bandwidth_Bps)
    assert price.joins_per_s == pytest.approx(8 / 0.7)  # (every member may leave, worker 0 too)


@pytest.mark.parametrize("departure_at", [None, 0.1], ids=["forms", "overtaken"])
def test_a_simulated_group_takes_run_form_time_to_form_and_a_departure_meanwhile_gives_it_up(departure_at):
    sim = Simulation()
    wire = start(sim, 3, ideal_links(3), seed=0)
    membership = SimulatedMembership(sim, wire, SimpleNamespace(min_workers=1), 3, lambda _: None, form_s=0.25)
    ended: dict[int, object] = {}

    def member(rank: int) -> None:
        superseded = lambda: "a newer generation" if membership.newest.number > 0 else None  # noqa: E731
        try:
            membership.member(rank, 10.0).form(membership.newest, torch.device("cpu"), 10.0, None, None, superseded)
            ended[rank] = timing.now()
        except RuntimeError as e:
            ended[rank] = str(e)

    for rank in range(3):
        sim.spawn(lambda rank=rank: member(rank), f"worker {rank}", rank=rank, main=True)
    if departure_at is not None:
        sim.spawn(lambda: (timing.sleep(departure_at), membership.publish(left=[{"member": 2, "how": "killed"}])),
                  "churn")  # fmt: skip
    sim.run()
    expected = 0.25 if departure_at is None else "a newer generation"
    assert ended == {0: expected, 1: expected, 2: expected}


def test_churn_faster_than_re_forming_ends_the_simulated_run_naming_why_not_a_member_churn_took_out(tmp_path):
    # (a member leaves every 75 ms, and a group takes 0.1 s to form: the members holding the state all go)
    with pytest.raises(WorkerFailed, match=r"^worker \d+ failed: every member that held the run's state is gone"):
        fast.train(out=str(tmp_path / "run"), **{**SIMULATED, "run__form_time": "0.1s"})


def test_the_founders_first_weights_cost_nothing_when_a_departure_overtakes_their_first_group(tmp_path):
    # (a member leaves every 0.5 s, and a group takes 0.5 s to form: the founders' first group is a later generation,
    # with a joiner; at 1,024 members, their first weights sent one by one as a catch-up took longer than churn allowed)
    summary = fast.train(out=str(tmp_path / "run"), **{**SIMULATED, "faults__churn__lifetime": "4s",
                                                       "run__form_time": "0.5s", "run__max_steps": 6})  # fmt: skip
    first, *later = summary["membership"]
    assert first["generation"] > 0 and first["left"] and first["step"] == 0, first
    state_bytes = max(change["catch_up_bytes"] / len(change["healed"]) for change in later if change["healed"])
    assert first["catch_up_bytes"] <= len(first["joined"]) * state_bytes, first  # the joiners' states alone


def test_a_member_churn_takes_out_in_the_runs_end_is_survived_in_the_simulated_engine(tmp_path):
    # (seed 6's draws take member 2 out while the others wait for it in local-sgd's last average)
    options = {"strategy__name": "local-sgd", "strategy__period": 4, "faults__churn__lifetime": "4s",
               "run__form_time": "0.5s", "run__epochs": 1, "run__seed": 6}  # fmt: skip
    summary = fast.train(out=str(tmp_path / "run"), **{**SIMULATED, **options})
    *_, last = summary["membership"]
    assert last["step"] == summary["steps_per_worker"] and last["left"] == [{"member": 2, "how": "killed"}], last
    assert summary["workers_at_end"] == 7 and summary["final_test_accuracy"] > 0.7
