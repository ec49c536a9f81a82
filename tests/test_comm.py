"""comm over real processes: results, exact byte counts, deadlines that name the operation and the peer."""

import time

import pytest
import torch

from fast.comm import Comm
from fast.errors import CommTimeout
from fast.runtime.launch import WorkerFailed
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


def _silent_peer(comm: Comm) -> None:
    if comm.rank == 1:
        time.sleep(600)  # never answers
    start = time.perf_counter()
    try:
        comm.recv(torch.empty(4), 1)
    except CommTimeout as e:
        raise CommTimeout(f"after {time.perf_counter() - start:.2f}s: {e}") from None


def test_a_silent_peer_becomes_a_clear_error_within_the_deadline(no_orphans):
    with pytest.raises(WorkerFailed, match=r"worker 0 failed: after .*recv with worker 1 passed its 2s deadline") as e:
        run_distributed(_silent_peer, 2, deadline_s=2.0)
    waited = float(str(e.value).split("after ")[1].split("s:")[0])
    assert 2.0 <= waited < 2.0 + 3.0
