"""The run's store is inside the trust boundary (fast.runtime.run_store), over real sockets and in real runs: a local
run listens on loopback alone; a process without the run's secret can neither read nor write the store, so it cannot
kill, stop, stall, close or hijack the run; a holder's malformed request is one refused request; and a fuzz of the
store's protocol ends with the run going on until its owner stops it, nobody gone."""

import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from fast.assemble import load_config
from fast.runtime import run_store
from fast.runtime.membership import PREFIX, Access, Refused, connect, read_key, read_secret, request_admission
from fast.runtime.run_store import RunStore, RunStoreServer
from tests.processes import listening

FAST = str(Path(sys.executable).with_name("fast"))
SECRET = bytes(range(32))

# every kind of key the members obey or the coordinator reads, with what an intruder would write there
FORGERIES = {
    "evict/1": "kill",
    "evict/0": "kill",
    "stopping": "1",
    "ending": "1",
    "closed": "1",
    "generation/1": json.dumps({"number": 1, "members": [0, 7], "failed": "forged"}),
    "generation": "1",
    "heartbeat/1": "not a time",
    "suspicions/0": "1",
    "requests": "5",
    "request/1": json.dumps({"config": "{}"}),
    "lines": "3",
    "queue": "99999",
}


# -- the store alone -------------------------------------------------------------------------------------------------
@pytest.fixture
def served():
    server = RunStoreServer("127.0.0.1", 0, SECRET)
    yield server
    server.close()


def test_a_holder_of_the_secret_reads_and_writes_as_on_a_tcpstore(served):
    a, b = (RunStore("127.0.0.1", served.port, SECRET, timeout_s=2) for _ in range(2))
    a.set("k", "v")
    assert b.get("k") == b"v" and b.check(["k"]) and not b.check(["k", "absent"])
    assert a.add("n", 2) == 2 and b.add("n", 3) == 5
    assert a.compare_set("once", "", "first") == b"first" and b.compare_set("once", "", "second") == b"first"
    assert a.compare_set("once", "first", "third") == b"third"
    a.multi_set(["x", "y"], ["1", b"\x00\xff"])
    assert b.multi_get(["x", "y"]) == [b"1", b"\x00\xff"]
    assert b.delete_key("x") and not b.delete_key("x")
    with pytest.raises(dist.DistStoreError, match="timed out"):
        b.wait(["never"], timedelta(seconds=0.2))


def test_the_store_listens_on_the_address_it_is_given_alone(served):
    mine = [(address, port) for _, address, port in listening(os.getsid(0)) if port == served.port]
    assert mine == [("127.0.0.1", served.port)]


def test_without_the_secret_nothing_is_read_or_written(served):
    holder = RunStore("127.0.0.1", served.port, SECRET, timeout_s=2)
    holder.set(PREFIX + "generation", "0")
    with pytest.raises(run_store.Refused, match="refused this process: it does not hold the run's secret"):
        RunStore("127.0.0.1", served.port, os.urandom(32), timeout_s=2)
    # torch's own client, which a TCPStore would have obeyed
    with pytest.raises(RuntimeError):
        intruder = dist.TCPStore("127.0.0.1", served.port, is_master=False, wait_for_workers=False,
                                 timeout=timedelta(seconds=2), use_libuv=True)  # fmt: skip
        intruder.set(PREFIX + "stopping", "1")
        intruder.get(PREFIX + "generation")
    assert not holder.check([PREFIX + "stopping"]) and holder.num_keys() == 1


def test_a_message_that_does_not_verify_ends_its_connection_and_changes_nothing(served):
    client = RunStore("127.0.0.1", served.port, SECRET, timeout_s=2)
    channel = client._channel
    body = bytes([run_store.SET]) + run_store._fields(b"stopping", b"1")
    tampered = bytearray(run_store._tag(channel.key, b"C", run_store._SEQUENCE.pack(channel.sent), body))
    tampered[0] ^= 1
    channel.sock.sendall(run_store._LENGTH.pack(len(body)) + body + bytes(tampered))
    assert channel.sock.recv(1) == b""  # closed by the store
    other = RunStore("127.0.0.1", served.port, SECRET, timeout_s=2)
    assert not other.check(["stopping"])
    # a message replayed (sent again under the sequence number it had) ends its connection the same way
    other.set("a", "1")
    other._channel.sent -= 1
    with pytest.raises(dist.DistNetworkError):
        other.set("a", "2")
    assert RunStore("127.0.0.1", served.port, SECRET, timeout_s=2).get("a") == b"1"


def test_a_fake_store_is_found_out_by_its_client():
    """A process that listens where the run's store should be, without the secret, is not believed."""
    impostor = RunStoreServer("127.0.0.1", 0, os.urandom(32))
    try:
        with pytest.raises(run_store.Refused):
            RunStore("127.0.0.1", impostor.port, SECRET, timeout_s=2)
    finally:
        impostor.close()


