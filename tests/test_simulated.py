"""`run.engine = "simulated"`: every worker in this process, in virtual time, under the very same strategies."""

import statistics
import sys

import pytest
import torch

import fast
from fast.comm import timing
from fast.comm.scheduler import Deadlock, Simulation
from fast.emulation.links import EmulatedLink, LinkTable
from fast.emulation.simulated_comm import world
from fast.emulation.simulated_machine import spread_factor
from fast.emulation.wire import start
from fast.errors import ConfigError
from fast.runtime.launch import WorkerFailed
from tests.test_loop_api import LOOP, _combined_batch_reference

JOB = {
    "data__name": "digits",
    "model__name": "mlp",
    "run__workers": 4,
    "run__epochs": 1,
    "run__batch_size": 16,
    "run__eval_every": 0.5,
    "run__engine": "simulated",
    "run__step_time": "4ms",
}
SLOW_LINKS = {"network__bandwidth": "20Mbit", "network__latency": "10ms", "network__jitter": "5ms"}
HOST_FIGURES = ("simulation", "run_dir")


def _without_host_figures(summary: dict) -> dict:
    return {k: v for k, v in summary.items() if k not in HOST_FIGURES}


@pytest.mark.parametrize("strategy", ["async-ps", "ad-psgd"])
def test_two_simulated_runs_with_the_same_seed_give_identical_summaries(tmp_path, strategy):
    job = {**JOB, **SLOW_LINKS, "strategy__name": strategy, "network__loss": 0.05}
    first = fast.train(None, out=str(tmp_path / "first"), **job)
    second = fast.train(None, out=str(tmp_path / "second"), **job)
    assert first["simulation"]["engine"] == "simulated" and first["simulation"]["host_s"] > 0
    assert _without_host_figures(first) == _without_host_figures(second)
    other_seed = fast.train(None, out=str(tmp_path / "other"), **job, run__seed=1)
    assert other_seed["evaluations"] != first["evaluations"]


def test_sync_simulated_reaches_the_weights_of_sync_real(tmp_path, no_orphans):
    job = {**JOB, "strategy__name": "sync", "run__max_steps": 12, **SLOW_LINKS}
    simulated_run = fast.train(None, out=str(tmp_path / "sim"), **job)
    real_run = fast.train(None, out=str(tmp_path / "real"), **{**job, "run__engine": "processes"})
    assert simulated_run["bytes_sent"] == real_run["bytes_sent"]  # the same messages, counted alike
    assert simulated_run["steps_per_worker"] == real_run["steps_per_worker"] == 12
    assert real_run["eval_time_s"] > 0 and simulated_run["eval_time_s"] == 0.0  # run.eval_time = "free"
    assert real_run["step_compute_spread"] > 0 and simulated_run["step_compute_spread"] == 0.0
    sim_weights = torch.load(tmp_path / "sim" / "model.pt", weights_only=True)
    real_weights = torch.load(tmp_path / "real" / "model.pt", weights_only=True)
    for key, value in real_weights.items():
        torch.testing.assert_close(sim_weights[key], value, rtol=1e-5, atol=1e-6)


def test_virtual_time_is_compute_plus_what_the_links_charge(tmp_path):
    """Two workers, sync, ideal compute of 10 ms: each step adds a ring all-reduce of two chunk messages (one
    reduce-scatter and one all-gather round), each paying latency plus its bytes over the bandwidth."""
    job = {**JOB, "strategy__name": "sync", "run__workers": 2, "run__max_steps": 10, "run__eval_every": 0,
           "run__step_time": "10ms", "network__bandwidth": "8Mbit", "network__latency": "20ms"}  # fmt: skip
    summary = fast.train(None, out=str(tmp_path), **job)
    parameters = sum(p.numel() for p in torch.load(tmp_path / "model.pt", weights_only=True).values())
    chunk_s = (parameters * 4 / 2) / 1e6  # half the gradient, at 8 Mbit/s = 1 MB/s
    rounds = 2  # N - 1 rounds of reduce-scatter and N - 1 of all-gather for N = 2
    # the buckets' messages queue on each NIC one after another; the latency is paid once per round
    expected_step = 0.010 + rounds * (0.020 + chunk_s)
    assert summary["step_time_s"] == pytest.approx(expected_step, rel=0.02)


