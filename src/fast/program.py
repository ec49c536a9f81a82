"""A packed program: a graph that torch.export wrote as JSON, read as untrusted data and run node by node.

FAST never hands a package's graph to torch's own deserializer, which evaluates some of the graph's strings as
Python (the guards on input shapes, and symbolic sizes through sympy) and would let a package run any code. It
reads only the graph's signature (parameters, buffers, inputs, outputs) and its nodes, checks every node against
the operator allow-list (fast.operators) before anything runs, and then runs the nodes in order on the package's
weights and the owner's batch. Nothing else torch.export writes beside them is read.

Beyond each node's operator and arguments, the reader applies the allow-list's rules on values (fast.operators):
a size comes only from a tensor's sizes and arithmetic on them; no node allocates more than the budget from the
sizes it is given (checked here where they are constants, Graph.check_budget, and again at run time where they
are not); and no node writes in place into the owner's batch or a parameter, or into a buffer outside the
training program (which updates running statistics), through a view of one included.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from fast.errors import PackageError
from fast.operators import DEVICES, DTYPES, LARGEST_SIZE, LATER, LAYOUTS, MEMORY_FORMATS, NODE_BYTES, Allowed, allowed

SCHEMA_MAJOR = 8  # the version of torch.export's graph format this reader knows
WEIGHT_NAME = {"parameter": re.compile(r"w\d{1,6}"), "buffer": re.compile(r"b\d{1,6}")}
_DEVICE = object()  # the key of the device the program runs on among a run's values
_BUDGET = object()  # the key of the bytes one node may allocate from the sizes it is given
_RUN_TIME = frozenset({"as_tensor", "as_tensors", "as_optional_tensors", "as_device"})  # values known only then
GiB = 1 << 30
Get = Callable[[dict[Any, Any]], Any]


class Malformed(Exception):
    """A graph's JSON is not what torch.export writes (reported as a PackageError by read_graph)."""


@dataclass(frozen=True)
class Node:
    """One operator call: its arguments (getters of constants or of earlier values), the names its results take,
    and the values nothing reads after it (dropped then, as a compiled graph would)."""

    operator: Allowed
    arguments: tuple[tuple[str, Get], ...]
    outputs: tuple[Any, ...]  # per result: a name, a tuple of names (a list of tensors), or None (unused)
    done_with: tuple[str, ...]
    label: str  # "node 12 (aten::full.default)"

    def run(self, values: dict[Any, Any]) -> None:
        if self.operator.positional:
            result = self.operator.function(*(get(values) for _, get in self.arguments))
        else:
            arguments = {name: get(values) for name, get in self.arguments}
            if self.operator.check is not None:
                self.operator.check(arguments)
            if self.operator.allocation is not None:
                within_budget(self.label, self.operator.allocates(arguments, self.label) or 0, values[_BUDGET])
            result = self.operator.function(**arguments)
        if self.outputs:
            results = result if len(self.outputs) > 1 else (result,)
            if not isinstance(results, tuple | list) or len(results) != len(self.outputs):
                raise PackageError(f"its graph expects {len(self.outputs)} results of {self.operator.name}")
            for names, value in zip(self.outputs, results, strict=True):
                if isinstance(names, tuple):
                    if not isinstance(value, tuple | list) or len(value) != len(names):
                        raise PackageError(f"its graph expects {len(names)} tensors from {self.operator.name}")
                    values.update(zip(names, value, strict=True))
                elif names is not None:
                    values[names] = value
        for name in self.done_with:
            del values[name]


@dataclass(frozen=True)
class Graph:
    """A checked program: its weights ((value name, w0 or b0), ...), inputs, nodes and outputs."""

    weights: tuple[tuple[str, str], ...]
    inputs: tuple[str, ...]
    nodes: tuple[Node, ...]
    outputs: tuple[str, ...]
    allocations: tuple[tuple[str, int], ...]  # (node, bytes) of every node whose allocation is known at load
    what: str  # "train.json", which names it in errors

    @property
    def weight_names(self) -> list[str]:
        return [name for _, name in self.weights]

    @property
    def operators(self) -> set[str]:
        return {node.operator.name for node in self.nodes}

    def check_budget(self, budget: int = NODE_BYTES) -> None:
        """PackageError, naming the node, when a node allocates more than `budget` bytes from constant sizes."""
        for label, size in self.allocations:
            within_budget(f"{self.what}: {label}", size, budget)

    def run(self, tensors: Mapping[str, torch.Tensor], *inputs: torch.Tensor,
            budget: int = NODE_BYTES) -> tuple[torch.Tensor, ...]:  # fmt: skip
        """The program's outputs on `inputs`, with the parameters and buffers `tensors` (by name: w0, ... b0); no
        node may allocate more than `budget` bytes from the sizes it is given."""
        if len(inputs) != len(self.inputs):
            raise PackageError(f"the packed program takes {len(self.inputs)} inputs, not {len(inputs)}")
        values: dict[Any, Any] = {value: tensors[name] for value, name in self.weights}
        values.update(zip(self.inputs, inputs, strict=True))
        values[_DEVICE] = inputs[0].device
        values[_BUDGET] = budget
        try:
            for node in self.nodes:
                node.run(values)
        except PackageError as e:
            raise PackageError(f"{self.what}: {e}") from None
        return tuple(values[name] for name in self.outputs)


