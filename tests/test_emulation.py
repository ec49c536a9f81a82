"""Emulated deployments: delays that match latency + bytes/bandwidth, collectives as rounds of messages,
lost and down links, seeded stragglers, deployment config checks, and a run that records it all."""

import json
import multiprocessing
import time

import pytest
import torch

from fast.assemble import load_config, world_size
from fast.comm import MessageLost
from fast.comm.waiting import waiting
from fast.emulation import network
from fast.emulation.compute import CRASH_EXIT_CODE, EmulatedMachine, MachinePlan
from fast.emulation.deployment import link_table, machine_for
from fast.emulation.links import EmulatedLink, LinkTable, Outage
from fast.emulation.network import EmulatedComm, Network
from fast.errors import ConfigError
from tests.distributed import run_distributed

LATENCY_S = 0.05
BANDWIDTH_BPS = 1e6  # 8 Mbit
SLACK_S = 0.04  # a busy shared machine may wake a sleeper late; never early


def _emulated(comm, links: LinkTable, seed: int = 0) -> EmulatedComm:
    network = Network(links, comm.rank, seed)
    return EmulatedComm(network=network, deadline_s=comm.deadline_s, device="cpu")


def _ping_pong(comm, sizes):
    """Each size goes 0 -> 1, then 1 -> 0; returns (size, sent at, send returned at) or (size, received at)."""
    emu = _emulated(comm, LinkTable(comm.size, EmulatedLink(LATENCY_S, BANDWIDTH_BPS)))
    emu.barrier()
    events = []
    for nbytes in sizes if comm.rank < 2 else []:
        payload = torch.zeros(nbytes, dtype=torch.uint8)
        for sender in (0, 1):
            if comm.rank == sender:
                started = time.time()
                emu.send(payload, 1 - sender)
                events.append(("sent", nbytes, started, time.time()))
            else:
                emu.recv(payload, sender)
                events.append(("received", nbytes, time.time()))
    return {"events": events, "counter": emu.counter.snapshot()}


def _collectives(comm):
    emu = _emulated(comm, LinkTable(comm.size, EmulatedLink(0.01, 1e8)))
    r = emu.rank
    started = time.time()
    x = torch.arange(1000, dtype=torch.float32) * (r + 1)
    emu.all_reduce(x)
    ring_s = time.time() - started
    sent_by_ring = emu.counter.bytes_sent
    mean = torch.full((5,), float(r))
    handle = emu.all_reduce(mean, op="mean", async_op=True)
    biggest = torch.tensor([float(r), -float(r)])
    emu.all_reduce(biggest, op="max")
    handle.wait()
    gathered = emu.all_gather(torch.tensor([r * 10.0, r * 10.0 + 1]))
    b = torch.full((3,), 7.0) if r == 1 else torch.zeros(3)
    emu.broadcast(b, src=1)
    with emu.unmetered():
        before = emu.counter.bytes_sent
        emu.all_reduce(torch.ones(100))
        unmetered_bytes = emu.counter.bytes_sent - before
    sizes = [len(p) for p in emu.all_gather_bytes(torch.ones(r + 2, dtype=torch.uint8))]
    group = emu.subgroups([[0, 1], [2]])
    pair = torch.ones(2)
    if group is not None and group.size == 2:
        group.all_reduce(pair)
    emu.barrier()
    return {
        "sum": x.tolist(),
        "ring_s": ring_s,
        "ring_bytes": sent_by_ring,
        "mean": mean.tolist(),
        "max": biggest.tolist(),
        "gathered": [g.tolist() for g in gathered],
        "broadcast": b.tolist(),
        "unmetered": unmetered_bytes,
        "sizes": sizes,
        "pair": pair.tolist(),
        "group_kind": type(group).__name__,
    }


