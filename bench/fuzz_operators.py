"""A fuzz of the operator allow-list through FAST's own path: no graph node it accepts may crash the process.

    .venv/bin/python bench/fuzz_operators.py [--minutes 10] [--cases 6] [--seed 0] [--only lstm --only div]
    .venv/bin/python bench/fuzz_operators.py --replay 'CASE'

Every overload that fast.operators accepts (each listed operator and its in-place form) is called with arguments
drawn at random from its schema: small tensors of several dtypes, some of them strided or expanded views, some
holding infinities, NaNs and the extreme integers; integers such as 0, -1 and LARGEST_SIZE; floats such as inf and
nan; lists; optional arguments left out. A case is a one-node training program whose tensors are its buffers
(which a training program may write into in place), read by fast.program.read_graph and run by Graph.run in a
forked process, one case at a time, under a limit on memory and a timeout. An exception, a refusal
included, is a fine outcome; a process killed by a signal, or one that does not finish, is not. Overloads take
turns, so a short run still calls each of them once. Run it again after a torch upgrade. The summary lists each
crash and hang with its CASE, which --replay runs in the foreground; the exit status is then 1.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import random
import resource
import select
import signal
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch

from fast.errors import PackageError
from fast.operators import DTYPES, LARGEST_SIZE, LAYOUTS, MEMORY_FORMATS, OPERATORS, allowed
from fast.program import SCHEMA_MAJOR, read_graph

CASE_SECONDS = 10
MEMORY_HEADROOM = 4 << 30  # bytes of address space a case may take beyond what the process holds when it forks
TENSOR_DTYPES = ["float32", "float32", "float64", "int64", "int32", "uint8", "bool"]
VIEWS = ["contiguous", "contiguous", "contiguous", "transposed", "strided", "expanded"]
INTEGERS = [0, -1, 1, 2, LARGEST_SIZE, -LARGEST_SIZE, 2**63 - 1]  # the last is refused unless it is not a size
FLOATS = [0.0, -0.0, 1.0, -1.0, 0.5, float("inf"), float("-inf"), float("nan"), 1e30, 2.0**31]
STRING_CHOICES = {  # STRINGS holds checks, not values: the values they accept, by (operator, argument)
    ("gelu", "approximate"): ["none", "tanh"],
    ("div", "rounding_mode"): ["trunc", "floor"],
    ("pad", "mode"): ["constant", "reflect", "replicate", "circular"],
}
ENUMERATIONS = {  # integer arguments that a graph writes as a dtype, a layout or a memory format
    "dtype": ("as_scalar_type", DTYPES), "out_dtype": ("as_scalar_type", DTYPES), "layout": ("as_layout", LAYOUTS),
    "memory_format": ("as_memory_format", MEMORY_FORMATS),
}  # fmt: skip
OUTCOMES = ["ok", "refused", "raised", "crashed", "hung"]


def accepted_overloads(only: list[str]) -> list[str]:
    """Every `packet.overload` (`add_.Tensor`) that the allow-list accepts, of the operators in `only` if given."""
    accepted = []
    for name in sorted(OPERATORS):
        for packet in (name, f"{name}_"):
            if (only and name not in only and packet not in only) or not hasattr(torch.ops.aten, packet):
                continue
            for overload in getattr(torch.ops.aten, packet).overloads():
                try:
                    allowed(f"torch.ops.aten.{packet}.{overload}")
                except PackageError:
                    continue
                accepted.append(f"{packet}.{overload}")
    return accepted


class CaseMaker:
    """Random arguments for one overload: the graph node's inputs and outputs as JSON, and the tensors its inputs
    are made from (name -> [shape, dtype, view, fraction of extreme values, seed])."""

    def __init__(self, rng: random.Random, overload: str) -> None:
        self.rng, self.overload = rng, overload
        self.operator = overload.split(".")[0].removesuffix("_")
        self.tensors: dict[str, list[Any]] = {}
        self.shape = [self.size() for _ in range(rng.choice([0, 1, 2, 2, 3, 3, 4]))]  # most tensors share it
        self.dtype = rng.choice(TENSOR_DTYPES)  # and this dtype

    def case(self) -> dict[str, Any]:
        packet, overload = self.overload.split(".")
        schema = getattr(getattr(torch.ops.aten, packet), overload)._schema
        given = [a for a in schema.arguments if not (a.has_default_value() and self.rng.random() < 0.25)]
        inputs = [{"name": a.name, "arg": self.argument(a.name, str(a.type)), "kind": 1} for a in given]
        outputs = [self.result(i, str(result.type)) for i, result in enumerate(schema.returns)]
        return {"target": f"torch.ops.aten.{self.overload}", "inputs": inputs, "outputs": outputs,
                "tensors": self.tensors}  # fmt: skip

    def argument(self, name: str, schema_type: str) -> dict[str, Any]:
        rng = self.rng
        if schema_type.startswith("Optional["):
            if rng.random() < 0.3:
                return {"as_none": True}
            schema_type = schema_type.removeprefix("Optional[").removesuffix("]")
        if schema_type == "int" and name in ENUMERATIONS:
            kind, table = ENUMERATIONS[name]
            return {kind: rng.choice(list(table))}
        makers: dict[str, Callable[[], dict[str, Any]]] = {
            "Tensor": lambda: self.tensor(name) if rng.random() < 0.9 else self.number(),
            "List[Tensor]": lambda: {"as_tensors": [self.tensor(name)["as_tensor"] for _ in range(rng.randint(0, 3))]},
            "List[Optional[Tensor]]": lambda: {"as_optional_tensors": [
                self.tensor("index") if rng.random() < 0.8 else {"as_none": True} for _ in range(rng.randint(0, 3))]},
            "int": lambda: {"as_int": self.integer()},
            "List[int]": lambda: {"as_ints": self.integers()},
            "float": lambda: {"as_float": self.real()},
            "List[float]": lambda: {"as_floats": [self.real() for _ in range(rng.randint(0, 4))]},
            "bool": lambda: {"as_bool": rng.random() < 0.5 and name != "pin_memory"},  # pinning needs a CUDA device
            "number": self.number,
            "Device": lambda: {"as_device": {"type": "cpu", "index": None}},
            "str": lambda: {"as_string": self.string(name)},
        }  # fmt: skip
        return makers.get(schema_type, lambda: {"as_none": True})()  # a Generator: only the default may be named

    def result(self, i: int, schema_type: str) -> dict[str, Any]:
        if schema_type == "Tensor":
            return {"as_tensor": {"name": f"r{i}"}}
        if schema_type == "int":
            return {"as_sym_int": {"as_name": f"r{i}"}}
        return {"as_none": True}  # a list of tensors, of a length the fuzz does not know

    def tensor(self, hint: str) -> dict[str, Any]:
        rng = self.rng
        if self.tensors and rng.random() < 0.15:  # the same tensor as two arguments (aliasing)
            return {"as_tensor": {"name": rng.choice(list(self.tensors))}}
        roll = rng.random()
        if roll < 0.5:
            shape = list(self.shape)
        elif roll < 0.7:  # one that broadcasts with the shared shape
            shape = [size if rng.random() < 0.7 else 1 for size in self.shape[rng.randint(0, len(self.shape)) :]]
        else:
            shape = [self.size() for _ in range(rng.randint(0, 4))]
        indices = any(word in hint for word in ("index", "indices", "target", "repeats"))
        dtype = rng.choice(["int64"] * indices + [self.dtype, self.dtype, rng.choice(TENSOR_DTYPES)])
        name = f"t{len(self.tensors)}"
        self.tensors[name] = [shape, dtype, rng.choice(VIEWS), rng.choice([0.0, 0.2, 1.0]), rng.randrange(2**31)]
        return {"as_tensor": {"name": name}}

    def size(self) -> int:
        return self.rng.choice([0, 1, 1, 2, 2, 3, 3, 4, 5, 6])

    def integer(self) -> int:
        return self.rng.randint(-2, 6) if self.rng.random() < 0.8 else self.rng.choice(INTEGERS)

    def integers(self) -> list[int]:
        roll = self.rng.random()
        if roll < 0.15:
            return list(self.shape)
        if roll < 0.25:  # an order of the dimensions (permute)
            return self.rng.sample(range(len(self.shape)), len(self.shape))
        return [self.integer() for _ in range(self.rng.randint(0, 4))]

    def real(self) -> float:
        return round(self.rng.uniform(-3, 3), 3) if self.rng.random() < 0.6 else self.rng.choice(FLOATS)

    def number(self) -> dict[str, Any]:
        return self.rng.choice([{"as_int": self.integer()}, {"as_float": self.real()}, {"as_bool": True}])

    def string(self, name: str) -> str:
        rng = self.rng
        if self.operator != "einsum":
            return rng.choice(STRING_CHOICES.get((self.operator, name), [""]))  # "" is refused
        if rng.random() < 0.2:
            return "".join(rng.choice("ijk.,-> ") for _ in range(rng.randint(1, 10)))
        operands = ",".join(self.subscripts() for _ in range(rng.randint(1, 3)))
        return operands + ("->" + self.subscripts() if rng.random() < 0.7 else "")

    def subscripts(self) -> str:
        letters = "".join(self.rng.choice("ijk") for _ in range(self.rng.randint(0, 3)))
        return "..." + letters if self.rng.random() < 0.1 else letters


def graph_json(case: dict[str, Any]) -> bytes:
    """The case as the one-node training program torch.export would write: the case's tensors as its buffers b0,
    b1, ..., and an input (the batch, whose device the program runs on) that the node does not use."""
    buffers = list(case["tensors"])
    results = [output["as_tensor"]["name"] for output in case["outputs"] if "as_tensor" in output]
    output = {"as_tensor": {"name": (results or ["batch"])[0]}}
    node = {"target": case["target"], "name": "node", "inputs": case["inputs"], "outputs": case["outputs"]}
    specs = [{"buffer": {"arg": {"name": name}, "buffer_name": f"b{i}"}} for i, name in enumerate(buffers)]
    signature = {"input_specs": [*specs, {"user_input": {"arg": {"as_tensor": {"name": "batch"}}}}],
                 "output_specs": [{"user_output": {"arg": output}}]}  # fmt: skip
    graph = {"nodes": [node], "outputs": [output]}
    return json.dumps({"schema_version": {"major": SCHEMA_MAJOR, "minor": 0},
                       "graph_module": {"graph": graph, "signature": signature}}).encode()  # fmt: skip


def make_tensor(shape: list[int], dtype_name: str, view: str, extreme_share: float, seed: int) -> torch.Tensor:
    """A tensor of `shape` laid out as `view` says, its values drawn from `seed`, with this fraction of them
    extreme: infinities, NaNs, the smallest and largest integers, -1 and 0."""
    generator, dtype = torch.Generator().manual_seed(seed), getattr(torch, dtype_name)
    stored = {"transposed": shape[::-1], "expanded": [1] * len(shape)}.get(view, list(shape))
    if view == "strided" and shape:
        stored = [*shape[:-1], 2 * shape[-1]]
    count = torch.Size(stored).numel()
    values = torch.randn(count, generator=generator, dtype=torch.float64) * 3
    special = torch.rand(count, generator=generator) < extreme_share
    pick = torch.randint(0, 4, (count,), generator=generator)
    if dtype == torch.bool:
        data = values > 0
    elif dtype.is_floating_point:
        extremes = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0], dtype=torch.float64)
        data = torch.where(special, extremes[pick], values).to(dtype)
    else:
        extremes = torch.tensor([torch.iinfo(dtype).min, torch.iinfo(dtype).max, -1, 0], dtype=torch.int64)
        data = torch.where(special, extremes[pick], values.round().to(torch.int64)).to(dtype)
    data = data.reshape(stored)
    if view == "transposed":
        return data.permute(list(range(len(shape)))[::-1])
    if view == "strided" and shape:
        return data[..., ::2]
    return data.expand(shape) if view == "expanded" else data


def run_case(case: dict[str, Any]) -> tuple[str, str]:
    """Reads and runs the case's graph in this process: "ok", "refused" (PackageError) or "raised", and a message."""
    buffers = {f"b{i}": make_tensor(*spec) for i, spec in enumerate(case["tensors"].values())}
    try:
        results = read_graph(graph_json(case), "fuzz", training=True).run(buffers, torch.zeros(1))
        for result in results:
            if torch.is_tensor(result):
                result.sum()  # reads every element: a result whose strides point outside its memory fails here
    except PackageError as e:
        return "refused", str(e)
    except Exception as e:
        return "raised", f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    return "ok", ""


