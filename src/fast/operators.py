"""The operators a packed job's graphs may call at the data owner's site: FAST's one operator allow-list.

A package's training and evaluation programs are graphs of ATen operators, run node by node by fast.program. A
node runs only if its operator is named below and each of its arguments is of a kind below: tensors, numbers,
booleans, dtypes, layouts, memory formats, devices, lists of those, and the few strings that pick a variant of a
computation (`gelu(approximate="tanh")`). Anything else is refused in one line, when the author packs and again
whenever a package is loaded.

How the list was chosen: the operators torch.export writes for the layers of torch.nn and the functions of
torch.nn.functional that training graphs are made of (the built-in models, the language model of examples/lm/,
and the common layers beyond them: normalisations, pools, attention, recurrent cells, losses), grouped below by
what they compute. Left out on purpose: every operator that names a file, a storage or shared memory (from_file,
set_), that prints, that allocates uninitialised memory (empty, new_empty) or reinterprets memory by strides
(as_strided); anything outside the aten namespace (custom operators, higher-order operators with subgraphs,
Python callables); arguments of any other kind (strings beyond those below, storages, generators other than the
default, script objects).

Then narrowed by a fuzz of every listed kernel with malformed arguments (about 27,000 calls, each in a process of
its own), which found CPU kernels that trust what torch.nn checks in Python before calling them, and so read or
write outside their tensors or crash on crafted arguments: the `native_*` and `_native_batch_norm_legit*` forms of
the normalisations (the composite ones check their arguments and are kept), `out=` overloads (a kernel writes a
strided `out` as if it were contiguous), `repeat_interleave` with a tensor of repeats (an overflow of its sum),
sizes near 2**31 and beyond (overflows in pooling and normalisation), integer division rounding towards zero of
the smallest integer by -1, overloads on plain numbers, and the recurrent kernels given states of the wrong shape.
Each is refused, or checked before the kernel runs (CHECKS). Kernels are C++ code of torch's: a package from an
author one does not trust still deserves the sandbox one would give any program (a container without network).

Sizes come from sizes: a value a graph uses as a size is a constant, a tensor's own size (sym_size, sym_numel) or
integer arithmetic on those (SIZE_ARITHMETIC), never a number computed from the data, and at run time it is a
Python int within LARGEST_SIZE. What a node allocates from the sizes and counts it is given (zeros, full, arange,
expand, repeat, ...: ALLOCATIONS) is at most a budget of bytes per node, NODE_BYTES unless the owner raises it
(package.max_node_gib); and no node writes in place (an argument its schema marks `a!`, or batch_norm's running
statistics while it computes batch statistics: WRITES) into the owner's batch or a parameter, nor into a buffer
outside the training program. fast.program applies these rules, at load where the values are constants and at
run time where they are not.
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Callable
from typing import Any

import torch

from fast.errors import PackageError

ALLOWED: dict[str, frozenset[str]] = {
    name: frozenset(operators.split())
    for name, operators in {
        "arithmetic": """abs neg add sub rsub mul div floor_divide remainder fmod pow sqrt rsqrt exp exp2 expm1 log
            log2 log10 log1p sin cos tan tanh sinh cosh asin acos atan atan2 sign sgn floor ceil round trunc frac
            reciprocal square clamp clamp_min clamp_max clip minimum maximum where lerp addcmul addcdiv erf erfc
            erfinv sigmoid logit hypot nan_to_num logaddexp""",
        "comparison and logic": """eq ne lt le gt ge logical_and logical_or logical_not logical_xor bitwise_and
            bitwise_or bitwise_not bitwise_xor isnan isinf isfinite any all masked_fill""",
        "activations": """relu relu6 leaky_relu elu selu celu gelu silu mish softplus hardtanh hardsigmoid
            hardswish prelu glu threshold softmax log_softmax _softmax _log_softmax""",
        "linear algebra": "linear matmul mm bmm addmm baddbmm einsum dot mv outer t numpy_T mT",
        "convolution and pooling": """conv1d conv2d conv3d convolution conv_transpose1d conv_transpose2d
            conv_transpose3d max_pool1d max_pool2d max_pool3d max_pool2d_with_indices avg_pool1d avg_pool2d
            avg_pool3d adaptive_avg_pool1d adaptive_avg_pool2d adaptive_avg_pool3d adaptive_max_pool1d
            adaptive_max_pool2d upsample_nearest2d upsample_bilinear2d pixel_shuffle pixel_unshuffle""",
        "normalisation": "batch_norm layer_norm group_norm instance_norm rms_norm",
        "random draws": """dropout feature_dropout alpha_dropout native_dropout bernoulli rand randn rand_like
            randn_like randint randint_like randperm normal""",
        "reductions": """sum mean prod max min amax amin argmax argmin std var var_mean std_mean norm
            linalg_vector_norm logsumexp cumsum cumprod topk sort argsort""",
        "shapes, indexing and copies": """view reshape flatten unflatten squeeze unsqueeze permute transpose
            contiguous expand expand_as repeat repeat_interleave tile cat stack split split_with_sizes chunk unbind
            narrow slice select index index_select gather scatter scatter_add index_put index_add embedding one_hot
            flip roll tril triu pad constant_pad_nd alias clone detach to type_as _to_copy lift_fresh_copy fill zero
            copy _assert_tensor_metadata sym_size sym_numel""",
        "new tensors": """zeros ones full zeros_like ones_like full_like arange linspace scalar_tensor new_zeros
            new_ones new_full""",
        "losses": """cross_entropy_loss nll_loss nll_loss_nd nll_loss2d mse_loss l1_loss smooth_l1_loss huber_loss
            binary_cross_entropy binary_cross_entropy_with_logits kl_div cosine_similarity""",
        "recurrent and attention": "lstm gru rnn_tanh rnn_relu lstm_cell gru_cell scaled_dot_product_attention",
    }.items()
}
OPERATORS: frozenset[str] = frozenset().union(*ALLOWED.values())  # and each one's in-place form (add_ for add)

# the only strings an argument may hold: (operator, argument) -> a check of the value
STRINGS: dict[tuple[str, str], Callable[[str], bool]] = {
    ("gelu", "approximate"): {"none", "tanh"}.__contains__,
    ("div", "rounding_mode"): {"trunc", "floor"}.__contains__,
    ("pad", "mode"): {"constant", "reflect", "replicate", "circular"}.__contains__,
    ("einsum", "equation"): re.compile(r"[A-Za-z.,\-> ]{1,200}").fullmatch,
}

LARGEST_SIZE = 2**31 - 1  # a size, dimension, count or index passed as an integer, or computed from sizes

# operators that run in these overloads only (whose arguments CHECKS checks)
OVERLOADS: dict[str, frozenset[str]] = {
    "lstm": frozenset({"input"}), "gru": frozenset({"input"}), "rnn_tanh": frozenset({"input"}),
    "rnn_relu": frozenset({"input"}), "lstm_cell": frozenset({"default"}), "gru_cell": frozenset({"default"}),
    "repeat_interleave": frozenset({"self_int"}),
}  # fmt: skip
RETURN_NO_TENSOR = frozenset({"sym_size.int", "sym_numel.default", "_assert_tensor_metadata.default"})
# the only operators, with SIZE_ARITHMETIC, whose result a graph may use as a size: a tensor's own sizes
SIZE_SOURCES = frozenset({"aten::sym_size.int", "aten::sym_numel.default"})
NODE_BYTES = 4 << 30  # what one node may allocate from the sizes it is given, unless the owner raises it


def _size(value: Any) -> int:
    if type(value) is not int:
        raise PackageError(f"its graph computes a size that is a {type(value).__name__}, not an integer")
    if not -LARGEST_SIZE <= value <= LARGEST_SIZE:
        raise PackageError(f"its graph computes a size of {value}, beyond {LARGEST_SIZE}")
    return value


def _arithmetic(function: Callable[..., int]) -> Callable[..., int]:
    return lambda *operands: _size(function(*operands))


# the integer arithmetic torch.export writes on sizes (the batch dimension is dynamic)
SIZE_ARITHMETIC: dict[str, Callable[..., int]] = {
    f"_operator.{name}": _arithmetic(getattr(operator, name))
    for name in ("add", "sub", "mul", "floordiv", "mod", "neg")
}
SIZE_TYPES = frozenset({"int", "Optional[int]", "List[int]", "Optional[List[int]]"})

# the kinds of a serialized argument each type of an operator's schema takes; an operator whose schema has an
# argument of any other type (Storage, a generic list, a script object) is not called
KINDS: dict[str, frozenset[str]] = {
    schema_type: frozenset(kinds.split())
    for schema_type, kinds in {
        "Tensor": "as_tensor as_int as_float as_bool",  # a number where a tensor goes is one (add_(b, 1))
        "Optional[Tensor]": "as_tensor as_int as_float as_bool as_none",
        "List[Tensor]": "as_tensors",
        "List[Optional[Tensor]]": "as_optional_tensors",
        "int": "as_int as_sym_int as_scalar_type as_layout as_memory_format",
        "Optional[int]": "as_int as_sym_int as_scalar_type as_layout as_memory_format as_none",
        "List[int]": "as_ints as_sym_ints",
        "Optional[List[int]]": "as_ints as_sym_ints as_none",
        "float": "as_float as_int",
        "Optional[float]": "as_float as_int as_none",
        "List[float]": "as_floats",
        "Optional[List[float]]": "as_floats as_none",
        "bool": "as_bool",
        "Optional[bool]": "as_bool as_none",
        "List[bool]": "as_bools",
        "number": "as_int as_float as_bool as_sym_int",
        "Optional[number]": "as_int as_float as_bool as_sym_int as_none",
        "Device": "as_device",
        "Optional[Device]": "as_device as_none",
        "Optional[Generator]": "as_none",  # the default generator only
        "str": "as_string",
        "Optional[str]": "as_string as_none",
    }.items()
}

DTYPES: dict[int, torch.dtype] = {  # torch.export's ScalarType numbers of the dtypes a graph may name
    1: torch.uint8, 2: torch.int8, 3: torch.int16, 4: torch.int32, 5: torch.int64, 6: torch.float16,
    7: torch.float32, 8: torch.float64, 12: torch.bool, 13: torch.bfloat16,
}  # fmt: skip
LAYOUTS: dict[int, torch.layout] = {7: torch.strided}
MEMORY_FORMATS: dict[int, torch.memory_format] = {1: torch.contiguous_format, 2: torch.channels_last,
                                                  3: torch.channels_last_3d, 4: torch.preserve_format}  # fmt: skip
DEVICES = frozenset({"cpu", "cuda"})  # a device named in a graph means the device the program runs on

_TARGET = re.compile(r"torch\.ops\.aten\.([A-Za-z0-9_]+)\.([A-Za-z0-9_]+)")


class Allowed:
    """An operator a graph may call: the function, its name and, for an ATen operator, its arguments' types."""

    def __init__(self, name: str, function: Callable[..., Any], types: dict[str, str] | None) -> None:
        self.name, self.function, self.types = name, function, types
        self.positional = types is None  # size arithmetic takes its operands in order
        self.makes_size = self.positional or name in SIZE_SOURCES  # its result may be used as a size
        if name in SIZE_SOURCES:  # a size at run time: a Python int within LARGEST_SIZE
            self.function = lambda **arguments: _size(function(**arguments))
        check = CHECKS.get(name.removeprefix("aten::"))
        self.check = None if check is None else _malformed_is_refused(name, check)
        packet = name.removeprefix("aten::").split(".")[0]
        self.allocation = ALLOCATIONS.get(packet) if types is not None else None
        schema = getattr(function, "_schema", None)
        arguments = schema.arguments if schema is not None else []
        self.written = frozenset(a.name for a in arguments if a.alias_info is not None and a.alias_info.is_write)
        # the arguments its results may be views of (or, for an in-place operator, are)
        returns_views = schema is not None and any(r.alias_info is not None for r in schema.returns)
        self.viewed = frozenset(a.name for a in arguments if a.alias_info is not None) if returns_views else frozenset()

    def allocates(self, arguments: dict[str, Any], node: str) -> int | None:
        """The bytes the node `node` ("node 7 (aten::full.default)") allocates from its sizes (`arguments`: at
        load, each argument's constant value or LATER), None where they are computed later; PackageError naming
        the node for a count beyond LARGEST_SIZE or arguments it cannot read."""
        if self.allocation is None:
            return None
        try:
            return self.allocation(arguments)
        except _Unknown:
            return None
        except PackageError as e:
            raise PackageError(f"{node} {e}") from None
        except (AttributeError, TypeError, IndexError, KeyError, ValueError, OverflowError):
            raise PackageError(f"{node} is given sizes of the wrong kind or number") from None

    def writes(self, constants: dict[str, Any]) -> frozenset[str]:
        """The arguments it writes into in place, given its arguments' constant values (`constants`)."""
        hidden = WRITES.get(self.name.removeprefix("aten::").split(".")[0])
        if hidden is None or constants.get(hidden[0]) is False:
            return self.written
        return self.written | hidden[1]

    def is_size(self, argument: str) -> bool:
        """Whether `argument` is a size, dimension, count or index (an integer at most LARGEST_SIZE); a slice's
        bounds are not (torch.export writes an open end as 2**63 - 1, and slice clamps them to the tensor)."""
        if self.name.startswith(("aten::slice.", "aten::slice_.")) and argument in ("start", "end"):
            return False
        return self.types is None or self.types.get(argument) in SIZE_TYPES

    def kinds(self, argument: str) -> frozenset[str]:
        """The serialized kinds `argument` may have; PackageError for an argument the operator does not take."""
        if self.types is None:
            return frozenset({"as_int", "as_sym_int"})
        if argument not in self.types:
            raise PackageError(f"its graph passes {self.name} an argument {argument!r} it does not take")
        return KINDS[self.types[argument]]

    def allows_string(self, argument: str, value: Any) -> bool:
        rule = STRINGS.get((self.name.split(".")[0].removeprefix("aten::").removesuffix("_"), argument))
        return rule is not None and isinstance(value, str) and bool(rule(value))


