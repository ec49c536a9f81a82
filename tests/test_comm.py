"""comm over real processes: results, exact byte counts, deadlines that name the operation and the peer."""

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from fast.comm import Comm, shared_memory
from fast.comm import bootstrap as engine
from fast.comm.shared_memory import SharedMemorySum, sum_buffer
from fast.emulation.links import EmulatedLink, LinkTable
from fast.emulation.network import EmulatedComm, Network
from fast.errors import CommError, CommTimeout
from fast.runtime.launch import WorkerFailed
from fast.runtime.run_store import RunStore, RunStoreServer
from tests.distributed import run_distributed


def _exchange(comm: Comm) -> dict:
    peer = 1 - comm.rank
    x = torch.full((100,), float(comm.rank))
    got = torch.empty(100)
    if comm.rank == 0:
        comm.send(x, peer)
        comm.recv(got, peer)
    else:
        comm.recv(got, peer)
        comm.send(x, peer)
    handle = comm.isend(torch.arange(10.0), peer)
    buf = comm.irecv(torch.empty(10), peer).wait()
    handle.wait()
    comm.send_bytes(torch.arange(7, dtype=torch.uint8), peer) if comm.rank == 0 else None
    src, payload = comm.recv_bytes() if comm.rank == 1 else (None, None)
    s = torch.tensor([comm.rank + 1.0, 2.0])
    comm.all_reduce(s)
    m = torch.tensor([comm.rank * 2.0])
    comm.all_reduce(m, op="mean")
    gathered = comm.all_gather(torch.tensor([comm.rank * 10.0]))
    b = torch.tensor([5.0]) if comm.rank == 0 else torch.zeros(1)
    comm.broadcast(b, src=0)
    variable = comm.all_gather_bytes(torch.ones(comm.rank + 3, dtype=torch.uint8))
    with comm.unmetered():
        comm.all_reduce(torch.ones(1000))
    comm.barrier()
    return {
        "got": got[0].item(),
        "buf": buf.tolist(),
        "src": src,
        "payload": None if payload is None else payload.tolist(),
        "sum": s.tolist(),
        "mean": m.item(),
        "gathered": [g.item() for g in gathered],
        "b": b.item(),
        "variable": [len(v) for v in variable],
        "counter": comm.counter.snapshot(),
    }


def test_point_to_point_and_collectives_move_the_right_values_and_count_exact_bytes():
    out = run_distributed(_exchange, 2)
    a, b = out[0], out[1]
    assert a["got"] == 1.0 and b["got"] == 0.0
    assert a["buf"] == list(range(10))
    assert b["src"] == 0 and b["payload"] == list(range(7))
    assert a["sum"] == b["sum"] == [3.0, 4.0]
    assert a["mean"] == b["mean"] == 1.0
    assert a["gathered"] == [0.0, 10.0]
    assert b["b"] == 5.0
    assert a["variable"] == b["variable"] == [3, 4]
    # rank 0: 400 (send) + 40 (isend) + 8+7 (frame) + all_reduce 8 + 4 (ring: 2(N-1)/N = 1x) + all_gather 4
    # + broadcast root 4 + all_gather_bytes (8 lengths + 4 padded payload) ; unmetered and barrier excluded
    assert a["counter"]["bytes_sent"] == 400 + 40 + 15 + 8 + 4 + 4 + 4 + 8 + 4
    assert b["counter"]["bytes_received"] == 400 + 40 + 15 + 8 + 4 + 4 + 4 + 8 + 4
    assert a["counter"]["sent_per_peer"] == {"1": a["counter"]["bytes_sent"]}
    assert a["counter"]["bytes_sent_unmetered"] == b["counter"]["bytes_sent_unmetered"] == 4000  # counted apart