def test_step_time_spread_draws_a_mean_one_factor_of_that_spread_that_repeats():
    factors = [spread_factor(0.4, 0, rank, step) for rank in range(4) for step in range(5000)]
    mean = statistics.fmean(factors)
    assert mean == pytest.approx(1.0, abs=0.01)
    assert statistics.pstdev(factors) / mean == pytest.approx(0.4, rel=0.05)
    assert spread_factor(0.4, 0, 1, 7) == spread_factor(0.4, 0, 1, 7) != spread_factor(0.4, 1, 1, 7)
    assert spread_factor(0.0, 0, 1, 7) == 1.0


def test_with_a_step_time_spread_sync_waits_each_step_for_the_slowest_draw(tmp_path):
    """Links that cost nothing: a sync step ends when the last of its workers has computed, so the run takes
    the sum over steps of the largest of the workers' draws."""
    job = {**JOB, "strategy__name": "sync", "run__max_steps": 20, "run__eval_every": 0,
           "run__step_time": "10ms", "run__step_time_spread": 0.5}  # fmt: skip
    summary = fast.train(None, out=str(tmp_path), **job)
    assert summary["steps_per_worker"] == 20
    slowest = [max(spread_factor(0.5, 0, rank, step) for rank in range(4)) for step in range(20)]
    assert summary["wall_time_s"] == pytest.approx(0.010 * sum(slowest), rel=1e-6)
    assert sum(slowest) / 20 > 1.3  # well above the mean draw of 1
    assert summary["step_compute_s"] == 0.010 and summary["step_compute_spread"] == 0.5


def test_a_server_s_work_on_each_request_holds_up_its_answer(tmp_path):
    """Links that cost nothing, 10 ms of compute, two workers: with 5 ms of server work per request the server
    answers them one after the other, and each worker's cycle is its compute plus its own request, 15 ms."""
    job = {**JOB, "strategy__name": "async-ps", "run__workers": 2, "run__max_steps": 40, "run__eval_every": 0,
           "run__step_time": "10ms"}  # fmt: skip
    free = fast.train(None, out=str(tmp_path / "free"), **job)
    assert free["step_time_s"] == pytest.approx(0.010, rel=0.01) and free["server_request_s"] == 0.0
    busy = fast.train(None, out=str(tmp_path / "busy"), **job, run__server_time="5ms")
    assert busy["server_request_s"] == 0.005
    assert busy["step_time_s"] == pytest.approx(0.015, rel=0.03)
    timed = fast.train(None, out=str(tmp_path / "timed"), **job, run__server_time="auto")
    assert 0 < timed["server_request_s"] < 0.1  # this host's time to apply an update of the MLP


def test_workers_in_step_check_as_the_time_runs_out_so_a_run_ends_right_at_its_max_time(tmp_path):
    """10 ms steps and 0.25 s of training: after the first step the workers agree to check again once the time is
    up (24 steps on), not at a fixed stride of steps."""
    job = {**JOB, "strategy__name": "sync", "run__epochs": 100, "run__eval_every": 0, "run__step_time": "10ms",
           "run__max_time": "0.25s"}  # fmt: skip
    summary = fast.train(None, out=str(tmp_path), **job)
    assert summary["steps_per_worker"] in (25, 26)


def test_gossip_exchange_travels_during_the_compute_and_an_evaluation_holds_up_the_peers(tmp_path):
    """Gossip posts its exchange before the forward pass: with 100 ms of compute and a message of well under
    100 ms, a step costs the compute alone. An evaluation of `run.eval_time` on worker 0 holds up its peer,
    which waits for worker 0's next message; worker 0's own clock leaves it out, as a real run's does."""
    job = {**JOB, "strategy__name": "gossip", "run__workers": 2, "run__max_steps": 20, "run__eval_every": 0,
           "run__step_time": "100ms", "network__bandwidth": "100Mbit", "network__latency": "10ms"}  # fmt: skip
    free = fast.train(None, out=str(tmp_path / "free"), **job)
    parameters = sum(p.numel() for p in torch.load(tmp_path / "free" / "model.pt", weights_only=True).values())
    message_s = 0.010 + parameters * 4 / 12.5e6
    assert message_s < 0.08
    assert free["step_time_s"] == pytest.approx(0.100, rel=0.03)  # not 0.100 + message_s
    assert free["eval_time_s"] == 0.0
    stride = {"run__max_steps": 40, "run__eval_every": 0.25}
    without = fast.train(None, out=str(tmp_path / "without"), **{**job, **stride})
    held = fast.train(None, out=str(tmp_path / "held"), **{**job, **stride}, run__eval_time="2s")
    assert held["eval_time_s"] == 2.0
    mid_run = len(held["evaluations"]) - 1  # the last one is the final evaluation, after training
    assert mid_run >= 1
    assert held["evaluations"][0]["time_s"] == without["evaluations"][0]["time_s"]  # worker 0's clock: paused
    assert held["wall_time_s"] - without["wall_time_s"] == pytest.approx(2.0 * mid_run, rel=0.05)