def _lossy(comm):
    links = LinkTable(
        comm.size,
        EmulatedLink(0.001, 1e8, loss=0.5),
        outages=[Outage(0, 1, 0.0, 0.3)],
    )
    emu = _emulated(comm, links, seed=3)
    emu.network.start_clock()
    out: dict = {}
    if comm.rank == 0:
        emu.send(torch.ones(4), 1, droppable=True)  # link down: lost
        emu.send_bytes(torch.ones(9, dtype=torch.uint8), 1, droppable=True)  # lost too
        emu.send(torch.full((4,), 2.0), 1)  # not droppable: waits for the link
        for i in range(40):
            emu.send(torch.full((4,), float(i)), 1, droppable=True)
        out["network"] = emu.network.record()
    else:
        out["first"] = _outcome(lambda: emu.recv(torch.empty(4), 0))
        out["bytes"] = _outcome(lambda: emu.recv_bytes(0))
        got = emu.recv(torch.empty(4), 0)
        out["held"] = (got.tolist(), time.time() - emu.network.origin)
        out["lossy"] = [_outcome(lambda: emu.recv(torch.empty(4), 0)[0].item()) for _ in range(40)]
    return out


def _scenarios(comm, sizes):
    """Every multi-process scenario in one set of 3 processes (starting processes is the slow part)."""
    out = {"ping_pong": _ping_pong(comm, sizes)}
    comm.barrier()
    out["collectives"] = _collectives(comm)
    comm.barrier()
    out["lossy"] = _lossy(comm) if comm.rank < 2 else None
    return out


def _outcome(receive):
    try:
        return receive()
    except MessageLost:
        return "lost"


SIZES = [1000, 100_000]


@pytest.fixture(scope="module")
def scenarios():
    return run_distributed(_scenarios, 3, SIZES)


@pytest.fixture(scope="module")
def ping_pong(scenarios):
    return {rank: scenarios[rank]["ping_pong"] for rank in scenarios}


def test_one_way_time_is_latency_plus_bytes_over_bandwidth(ping_pong):
    sends = [e for rank in (0, 1) for e in ping_pong[rank]["events"] if e[0] == "sent"]
    receives = [e for rank in (1, 0) for e in ping_pong[rank]["events"] if e[0] == "received"]
    assert len(sends) == len(receives) == 4
    for (_, nbytes, started, _), (_, size, arrived) in zip(sends, receives, strict=True):
        assert nbytes == size
        expected = LATENCY_S + nbytes / BANDWIDTH_BPS
        assert expected <= arrived - started <= expected + SLACK_S, (nbytes, arrived - started)


def test_the_sender_is_busy_while_its_bytes_go_out(ping_pong):
    for rank in (0, 1):
        blocked = {e[1]: e[3] - e[2] for e in ping_pong[rank]["events"] if e[0] == "sent"}
        assert 0.1 <= blocked[100_000] <= 0.1 + SLACK_S
        assert blocked[1000] <= 0.001 + SLACK_S


def test_emulated_bytes_are_the_payloads_only(ping_pong):
    for rank in (0, 1):
        counter = ping_pong[rank]["counter"]
        assert counter["bytes_sent"] == counter["bytes_received"] == sum(SIZES)


def test_collectives_run_as_rounds_with_right_values_and_ring_bytes(scenarios):
    out = {rank: scenarios[rank]["collectives"] for rank in scenarios}
    # 2(N-1) rounds, each one latency, for the rank that began first (a later one finds its first message under way)
    assert max(out[r]["ring_s"] for r in range(3)) >= 4 * 0.01
    for r in range(3):
        got = out[r]
        assert got["sum"] == (torch.arange(1000.0) * 6).tolist()
        assert 4 * 4 * 333 <= got["ring_bytes"] <= 4 * 4 * 334  # 2(N-1) chunks of about 4000/N bytes
        assert got["mean"] == [1.0] * 5
        assert got["max"] == [2.0, 0.0]
        assert got["gathered"] == [[0.0, 1.0], [10.0, 11.0], [20.0, 21.0]]
        assert got["broadcast"] == [7.0] * 3
        assert got["unmetered"] == 0
        assert got["sizes"] == [2, 3, 4]
    assert sum(out[r]["ring_bytes"] for r in range(3)) == 2 * 2 * 4000
    assert out[0]["pair"] == out[1]["pair"] == [2.0, 2.0] and out[2]["pair"] == [1.0, 1.0]
    assert out[0]["group_kind"] == "EmulatedComm"


