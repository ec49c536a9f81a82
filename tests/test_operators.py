"""The operator allow-list and the program runner: a graph runs only allowed operators with allowed arguments, and
the kernels a fuzz found to crash or to read and write outside their tensors on crafted arguments are refused or
checked before they run (each case below crashed or corrupted memory when called directly)."""

from __future__ import annotations

import json

import pytest
import torch

from fast.errors import PackageError
from fast.operators import LARGEST_SIZE
from fast.program import read_graph


def _argument(value):
    """A graph argument as torch.export writes it: a tensor by name ("%x"), a number, a list, or as given."""
    if isinstance(value, str) and value.startswith("%"):
        return {"as_tensor": {"name": value[1:]}}
    if isinstance(value, bool):
        return {"as_bool": value}
    if isinstance(value, int):
        return {"as_int": value}
    if isinstance(value, float):
        return {"as_float": value}
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return {"as_tensors": [{"name": v[1:]} for v in value]}
    if isinstance(value, list):
        return {"as_ints": value} if all(isinstance(v, int) for v in value) else {"as_floats": value}
    return value


def _graph(nodes: list[tuple], inputs: tuple[str, ...] = ("x",), output: str = "out") -> bytes:
    """A program of `nodes` ((target, {argument: value}, [output names]), ...) on user inputs `inputs`."""

    def result(target: str, name: str) -> dict:
        sizes = target == "torch.ops.aten.sym_size.int" or target.startswith("_operator.")
        return {"as_sym_int": {"as_name": name}} if sizes else {"as_tensor": {"name": name}}

    serialized = [{"target": target, "name": outputs[0],
                   "inputs": [{"name": k, "arg": _argument(v), "kind": 1} for k, v in arguments.items()],
                   "outputs": [result(target, o) for o in outputs]}
                  for target, arguments, outputs in nodes]  # fmt: skip
    return json.dumps({
        "schema_version": {"major": 8, "minor": 20},
        "graph_module": {
            "graph": {"nodes": serialized, "outputs": [{"as_tensor": {"name": output}}]},
            "signature": {
                "input_specs": [{"user_input": {"arg": {"as_tensor": {"name": n}}}} for n in inputs],
                "output_specs": [{"user_output": {"arg": {"as_tensor": {"name": output}}}}],
            },
        },
    }).encode()  # fmt: skip


def test_a_graph_of_allowed_operators_computes_what_torch_does():
    x, w = torch.randn(4, 8), torch.randn(3, 8)
    program = read_graph(_graph([
        ("torch.ops.aten.linear.default", {"input": "%x", "weight": "%w"}, ["h"]),
        ("torch.ops.aten.gelu.default", {"self": "%h", "approximate": {"as_string": "tanh"}}, ["g"]),
        ("torch.ops.aten.sym_size.int", {"self": "%x", "dim": 0}, ["b"]),
        ("_operator.mul", {"a": {"as_sym_int": {"as_name": "b"}}, "b": 3}, ["n"]),
        ("torch.ops.aten.reshape.default", {"self": "%g", "shape": {"as_sym_ints": [{"as_name": "n"}]}}, ["out"]),
    ], inputs=("x", "w")), "test")  # fmt: skip
    (out,) = program.run({}, x, w)
    torch.testing.assert_close(out, torch.nn.functional.gelu(x @ w.T, approximate="tanh").reshape(12))


