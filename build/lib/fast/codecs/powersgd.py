"""PowerSGD (Vogels et al. 2019): a rank-r approximation P Q^T from one step of power iteration.

A tensor is seen as the matrix M = x.reshape(shape[0], -1) (n x m). With the Q of the last step
(warm start; a seeded random one the first time):

    P = M Q          (n x r)       summable: all-reduce it across workers
    P = orthonormalise(P)
    Q = M^T P        (m x r)       summable: all-reduce it across workers
    receiver sees P Q^T

Single-process `encode` sends P and Q (fp32) in one frame. Across workers the two halves are
separate steps around two all-reduces (`compute_p`, `compute_q`, `decompress`); every worker must
build the codec with the same seed so that the first Q agrees. Tensors of fewer than 2 dimensions,
and matrices whose factors would not be smaller than the matrix, travel raw. The paper's algorithm
uses error feedback: `build_codec("powersgd")` wraps it in ErrorFeedback unless told otherwise.
"""

from __future__ import annotations

import math
import zlib

import torch

from fast.codecs.base import Codec, positive_int
from fast.codecs.packing import BodyReader, tensor_bytes
from fast.errors import ConfigError


def matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """(rows, columns) of the matrix view of a tensor of `shape`: the first axis against the rest."""
    rows = shape[0]
    return rows, math.prod(shape) // rows


def orthonormalise(p: torch.Tensor) -> torch.Tensor:
    """An orthonormal basis (n x r) of the columns of `p` (reduced QR; the paper uses Gram-Schmidt)."""
    return torch.linalg.qr(p, mode="reduced").Q


class PowerSGD(Codec):
    """Rank-`rank` compression by power iteration, warm-started from the previous step's Q."""

    low_rank = True
    contractive = True

    name = "powersgd"
    per_tensor_state = {"q": "_q"}

    def __init__(self, *, rank: int = 1, warm_start: bool = True, min_elements: int = 0, seed: int = 0):
        super().__init__(min_elements=min_elements, seed=seed)
        self.rank = positive_int("rank", rank)
        if not isinstance(warm_start, bool):
            raise ConfigError(f"codec option warm_start must be true or false, got {warm_start!r}")
        self.warm_start = warm_start
        self._q: dict[str, torch.Tensor] = {}

    def sends_raw(self, shape: tuple[int, ...]) -> bool:
        if super().sends_raw(shape) or len(shape) < 2:
            return True
        rows, columns = matrix_shape(shape)
        return (rows + columns) * self._rank_for(rows, columns) >= rows * columns

    def _rank_for(self, rows: int, columns: int) -> int:
        return min(self.rank, rows, columns)

    def _start_q(self, key: str, rows: int, columns: int, device: torch.device) -> torch.Tensor:
        """The Q this step starts from: the last one for `key` (warm start) or a fresh random one."""
        rank = self._rank_for(rows, columns)
        q = self._q.get(key) if self.warm_start else None
        if q is not None and q.shape == (columns, rank):
            return q
        if q is not None:
            raise ValueError(
                f"tensor key {key!r} was used for a {q.shape[0]}-column matrix and now for {columns} columns: "
                "give every tensor its own key"
            )
        if self.warm_start:  # the first Q depends only on (seed, key), so every worker draws the same one
            generator = torch.Generator().manual_seed((self.seed * 1_000_003 + zlib.crc32(key.encode())) % 2**63)
        else:
            generator = self.generator("cpu")
        return torch.randn(columns, rank, generator=generator).to(device)

    def compute_p(self, key: str, matrix: torch.Tensor) -> torch.Tensor:
        """P = M Q (n x r), to be summed across workers."""
        rows, columns = matrix.shape
        return matrix.float() @ self._start_q(key, rows, columns, matrix.device)

    def compute_q(self, key: str, matrix: torch.Tensor, p_sum: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(orthonormalised P, Q = M^T P); Q is to be summed across workers."""
        p = orthonormalise(p_sum)
        return p, matrix.float().T @ p

    def decompress(self, key: str, p: torch.Tensor, q_sum: torch.Tensor) -> torch.Tensor:
        """P Q^T (n x m); keeps Q as the next step's warm start. Divide Q by the worker count for a mean."""
        if self.warm_start:
            self._q[key] = q_sum.detach().clone()
        return p @ q_sum.T

    def _encode_body(self, x: torch.Tensor, key: str) -> torch.Tensor:
        matrix = x.reshape(matrix_shape(tuple(x.shape)))
        p, q = self.compute_q(key, matrix, self.compute_p(key, matrix))
        if self.warm_start:
            self._q[key] = q.clone()
        return torch.cat([tensor_bytes(p), tensor_bytes(q)])

    def _decode_body(self, body: BodyReader, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        rows, columns = matrix_shape(shape)
        rank = self._rank_for(rows, columns)
        p = body.take(torch.float32, rows * rank).view(rows, rank)
        q = body.take(torch.float32, columns * rank).view(columns, rank)
        return (p @ q.T).to(dtype).reshape(shape)

    def _body_size(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        rows, columns = matrix_shape(shape)
        return 4 * (rows + columns) * self._rank_for(rows, columns)

    def __repr__(self) -> str:
        return f"PowerSGD(rank={self.rank}, warm_start={self.warm_start}, seed={self.seed})"