def _announced_past_the_limit(comm: Comm) -> dict:
    """Rank 0 sends 1000 bytes twice; rank 1 expects at most 1000, then at most 999 (and drains the payload)."""
    payload = torch.arange(1000, dtype=torch.int64).to(torch.uint8)
    if comm.rank == 0:
        comm.send_bytes(payload, 1)
        comm.send_bytes(payload, 1)
        comm.barrier()
        return {}
    _, first = comm.recv_bytes(0, limit=1000)
    try:
        comm.recv_bytes(0, limit=999)
        refused = ""
    except CommError as e:
        refused = str(e)
        comm.recv(torch.empty(1000, dtype=torch.uint8), 0)  # what was sent still arrives: taken here, unallocated
    comm.barrier()
    return {"first": len(first), "refused": refused}


def test_recv_bytes_refuses_a_length_past_what_its_caller_expects():
    out = run_distributed(_announced_past_the_limit, 2)[1]
    assert out["first"] == 1000
    assert "recv_bytes from worker 0: 1,000 bytes announced, more than the 999 this receive expects" in out["refused"]


@pytest.mark.parametrize("model", ["mlp", "lenet", "resnet8", "lstm"])
def test_the_bound_on_a_saved_state_holds_the_state_and_not_much_more(model):
    import io

    from fast.comm.comm import limit_for
    from fast.jobs.models import build_model

    state = build_model(model, (1, 8, 8), 10).state_dict()
    buffer = io.BytesIO()
    torch.save(state, buffer)
    tensors = sum(t.numel() * t.element_size() for t in state.values())
    assert len(buffer.getvalue()) <= limit_for(state) <= tensors + 4096 * len(state) + (1 << 20)
    assert limit_for(state, times=2) > 2 * len(buffer.getvalue()) - (1 << 20)


def _in_pieces(comm: Comm) -> dict:
    import torch.distributed as dist

    calls = []
    whole = dist.all_reduce

    def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        calls.append(tensor.numel())
        return whole(tensor, *args, **kwargs)

    dist.all_reduce = counted
    comm.piece_bytes = 1024  # 256 floats
    x = torch.arange(1000.0) * (comm.rank + 1)
    comm.all_reduce(x, op="mean")
    small = torch.ones(10)
    comm.all_reduce(small)
    behind = torch.arange(600.0)  # started together, done together
    comm.all_reduce(behind, async_op=True).wait()
    return {"pieces": calls, "x": x.tolist(), "small": small.tolist(), "behind": behind.tolist(),
            "sent": comm.counter.snapshot()["bytes_sent"]}  # fmt: skip


def test_a_blocking_all_reduce_larger_than_a_piece_goes_in_consecutive_pieces_with_the_same_result_and_bytes():
    out = run_distributed(_in_pieces, 3)
    for rank in range(3):
        assert out[rank]["pieces"] == [256, 256, 256, 232, 10, 256, 256, 88]
        assert out[rank]["x"] == pytest.approx([2.0 * i for i in range(1000)])
        assert out[rank]["small"] == [3.0] * 10
        assert out[rank]["behind"] == [3.0 * i for i in range(600)]
        # counted as the whole tensor's ring all-reduce: 2(N-1)/N of its bytes
        assert out[rank]["sent"] == round(4000 * 4 / 3) + round(40 * 4 / 3) + round(2400 * 4 / 3)


def test_the_runs_allreduce_piece_kb_reaches_the_comms_it_makes():
    from fast.emulation.deployment import comm_maker

    assert comm_maker(None, 256)(rank=0, world_size=1).piece_bytes == 256 * 1024
    assert comm_maker(None, 0)(rank=0, world_size=1).piece_bytes is None


def _timed(action: Any, error: type[CommError]) -> None:
    """Run `action`; its `error` says after how many seconds it came."""
    start = time.perf_counter()
    try:
        action()
    except error as e:
        raise error(f"after {time.perf_counter() - start:.2f}s: {e}") from None


def _waited_s(failure: pytest.ExceptionInfo) -> float:
    return float(str(failure.value).split("after ")[1].split("s:")[0])


def _silent_peer(comm: Comm) -> None:
    if comm.rank == 1:
        time.sleep(600)  # never answers
    _timed(lambda: comm.recv(torch.empty(4), 1), CommTimeout)