@pytest.mark.parametrize(
    ("target", "arguments", "words"),
    [
        # found by the fuzz: null dereference, out-of-bounds reads and writes of the running statistics
        ("torch.ops.aten.native_batch_norm.default", {"input": "%x"}, "not on FAST's operator allow-list"),
        ("torch.ops.aten._native_batch_norm_legit.no_stats", {"input": "%x"}, "not on FAST's operator allow-list"),
        ("torch.ops.aten.native_group_norm.default", {"input": "%x"}, "not on FAST's operator allow-list"),
        # a strided `out` written as if contiguous
        ("torch.ops.aten._softmax.out", {"self": "%x", "dim": 0, "half_to_float": False, "out": "%x"}, "(out=)"),
        ("torch.ops.aten.avg_pool3d.out", {"self": "%x", "kernel_size": [2, 2, 2], "out": "%x"}, "(out=)"),
        ("torch.ops.aten.triu.out", {"self": "%x", "out": "%x"}, "(out=)"),
        # an overflowing sum of repeats
        ("torch.ops.aten.repeat_interleave.Tensor", {"repeats": "%x"}, "whose arguments FAST does not check"),
        ("torch.ops.aten.repeat_interleave.self_Tensor", {"self": "%x", "repeats": "%x"}, "does not check"),
        # plain-number overloads (SIGFPE on 5 % 0)
        ("torch.ops.aten.remainder.int", {"a": 5, "b": 0}, "computes on plain numbers"),
        # sizes that overflow: a pooling kernel of 2**62 never returns; a group norm of HxW = 2**61 + 3 crashes
        ("torch.ops.aten.max_pool1d.default", {"self": "%x", "kernel_size": [2**62]}, "a size beyond"),
        ("torch.ops.aten.zeros.default", {"size": [LARGEST_SIZE + 1]}, "a size beyond"),
        # files, storages, uninitialised memory, strides over memory
        ("torch.ops.aten.from_file.default", {"filename": {"as_string": "/etc/passwd"}}, "not on FAST's"),
        ("torch.ops.aten.empty.memory_format", {"size": [4]}, "not on FAST's operator allow-list"),
        ("torch.ops.aten.as_strided.default", {"self": "%x", "size": [4], "stride": [1]}, "not on FAST's"),
        ("torch.ops.aten._print.default", {"s": {"as_string": "hello"}}, "not on FAST's operator allow-list"),
    ],
)
def test_unsafe_operators_and_arguments_are_refused_before_anything_runs(target, arguments, words):
    with pytest.raises(PackageError, match="^test: ") as error:
        read_graph(_graph([(target, arguments, ["out"])]), "test")
    assert words in str(error.value) and len(str(error.value).splitlines()) == 1


@pytest.mark.parametrize(
    ("nodes", "inputs", "words"),
    [
        # an LSTM state of the wrong batch: the kernel corrupts the heap ("corrupted size vs. prev_size")
        ([("torch.ops.aten.lstm.input", {"input": "%x", "hx": ["%h", "%h"], "params": ["%w", "%u"],
           "has_biases": False, "num_layers": 1, "dropout": 0.0, "train": True, "bidirectional": False,
           "batch_first": False}, ["out", "h1", "c1"])],
         {"x": torch.ones(2, 3, 4), "h": torch.zeros(1, 2, 5), "w": torch.ones(20, 4), "u": torch.ones(20, 5)},
         "states of the wrong shape"),
        # INT64_MIN // -1 rounded towards zero: SIGFPE
        ([("torch.ops.aten.div.Tensor_mode", {"self": "%x", "other": "%m",
                                              "rounding_mode": {"as_string": "trunc"}}, ["out"])],
         {"x": torch.tensor([-(2**63)]), "m": torch.tensor([-1])}, "rounding towards zero"),
        # a number where the cell's state goes: the check itself cannot read it
        ([("torch.ops.aten.gru_cell.default", {"input": "%x", "hx": 1.5, "w_ih": "%x", "w_hh": "%x"}, ["out"])],
         {"x": torch.ones(3, 4)}, "arguments of the wrong kind or number"),
        # negative repeats
        ([("torch.ops.aten.repeat_interleave.self_int", {"self": "%x", "repeats": -3}, ["out"])],
         {"x": torch.ones(3)}, "negative repeats"),
        # a size computed past the bound from real sizes
        ([("torch.ops.aten.sym_size.int", {"self": "%x", "dim": 0}, ["b"]),
          ("_operator.mul", {"a": {"as_sym_int": {"as_name": "b"}}, "b": 2**30}, ["n"]),
          ("torch.ops.aten.zeros.default", {"size": {"as_sym_ints": [{"as_name": "n"}]}}, ["out"])],
         {"x": torch.ones(4)}, "computes a size of 4294967296"),
    ],
)  # fmt: skip
def test_kernels_that_trust_their_arguments_are_checked_before_they_run(nodes, inputs, words):
    program = read_graph(_graph(nodes, inputs=tuple(inputs)), "test")
    with pytest.raises(PackageError, match=words):
        program.run({}, *inputs.values())


def test_a_value_used_before_it_is_made_or_made_twice_is_refused():
    twice = [("torch.ops.aten.relu.default", {"self": "%x"}, ["out"]),
             ("torch.ops.aten.relu.default", {"self": "%x"}, ["out"])]  # fmt: skip
    early = [("torch.ops.aten.relu.default", {"self": "%later"}, ["out"])]
    for nodes in (twice, early):
        with pytest.raises(PackageError, match="is not a graph torch.export wrote"):
            read_graph(_graph(nodes), "test")


BATCH_NORM = {"input": "%x", "weight": {"as_none": True}, "bias": {"as_none": True}, "running_mean": "%m",
              "running_var": "%v", "momentum": 0.1, "eps": 1e-5, "cudnn_enabled": False}  # fmt: skip