def test_a_crashed_worker_is_survived_by_gossip_and_ends_sync_with_a_clear_error(tmp_path):
    crash = {"faults__crash": [{"worker": 2, "step": 6}], "run__deadline_s": 5.0}
    summary = fast.train(None, out=str(tmp_path / "gossip"), **JOB, **crash, strategy__name="gossip")
    assert [f["worker"] for f in summary["failures"]] == [2]
    assert summary["steps_per_worker"] == summary["steps_per_epoch"]  # worker 0 trained to the end
    assert summary["final_test_accuracy"] > 0.5
    with pytest.raises(WorkerFailed, match="worker 2 crashed before step 6"):
        fast.train(None, out=str(tmp_path / "sync"), **JOB, **crash, strategy__name="sync")


def _fails_on_worker_1(model, x, y):
    if fast.job().rank == 1 and fast.job().step == 3:
        raise ValueError("a bad batch on worker 1")
    return torch.nn.functional.cross_entropy(model(x), y)


def test_a_worker_that_raises_ends_the_simulated_run_with_its_own_error(tmp_path):
    with pytest.raises(WorkerFailed, match="worker 1 failed: ValueError: a bad batch on worker 1"):
        fast.train(None, out=str(tmp_path), step_fn=_fails_on_worker_1, **JOB, strategy__name="sync")


def test_the_loop_api_runs_simulated_and_matches_one_worker_with_the_combined_batch(tmp_path):
    workers, batch, steps = 2, 16, 12
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    overrides = {"run__seed": 0, "run__max_steps": steps, "optimizer__lr": 0.05, "run__engine": "simulated"}
    main, argv = sys.modules["__main__"], list(sys.argv)
    summary = fast.run(str(script), str(tmp_path / "loop"), workers=workers, out=str(tmp_path / "loop"), **overrides)
    assert summary["simulation"]["engine"] == "simulated"
    # the scripts ran in this process: what they set process-wide is back (processes started later would
    # otherwise run the script again as their __main__)
    assert sys.modules["__main__"] is main and sys.argv == argv
    weights = torch.load(tmp_path / "loop" / "model.pt", weights_only=True)
    for key, value in _combined_batch_reference(workers, steps, batch).items():
        torch.testing.assert_close(weights[key], value, rtol=1e-4, atol=1e-5)


def test_a_simulation_where_everyone_waits_forever_is_an_error_naming_the_waits():
    sim = Simulation()

    def wait_for_a_notify() -> None:
        changed = timing.Condition()
        with changed:
            changed.wait()

    sim.spawn(wait_for_a_notify, "worker 0", rank=0, main=True)
    sim.spawn(wait_for_a_notify, "worker 1", rank=1, main=True)
    with pytest.raises(Deadlock, match="worker 0 waits for a condition; worker 1 waits for a condition"):
        sim.run()