def test_down_and_lossy_links_drop_droppable_messages_and_hold_the_others(scenarios):
    out = {rank: scenarios[rank]["lossy"] for rank in (0, 1)}
    sender, receiver = out[0], out[1]
    assert receiver["first"] == "lost" and receiver["bytes"] == "lost"
    values, arrived_s = receiver["held"]
    assert values == [2.0] * 4 and arrived_s >= 0.25  # the outage ends 0.3 s after the sender's start
    lossy = receiver["lossy"]
    lost = [i for i, v in enumerate(lossy) if v == "lost"]
    assert 5 <= len(lost) <= 35
    assert [v for v in lossy if v != "lost"] == [float(i) for i in range(40) if i not in lost]
    network = sender["network"]
    assert network["lost_to_outage"] == 2 and network["lost_to_loss"] == len(lost)
    assert network["waited_for_outage_s"] > 0.2


def test_losses_repeat_for_the_same_seed_and_jitter_stays_within_bounds():
    table = LinkTable(2, EmulatedLink(0.01, 1e9, jitter_s=0.005, loss=0.3))

    def draws(seed):
        network = Network(table, 0, seed)
        return [network.transmit(1, 10, (1, 0, i), droppable=True) for i in range(50)]

    lost = [t.lost for t in draws(4)]
    assert lost == [t.lost for t in draws(4)] and lost != [t.lost for t in draws(5)]
    assert 5 <= sum(lost) <= 25
    delays = [t.deliver_at - t.sent_at for t in draws(4)]
    assert all(0.005 <= d <= 0.016 for d in delays) and max(delays) - min(delays) > 0.002


def test_a_message_on_a_busy_nic_waits_for_the_one_before_both_out_and_in():
    network = Network(LinkTable(3, EmulatedLink(0.0, 1000.0)), 0, 0)
    first = network.transmit(1, 500, (1, 0, 1), droppable=False)
    second = network.transmit(2, 500, (1, 0, 1), droppable=False)
    assert second.sent_at == pytest.approx(first.sent_at + 0.5, abs=1e-6)
    assert network.arrival(1, 500, 100.0) == 100.0  # from ranks 1 and 2 at once: taken in one by one
    assert network.arrival(2, 500, 100.0) == pytest.approx(100.5)
    assert network.arrival(1, 500, 200.0) == 200.0  # the NIC was idle again


def test_deployment_tables_resolve_sites_wan_and_overrides():
    config = load_config(
        None,
        data__name="digits",
        run__workers=4,
        network__bandwidth="100Mbit",
        network__latency="1ms",
        network__sites={"a": [0, 1], "b": [2, 3]},
        network__wan={"bandwidth": "10Mbit", "latency": "50ms"},
        network__links=[{"a": 0, "b": 3, "bandwidth": "1Mbit"}],
        faults__link_down=[{"a": 0, "b": 1, "start": "1s", "end": "2s"}],
    )
    table = link_table(config, world_size(config))
    assert table.link(0, 1) == EmulatedLink(0.001, 12.5e6)
    assert table.link(1, 2) == EmulatedLink(0.05, 1.25e6)
    assert table.link(3, 0) == EmulatedLink(0.05, 125e3)  # the override starts from the WAN link
    assert table.up_again_at(1, 0, 1.5) == 2.0 and table.up_again_at(0, 2, 1.5) == 1.5


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"network__latency": "fast"}, "network.latency"),
        ({"network__loss": 1.0}, "network.loss"),
        ({"network__sites": {"a": [0], "b": [0]}}, "network.sites"),
        ({"network__links": [{"a": 0, "b": 9}]}, "network.links.0.b"),
        ({"compute__slowdown": [1, 1]}, "compute.slowdown"),
        ({"compute__slowdown": [1, 0.5, 1, 1]}, "compute.slowdown"),
        ({"faults__crash": [{"worker": 1, "step": 2, "time": "1s"}]}, "faults.crash.0"),
        ({"faults__link_down": [{"a": 0, "b": 1, "start": "2s", "end": "1s"}]}, "faults.link_down.0"),
        ({"faults__link_down": [{"a": 0, "b": 1, "start": "1s", "end": "2s"}]}, "faults.link_down"),
    ],
)
def test_bad_deployment_keys_are_one_line_errors_naming_the_key(overrides, key):
    with pytest.raises(ConfigError) as error:
        load_config(None, data__name="digits", run__workers=4, **overrides)
    assert f"`{key}" in str(error.value) and "\n" not in str(error.value)


