"""The random Hadamard transform (RHT) of NVFP4 (NUMERICS.md 6, Transformer Engine's
``NVFP4BlockScaling``): each run of 16 consecutive values along the scaling axis is
multiplied by ``H = diag(s) H16 / 4``, which spreads an outlier over its run before the
block scale sees it. ``H`` is orthonormal, so a GEMM whose two operands are both
transformed along the contraction dim is unchanged in exact arithmetic.
"""

from __future__ import annotations

import torch

from .constants import ConstantCache

__all__ = ["RHT_SIZE", "RHT_SIGNS", "hadamard_matrix", "random_hadamard_transform", "hadamard_transform", "rht_matrix"]

RHT_SIZE = 16
RHT_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)
"""The sign vector ``s`` of Transformer Engine's transform (its fixed "random" signs)."""


def hadamard_matrix(dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> torch.Tensor:
    """``H = diag(s) H16 / 4`` (``H16`` Sylvester's 16x16 +-1 matrix, ``H16[i][j] =
    (-1)^popcount(i & j)``): row ``i`` of ``H16`` times ``s[i]``, divided by 4."""
    index = torch.arange(RHT_SIZE)
    parity = torch.zeros(RHT_SIZE, RHT_SIZE, dtype=torch.int64)
    both = index.reshape(-1, 1) & index.reshape(1, -1)
    for bit in range(4):
        parity ^= (both >> bit) & 1
    sylvester = 1 - 2 * parity
    signs = torch.tensor(RHT_SIGNS).reshape(-1, 1)
    return (signs * sylvester).to(dtype=dtype, device=device) / 4


_device_hadamard_matrix = ConstantCache(hadamard_matrix)
""":func:`hadamard_matrix` per ``(dtype, device)``, built (and copied to the device) once."""


def rht_matrix(device: torch.device) -> torch.Tensor:
    """The float32 :func:`hadamard_matrix` on ``device`` that :func:`hadamard_transform` takes."""
    return _device_hadamard_matrix(torch.float32, device)


def random_hadamard_transform(x: torch.Tensor, axis: int) -> torch.Tensor:
    """``y_j = sum_i x_i H[i][j]`` over each run of 16 along ``axis`` of the 2-D view of ``x``
    (``-1``: the last dim; ``0``: the first, flattened dim), products and sums in float32 in
    index order, rounded once to ``x``'s dtype. Returns a tensor of ``x``'s shape.

    The sum is a loop over ``i`` (16 vectorized steps), not a matmul, so that the float32
    addition order is the contract's on every device and every BLAS.
    """
    return hadamard_transform(x, axis, rht_matrix(x.device))


def hadamard_transform(x: torch.Tensor, axis: int, matrix: torch.Tensor) -> torch.Tensor:
    """:func:`random_hadamard_transform` with its float32 matrix on ``x``'s device at hand
    (:func:`rht_matrix`): a 2-D ``x`` takes no reshape and no conversion that changes nothing."""
    shape = x.shape
    x_2d = x if x.ndim == 2 else (x.reshape(-1, shape[-1]) if x.ndim > 2 else x.reshape(1, -1))
    runs_last = x_2d if axis == -1 else x_2d.T
    rows, length = runs_last.shape
    runs = runs_last.reshape(rows, length // RHT_SIZE, RHT_SIZE)
    runs = runs if runs.dtype == torch.float32 else runs.to(torch.float32)
    out = runs[:, :, 0:1] * matrix[0]
    for i in range(1, RHT_SIZE):
        out += runs[:, :, i : i + 1] * matrix[i]
    out = out.reshape(rows, length)
    out = out if x.dtype == torch.float32 else out.to(x.dtype)
    out = out if axis == -1 else out.T
    return out if x.ndim == 2 else out.reshape(shape)
