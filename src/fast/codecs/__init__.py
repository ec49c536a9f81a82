"""Compression codecs, looked up by name: how a tensor is encoded on the wire.

    codec = build_codec("topk", ratio=0.01, error_feedback=True, min_elements=1024, seed=0)
    frame = codec.encode(gradient, key="layer1.weight")   # uint8 tensor: header + packed body + crc32
    gradient_seen = codec.decode(frame)                    # x's shape and dtype

Every codec takes `min_elements` (smaller tensors travel raw) and `seed` (its random streams);
`error_feedback` wraps it in ErrorFeedback (on by default for `ef-sign` and `powersgd`).
"""

from __future__ import annotations

import inspect
from typing import Any

from fast.codecs.base import Codec
from fast.codecs.cast import BFloat16, Float16, NoCompression
from fast.codecs.chunked import ChunkTopK, DctTopK
from fast.codecs.dgc import DGC
from fast.codecs.frame import CODEC_IDS, Frame, pack_frame, unpack_frame
from fast.codecs.memory import ErrorFeedback
from fast.codecs.powersgd import PowerSGD
from fast.codecs.quantize import QSGD, TernGrad, Uint8
from fast.codecs.sign import Sign, Signum
from fast.codecs.sparsify import RandomK, Threshold, TopK
from fast.errors import ConfigError

_CLASSES: dict[str, type[Codec]] = {
    "none": NoCompression,
    "fp16": Float16,
    "bf16": BFloat16,
    "uint8": Uint8,
    "qsgd": QSGD,
    "terngrad": TernGrad,
    "sign": Sign,
    "ef-sign": Sign,
    "signum": Signum,
    "topk": TopK,
    "randomk": RandomK,
    "threshold": Threshold,
    "dgc": DGC,
    "powersgd": PowerSGD,
    "chunk-topk": ChunkTopK,
    "dct-topk": DctTopK,
}
CODECS: tuple[str, ...] = tuple(_CLASSES)
_ERROR_FEEDBACK_BY_DEFAULT = {"ef-sign", "powersgd"}


def codec_options(name: str) -> tuple[str, ...]:
    """The options `build_codec(name, ...)` accepts."""
    if name not in _CLASSES:
        raise ConfigError(f"unknown codec {name!r}: choose one of {', '.join(CODECS)}")
    parameters = inspect.signature(_CLASSES[name].__init__).parameters
    return tuple(option for option in parameters if option != "self") + ("error_feedback",)


def build_codec(name: str, *, error_feedback: bool | None = None, **options: Any) -> Codec:
    """The codec called `name` with its `options`; ConfigError for unknown names, options or values."""
    valid = codec_options(name)
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ConfigError(f"codec {name!r} has no option {unknown[0]!r}: valid options are {', '.join(valid)}")
    if error_feedback is not None and not isinstance(error_feedback, bool):
        raise ConfigError(f"codec option error_feedback must be true or false, got {error_feedback!r}")
    wrap = name in _ERROR_FEEDBACK_BY_DEFAULT if error_feedback is None else error_feedback
    if name == "ef-sign" and not wrap:
        raise ConfigError("ef-sign is sign with error feedback: use codec 'sign' for sign without it")
    if name == "dgc" and wrap:
        raise ConfigError("dgc keeps what it did not send in its own accumulator: set error_feedback = false")
    codec = _CLASSES[name](**options)
    return ErrorFeedback(codec) if wrap else codec


__all__ = [
    "CODECS",
    "CODEC_IDS",
    "BFloat16",
    "ChunkTopK",
    "Codec",
    "DGC",
    "DctTopK",
    "ErrorFeedback",
    "Float16",
    "Frame",
    "NoCompression",
    "PowerSGD",
    "QSGD",
    "RandomK",
    "Sign",
    "Signum",
    "TernGrad",
    "Threshold",
    "TopK",
    "Uint8",
    "build_codec",
    "codec_options",
    "pack_frame",
    "unpack_frame",
]