def test_stragglers_and_slowdowns_are_seeded_per_worker_and_step():
    plan = MachinePlan(rank=1, seed=7, slowdown=2.0, straggler_probability=0.25, straggler_pause_s=0.2, heavy_tail=1.5)
    again = MachinePlan(rank=1, seed=7, slowdown=2.0, straggler_probability=0.25, straggler_pause_s=0.2, heavy_tail=1.5)
    pauses = [plan.pause_s(step) for step in range(400)]
    assert pauses == [again.pause_s(step) for step in range(400)]
    assert 60 <= sum(p > 0 for p in pauses) <= 140
    factors = [plan.factor(step) for step in range(400)]
    assert min(factors) >= 2.0 and max(factors) <= 2.0 * plan.heavy_tail_max and max(factors) > 6
    assert pauses != [MachinePlan(rank=2, seed=7, straggler_probability=0.25, straggler_pause_s=0.2).pause_s(s)
                      for s in range(400)]  # fmt: skip


def _steps(machine: EmulatedMachine, steps: range, work_s: float) -> list[float]:
    """Each step's seconds on `machine`, its own work `work_s`."""
    took = []
    for step in steps:
        started = time.perf_counter()
        machine.before_step(step)
        time.sleep(work_s)
        machine.after_step()
        took.append(time.perf_counter() - started)
    return took


def test_a_slow_machine_sleeps_in_proportion_to_its_compute():
    machine = EmulatedMachine(MachinePlan(rank=0, slowdown=3.0))
    took = _steps(machine, range(3), 0.02)[-1]
    assert took >= 0.02 + 2 * 0.02 * 0.9
    assert machine.record()["slowdown_s"] >= 0.07


def test_a_step_time_makes_a_faster_step_wait_out_the_rest_and_a_slower_one_wait_nothing():
    machine = EmulatedMachine(MachinePlan(rank=0, step_time_s=0.1))
    assert min(_steps(machine, range(3), 0.02)) >= 0.1
    waited = machine.record()["step_time_waited_s"]
    assert 3 * 0.05 <= waited <= 3 * 0.08
    assert machine.compute_s < 0.05  # the step's own work, not what it waited
    _steps(machine, range(3, 4), 0.12)
    assert machine.record()["step_time_waited_s"] == waited


def test_a_runs_step_time_is_its_machines():
    config = load_config(None, data__name="digits", run__workers=4, run__step_time="200ms")
    assert machine_for(config, 3).plan.step_time_s == 0.2
    assert machine_for(load_config(None, data__name="digits"), 0).plan.step_time_s is None


def test_a_servers_request_time_holds_its_reading_but_not_its_waits():
    """What a serving thread does between two answers (parsing the next request) is work on that request; the
    time it waits for the request to arrive is not."""
    machine = EmulatedMachine(MachinePlan(rank=4))
    for _ in range(3):
        with waiting():
            time.sleep(0.05)  # the next request is on its way
        time.sleep(0.01)  # reading it
        with machine.serving():
            time.sleep(0.01)  # answering it
    assert 0.015 <= machine.request_s < 0.045  # the first request's reading came before any answer: not timed


def test_machine_plan_comes_from_compute_and_faults():
    config = load_config(
        None,
        data__name="digits",
        run__workers=4,
        compute__slowdown={"3": 4.0},
        compute__straggler_probability=0.1,
        faults__crash=[{"worker": 3, "step": 10}, {"worker": 3, "time": "5s"}],
    )
    plan = machine_for(config, 3).plan
    assert (plan.slowdown, plan.straggler_probability, plan.crash_step, plan.crash_time_s) == (4.0, 0.1, 10, 5.0)
    assert machine_for(config, 0).plan.slowdown == 1.0 and machine_for(config, 0).plan.crash_step is None


