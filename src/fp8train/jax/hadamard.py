"""The random Hadamard transform (RHT) of NVFP4 in JAX (NUMERICS.md 6), the twin of
:mod:`fp8train.quant.hadamard`: each run of 16 consecutive values along the scaling axis is
multiplied by ``H = diag(s) H16 / 4``.

``y_j = sum_i x_i H[i][j]``: products and sums in float32 in index order, rounded once to
``x``'s dtype. The sum is 16 explicit steps (a ``lax.scan`` over ``i``), each an IEEE add (:func:`exact_add`, which
keeps subnormals where XLA's CPU would flush them), and every product ``x_i * (+-1/4)`` is
rounded as IEEE rounds it (:func:`exact_multiply`): XLA does not reassociate float adds
(no fast-math), and no multiply feeds an add it could fuse, since each product comes back
through a bitcast.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..spec.granularities import view_2d_shape
from .cast import to_float32
from .ieee import exact_add, exact_multiply

__all__ = ["RHT_SIZE", "RHT_SIGNS", "hadamard_matrix", "random_hadamard_transform"]

RHT_SIZE = 16
RHT_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)
"""The sign vector ``s`` of Transformer Engine's transform (its fixed "random" signs)."""


def hadamard_matrix() -> np.ndarray:
    """``H = diag(s) H16 / 4`` as float32 NumPy (``H16[i][j] = (-1)^popcount(i & j)``)."""
    index = np.arange(RHT_SIZE)
    both = index.reshape(-1, 1) & index.reshape(1, -1)
    parity = np.zeros((RHT_SIZE, RHT_SIZE), np.int64)
    for bit in range(4):
        parity ^= (both >> bit) & 1
    signs = np.asarray(RHT_SIGNS).reshape(-1, 1)
    return (signs * (1 - 2 * parity) / 4).astype(np.float32)


def random_hadamard_transform(x: jax.Array, axis: int) -> jax.Array:
    """The transform of each run of 16 along ``axis`` (-1: the last dim; 0: the first,
    flattened dim) of the 2-D view of ``x``; returns an array of ``x``'s shape and dtype."""
    shape = x.shape
    m, k = view_2d_shape(tuple(shape))
    x_2d = to_float32(x).reshape(m, k)
    runs_last = x_2d if axis == -1 else x_2d.T
    rows, length = runs_last.shape
    # [i, rows, runs, 1]: step i of the sum adds x_i times row i of H to every output j.
    runs = jnp.moveaxis(runs_last.reshape(rows, length // RHT_SIZE, RHT_SIZE), 2, 0)[..., None]
    matrix = jnp.asarray(hadamard_matrix())

    def add_row(out, step):
        x_i, h_i = step
        return exact_add(out, exact_multiply(x_i, h_i)), None

    first = exact_multiply(runs[0], matrix[0])
    out, _ = lax.scan(add_row, first, (runs[1:], matrix[1:]))  # in index order, one body compiled
    out = out.reshape(rows, length).astype(x.dtype)  # a conversion: subnormals kept
    return (out if axis == -1 else out.T).reshape(shape)