def test_a_message_arrives_after_latency_and_transfer_and_queues_behind_the_one_before():
    sim = Simulation()
    links = LinkTable(size=2, default=EmulatedLink(latency_s=0.05, bandwidth_Bps=1e6))
    start(sim, 2, links, seed=0)
    arrivals: list[float] = []

    def sender() -> None:
        comm = world(0, torch.device("cpu"), 10.0)
        comm.isend(torch.zeros(250_000), 1, tag=3)  # 1 MB: 1 s on the wire
        comm.send(torch.zeros(250_000), 1, tag=3)

    def receiver() -> None:
        comm = world(1, torch.device("cpu"), 10.0)
        for _ in range(2):
            comm.recv(torch.empty(250_000), 0, tag=3)
            arrivals.append(timing.now())

    sim.spawn(sender, "worker 0", rank=0, main=True)
    sim.spawn(receiver, "worker 1", rank=1, main=True)
    sim.run()
    assert arrivals == pytest.approx([1.05, 2.05])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"run__engine": "virtual"}, r"run\.engine"),
        ({"run__step_time": "soon"}, r"run\.step_time"),
        ({"run__eval_time": "-1s"}, r"run\.eval_time.*\"free\" or \"auto\""),
        ({"run__step_time_spread": -0.1}, r"run\.step_time_spread"),
        ({"run__server_time": "later"}, r"run\.server_time.*\"free\" or \"auto\""),
        ({"run__max_restarts": 1}, r"run\.max_restarts"),
        ({"run__form_time": "auto"}, r"run\.form_time.*\"free\""),
    ],
)
def test_a_bad_simulation_setting_is_a_one_line_error(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        fast.train(None, out=str(tmp_path), **{**JOB, **overrides})


def test_a_simulated_comparison_writes_its_report_with_the_engine_and_each_variant_host_time(tmp_path):
    config = {
        "run": {"workers": 2, "max_steps": 6, "batch_size": 16, "eval_every": 0, "engine": "simulated",
                "step_time": "4ms"},
        "data": {"name": "digits"},
        "model": {"name": "mlp"},
        "variant": [{"name": "sync", "strategy": {"name": "sync"}}, {"name": "ring", "strategy": {"name": "gossip"}}],
    }  # fmt: skip
    comparison = fast.compare(config, out=str(tmp_path))
    assert not comparison.failed
    report = comparison.report.read_text()
    assert "simulated: every worker in one process, all times virtual" in report
    assert "host time sync " in report and ", ring " in report


def test_the_simulated_engine_takes_thousands_of_workers_and_processes_are_refused_past_256_in_one_line():
    from fast.assemble import load_config

    assert load_config({"run": {"workers": 1024, "max_workers": 4096, "engine": "simulated"}}).run.workers == 1024
    with pytest.raises(ConfigError, match=r'^`run.workers` = 300: a run of processes .* run.engine = "simulated"'):
        load_config({"run": {"workers": 300}})
    with pytest.raises(ConfigError, match=r"run\.workers"):
        load_config({"run": {"workers": 4097, "engine": "simulated"}})


def test_a_simulated_run_evaluates_the_own_replicas_of_eval_replicas_workers_evenly_spaced(tmp_path):
    job = {**JOB, "strategy__name": "gossip", "run__workers": 6, "run__max_steps": 4, "eval__replicas": 3}
    summary = fast.train(None, out=str(tmp_path), **job)
    evaluated = [rank for rank, accuracy in enumerate(summary["worker_test_accuracy"]) if accuracy is not None]
    assert evaluated == [0, 2, 4] and summary["simulation"]["setup_host_s"] > 0


def test_what_a_member_gone_leaves_on_the_wire_is_dropped_once_nobody_can_take_it():
    """A collective that a gone member broke, and the messages on their way to it, are let go: a broken generation's
    parts (a member's gradients each) would otherwise stay to the end of a run (60 MB a change at 1,024 workers)."""
    sim = Simulation()
    the_wire = start(sim, 3, LinkTable(size=3, default=EmulatedLink(latency_s=0.01, bandwidth_Bps=1e6)), seed=0)
    failed: list[int] = []

    def member(rank: int) -> None:
        comm = world(rank, torch.device("cpu"), 10.0)
        if rank == 2:
            the_wire.leave(2, "killed")  # before it brings its part
            return
        comm.isend(torch.zeros(1000), 2, tag=5)  # never to be taken
        try:
            comm.all_reduce(torch.ones(1000))
        except Exception:
            failed.append(rank)

    for rank in range(3):
        sim.spawn(lambda rank=rank: member(rank), f"worker {rank}", rank=rank, main=True)
    sim.run()
    assert failed == [0, 1]
    assert the_wire.meetings == {}
    assert [key for key in the_wire.boxes if key[1] == 2] == []