def within_budget(label: str, size: int, budget: int) -> None:
    """PackageError naming the node `label` when it would allocate `size` bytes, over `budget`."""
    if size > budget:
        raise PackageError(f"{label} would allocate {_gib(size)} from the sizes it is given, over the "
                           f"{_gib(budget)} one node may: if you trust this package to need it, raise "
                           "package.max_node_gib; else do not train it")  # fmt: skip


def _gib(size: int) -> str:
    return f"{size / GiB:,.0f} GiB" if size >= 1000 * GiB else f"{size / GiB:.3g} GiB"


def read_graph(data: bytes, what: str, *, training: bool = False) -> Graph:
    """The program in `data` (torch.export's JSON), every node checked against the operator allow-list and its
    rules on sizes and in-place writes (a training program may write into its buffers: running statistics);
    PackageError, in one line that names `what` (e.g. "train.json"), for anything else."""
    try:
        return _Reader(what, training).read(data)
    except PackageError as e:
        raise PackageError(f"{what}: {e}") from None
    except (Malformed, KeyError, TypeError, ValueError, AttributeError, IndexError, RecursionError) as e:
        detail = f": {e}" if isinstance(e, Malformed) else ""
        raise PackageError(f"{what}: its graph is not a graph torch.export wrote{detail}") from None


def _one(argument: Any) -> tuple[str, Any]:
    if not isinstance(argument, dict) or len(argument) != 1:
        raise Malformed("an argument is not one tagged value")
    return next(iter(argument.items()))