def child(case: dict[str, Any], report: int, log: int) -> None:
    """The forked process of one case: it reports its outcome on `report` and never returns."""
    try:
        os.dup2(log, 1)
        os.dup2(log, 2)
        held = int(Path("/proc/self/statm").read_text().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        resource.setrlimit(resource.RLIMIT_AS, (held + MEMORY_HEADROOM, held + MEMORY_HEADROOM))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        torch.set_num_threads(1)
        warnings.simplefilter("ignore")
        outcome, _ = run_case(case)
        gc.collect()  # then blocks of many sizes, so that a heap the case corrupted fails in the case's process
        blocks = [torch.ones(size) for size in range(1, 4000, 37)] + [bytearray(size) for size in range(1, 9000, 91)]
        del blocks
        os.write(report, outcome.encode())
    except BaseException:
        traceback.print_exc()  # a fault of this script's: its last line is reported with the exit status
    finally:
        os._exit(0)


def fork_case(case: dict[str, Any], log: IO[bytes]) -> tuple[str, str]:
    """The outcome of the case run in a child process, and for a crash the signal and the child's last words."""
    log.seek(0)
    log.truncate()
    report_read, report_write = os.pipe()
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:
        os.close(report_read)
        child(case, report_write, log.fileno())
    os.close(report_write)
    pidfd = os.pidfd_open(pid)
    finished = select.select([pidfd], [], [], CASE_SECONDS)[0]
    if not finished:
        os.kill(pid, signal.SIGKILL)
    status = os.waitpid(pid, 0)[1]
    os.close(pidfd)
    outcome = os.read(report_read, 64).decode()
    os.close(report_read)
    if not finished:
        return "hung", f"after {CASE_SECONDS} s"
    log.seek(0)
    words = [line for line in log.read().decode(errors="replace").splitlines() if line.strip()][-1:]
    if os.WIFSIGNALED(status):
        return "crashed", " ".join([signal.Signals(os.WTERMSIG(status)).name, *words])
    if not outcome:
        return "crashed", " ".join([f"exit status {os.WEXITSTATUS(status)}", *words])
    return outcome, ""


def fuzz(overloads: list[str], cases: int, seconds: float, seed: int) -> int:
    rng = random.Random(seed)
    counts = dict.fromkeys(OUTCOMES, 0)
    covered: set[str] = set()
    failures: list[str] = []
    started = reported = time.monotonic()
    schedule = (overload for _ in range(cases) for overload in rng.sample(overloads, len(overloads)))
    with tempfile.TemporaryFile() as log:
        for overload in itertools.takewhile(lambda _: time.monotonic() - started < seconds, schedule):
            case = CaseMaker(rng, overload).case()
            outcome, detail = fork_case(case, log)
            counts[outcome] += 1
            covered.add(overload)
            if outcome in ("crashed", "hung"):
                failures.append(f"{outcome} ({detail}) {overload}: .venv/bin/python bench/fuzz_operators.py "
                                f"--replay '{json.dumps(case)}'")  # fmt: skip
                print(failures[-1], flush=True)
            if time.monotonic() - reported > 30:
                reported = time.monotonic()
                tally = ", ".join(f"{counts[name]} {name}" for name in OUTCOMES)
                print(f"{reported - started:5.0f} s: {len(covered)} overloads, {tally}", flush=True)
    tally = ", ".join(f"{counts[name]} {name}" for name in OUTCOMES)
    print(f"{len(covered)} of {len(overloads)} overloads, {sum(counts.values())} cases in "
          f"{time.monotonic() - started:.0f} s: {tally}")  # fmt: skip
    print(f"{len(failures)} crashes and hangs" + (":" if failures else "."), *failures, sep="\n")
    return 1 if failures else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=5.0, help="stop after this long")
    parser.add_argument("--cases", type=int, default=6, help="cases per overload")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", action="append", default=[], help="an operator to fuzz alone (repeatable)")
    parser.add_argument("--replay", help="run one CASE the summary printed, in this process")
    args = parser.parse_args()
    if args.replay:
        print(*run_case(json.loads(args.replay)))
        return 0
    overloads = accepted_overloads(args.only)
    if not overloads:
        parser.error(f"no overload the allow-list accepts among {args.only}")
    print(f"{len(overloads)} overloads, {args.cases} cases each, at most {args.minutes:g} minutes", flush=True)
    return fuzz(overloads, args.cases, 60 * args.minutes, args.seed)


if __name__ == "__main__":
    sys.exit(main())