# -- in a run --------------------------------------------------------------------------------------------------------
def _intrude(host: str, port: int, seconds: float, seed: int) -> int:
    """For `seconds`, what a process that reaches the store's port without the secret can send: torch's client
    writing every key the members obey, clients with wrong secrets, raw bytes, half handshakes, forged proofs,
    floods of connections. Returns how many attempts it made."""
    rng, attempts, end = random.Random(seed), 0, time.monotonic() + seconds
    while time.monotonic() < end:
        attempts += 1
        kind = rng.randrange(5)
        try:
            if kind == 0:
                store = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                                      timeout=timedelta(seconds=1), use_libuv=True)  # fmt: skip
                for key, value in FORGERIES.items():
                    store.set(PREFIX + key, value)
            elif kind == 1:
                RunStore(host, port, os.urandom(32), timeout_s=1).set(PREFIX + "stopping", "1")
            else:
                with socket.create_connection((host, port), timeout=1) as raw:
                    if kind == 2:
                        raw.sendall(os.urandom(rng.randrange(1, 4096)))
                    elif kind == 3:  # a handshake of the right shape, its proof forged
                        raw.recv(40)
                        raw.sendall(os.urandom(64) + os.urandom(rng.randrange(0, 64)))
                    raw.recv(1)
        except (RuntimeError, OSError):
            pass
    return attempts


def _malformed_requests(access: Access, run_dir: Path) -> list[str]:
    """What a holder of the secret may send by mistake: each is refused, or skipped, and the membership goes on.
    Returns the answers to the malformed join requests."""
    store = connect(access, 10)
    invalid_config = json.dumps({"run": {"workers": "many"}})
    written = [b"\xff\xfe not json", b"[1, 2]", json.dumps({"config": 5}).encode(),
               json.dumps({"config": invalid_config}).encode(), b'{"proof": "\xc3\xa9"}']  # fmt: skip
    numbers = []
    for value in written:
        number = int(store.add(PREFIX + "requests", 1))
        store.set(PREFIX + f"request/{number}", value)
        numbers.append(number)
    store.add(PREFIX + "requests", 1)  # a request counted whose writer died before it wrote it
    for key, value in {"heartbeat/1": b"not a time", "figures/1": b"{oops", "leave/77": b"\xff\xfe"}.items():
        store.set(PREFIX + key, value)
    answers = []
    for number in numbers:
        while (answer := read_key(store, f"answer/{number}")) is None:
            time.sleep(0.05)
        answers.append(json.loads(answer)["refused"])
    # the next request is still answered, once the unwritten one is skipped
    other = load_config(run_dir / "config.toml", model__name="lenet")
    with pytest.raises(Refused, match="its config differs from the run's: model.name"):
        request_admission(access, other, 60)
    return answers


def _logged_steps(run: Path) -> int:
    lines = (run / "workers" / "metrics-0.jsonl").read_text().splitlines()
    return max((json.loads(line).get("step", 0) for line in lines if '"loss"' in line), default=0)


def test_no_process_without_the_secret_changes_a_run_and_a_malformed_request_is_one_refusal(tmp_path, no_orphans):
    """A local live run of 3 workers: every socket of every process listens on loopback; then for several seconds
    intruders try every key the members obey (evict, stop, end, close, forged generations, heartbeats, the counters)
    and a fuzz of the protocol, while a holder of the secret sends malformed requests. The run goes on to its end:
    until its owner stops it, nobody left or joined, its accuracy."""
    run = tmp_path / "run"
    # (a run its owner ends, with fast stop)
    sets = {"data.name": "digits", "model.name": "mlp", "run.membership": "live", "run.workers": 3,
            "run.epochs": 100000, "run.batch_size": 32, "run.eval_every": 0, "run.log_every": 10}  # fmt: skip
    command = [FAST, "train", "--out", str(run), *[a for k, v in sets.items() for a in ("--set", f"{k}={v}")]]
    env = {**os.environ, "FAST_PROGRESS": "0"}
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)  # fmt: skip
    try:
        end = time.monotonic() + 120
        while not (run / "workers" / "metrics-2.jsonl").is_file():
            assert proc.poll() is None and time.monotonic() < end, proc.communicate()
            time.sleep(0.05)
        where = json.loads((run / "membership.json").read_text())
        access = Access(where["address"], where["port"], read_secret("test", run / "membership.secret"))
        sockets = listening(proc.pid)
        assert ("127.0.0.1", access.port) in [(a, p) for _, a, p in sockets]
        assert all(address in ("127.0.0.1", "::1") for _, address, _ in sockets), sockets
        attempts: list[int] = []
        intruders = [threading.Thread(target=lambda s=s: attempts.append(_intrude("127.0.0.1", access.port, 6, s)))
                     for s in range(2)]  # fmt: skip
        for t in intruders:
            t.start()
        answers = _malformed_requests(access, run)
        for t in intruders:
            t.join()
        assert proc.poll() is None, "the run ended while intruders knocked"
        steps_by_then = _logged_steps(run)
        stopped = subprocess.run([FAST, "stop", str(run)], capture_output=True, text=True, timeout=60)
        assert stopped.returncode == 0, stopped.stderr
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, err
    assert sum(attempts) > 20
    assert all(answer.startswith("its request is not valid") for answer in answers), answers
    assert "refused a connection to the run's store from 127.0.0.1: it did not prove the run's secret" in err
    summary = json.loads((run / "summary.json").read_text())
    assert [event["members"] for event in summary["membership"]] == [[0, 1, 2]]
    assert summary["workers_at_end"] == 3
    assert summary["steps_per_worker"] >= steps_by_then > 0
    assert summary["final_test_accuracy"] > 0.9
