"""Error feedback: a memory of what a lossy codec did not send, added back to the next tensor.

One step per tensor key (Seide et al. 2014; Karimireddy et al. 2019), as in GRACE's memory:

    compensated = x + residual        compensate
    frame, sent = codec(compensated)  compress (sent: what the receiver will decode)
    residual = compensated - sent     update the memory
    return frame                      send

so that sent + new residual == x + old residual. The receiver needs no memory: decoding is the codec's.

With a `decay` β < 1 the memory fades: compensated = x + β · residual, so that it is a momentum of what was
not sent (SparseLoCo's error feedback, DeMo's decoupled momentum: sent + new residual == x + β · old residual).
"""

from __future__ import annotations

from typing import Any

import torch

from fast.codecs.base import CAPABILITIES, Codec, per_tensor_state
from fast.codecs.frame import MAX_FRAME_BYTES


class ErrorFeedback(Codec):
    """Wraps `codec` with a per-key residual memory; on the wire it is exactly `codec`."""

    def __init__(self, codec: Codec, decay: float = 1.0):
        super().__init__(min_elements=codec.min_elements, seed=codec.seed)
        if isinstance(codec, ErrorFeedback):
            raise ValueError("the codec already has error feedback")
        self.codec, self.decay = codec, decay
        self.name = codec.name
        for capability in CAPABILITIES:  # on the wire it is the codec it wraps
            setattr(self, capability, getattr(codec, capability))
        self._residuals: dict[str, torch.Tensor] = {}

    def residual(self, key: str = "") -> torch.Tensor | None:
        """What has not been sent yet of tensor `key` (None before its first step).

        This is the live buffer, updated in place by the next step: clone it to keep a snapshot.
        """
        return self._residuals.get(key)

    def compensate(self, key: str, x: torch.Tensor) -> torch.Tensor:
        """x plus the residual kept for `key` (times `decay`), computed in the memory's own buffer (no new tensor)."""
        residual = per_tensor_state(self._residuals, key, x)
        return (residual.mul_(self.decay) if self.decay != 1.0 else residual).add_(x)

    def update(self, key: str, compensated: torch.Tensor, sent: torch.Tensor) -> None:
        """Remember what of `compensated` (the buffer compensate returned) the receiver did not get."""
        self._residuals[key] = compensated.sub_(sent)

    def encode_and_decode(self, x: torch.Tensor, key: str = "") -> tuple[torch.Tensor, torch.Tensor]:
        x = self._check_input(x)
        compensated = self.compensate(key, x)
        frame, sent = self.codec.encode_and_decode(compensated, key)
        self.update(key, compensated, sent)
        return frame, sent

    def encode(self, x: torch.Tensor, key: str = "") -> torch.Tensor:
        return self.encode_and_decode(x, key)[0]

    def decode(self, frame: torch.Tensor | bytes, *, max_bytes: int = MAX_FRAME_BYTES) -> torch.Tensor:
        return self.codec.decode(frame, max_bytes=max_bytes)

    def sends_raw(self, shape: tuple[int, ...]) -> bool:
        return self.codec.sends_raw(shape)

    def encoded_size(self, shape: tuple[int, ...], dtype: torch.dtype = torch.float32, **details: Any) -> int:
        return self.codec.encoded_size(shape, dtype, **details)

    def state_dict(self) -> dict[str, Any]:
        return {
            "codec": self.codec.state_dict(),
            "residuals": {key: value.clone() for key, value in self._residuals.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.codec.load_state_dict(state["codec"])
        self._residuals = {key: value.clone() for key, value in state["residuals"].items()}

    def __repr__(self) -> str:
        decay = f", decay={self.decay:g}" if self.decay != 1.0 else ""
        return f"ErrorFeedback({self.codec!r}{decay})"
