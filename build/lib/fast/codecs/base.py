"""The codec interface: a tensor in, a checked wire frame out, and the same shape and dtype back.

A codec implements three small pieces, `_encode_body`, `_decode_body` and `_body_size`; the base class
wraps them in frames, sends small tensors raw (`min_elements`), checks what arrives, and keeps the
seeded random generators of the stochastic codecs. Stateful codecs (momentum, warm starts) keep their
state per tensor `key`, so one codec object serves every tensor of a model.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch

from fast.codecs.frame import (
    CODEC_IDS,
    CODEC_NAMES,
    DTYPE_CODES,
    MAX_FRAME_BYTES,
    frame_size,
    pack_frame,
    unpack_frame,
)
from fast.codecs.packing import BodyReader, tensor_bytes
from fast.comm import timeline
from fast.errors import ConfigError, FrameError

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
CAPABILITIES = ("summable", "floats_only", "low_rank", "sparsifier", "fixed_size", "contractive", "gradients_only")
RAW_CODEC_ID = CODEC_IDS["none"]


class Codec:
    """Encodes tensors into frames (uint8 tensors) and decodes frames back into tensors.

    What a codec can do is declared as capabilities, which strategies and exchanges ask instead of its name:
    `summable` codecs produce values that peers may add elementwise (an all-reduce in `wire_dtype`), the others
    are all-gathered and decoded one by one; `low_rank` ones (PowerSGD) sum as factors; `sparsifier`s select
    elements over a whole flat tensor; `fixed_size` frames have a size known before encoding (a receiver can
    post its receive first); `contractive` ones shrink what they compress, E‖Q(v) − v‖² < ‖v‖² (what CHOCO-SGD
    needs); `gradients_only` ones keep a momentum of what they compress, which only gradients have.
    """

    name: ClassVar[str]
    summable: ClassVar[bool] = False
    floats_only: ClassVar[bool] = True
    low_rank: ClassVar[bool] = False
    sparsifier: ClassVar[bool] = False
    fixed_size: ClassVar[bool] = True
    contractive: ClassVar[bool] = False
    gradients_only: ClassVar[bool] = False
    # per-tensor state a stateful codec checkpoints: the state's key -> the attribute holding {tensor key: tensor}
    per_tensor_state: ClassVar[dict[str, str]] = {}

    def __init__(self, *, min_elements: int = 0, seed: int = 0):
        self.min_elements = non_negative_int("min_elements", min_elements)
        self.seed = non_negative_int("seed", seed)
        self._generators: dict[str, torch.Generator] = {}

    @property
    def codec_id(self) -> int:
        return CODEC_IDS[self.name]

    def sends_raw(self, shape: tuple[int, ...]) -> bool:
        """Whether a tensor of `shape` travels uncompressed (as codec `none`)."""
        numel = math.prod(shape)
        return numel == 0 or numel < self.min_elements

    @timeline.timed("encode")
    def encode(self, x: torch.Tensor, key: str = "") -> torch.Tensor:
        """The frame for `x`; `key` names the tensor for codecs that keep state per tensor."""
        x = self._check_input(x)
        shape = tuple(x.shape)
        if self.sends_raw(shape):
            return pack_frame(RAW_CODEC_ID, x.dtype, shape, tensor_bytes(x).cpu())
        return pack_frame(self.codec_id, x.dtype, shape, self._encode_body(x, key).cpu())

    @timeline.timed("encode")
    def encode_and_decode(self, x: torch.Tensor, key: str = "") -> tuple[torch.Tensor, torch.Tensor]:
        """The frame for `x` and the tensor a receiver decodes from it (on x's device), in one pass."""
        x = self._check_input(x)
        shape = tuple(x.shape)
        if self.sends_raw(shape):
            return pack_frame(RAW_CODEC_ID, x.dtype, shape, tensor_bytes(x).cpu()), x.clone()
        body = self._encode_body(x, key)
        frame = pack_frame(self.codec_id, x.dtype, shape, body.cpu())
        reader = BodyReader(body, self.name)
        received = self._decode_body(reader, shape, x.dtype)
        reader.finish()
        return frame, received

    def compress(self, x: torch.Tensor, key: str = "") -> torch.Tensor:
        """What a receiver sees of `x`: decode(encode(x)). Counts as a step for stateful codecs."""
        return self.encode_and_decode(x, key)[1]

    @timeline.timed("decode")
    def decode(self, frame: torch.Tensor | bytes, *, max_bytes: int = MAX_FRAME_BYTES) -> torch.Tensor:
        """The tensor in `frame`; FrameError if the frame is damaged or was not made by this codec."""
        parts = unpack_frame(frame, max_bytes=max_bytes)
        raw = self.sends_raw(parts.shape)
        expected = RAW_CODEC_ID if raw else self.codec_id
        if parts.codec_id != expected:
            raise FrameError(
                f"frame was encoded by codec {parts.codec_name!r}, but a {self.name!r} receiver expects "
                f"{CODEC_NAMES[expected]!r} for shape {parts.shape}: configure the same codec on both sides"
            )
        if self.floats_only and parts.dtype not in FLOAT_DTYPES:
            raise FrameError(f"{self.name} frame claims dtype {parts.dtype}, which {self.name} never encodes")
        reader = BodyReader(parts.body, CODEC_NAMES[expected])
        if raw:
            decoded = decode_raw(reader, parts.shape, parts.dtype)
        else:
            decoded = self._decode_body(reader, parts.shape, parts.dtype)
        reader.finish()
        return decoded

    def encoded_size(self, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> int:
        """Exact bytes of the frame for a tensor of `shape` and `dtype`, header and checksum included."""
        shape = tuple(shape)
        if self.sends_raw(shape):
            body = math.prod(shape) * dtype.itemsize
        else:
            body = self._body_size(shape, dtype)
        return frame_size(len(shape), body)

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        """This codec's random generator on `device`, seeded with `seed` on first use."""
        name = str(torch.device(device))
        if name not in self._generators:
            self._generators[name] = torch.Generator(device=name).manual_seed(self.seed)
        return self._generators[name]

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume this codec where it stopped (random streams, per-tensor state)."""
        state: dict[str, Any] = {"generators": {name: g.get_state() for name, g in self._generators.items()}}
        for name, attribute in self.per_tensor_state.items():
            state[name] = {key: value.clone() for key, value in getattr(self, attribute).items()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, generator_state in state["generators"].items():
            self.generator(name).set_state(generator_state)
        for name, attribute in self.per_tensor_state.items():
            setattr(self, attribute, {key: value.clone() for key, value in state[name].items()})

    def __repr__(self) -> str:
        return f"{type(self).__name__}(min_elements={self.min_elements}, seed={self.seed})"

    # The three pieces each codec writes. x is never empty here and has a dtype the codec accepts.
    def _encode_body(self, x: torch.Tensor, key: str) -> torch.Tensor:
        raise NotImplementedError

    def _decode_body(self, body: BodyReader, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def _body_size(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        raise NotImplementedError

    def _check_input(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{self.name} encodes torch tensors, got {type(x).__name__}")
        allowed = FLOAT_DTYPES if self.floats_only else tuple(DTYPE_CODES)
        if x.dtype not in allowed:
            raise TypeError(f"{self.name} encodes tensors of dtype {', '.join(map(str, allowed))}; got {x.dtype}")
        return x.detach()


def decode_raw(body: BodyReader, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor sent uncompressed: its memory, copied out of the frame."""
    return body.take(dtype, math.prod(shape)).reshape(shape).clone()


def per_tensor_state(store: dict[str, torch.Tensor], key: str, like: torch.Tensor) -> torch.Tensor:
    """The state tensor kept for `key` (zeros like `like` the first time); checks the shape still fits."""
    state = store.get(key)
    if state is None:
        state = store[key] = torch.zeros_like(like, memory_format=torch.contiguous_format)
    elif state.shape != like.shape or state.dtype != like.dtype:
        raise ValueError(
            f"tensor key {key!r} was used for a {state.dtype} tensor of shape {tuple(state.shape)} and now for "
            f"a {like.dtype} one of shape {tuple(like.shape)}: give every tensor its own key"
        )
    return state


def non_negative_int(option: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"codec option {option} must be a whole number >= 0, got {value!r}")
    return value


def positive_int(option: str, value: Any, *, limit: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or (limit and value > limit):
        bound = f" and <= {limit}" if limit else ""
        raise ConfigError(f"codec option {option} must be a whole number >= 1{bound}, got {value!r}")
    return value


def fraction(option: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1:
        raise ConfigError(f"codec option {option} must be a number in (0, 1], got {value!r}")
    return float(value)


def non_negative_float(option: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < math.inf:
        raise ConfigError(f"codec option {option} must be a finite number >= 0, got {value!r}")
    return float(value)