def test_a_silent_peer_becomes_a_clear_error_within_the_deadline(no_orphans):
    with pytest.raises(WorkerFailed, match=r"worker 0 failed: after .*recv with worker 1 passed its 2s deadline") as e:
        run_distributed(_silent_peer, 2, deadline_s=2.0)
    assert 2.0 <= _waited_s(e) < 2.0 + 3.0


def _a_group_one_member_never_makes(comm: Comm, port: int, secret: bytes) -> None:
    engine.abort()  # a live membership's world instead: over a group store whose waits last 2 s
    store = RunStore("127.0.0.1", port, secret, 2.0).for_group("generation1/")
    world = engine.start_group(store, comm.rank, 2, torch.device("cpu"), deadline_s=30.0, connect_s=2.0)
    if comm.rank == 1:
        time.sleep(600)  # gone, as far as its peers can tell
    world.connect_s = 2.0  # a live membership's groups: how long making one waits for its members
    _timed(world.separate_group, CommError)


def test_a_group_a_member_never_comes_to_make_fails_after_the_connect_time(no_orphans):
    with pytest.raises(WorkerFailed, match=r"worker 0 failed: after .*forming a group of workers \[0, 1\]") as e:
        _with_a_run_store(_a_group_one_member_never_makes, 2, deadline_s=30.0)
    assert 2.0 <= _waited_s(e) < 2.0 + 3.0  # the connect time, not the 30 s deadline


def _forms_after_a_failed_attempt(comm: Comm, port: int, secret: bytes) -> float:
    engine.abort()  # a live member leaving its generation's group
    if comm.rank == 0:  # it tries to form a group its peer never comes to (the peer's generation is newer)
        alone = RunStore("127.0.0.1", port, secret, 5.0).for_group("generation1/")
        with pytest.raises(RuntimeError):
            engine.start_group(alone, 0, 2, torch.device("cpu"), deadline_s=5.0, connect_s=1.0)
    return _sum_in_the_next_group(RunStore("127.0.0.1", port, secret, 20.0), comm.rank)


def _sum_in_the_next_group(store: RunStore, rank: int) -> float:
    """Ranks 0 and 1 form generation 2's group over the run's store and sum their rank + 1 in it (3.0)."""
    group = engine.start_group(store.for_group("generation2/"), rank, 2, torch.device("cpu"), deadline_s=20.0,
                               connect_s=20.0)  # fmt: skip
    total = torch.tensor([rank + 1.0])
    group.all_reduce(total)
    return total.item()


def _with_a_run_store(fn: Any, nprocs: int, deadline_s: float) -> dict[int, Any]:
    """`fn(comm, port, secret)` on each of `nprocs` ranks, beside a run's store server of its own."""
    secret = os.urandom(32)
    server = RunStoreServer("127.0.0.1", 0, secret)
    try:
        return run_distributed(fn, nprocs, server.port, secret, deadline_s=deadline_s)
    finally:
        server.close()


def test_members_that_failed_to_form_a_group_unequally_often_still_form_the_next_one(no_orphans):
    """torch names a group after the count of groups its process made, and that name is part of every key its
    members meet on: a failed attempt counted on one member and not on another made them miss each other at every
    later generation (a live run re-forming every few seconds, forever). Each generation's group counts from 0."""
    sums = _with_a_run_store(_forms_after_a_failed_attempt, 2, deadline_s=60.0)
    assert sums == {0: 3.0, 1: 3.0}


