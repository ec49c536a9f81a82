"""FAST held against the systems its users would pick instead, on the same job and the same links, bytes counted by
the kernel: DDP against FAST `sync`, torchft's LocalSGD and DiLoCo against FAST `local-sgd` and `diloco`.

Two network namespaces stand for two machines, joined by a veth pair whose both ends are capped by `tc ... tbf`
(this kernel has no `netem`: no added latency). Each system's two workers run one per namespace
(bench/peers_worker.py: Fashion-MNIST LeNet, batch 64 a worker, rounds every 16 steps), DDP and FAST under
torchrun's static rendezvous, torchft's replicas with its lighthouse in the first namespace. The systems take turns
in every round, and each run's bytes on the wire are the veths' own transmit counters.

    sudo .venv/bin/python bench/peers.py [--steps 160] [--rounds 5] [--links unlimited,10mbit]

Needs root (namespaces) and the peers extra (pip install -e '.[peers]'); says so in one line and exits otherwise.
Prints per link a table: system, strategy, samples/s (median and range over rounds), final test accuracy (median),
MB on the wire by the kernel, MB FAST counted, and FAST's samples/s against the peer's on the same strategy.
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
PAIRS = [("ddp", "sync"), ("fast", "sync"), ("torchft", "local-sgd"), ("fast", "local-sgd"),
         ("torchft", "diloco"), ("fast", "diloco")]  # fmt: skip
BATCH, WORKERS = 64, 2


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

    def close(self) -> None:
        for name in self.names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


def run_once(machines: Machines, system: str, strategy: str, steps: int, folder: Path) -> dict:
    """Both workers of one system on one strategy; their results, the kernel's bytes and the wall time."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    env = {**os.environ, "FAST_PROGRESS": "0", "OMP_NUM_THREADS": "1"}
    quiet = {"env": env, "stdout": subprocess.DEVNULL, "stderr": subprocess.PIPE, "text": True}
    before = machines.sent()
    processes = []
    lighthouse = None
    if system == "torchft":
        lighthouse = subprocess.Popen([*machines.prefix(0), str(BIN / "torchft_lighthouse"), "--min_replicas", "2",
                                       "--bind", f"{ADDRESSES[0]}:29510"], stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL)  # fmt: skip
        time.sleep(1.0)
        for i in range(WORKERS):
            command = [sys.executable, str(WORKER), system, strategy, str(steps), str(folder),
                       f"http://{ADDRESSES[0]}:29510", ADDRESSES[i]]  # fmt: skip
            variables = [f"REPLICA={i}", f"GLOO_SOCKET_IFNAME={machines.devices[i]}"]
            processes.append(subprocess.Popen([*machines.prefix(i), "env", *variables, *command], **quiet))
    else:
        port = 29400 + (int(time.time()) % 500)
        for i in range(WORKERS):
            torchrun = [str(BIN / "torchrun"), "--nnodes", str(WORKERS), "--nproc-per-node", "1", "--node-rank",
                        str(i), "--master-addr", ADDRESSES[0], "--master-port", str(port), "--local-addr",
                        ADDRESSES[i]]  # fmt: skip
            gloo = [] if system == "fast" else [f"GLOO_SOCKET_IFNAME={machines.devices[i]}"]  # FAST picks its own
            command = [*torchrun, str(WORKER), system, strategy, str(steps), str(folder)]
            processes.append(subprocess.Popen([*machines.prefix(i), "env", *gloo, *command], **quiet))
    errors = [p.communicate(timeout=1800)[1] for p in processes]
    if lighthouse is not None:
        lighthouse.kill()
        lighthouse.wait()
    if any(p.returncode for p in processes):
        raise RuntimeError(f"{system} {strategy} failed: {errors[0][-2000:]}{errors[1][-2000:]}")
    results = [json.loads((folder / f"result{r}.json").read_text()) for r in range(WORKERS)]
    seconds = max(r["seconds"] for r in results)
    return {"system": system, "strategy": strategy, "samples_per_s": WORKERS * BATCH * results[0]["steps"] / seconds,
            "accuracy": results[0]["accuracy"], "wire_bytes": machines.sent() - before,
            "fast_bytes": results[0].get("fast_bytes_sent")}  # fmt: skip


def _mb(value: float | None) -> str:
    return "—" if value is None else f"{value / 1e6:,.1f}"


def table(rows: list[dict], link: str) -> str:
    lines = [f"\nlink: {link} (both directions; no added latency: this kernel has no netem)",
             f"{'system':8} {'strategy':10} {'samples/s (median, range)':>30} {'accuracy':>9} {'MB wire':>9} "
             f"{'MB FAST':>9} {'FAST/peer':>10}"]  # fmt: skip
    medians = {}
    for system, strategy in PAIRS:
        mine = [r for r in rows if r["system"] == system and r["strategy"] == strategy]
        if not mine:
            continue
        speeds = [r["samples_per_s"] for r in mine]
        medians[system, strategy] = statistics.median(speeds)
        peer = next((medians[s, strategy] for s in ("ddp", "torchft") if (s, strategy) in medians), None)
        ratio = f"{medians[system, strategy] / peer:.3f}" if system == "fast" and peer else ""
        fast_mb = statistics.median(r["fast_bytes"] for r in mine) if system == "fast" else None
        accuracy = statistics.median(r["accuracy"] for r in mine)
        wire = statistics.median(r["wire_bytes"] for r in mine)
        lines.append(f"{system:8} {strategy:10} {statistics.median(speeds):>12,.0f} "
                     f"({min(speeds):>7,.0f}–{max(speeds):>7,.0f}) {accuracy:>9.4f} "
                     f"{_mb(wire):>9} {_mb(fast_mb):>9} {ratio:>10}")  # fmt: skip
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=160, help="steps a worker, a multiple of 16")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--links", default="unlimited,10mbit", help="comma-separated: unlimited or a tbf rate")
    parser.add_argument("--json", help="also write every run's figures here")
    args = parser.parse_args()
    if os.geteuid() != 0 or shutil.which("ip") is None:
        print("bench/peers.py: skipped: network namespaces need root and iproute2")
        return 0
    if importlib.util.find_spec("torchft") is None:
        print("bench/peers.py: skipped: the peers extra is not installed: pip install -e '.[peers]'")
        return 0
    machines = Machines()
    runs = []
    try:
        with tempfile.TemporaryDirectory() as scratch:
            for link in args.links.split(","):
                machines.cap(None if link == "unlimited" else link)
                rows = []
                for round_ in range(args.rounds):
                    order = PAIRS if round_ % 2 == 0 else PAIRS[::-1]  # alternate who goes first
                    for system, strategy in order:
                        row = run_once(machines, system, strategy, args.steps, Path(scratch) / "run")
                        rows.append({**row, "link": link, "round": round_})
                        print(f"  {link} round {round_ + 1}: {system} {strategy} {row['samples_per_s']:,.0f} "
                              f"samples/s, accuracy {row['accuracy']:.4f}, {_mb(row['wire_bytes'])} MB on the wire",
                              flush=True)  # fmt: skip
                print(table(rows, link), flush=True)
                runs += rows
    finally:
        machines.close()
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
