"""The spread of the nondeterministic tests' accuracies over seeds, from which their bars are set.

Runs every test marked `nondeterministic` (asynchronous, threaded or timing-dependent runs) once per seed, with
`FAST_TEST_SEED` seeding all its runs alike (tests/conftest.py), and prints for each of its runs the minimum,
mean, standard deviation and maximum of the final test accuracy, and a bar with a margin: the minimum less
max(0.03, 2 sd), rounded down to the hundredth. A test's bar must not be above that.

    .venv/bin/python bench/accuracy_spread.py --seeds 10 [-k EXPR]      # about 20 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARGIN = 0.03  # the least a bar sits below the lowest accuracy seen


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=10, help="seeds 0..N-1 (at least 10 to set a bar)")
    parser.add_argument("-k", default=None, help="only the tests pytest's -k selects")
    args = parser.parse_args()
    log = Path(tempfile.mkdtemp(prefix="fast-spread-")) / "spread.jsonl"
    for seed in range(args.seeds):
        command = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "--tb=line",
            "-p",
            "no:cacheprovider",
            "-m",
            "nondeterministic",
        ]
        if args.k:
            command += ["-k", args.k]
        env = {**os.environ, "FAST_TEST_SEED": str(seed), "FAST_SPREAD_LOG": str(log)}
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
        failed = [line for line in done.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
        print(f"seed {seed}: {done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.returncode}")
        for line in failed:
            print(f"    {line[:200]}")
    runs: dict[tuple[str, int], list[float]] = defaultdict(list)
    for record in map(json.loads, log.read_text().splitlines()):
        if record["accuracy"] is not None:
            runs[(record["test"], record["call"])].append(record["accuracy"])
    print("\n| test (run) | n | min | mean | sd | max | bar at most |\n|---|---|---|---|---|---|---|")
    for (test, call), values in sorted(runs.items()):
        sd = statistics.stdev(values) if len(values) > 1 else 0.0
        bar = math.floor((min(values) - max(MARGIN, 2 * sd)) * 100) / 100
        name = test.removeprefix("tests/")
        print(
            f"| {name} ({call}) | {len(values)} | {min(values):.3f} | {statistics.mean(values):.3f} | {sd:.3f} "
            f"| {max(values):.3f} | {bar:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