def _forms_groups_whose_member_2_dies(rank: int, port: int, secret: bytes, which: str, generations: list[int],
                                      results: Any) -> None:  # fmt: skip
    """Rank `rank` of each of `generations` (live generations of 3 members, connect_s 2 s), forming its world group
    or, with the world formed, its control group. Rank 2 is a new member in each, which dies as soon as it has
    published its address there; ranks 0 and 1 come once it is dead ("gone/G") and report how their forming ended."""
    cpu = torch.device("cpu")
    for generation in generations:
        engine.abort()  # (the last generation's group, as a live member leaves it)
        store = RunStore("127.0.0.1", port, secret, 60.0)
        group = store.for_group(f"generation{generation}/")
        world = None
        if which == "control group":
            world = engine.start_group(group, rank, 3, cpu, deadline_s=30.0, connect_s=2.0)
            world.connect_s = 2.0
        if rank == 2:  # its address is the one thing gloo sets in the store: it dies once that is in
            published = store.set
            store.set = lambda key, value, published=published: (published(key, value), os.kill(os.getpid(), 9))
        else:
            store.wait([f"gone/{generation}"])
        start = time.monotonic()
        try:
            if world is None:
                engine.start_group(group, rank, 3, cpu, deadline_s=30.0, connect_s=2.0)
            else:
                world.subgroups([world.ranks], gloo=True)
            outcome = "formed"
        except Exception as e:  # CommError, or torch's own RuntimeError (start_group's)
            outcome = type(e).__name__
        results.put((generation, rank, outcome, round(time.monotonic() - start, 2)))


@pytest.mark.parametrize("which", ["world", "control group"])
def test_a_group_whose_member_died_after_publishing_its_address_fails_within_the_connect_time(which, no_orphans):
    """gloo gives a peer five times a group's timeout to connect their pair: members of a 10-minute churned run spent
    50 s of a 10 s connect time forming a group with a member that had published its address and died. (Which side
    of a pair waits is gloo's pick, by port: three generations make it near certain that a member waited.)"""
    secret, context, generations = os.urandom(32), mp.get_context("spawn"), [1, 2, 3]
    server, results = RunStoreServer("127.0.0.1", 0, secret), context.Queue()
    args = [(rank, server.port, secret, which, generations, results) for rank in (0, 1)]
    args += [(2, server.port, secret, which, [generation], results) for generation in generations]
    members = [context.Process(target=_forms_groups_whose_member_2_dies, args=mine) for mine in args]
    store = RunStore("127.0.0.1", server.port, secret, 60.0)
    try:
        for member in members:
            member.start()
        for generation, dying in zip(generations, members[2:], strict=True):
            dying.join(timeout=60)
            assert dying.exitcode == -signal.SIGKILL
            store.set(f"gone/{generation}", "1")
        ended = sorted(results.get(timeout=60) for _ in range(2 * len(generations)))
    finally:
        for member in members:
            member.join(timeout=10)
            member.kill()
        server.close()
    assert [(generation, rank) for generation, rank, _, _ in ended] == [(g, r) for g in generations for r in (0, 1)]
    # a member that connects to the dead one is refused at once; one that waits for it to connect waits 2 s
    assert all(outcome != "formed" and seconds < 2.0 + 3.0 for _, _, outcome, seconds in ended), ended


def _aborted_inside_a_collective(comm: Comm, port: int, secret: bytes) -> tuple[float, float] | None:
    store = RunStore("127.0.0.1", port, secret, 60.0)
    if comm.rank == 2:  # alive, elsewhere: it never comes to the collective, and keeps its connections open
        store.wait(["done"])
        return None
    running = torch.distributed.all_reduce(torch.ones(1000), async_op=True)  # noqa: F841 (held, as a Handle does)
    time.sleep(0.5)
    started = time.monotonic()
    engine.abort()
    left_s = time.monotonic() - started
    total = _sum_in_the_next_group(store, comm.rank)
    if comm.rank == 0:
        store.set("done", b"1")
    return left_s, total


def test_a_member_leaves_a_group_whose_collective_is_still_running_at_once_and_forms_the_next():
    """gloo's abort of a group whose collective still runs (its peers alive and elsewhere) waits out the group's
    timeout: two members of a 10-minute churned run spent 10 s each in it. The member goes on at once."""
    out = _with_a_run_store(_aborted_inside_a_collective, 3, deadline_s=30.0)
    for rank in (0, 1):
        left_s, total = out[rank]
        assert left_s < 5.0 and total == 3.0, out  # (the group's timeout is 30 s: waited out, it would be 29.5)