def allowed(target: Any) -> Allowed:
    """The operator a graph node names (`torch.ops.aten.linear.default`); PackageError naming it when the
    allow-list does not hold it."""
    if not isinstance(target, str):
        raise PackageError("its graph has a node with no operator name")
    if target in SIZE_ARITHMETIC:
        return Allowed(target, SIZE_ARITHMETIC[target], None)
    match = _TARGET.fullmatch(target)
    if match is None:
        what = "a Python callable or an operator outside the aten namespace"
        raise PackageError(f"its graph calls {target[:80]!r}, {what}, which packages may not call")
    packet_name, overload_name = match.groups()
    name = f"aten::{packet_name}.{overload_name}"
    computes = packet_name.removesuffix("_") if packet_name.endswith("_") else packet_name  # add_ computes add
    if computes not in OPERATORS:
        raise PackageError(f"its graph calls {name}, which is not on FAST's operator allow-list (fast.operators)")
    packet = getattr(torch.ops.aten, packet_name)
    if overload_name not in packet.overloads():
        raise PackageError(f"its graph calls {name}, an overload this torch does not have")
    if overload_name not in OVERLOADS.get(packet_name, [overload_name]):
        raise PackageError(f"its graph calls {name}, an overload whose arguments FAST does not check")
    overload = getattr(packet, overload_name)
    schema = overload._schema
    if any(argument.is_out for argument in schema.arguments):
        raise PackageError(f"its graph calls {name}, which writes into a tensor it is given (out=)")
    returns = [str(r.type) for r in schema.returns]
    if not any("Tensor" in r for r in returns) and f"{packet_name}.{overload_name}" not in RETURN_NO_TENSOR:
        raise PackageError(f"its graph calls {name}, which computes on plain numbers, not tensors")
    types = {argument.name: str(argument.type) for argument in schema.arguments}
    for argument, schema_type in types.items():
        strings = schema_type in ("str", "Optional[str]") and (computes, argument) in STRINGS
        if schema_type not in KINDS or (schema_type in ("str", "Optional[str]") and not strings):
            raise PackageError(f"its graph calls {name}, whose argument {argument!r} is a {schema_type}, which "
                               "packages may not pass")  # fmt: skip
    return Allowed(name, overload, types)