class _Reader:
    def __init__(self, what: str, training: bool) -> None:
        self.what, self.training = what, training
        self.kinds: dict[str, str] = {}  # every value made so far: "tensor" or "int"
        self.reads: list[str] = []  # the values the node being read uses
        self.guarded: dict[str, str] = {}  # the values no node may write into (inputs, weights): what each is
        self.views: dict[str, frozenset[str]] = {}  # the guarded values a value may be a view of
        self.label = ""  # the node being read

    def read(self, data: bytes) -> Graph:
        program = json.loads(data)
        if int(program["schema_version"]["major"]) != SCHEMA_MAJOR:
            raise Malformed(f"its format is version {program['schema_version']['major']}, this FAST reads "
                            f"{SCHEMA_MAJOR}")  # fmt: skip
        module = program["graph_module"]
        graph, signature = module["graph"], module["signature"]
        weights, inputs = [], []
        for spec in signature["input_specs"]:
            kind, body = _one(spec)
            if kind in WEIGHT_NAME:
                name = body[f"{kind}_name"]
                if not isinstance(name, str) or not WEIGHT_NAME[kind].fullmatch(name):
                    raise Malformed(f"a {kind} is named {str(name)[:40]!r}, not as fast pack names them")
                weights.append((self.make(body["arg"]["name"], "tensor"), name))
                if kind == "parameter" or not self.training:
                    self.guarded[weights[-1][0]] = f"the {kind} {name}"
            elif kind == "user_input":
                inputs.append(self.make(self.tensor_name(body["arg"]), "tensor"))
                self.guarded[inputs[-1]] = "an input of the program (the owner's batch)"
            else:
                raise PackageError(f"its program takes a {kind} input, which packages may not have")
        if not isinstance(graph["nodes"], list):
            raise Malformed("its nodes are not a list")
        nodes = [self.node(i, node) for i, node in enumerate(graph["nodes"])]
        made = [*(value for value, _ in weights), *inputs]
        outputs = []
        for spec in signature["output_specs"]:
            kind, body = _one(spec)
            if kind != "user_output":
                raise PackageError(f"its program has a {kind} output, which packages may not have")
            outputs.append(self.use(self.tensor_name(body["arg"]), "tensor"))
        if [self.tensor_name(output) for output in graph["outputs"]] != outputs:
            raise Malformed("its outputs are not its signature's")
        allocations = tuple((p.label, p.allocation) for p in nodes if p.allocation is not None)
        return Graph(tuple(weights), tuple(inputs), _with_lifetimes(made, nodes, outputs), tuple(outputs),
                     allocations, self.what)  # fmt: skip

    def make(self, name: Any, kind: str) -> str:
        if not isinstance(name, str) or name in self.kinds:
            raise Malformed(f"the value {str(name)[:40]!r} is made twice or has no name")
        self.kinds[name] = kind
        return name

    def use(self, name: Any, kind: str) -> str:
        if self.kinds.get(name) != kind:
            raise Malformed(f"{str(name)[:40]!r} is used before it is made, or as a {kind} when it is not one")
        self.reads.append(name)
        return name

    @staticmethod
    def tensor_name(argument: Any) -> str:
        kind, body = _one(argument)
        if kind != "as_tensor":
            raise PackageError(f"its program passes a {kind} where only tensors may go")
        return body["name"]

    def node(self, index: int, node: dict[str, Any]) -> _Parsed:
        operator = allowed(node["target"])
        self.label = f"node {index} ({operator.name})"
        arguments, seen, self.reads = [], set(), []
        constants: dict[str, Any] = {}  # each argument's value where it is a constant, LATER where it is not
        uses: dict[str, list[str]] = {}  # the tensors each argument passes
        for entry in node["inputs"]:
            name = entry["name"]
            if not isinstance(name, str) or name in seen:
                raise Malformed(f"{operator.name} is given an argument twice")
            seen.add(name)
            kind, body = _one(entry["arg"])
            if kind not in operator.kinds(name):
                raise PackageError(f"its graph passes {operator.name} a {kind.removeprefix('as_')} as {name!r}, "
                                   "which packages may not pass")  # fmt: skip
            if kind == "as_string" and not operator.allows_string(name, body):
                raise PackageError(f"its graph passes {operator.name} the string {str(body)[:40]!r} as {name!r}")
            if operator.is_size(name) and not _small(kind, body):
                raise PackageError(f"its graph passes {operator.name} a size beyond {LARGEST_SIZE} as {name!r}")
            before = len(self.reads)
            arguments.append((name, self.value(kind, body)))
            uses[name] = self.reads[before:]
            constants[name] = LATER if kind in _RUN_TIME else _static(kind, body)
        reads = self.reads
        self.check_writes(operator, constants, uses)
        allocation = operator.allocates(constants, self.label)
        viewed = frozenset().union(*(self.views_of(uses[name]) for name in operator.viewed if name in uses))
        outputs = tuple(self.output(operator, output, viewed) for output in node["outputs"])
        return _Parsed(operator, tuple(arguments), outputs, tuple(reads), self.label, allocation)

    def views_of(self, names: list[str]) -> frozenset[str]:
        """The guarded values that the values `names` are, or may be views of."""
        return frozenset(n for n in names if n in self.guarded).union(*(self.views.get(n, ()) for n in names))

    def check_writes(self, operator: Allowed, constants: dict[str, Any], uses: dict[str, list[str]]) -> None:
        """PackageError when the node writes in place into a guarded value (an input, a weight), or a view of one."""
        for argument in sorted(operator.writes(constants)):
            for target in sorted(self.views_of(uses.get(argument, []))):
                raise PackageError(f"{self.label} writes in place into {self.guarded[target]} (through {argument!r}): "
                                   "a program may not change the owner's batch, its parameters, or, outside "
                                   "training, its buffers; do not train it")  # fmt: skip

    def output(self, operator: Allowed, output: Any, viewed: frozenset[str]) -> Any:
        kind, body = _one(output)
        if kind == "as_sym_int" and not operator.makes_size:
            raise PackageError(f"{self.label} gives a size, but sizes come only from sym_size, sym_numel and "
                               "arithmetic on them (never from the data): do not train it")  # fmt: skip
        if operator.makes_size and kind not in ("as_sym_int", "as_none"):
            raise PackageError(f"{self.label} gives its size as a {kind.removeprefix('as_')}: do not train it")
        if kind == "as_tensor":
            made = self.make(body["name"], "tensor")
        elif kind == "as_tensors":
            made = tuple(self.make(item["name"], "tensor") for item in body)
        elif kind == "as_sym_int" and set(body) == {"as_name"}:
            return self.make(body["as_name"], "int")
        elif kind == "as_none":
            return None
        else:
            raise PackageError(f"its graph has a node whose result is a {kind.removeprefix('as_')}")
        if viewed:
            self.views.update(dict.fromkeys(made if isinstance(made, tuple) else (made,), viewed))
        return made

    def value(self, kind: str, body: Any) -> Get:
        """A getter of the argument's value at run time: a constant, or a value made earlier."""
        if kind == "as_tensor":
            name = self.use(body["name"], "tensor")
            return lambda values: values[name]
        if kind == "as_tensors":
            names = [self.use(item["name"], "tensor") for item in body]
            return lambda values: [values[name] for name in names]
        if kind == "as_optional_tensors":
            getters = [self.value(*_one(item)) for item in body]
            if any(_one(item)[0] not in ("as_tensor", "as_none") for item in body):
                raise Malformed("a list of optional tensors holds something else")
            return lambda values: [get(values) for get in getters]
        if kind == "as_sym_int":
            return self.size(body)
        if kind == "as_sym_ints":
            getters = [self.size(item) for item in body]
            return lambda values: [get(values) for get in getters]
        if kind == "as_device":
            if body.get("type") not in DEVICES or not isinstance(body.get("index"), int | None):
                raise PackageError(f"its graph names the device {str(body)[:40]!r}")
            return lambda values: values[_DEVICE]  # the device the owner runs the program on
        return _constant(_literal(kind, body))

    def size(self, body: Any) -> Get:
        kind, value = _one(body)
        if kind == "as_name":
            name = self.use(value, "int")
            return lambda values: values[name]
        if kind == "as_int" and type(value) is int:
            return _constant(value)
        raise Malformed("a size is neither a number nor a computed size")