def _sums(comm: Comm, shared_memory: bool) -> dict:
    summed = sum_buffer(comm, 9, shared_memory)
    before = comm.counter.snapshot()["bytes_sent"]  # making the buffer is set-up, not traffic
    results = []
    for round_ in range(3):  # the buffer is summed again and again, each round from new values
        summed.tensor.copy_(torch.arange(9.0) * (comm.rank + 1) + round_)
        summed.start().wait()
        results.append(summed.tensor.tolist())
    counter = comm.counter.snapshot()
    return {"transport": summed.transport, "results": results, "before": before, "counter": counter}


@pytest.mark.parametrize(("shared_memory", "transport"), [(True, "shared memory"), (False, "backend")])
def test_a_sum_buffer_sums_in_place_round_after_round_and_counts_the_rings_bytes(shared_memory, transport):
    out = run_distributed(_sums, 3, shared_memory)
    for rank, got in out.items():
        assert got["transport"] == transport
        assert got["before"] == 0
        for round_, values in enumerate(got["results"]):
            assert values == [(1 + 2 + 3) * i + 3 * round_ for i in range(9)], (rank, round_)
        # the ring moves 2(N-1)/N of the 9 floats a round, 12 each way, and so does shared memory: its chunk of
        # each peer's values in, each peer's chunk of the sum in, and the same out
        assert got["counter"]["bytes_sent"] == got["counter"]["bytes_received"] == 3 * 12 * 4


def _local_sums(comm: Comm) -> dict:
    comm.local_sums = shared_memory.LocalSums(comm)
    mean = torch.full((2, 3), float(comm.rank))
    comm.all_reduce(mean, op="mean")
    counts = torch.tensor([comm.rank + 1])  # not float32: the backend's
    comm.all_reduce(counts)
    sizes = [comm.all_reduce(torch.ones(n)).tolist() for n in range(1, shared_memory.MAX_SIZES + 3)]
    return {"mean": mean.tolist(), "counts": counts.tolist(), "sizes": sizes,
            "transports": [summed.transport for summed in comm.local_sums.sums.values()]}  # fmt: skip


def test_a_groups_blocking_all_reduces_go_through_shared_memory_for_its_first_sizes():
    out = run_distributed(_local_sums, 2)
    for got in out.values():
        assert got["mean"] == [[0.5] * 3] * 2 and got["counts"] == [3]
        assert got["sizes"] == [[2.0] * n for n in range(1, shared_memory.MAX_SIZES + 3)]
        # (2, 3) is 6 floats; with sizes 1 to 16 that makes the 16 kept, and sizes 17 and 18 go through gloo
        assert got["transports"] == ["shared memory"] * shared_memory.MAX_SIZES


def _sum_where(comm: Comm, where: str) -> dict:
    if where == "no /dev/shm":  # the first member has nowhere to put the file
        shared_memory.TMPFS = Path("/nonexistent")
    elif where == "another machine" and comm.rank == 1:  # it maps the file, but runs on another kernel
        shared_memory._boot_id = lambda: 12345
    summed = sum_buffer(comm, 5)
    summed.tensor.fill_(comm.rank + 1.0)
    summed.start().wait()
    return {"transport": summed.transport, "sum": summed.tensor.tolist()}


@pytest.mark.parametrize("where", ["no /dev/shm", "another machine"])
def test_a_sum_buffer_falls_back_to_the_backend_on_every_member_when_memory_is_not_shared(where):
    out = run_distributed(_sum_where, 2, where)
    assert [got["transport"] for got in out.values()] == ["backend", "backend"]
    assert [got["sum"] for got in out.values()] == [[3.0] * 5] * 2


@pytest.mark.skipif(not os.path.exists("/proc/self/ns/pid"), reason="finds dead peers through /proc (Linux)")
def test_a_shared_memory_sum_whose_peer_is_gone_fails_at_once_naming_it(tmp_path):
    # worker 1 of this sum is a process that has exited; worker 0 is this one
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    path = tmp_path / "sum"
    path.write_bytes(bytes(16 * 2 + 4 * 10 * 3))
    storage = torch.UntypedStorage.from_file(str(path), shared=True, nbytes=path.stat().st_size)
    comm = Comm(ranks=[0, 1], rank=0, world_size=2, deadline_s=60.0)
    namespace = os.stat("/proc/self/ns/pid").st_ino
    summed = SharedMemorySum(comm, 10, storage, [(os.getpid(), namespace), (gone.pid, namespace)])
    start = time.perf_counter()
    with pytest.raises(CommError, match=r"all_reduce with the group \[0, 1\] failed: worker 1's process is gone"):
        summed.start().wait()
    assert time.perf_counter() - start < 5.0  # not the 60 s deadline