# -- kernels that trust their arguments' shapes (torch.nn checks them in Python, before calling the kernel) ------
def _check_recurrent(gates: int) -> Callable[[dict[str, Any]], None]:
    """The shapes an RNN kernel (LSTM: 4 gates, GRU: 3, plain: 1) needs of its states and weights: its CPU code
    reads them by the sizes it is told, without checking (a wrong state shape corrupts the heap)."""

    def check(arguments: dict[str, Any]) -> None:
        x, params, hx = arguments["input"], list(arguments["params"]), arguments["hx"]
        states = list(hx) if isinstance(hx, list | tuple) else [hx]
        layers, directions = int(arguments["num_layers"]), 2 if arguments["bidirectional"] else 1
        per_layer = 4 if arguments["has_biases"] else 2
        projected = gates == 4 and len(params) == layers * directions * (per_layer + 1)
        step = per_layer + projected
        if x.dim() != 3 or layers < 1 or len(params) != layers * directions * step or params[1].dim() != 2:
            raise PackageError("its graph calls a recurrent layer with malformed inputs or weights")
        batch = x.shape[0] if arguments["batch_first"] else x.shape[1]
        hidden, size = states[-1].shape[-1], params[1].shape[1]  # size: the output's, hidden unless projected
        shapes = [(layers * directions, batch, size)] + ([(layers * directions, batch, hidden)] if gates == 4 else [])
        if [tuple(state.shape) for state in states] != shapes:
            raise PackageError("its graph calls a recurrent layer with states of the wrong shape")
        width = x.shape[-1]
        for layer in range(layers):
            for direction in range(directions):
                w_ih, w_hh, *rest = params[(layer * directions + direction) * step :][:step]
                expected = [(gates * hidden, width), (gates * hidden, size)]
                expected += [(gates * hidden,)] * (per_layer - 2) + [(size, hidden)] * projected
                if [tuple(t.shape) for t in (w_ih, w_hh, *rest)] != expected:
                    raise PackageError("its graph calls a recurrent layer with weights of the wrong shape")
            width = size * directions
        if any(t.dtype != x.dtype or t.device != x.device for t in [*params, *states]):
            raise PackageError("its graph calls a recurrent layer with weights of another dtype or device")

    return check