def _small(kind: str, body: Any) -> bool:
    """Whether the integers among a size argument's constants are at most LARGEST_SIZE in magnitude."""
    if kind in ("as_int", "as_ints"):
        values = body if isinstance(body, list) else [body]
    elif kind in ("as_sym_int", "as_sym_ints"):
        values = [item.get("as_int", 0) for item in (body if isinstance(body, list) else [body])]
    else:
        return True
    return all(not isinstance(v, int) or abs(v) <= LARGEST_SIZE for v in values)


def _constant(value: Any) -> Get:
    return lambda values: value


def _static(kind: str, body: Any) -> Any:
    """An argument's value as far as it is known at load: constants as they run, LATER for computed sizes."""
    if kind == "as_sym_int":
        return body["as_int"] if "as_int" in body else LATER
    if kind == "as_sym_ints":
        return [item["as_int"] if "as_int" in item else LATER for item in body]
    return _literal(kind, body)


def _literal(kind: str, body: Any) -> Any:
    """A constant argument, checked to be of its kind."""

    def number(v: Any) -> bool:
        return type(v) in (int, float)

    checks: dict[str, Callable[[Any], bool]] = {
        "as_none": lambda v: True,
        "as_int": lambda v: type(v) is int,
        "as_ints": lambda v: isinstance(v, list) and all(type(i) is int for i in v),
        "as_float": number,
        "as_floats": lambda v: isinstance(v, list) and all(number(i) for i in v),
        "as_bool": lambda v: type(v) is bool,
        "as_bools": lambda v: isinstance(v, list) and all(type(i) is bool for i in v),
        "as_string": lambda v: isinstance(v, str),
        "as_scalar_type": lambda v: type(v) is int and v in DTYPES,
        "as_layout": lambda v: type(v) is int and v in LAYOUTS,
        "as_memory_format": lambda v: type(v) is int and v in MEMORY_FORMATS,
    }
    if kind not in checks or not checks[kind](body):
        raise PackageError(f"its graph passes a {kind.removeprefix('as_')} of a kind packages may not pass")
    tables: dict[str, dict[int, Any]] = {"as_scalar_type": DTYPES, "as_layout": LAYOUTS,
                                          "as_memory_format": MEMORY_FORMATS}  # fmt: skip
    return None if kind == "as_none" else tables[kind][body] if kind in tables else body


@dataclass(frozen=True)
class _Parsed:
    operator: Allowed
    arguments: tuple[tuple[str, Get], ...]
    outputs: tuple[Any, ...]
    reads: tuple[str, ...]
    label: str
    allocation: int | None  # the bytes it allocates, where its sizes are constants

    @property
    def made(self) -> list[str]:
        return [n for names in self.outputs for n in (names if isinstance(names, tuple) else (names,)) if n]


def _with_lifetimes(inputs: list[str], parsed: list[_Parsed], outputs: list[str]) -> tuple[Node, ...]:
    """The nodes, each with the values that no later node reads (the program's outputs are kept)."""
    last: dict[str, int] = {name: 0 for name in inputs}
    for i, node in enumerate(parsed):
        last.update({name: i for name in [*node.made, *node.reads]})
    for name in outputs:
        last.pop(name, None)
    done: dict[int, list[str]] = {}
    for name, i in last.items():
        done.setdefault(i, []).append(name)
    return tuple(Node(p.operator, p.arguments, p.outputs, tuple(done.get(i, ())), p.label)
                 for i, p in enumerate(parsed))  # fmt: skip