def _peer_silent_before_summing(comm: Comm) -> None:
    summed = sum_buffer(comm, 1000)
    if comm.rank == 1:
        time.sleep(600)  # alive, never sums
    start = time.perf_counter()
    try:
        summed.start().wait()
    except CommTimeout as e:
        raise CommTimeout(f"after {time.perf_counter() - start:.2f}s: {e}") from None


def test_a_shared_memory_sum_with_a_silent_peer_ends_at_its_deadline(no_orphans):
    with pytest.raises(
        WorkerFailed, match=r"worker 0 failed: after .*all_reduce with the group \[0, 1\] passed its 2s"
    ) as e:
        run_distributed(_peer_silent_before_summing, 2, deadline_s=2.0)
    waited = float(str(e.value).split("after ")[1].split("s:")[0])
    assert 2.0 <= waited < 2.0 + 3.0


def _a_payload_from_a_silent_peer(comm: Comm) -> str | None:
    if comm.rank == 0:  # (sends nothing, and stays until the other has given up)
        time.sleep(3)
        return None
    incoming, asked = comm.irecv_bytes(0, limit=1 << 20), time.monotonic()
    try:
        incoming.take(lambda: "the membership changed" if time.monotonic() - asked > 0.5 else None)
    except CommError as e:
        return str(e)
    return "received"


def test_a_payload_on_its_way_is_given_up_when_the_membership_changes():
    """A joiner's state comes behind the steps (`irecv_bytes`); waiting for it gives up once the live group's
    membership changes: a joiner whose source had stopped sending waited out the whole deadline (60 s), while the
    others waited for it at the next generation."""
    out = run_distributed(_a_payload_from_a_silent_peer, 2)
    assert out[1] == "receiving a payload given up: the membership changed", out[1]


def _in_turn(comm: Comm) -> dict:
    """Rank 0 sends rank 1 a state of 4 MB and rank 2 one of 2 MB, in turn, over emulated links of 2 MB/s with a
    deadline of 1.5 s: each receiver's payload, and when it was in."""
    link = LinkTable(comm.size, EmulatedLink(0.001, 2e6))
    emulated = EmulatedComm(network=Network(link, comm.rank, 0), deadline_s=comm.deadline_s, device="cpu")
    emulated.barrier()
    started = time.monotonic()
    if comm.rank == 0:
        lines = [
            (torch.full((4 << 20,), 1, dtype=torch.uint8), 1, 0),
            (torch.full((2 << 20,), 2, dtype=torch.uint8), 2, 0),
        ]
        emulated.isend_bytes_in_turn(lines).join()
        return {}
    payload = emulated.irecv_bytes(0, limit=8 << 20).take()
    return {"in_s": time.monotonic() - started, "bytes": payload.numel(), "values": payload.unique().tolist()}


def test_states_sent_in_turn_come_in_one_after_another_and_a_receiver_waiting_its_turn_outlasts_the_deadline():
    """A source heals its joiners one after another (`isend_bytes_in_turn`): the first is in after its own bytes,
    not after everyone's, so it can send at the next heal. The second waits longer than the deadline for its
    turn, and its receive holds: a piece comes to it every third of the deadline."""
    out = run_distributed(_in_turn, 3, deadline_s=1.5)
    assert (out[1]["bytes"], out[1]["values"], out[2]["bytes"], out[2]["values"]) == (4 << 20, [1], 2 << 20, [2])
    # side by side, the 2 MB state would be in at 2 s and the 4 MB one at 3 s
    assert out[1]["in_s"] < out[2]["in_s"], out