def _check_cell(gates: int) -> Callable[[dict[str, Any]], None]:
    def check(arguments: dict[str, Any]) -> None:
        x, hx, w_ih, w_hh = arguments["input"], arguments["hx"], arguments["w_ih"], arguments["w_hh"]
        states = list(hx) if isinstance(hx, list | tuple) else [hx]
        hidden = w_hh.shape[-1]
        state = (x.shape[0], hidden) if x.dim() == 2 else (hidden,)
        shapes = [tuple(w_ih.shape), tuple(w_hh.shape), *(tuple(s.shape) for s in states)]
        expected = [(gates * hidden, x.shape[-1]), (gates * hidden, hidden), *[state] * len(states)]
        biases = [b for b in (arguments.get("b_ih"), arguments.get("b_hh")) if b is not None]
        if x.dim() not in (1, 2) or shapes != expected or any(tuple(b.shape) != (gates * hidden,) for b in biases):
            raise PackageError("its graph calls a recurrent cell with weights or states of the wrong shape")

    return check


def _check_repeats(arguments: dict[str, Any]) -> None:
    if arguments.get("output_size") is not None or int(arguments["repeats"]) < 0:
        raise PackageError("its graph calls repeat_interleave with negative repeats or an output size")


def _check_truncation(arguments: dict[str, Any]) -> None:
    """Integer division rounded towards zero of the smallest integer by -1 kills the process (SIGFPE)."""
    operands = [arguments["self"], arguments["other"]]
    integers = all(not torch.is_tensor(v) and isinstance(v, int) or torch.is_tensor(v) and not
                   (v.is_floating_point() or v.is_complex()) for v in operands)  # fmt: skip
    if arguments.get("rounding_mode") == "trunc" and integers:
        raise PackageError("its graph divides integers rounding towards zero, which FAST does not run: use floor")


