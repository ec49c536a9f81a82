"""FAST held against the systems its users would pick instead, on the same job and the same links, bytes counted by
the kernel: DDP against FAST `sync`; torchft's LocalSGD, DiLoCo and streaming DiLoCo against FAST `local-sgd`,
`diloco` and `streaming-diloco`; hivemind's Optimizer with local updates against FAST `local-sgd`.

Two network namespaces stand for two machines, joined by a veth pair whose both ends are capped by `tc ... tbf`
(this kernel has no `netem`: no added latency). Each system's two workers run one per namespace
(bench/peers_worker.py: Fashion-MNIST LeNet, or the language model of examples/lm; rounds every 16 steps), DDP and
FAST under torchrun's static rendezvous, torchft's replicas with its lighthouse in the first namespace, hivemind's
peers on a DHT the first one starts. The systems take turns in every round, and each run's bytes on the wire are the
veths' own transmit counters. Round r runs every system with seed r (initial weights and data order), so that the
samples/s compare within a round and the final metric's range over the rounds is each system's spread over seeds.

    sudo .venv/bin/python bench/peers.py [--jobs lenet,lm] [--steps 160] [--rounds 5] [--links unlimited,10mbit]
                                         [--lm-links unlimited] [--systems fast,torchft,...] [--strategies ...]

Needs root (namespaces) and the peers extra (pip install -e '.[peers]'); says so in one line and exits otherwise.
Prints per job and link a table: system, strategy, samples/s (median and range over rounds), the final metric
(median), MB on the wire by the kernel, MB FAST counted (its `bytes_sent`, + the set-up it leaves out), TCP
segments retransmitted (the kernel's count), the lines each system adds to a plain loop, the seconds of its end of
run (apart from the samples/s), and FAST's samples/s over each peer's on the same strategy, round by round (median
and range).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORKER = HERE / "peers_worker.py"
BIN = Path(sys.executable).parent
ADDRESSES = ("10.78.0.1", "10.78.0.2")
PAIRS = [("ddp", "sync"), ("fast", "sync"), ("torchft", "local-sgd"), ("hivemind", "local-sgd"),
         ("fast", "local-sgd"), ("torchft", "diloco"), ("fast", "diloco"), ("torchft", "streaming-diloco"),
         ("fast", "streaming-diloco")]  # fmt: skip
PEERS = ("ddp", "torchft", "hivemind")
BATCH, WORKERS = {"lenet": 64, "lm": 16}, 2
# the lines each system adds to a plain training loop (its branch in bench/peers_worker.py, imports and the end of
# the run included, options on one line): DDP init, wrap, destroy; FAST import, init, prepare, finish; torchft
# its store, manager, strategy context, enter, exit, shutdown; hivemind its DHT (the second peer given the first's
# address), Optimizer, shutdowns
USER_LINES = {"ddp": 5, "fast": 4, "torchft": 9, "hivemind": 7}


class Machines:
    """Two namespaces joined by a veth pair: `run(i, command)` runs a command in machine i."""

    def __init__(self) -> None:
        tag = os.getpid() % 100000
        self.names = [f"peersA{tag}", f"peersB{tag}"]
        self.devices = [f"pA{tag}", f"pB{tag}"]
        _ip("link", "add", self.devices[0], "type", "veth", "peer", "name", self.devices[1])
        for name, device, address in zip(self.names, self.devices, ADDRESSES, strict=True):
            _ip("netns", "add", name)
            _ip("link", "set", device, "netns", name)
            _ip("-n", name, "addr", "add", f"{address}/24", "dev", device)
            _ip("-n", name, "link", "set", device, "up")
            _ip("-n", name, "link", "set", "lo", "up")

    def prefix(self, i: int) -> list[str]:
        return ["ip", "netns", "exec", self.names[i]]

    def cap(self, rate: str | None) -> None:
        """Both directions at `rate` (tbf), or uncapped."""
        for i, device in enumerate(self.devices):
            subprocess.run([*self.prefix(i), "tc", "qdisc", "del", "dev", device, "root"], capture_output=True)
            if rate is not None:
                subprocess.run([*self.prefix(i), "tc", "qdisc", "add", "dev", device, "root", "tbf", "rate", rate,
                                "burst", "64kb", "latency", "100ms"], check=True)  # fmt: skip

    def sent(self) -> int:
        """Bytes both machines' interfaces have put on the wire."""
        return sum(int(subprocess.run([*self.prefix(i), "cat", f"/sys/class/net/{device}/statistics/tx_bytes"],
                                      capture_output=True, text=True, check=True).stdout)
                   for i, device in enumerate(self.devices))  # fmt: skip

    def retransmitted(self) -> int:
        """TCP segments both machines have sent again (a queue that dropped them, mostly): each namespace's own."""
        total = 0
        for i in range(WORKERS):
            snmp = subprocess.run([*self.prefix(i), "cat", "/proc/net/snmp"], capture_output=True, text=True,
                                  check=True).stdout.splitlines()  # fmt: skip
            names, values = [line.split() for line in snmp if line.startswith("Tcp:")][:2]
            total += int(values[names.index("RetransSegs")])
        return total

    def close(self) -> None:
        for name in self.names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