def _tiny_run(tmp_path, **overrides):
    from fast.tools.start import train

    return train(
        None,
        out=tmp_path,
        data__name="digits",
        model__name="mlp",
        run__workers=2,
        run__epochs=1,
        run__max_steps=12,
        run__eval_every=0,
        run__log_every=4,
        run__deadline_s=20,
        run__threads_per_worker=1,
        **overrides,
    )


def test_a_live_run_with_a_step_time_takes_it_for_each_step_on_its_cores_own_work(tmp_path, monkeypatch):
    """The churn bench's emulated device: a live run's steps take run.step_time, their own work being less."""
    monkeypatch.setenv("FAST_PROGRESS", "0")
    summary = _tiny_run(tmp_path, run__step_time="100ms", run__membership="live")
    assert summary["step_time_s"] >= 0.1
    assert summary["step_compute_s"] < 0.1


def test_an_emulated_run_records_its_deployment_and_prediction(tmp_path, monkeypatch):
    monkeypatch.setenv("FAST_PROGRESS", "0")
    summary = _tiny_run(
        tmp_path,
        network__bandwidth="100Mbit",
        network__latency="5ms",
        compute__straggler_probability=0.5,
        compute__straggler_pause="10ms",
    )
    deployment = summary["deployment"]
    assert deployment["network"]["default"] == {
        "latency_s": 0.005,
        "bandwidth_Bps": 12.5e6,
        "jitter_s": 0.0,
        "loss": 0.0,
    }
    ranks = deployment["per_rank"]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(r["network"]["messages"] > 0 for r in ranks)
    expected = [
        [s, 0.01]
        for s in range(summary["steps_per_worker"])
        if MachinePlan(0, straggler_probability=0.5, straggler_pause_s=0.01).pause_s(s)
    ]
    assert ranks[0]["straggler_pauses"] == expected
    assert summary["predicted_step_time_s"] > 0
    assert summary["bytes_sent"] > 0 and summary["final_test_accuracy"] is not None
    links = deployment["bytes_per_link"]  # every byte counted is on the link from its sender to its peer
    assert [(link["src"], link["dst"]) for link in links] == [(0, 1), (1, 0)]
    assert sum(link["bytes"] for link in links) == summary["bytes_sent"]


def _crash_child(events_file, crash_step, crash_time_s):
    machine = EmulatedMachine(MachinePlan(rank=2, crash_step=crash_step, crash_time_s=crash_time_s), events_file)
    machine.start()
    for step in range(1000):
        machine.before_step(step)
        time.sleep(0.01)
        machine.after_step()


def test_a_crash_fault_ends_the_process_abruptly_at_its_step_or_time(tmp_path):
    context = multiprocessing.get_context("spawn")
    by_step = context.Process(target=_crash_child, args=(tmp_path / "step.jsonl", 3, None))
    by_time = context.Process(target=_crash_child, args=(tmp_path / "time.jsonl", None, 0.3))
    for process in (by_step, by_time):
        process.start()
    for process in (by_step, by_time):
        process.join(60)
        assert process.exitcode == CRASH_EXIT_CODE
    at_step = json.loads((tmp_path / "step.jsonl").read_text())
    assert at_step["fault"] == "crash" and at_step["worker"] == 2 and at_step["step"] == 3
    at_time = json.loads((tmp_path / "time.jsonl").read_text())
    assert "step" not in at_time and at_time["time_s"] >= 0.3


def test_a_groups_thread_of_emulated_collectives_ends_when_idle_and_starts_again(monkeypatch):
    """A live run re-forms its groups at every change: the groups of past generations leave no thread behind (one
    churned run kept dozens), and a group idle for a while still runs its next collective."""
    monkeypatch.setattr(network, "IDLE_S", 0.05)
    rounds = network._Rounds()
    assert rounds.submit(lambda: 1).result(timeout=5) == 1
    end = time.monotonic() + 5
    while rounds._thread is not None and time.monotonic() < end:
        time.sleep(0.01)
    assert rounds._thread is None
    assert rounds.submit(lambda: 2).result(timeout=5) == 2