def _malformed_is_refused(name: str, check: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
    """`check`, with arguments it cannot even read (a number where a tensor goes, an empty list) refused too."""

    def checked(arguments: dict[str, Any]) -> None:
        try:
            check(arguments)
        except (AttributeError, TypeError, IndexError, KeyError, ValueError):
            raise PackageError(f"its graph calls {name} with arguments of the wrong kind or number") from None

    return checked


CHECKS: dict[str, Callable[[dict[str, Any]], None]] = {  # by operator.overload, before its kernel runs
    "lstm.input": _check_recurrent(4),
    "gru.input": _check_recurrent(3),
    "rnn_tanh.input": _check_recurrent(1),
    "rnn_relu.input": _check_recurrent(1),
    "lstm_cell.default": _check_cell(4),
    "gru_cell.default": _check_cell(3),
    "repeat_interleave.self_int": _check_repeats,
    **{
        f"{name}.{overload}": _check_truncation
        for name in ("div", "div_")
        for overload in ("Tensor_mode", "Scalar_mode")
    },
}


# -- in-place writes a schema does not mark -----------------------------------------------------------------------
# batch_norm and instance_norm update their running statistics in place while they compute batch statistics
# (their flag true), though their schemas mark no argument written
WRITES: dict[str, tuple[str, frozenset[str]]] = {
    "batch_norm": ("training", frozenset({"running_mean", "running_var"})),
    "instance_norm": ("use_input_stats", frozenset({"running_mean", "running_var"})),
}


# -- what a node allocates from the sizes and counts it is given --------------------------------------------------
class Later:
    """The value of an argument that is computed at run time (at load, an allocation that needs it waits for it)."""


LATER = Later()


class _Unknown(Exception):
    pass


def _known(value: Any) -> Any:
    if value is LATER:
        raise _Unknown
    return value


def _count(sizes: Any) -> int:
    """The elements of a tensor of `sizes` (a negative size, which the kernel refuses, counts as none)."""
    total = 1
    for size in _known(sizes):
        total *= max(int(_known(size)), 0)
    return total


def _itemsize(arguments: dict[str, Any], default: torch.dtype, like: str = "self") -> int:
    """The bytes of an element of the new tensor: its `dtype`, or that of the tensor it is made like; at load,
    when that tensor is not known yet, 1 (a lower bound: the exact size is checked at run time)."""
    dtype = arguments.get("dtype")
    if isinstance(dtype, torch.dtype):
        return dtype.itemsize
    tensor = arguments.get(like)
    if tensor is LATER:
        return 1
    return tensor.dtype.itemsize if torch.is_tensor(tensor) else default.itemsize


def _numel(arguments: dict[str, Any], name: str = "self") -> int:
    tensor = _known(arguments[name])
    return tensor.numel() if torch.is_tensor(tensor) else 1


def _by_size(arguments: dict[str, Any]) -> int:
    """zeros, full, rand, randint, new_zeros, ...: a tensor of `size`."""
    if "size" not in arguments:  # normal(mean, std) and the like: a tensor of their tensors' shapes
        return 0
    fill = arguments.get("fill_value")
    default = torch.int64 if type(fill) is int or "high" in arguments else torch.get_default_dtype()
    return _count(arguments["size"]) * _itemsize(arguments, torch.bool if type(fill) is bool else default)


def _expanded(arguments: dict[str, Any]) -> int:
    """expand: a view that spans prod(size) elements, which the next operator that copies it allocates (-1 keeps
    the tensor's size; at load, before the tensor is known, it counts as 1)."""
    size, tensor = [int(_known(s)) for s in _known(arguments["size"])], arguments["self"]
    if tensor is not LATER:
        shape = [1] * (len(size) - tensor.dim()) + list(tensor.shape)
        size = [shape[i] if s == -1 and i < len(shape) else s for i, s in enumerate(size)]
    return _count([1 if s == -1 else s for s in size]) * _itemsize(arguments, torch.get_default_dtype())


def _scalar(arguments: dict[str, Any], name: str, default: float) -> float:
    value = _known(arguments.get(name, default))
    value = float(value.item() if torch.is_tensor(value) else value)
    if not abs(value) <= LARGEST_SIZE:  # and not nan
        raise PackageError(f"is given {name}={value:g}, beyond {LARGEST_SIZE}")
    return value


def _arange(arguments: dict[str, Any]) -> int:
    start, end = _scalar(arguments, "start", 0), _scalar(arguments, "end", 0)
    step = _scalar(arguments, "step", 1)
    count = max(math.ceil((end - start) / step), 0) if step else 0
    if count > LARGEST_SIZE:
        raise PackageError(f"is asked for {count:,} values, more than {LARGEST_SIZE}")
    numbers = [arguments.get(name, 0) for name in ("start", "end", "step")]
    default = torch.int64 if all(type(v) is int for v in numbers) else torch.get_default_dtype()
    return count * _itemsize(arguments, default, like="")


def _counted(arguments: dict[str, Any], name: str, default: torch.dtype) -> int:
    """linspace(steps), randperm(n): a tensor of that many elements."""
    return max(int(_known(arguments[name])), 0) * _itemsize(arguments, default, like="")


def _one_hot(arguments: dict[str, Any]) -> int:
    classes = int(_known(arguments.get("num_classes", -1)))
    if classes < 0:
        raise PackageError("is given no number of classes, which it would take from the data")
    return _numel(arguments) * classes * torch.int64.itemsize


def _repeated(name: str) -> Callable[[dict[str, Any]], int]:
    def allocation(arguments: dict[str, Any]) -> int:
        times = _known(arguments[name])
        times = _count(times) if isinstance(times, list | tuple) else max(int(times), 0)
        return _numel(arguments) * times * _itemsize(arguments, torch.get_default_dtype())

    return allocation


def _padded(arguments: dict[str, Any]) -> int:
    tensor, pad = _known(arguments["self"]), [int(_known(p)) for p in _known(arguments["pad"])]
    shape = list(tensor.shape)
    for i in range(min(len(pad) // 2, len(shape))):
        shape[-1 - i] += pad[2 * i] + pad[2 * i + 1]
    return _count(shape) * tensor.dtype.itemsize


def _upsampled(arguments: dict[str, Any]) -> int:
    tensor = _known(arguments["input"] if "input" in arguments else arguments["self"])
    size = _known(arguments.get("output_size"))
    if size is None:
        factors = _known(arguments.get("scale_factors")) or []
        size = [math.floor(n * float(f)) for n, f in zip(tensor.shape[2:], factors, strict=False)]
    return _count([*tensor.shape[:2], *size]) * tensor.dtype.itemsize


# by operator (not its in-place form, which allocates nothing): the bytes of the tensor it makes, from its
# arguments; PackageError for a count beyond LARGEST_SIZE, _Unknown (at load) when it needs a value computed later
ALLOCATIONS: dict[str, Callable[[dict[str, Any]], int]] = {
    **{name: _by_size for name in "zeros ones full rand randn randint normal new_zeros new_ones new_full".split()},
    "expand": _expanded,
    "arange": _arange,
    "linspace": lambda arguments: _counted(arguments, "steps", torch.get_default_dtype()),
    "randperm": lambda arguments: _counted(arguments, "n", torch.int64),
    "one_hot": _one_hot,
    "repeat": _repeated("repeats"),
    "tile": _repeated("dims"),
    "repeat_interleave": _repeated("repeats"),
    "constant_pad_nd": _padded,
    "pad": _padded,
    "upsample_nearest2d": _upsampled,
    "upsample_bilinear2d": _upsampled,
}