@pytest.mark.parametrize(
    ("nodes", "words"),
    [
        # a view of a view of an input, written into
        ([("torch.ops.aten.transpose.int", {"self": "%x", "dim0": 0, "dim1": 1}, ["t"]),
          ("torch.ops.aten.unsqueeze.default", {"self": "%t", "dim": 0}, ["u"]),
          ("torch.ops.aten.copy_.default", {"self": "%u", "src": "%u"}, ["out"])],
         "node 2 (aten::copy_.default) writes in place into an input of the program (the owner's batch)"),
        # batch_norm computing batch statistics updates its running statistics, though its schema says nothing
        ([("torch.ops.aten.batch_norm.default", {**BATCH_NORM, "training": True}, ["out"])],
         "node 0 (aten::batch_norm.default) writes in place into an input of the program"),
        # an in-place change of an input's shape is a write too
        ([("torch.ops.aten.unsqueeze_.default", {"self": "%x", "dim": 0}, ["out"])], "writes in place into an input"),
    ],
)  # fmt: skip
def test_a_write_into_an_input_through_a_view_or_a_hidden_write_is_refused_at_load(nodes, words):
    with pytest.raises(PackageError, match="^test: ") as error:
        read_graph(_graph(nodes, inputs=("x", "m", "v")), "test", training=True)
    assert words in str(error.value) and len(str(error.value).splitlines()) == 1


def test_writes_into_what_the_program_made_run_and_leave_its_inputs_as_they_were():
    x, m, v = torch.randn(4, 3), torch.zeros(3), torch.ones(3)
    program = read_graph(_graph([
        ("torch.ops.aten.clone.default", {"self": "%x"}, ["c"]),
        ("torch.ops.aten.add_.Tensor", {"self": "%c", "other": 1}, ["added"]),
        ("torch.ops.aten.batch_norm.default", {**BATCH_NORM, "input": "%added", "training": False}, ["out"]),
    ], inputs=("x", "m", "v")), "test")  # fmt: skip
    (out,) = program.run({}, x.clone(), m, v)
    torch.testing.assert_close(out, (x + 1) / torch.sqrt(torch.tensor(1 + 1e-5)))
    assert torch.equal(m, torch.zeros(3)) and torch.equal(v, torch.ones(3))


def test_a_number_computed_from_the_data_is_no_size():
    serialized = json.loads(_graph([("torch.ops.aten.sum.default", {"self": "%x"}, ["s"])]))
    serialized["graph_module"]["graph"]["nodes"][0]["outputs"] = [{"as_sym_int": {"as_name": "s"}}]
    with pytest.raises(PackageError, match=r"^test: node 0 \(aten::sum.default\) gives a size, but sizes come only"):
        read_graph(json.dumps(serialized).encode(), "test")


def test_a_count_known_at_load_is_held_to_the_budget_before_anything_runs():
    program = read_graph(_graph([("torch.ops.aten.randperm.default", {"n": LARGEST_SIZE}, ["out"])]), "test")
    assert program.allocations == (("node 0 (aten::randperm.default)", 8 * LARGEST_SIZE),)  # int64
    with pytest.raises(PackageError, match=r"^test: node 0 \(aten::randperm.default\) would allocate 16 GiB"):
        program.check_budget()
    program.check_budget(20 << 30)  # the owner's, raised


def test_an_expanded_view_spans_no_more_than_the_budget_whatever_copies_it():
    program = read_graph(_graph([
        ("torch.ops.aten.expand.default", {"self": "%x", "size": [2**20, 2**20, -1]}, ["wide"]),
        ("torch.ops.aten.clone.default", {"self": "%wide"}, ["out"]),
    ]), "test")  # fmt: skip
    with pytest.raises(PackageError, match=r"node 0 \(aten::expand.default\) would allocate 4,096 GiB"):
        program.run({}, torch.ones(1, 1, 1))


def test_only_the_training_program_updates_its_buffers():
    """batch_norm's running statistics (buffers b0, b1) updated while it computes batch statistics: the training
    program's way, refused in the evaluation program."""
    graph = json.loads(_graph([("torch.ops.aten.batch_norm.default", {**BATCH_NORM, "training": True}, ["out"])]))
    graph["graph_module"]["signature"]["input_specs"][:0] = [
        {"buffer": {"arg": {"name": value}, "buffer_name": name}} for value, name in (("m", "b0"), ("v", "b1"))
    ]
    data = json.dumps(graph).encode()
    with pytest.raises(PackageError, match=r"node 0 \(aten::batch_norm.default\) writes in place into the buffer b0"):
        read_graph(data, "eval.json")
    buffers = {"b0": torch.zeros(3), "b1": torch.ones(3)}
    read_graph(data, "train.json", training=True).run(buffers, torch.randn(4, 3) + 5)
    assert float(buffers["b0"].mean()) > 0.4  # the running mean moved towards the batch's (about 5)