def run_once(machines: Machines, system: str, strategy: str, job: str, steps: int, folder: Path, seed: int) -> dict:
    """Both workers of one system on one strategy; their results, the kernel's bytes and the wall time."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    env = {**os.environ, "FAST_PROGRESS": "0", "OMP_NUM_THREADS": "1", "PEERS_SEED": str(seed)}
    quiet = {"env": env, "stdout": subprocess.DEVNULL, "stderr": subprocess.PIPE, "text": True}
    before, retransmitted = machines.sent(), machines.retransmitted()
    processes = []
    lighthouse = None
    arguments = [str(WORKER), system, strategy, job, str(steps), str(folder)]
    if system == "torchft":
        lighthouse = subprocess.Popen([*machines.prefix(0), str(BIN / "torchft_lighthouse"), "--min_replicas", "2",
                                       "--bind", f"{ADDRESSES[0]}:29510"], stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL)  # fmt: skip
        time.sleep(1.0)
    if system in ("torchft", "hivemind"):
        for i in range(WORKERS):
            where = [f"http://{ADDRESSES[0]}:29510"] if system == "torchft" else []
            command = [sys.executable, *arguments, *where, ADDRESSES[i]]
            variables = [f"REPLICA={i}", f"GLOO_SOCKET_IFNAME={machines.devices[i]}"]
            processes.append(subprocess.Popen([*machines.prefix(i), "env", *variables, *command], **quiet))
    else:
        port = 29400 + (int(time.time()) % 500)
        for i in range(WORKERS):
            torchrun = [str(BIN / "torchrun"), "--nnodes", str(WORKERS), "--nproc-per-node", "1", "--node-rank",
                        str(i), "--master-addr", ADDRESSES[0], "--master-port", str(port), "--local-addr",
                        ADDRESSES[i]]  # fmt: skip
            gloo = [] if system == "fast" else [f"GLOO_SOCKET_IFNAME={machines.devices[i]}"]  # FAST picks its own
            processes.append(subprocess.Popen([*machines.prefix(i), "env", *gloo, *torchrun, *arguments], **quiet))
    errors = [p.communicate(timeout=1800)[1] for p in processes]
    if lighthouse is not None:
        lighthouse.kill()
        lighthouse.wait()
    if any(p.returncode for p in processes):
        raise RuntimeError(f"{system} {strategy} failed: {errors[0][-2000:]}{errors[1][-2000:]}")
    results = [json.loads((folder / f"result{r}.json").read_text()) for r in range(WORKERS)]
    seconds = max(r["seconds"] for r in results)
    return {"system": system, "strategy": strategy, "job": job, "metric": results[0]["metric"],
            "value": results[0]["value"], "samples_per_s": WORKERS * BATCH[job] * results[0]["steps"] / seconds,
            "end_s": max(r["end_s"] for r in results), "wire_bytes": machines.sent() - before,
            "retransmitted": machines.retransmitted() - retransmitted,
            "fast_bytes": results[0].get("fast_bytes_sent"), "fast_unmetered": results[0].get("fast_bytes_unmetered"),
            "averaging_rounds": results[0].get("averaging_rounds")}  # fmt: skip


def _mb(value: float | None) -> str:
    return "—" if value is None else f"{value / 1e6:,.1f}"


def table(rows: list[dict], job: str, link: str, pairs: list[tuple[str, str]]) -> str:
    metric = rows[0]["metric"]
    lines = [f"\njob: {job}, link: {link} (both directions; no added latency: this kernel has no netem)",
             f"{'system':8} {'strategy':17} {'samples/s (median, range)':>28} {metric + ' (median, range)':>28} "
             f"{'MB wire':>8} {'MB FAST':>8} {'retx':>5} {'lines':>5} {'end s':>6}  "
             "FAST/peer (median, range)"]  # fmt: skip
    medians = {}
    for system, strategy in pairs:
        mine = [r for r in rows if r["system"] == system and r["strategy"] == strategy]
        if not mine:
            continue
        speeds = [r["samples_per_s"] for r in mine]
        medians[system, strategy] = statistics.median(speeds)
        ratios = ""
        if system == "fast":
            peers = [peer for peer in PEERS if (peer, strategy) in medians]
            ratios = ", ".join(_paired(rows, strategy, peer) for peer in peers)
        fast_mb = "—"
        if system == "fast":  # bytes_sent + what it leaves out (set-up: the start's broadcast of worker 0's weights)
            unmetered = statistics.median(r["fast_unmetered"] for r in mine)
            fast_mb = f"{_mb(statistics.median(r['fast_bytes'] for r in mine))}+{_mb(unmetered)}"
        values = [r["value"] for r in mine]
        wire = statistics.median(r["wire_bytes"] for r in mine)
        end = statistics.median(r["end_s"] for r in mine)
        lines.append(f"{system:8} {strategy:17} {statistics.median(speeds):>10,.0f} "
                     f"({min(speeds):>7,.0f}–{max(speeds):>7,.0f}) {statistics.median(values):>10.4f} "
                     f"({min(values):>7.4f}–{max(values):>7.4f}) "
                     f"{_mb(wire):>8} {fast_mb:>8} {statistics.median(r['retransmitted'] for r in mine):>5.0f} "
                     f"{USER_LINES[system]:>5} {end:>6.2f}  {ratios}")  # fmt: skip
    return "\n".join(lines)


def _paired(rows: list[dict], strategy: str, peer: str) -> str:
    """FAST's samples/s over the peer's in each round (same seed, back to back): their median and range."""
    speed = {(r["system"], r["round"]): r["samples_per_s"] for r in rows if r["strategy"] == strategy}
    ratios = [speed["fast", k] / speed[peer, k] for system, k in speed if system == "fast" and (peer, k) in speed]
    return f"{statistics.median(ratios):.3f} ({min(ratios):.3f}–{max(ratios):.3f}) {peer}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", default="lenet,lm", help="comma-separated: lenet, lm")
    parser.add_argument("--steps", type=int, default=160, help="steps a worker, a multiple of 16")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--links", default="unlimited,10mbit", help="LeNet's links, comma-separated: unlimited or "
                        "a tbf rate")  # fmt: skip
    parser.add_argument("--lm-links", default="unlimited", help="the language model's (its sync at 10 Mbit/s "
                        "takes minutes a run)")  # fmt: skip
    parser.add_argument("--systems", default=",".join(dict.fromkeys(s for s, _ in PAIRS)), help="comma-separated")
    parser.add_argument("--strategies", default=",".join(dict.fromkeys(s for _, s in PAIRS)), help="comma-separated")
    parser.add_argument("--json", help="also write every run's figures here")
    args = parser.parse_args()
    if os.geteuid() != 0 or shutil.which("ip") is None:
        print("bench/peers.py: skipped: network namespaces need root and iproute2")
        return 0
    missing = [name for name in ("torchft", "hivemind") if importlib.util.find_spec(name) is None]
    if missing:
        print(f"bench/peers.py: skipped: the peers extra is not installed ({', '.join(missing)}): "
              "pip install -e '.[peers]'")  # fmt: skip
        return 0
    systems, strategies = args.systems.split(","), args.strategies.split(",")
    pairs = [(system, strategy) for system, strategy in PAIRS if system in systems and strategy in strategies]
    machines = Machines()
    runs = []
    try:
        with tempfile.TemporaryDirectory() as scratch:
            for job in args.jobs.split(","):
                for link in (args.links if job == "lenet" else args.lm_links).split(","):
                    machines.cap(None if link == "unlimited" else link)
                    rows = []
                    for round_ in range(args.rounds):
                        order = pairs if round_ % 2 == 0 else pairs[::-1]  # alternate who goes first
                        for system, strategy in order:
                            where = Path(scratch) / "run"
                            try:  # each round its own seed: the metric's range is the seeds' spread
                                row = run_once(machines, system, strategy, job, args.steps, where, round_)
                            except RuntimeError as e:  # once more, saying so (a peer's exit can crash)
                                print(f"  {job} {link} round {round_ + 1}: {str(e).splitlines()[0][:200]}; again")
                                row = run_once(machines, system, strategy, job, args.steps, where, round_)
                            rows.append({**row, "link": link, "round": round_})
                            print(f"  {job} {link} round {round_ + 1}: {system} {strategy} "
                                  f"{row['samples_per_s']:,.0f} samples/s, {row['metric']} {row['value']:.4f}, "
                                  f"{_mb(row['wire_bytes'])} MB on the wire, end {row['end_s']:.2f} s"
                                  + (f", {row['averaging_rounds']} averagings" if system == "hivemind" else ""),
                                  flush=True)  # fmt: skip
                    print(table(rows, job, link, pairs), flush=True)
                    runs += rows
    finally:
        machines.close()
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
