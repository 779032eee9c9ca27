"""The numba kernels of delayed scaling's per-step arithmetic on the CPU, behind
:mod:`.delayed` (imported only when numba is): an amax folded into a history element as
``torch.maximum`` folds it, and the update of a state's scales and history, bit for bit
:func:`fp8train.quant.scaling.update_scale_and_history`'s PyTorch ops (about a dozen ops on
a ``(amax_history_len, 3)`` buffer, the most of a small delayed layer's host time: issue 38).

Values are handled by their float32 bits where they are copied (a NaN's payload kept), as
float32 where compared and divided (one IEEE float32 division, as PyTorch's).
"""

from __future__ import annotations

import numba
import numpy as np

from .numba_elements import F, U, at, f32_bits, f32_from_bits

_QUIET_NAN = U(0x7FC00000)  # what PyTorch's maximum of one element gives for a NaN operand
_FLOAT32_MAX = F(np.finfo(np.float32).max)


@numba.njit(cache=True, inline="always", error_model="numpy")
def fold_max(into, value):
    """``into[0] = torch.maximum(into[0], value)`` for one float32 element held as its bits
    (``into``: a one-element uint32 array): the quiet NaN where either is NaN, else the
    larger, the element kept where they compare equal (PyTorch's scalar path)."""
    current = f32_from_bits(into[0])
    if current != current or value != value:
        into[0] = _QUIET_NAN
    elif current < value:
        into[0] = f32_bits(value)


@numba.njit(cache=True, error_model="numpy")
def update_delayed_at(history, scale, length, columns, num_roles, lo, hi, fp8_max, divisor, most_recent):
    """Rescale and roll, in place, the columns of roles ``lo`` to ``hi`` (column ``c`` is role
    ``c % num_roles``) of the contiguous float32 ``history`` ``(length, columns)`` and
    ``scale`` ``(columns,)`` at those addresses, as ``update_scale_and_history`` does:

    * a column whose current amax (row 0) is 0 did not run: left as it is;
    * amax = the history's max (NaN if it holds one), or row 0 (``most_recent``);
    * scale = ``fp8_max[role] / amax`` (``/ divisor``, ``2**margin``, where not 1; an
      overflow to inf gives float32's max) where ``0 < amax < inf``, else unchanged;
    * history rolled up one row (row 0 to the last row), then row 0 zeroed.
    """
    bits = at(history, (length, columns), U(0))
    scales = at(scale, (columns,), F(0))
    for c in range(columns):
        role = c % num_roles
        if role < lo or role >= hi or f32_from_bits(bits[0, c]) == F(0):
            continue
        amax = f32_from_bits(bits[0, c])
        if not most_recent:
            for i in range(1, length):
                v = f32_from_bits(bits[i, c])
                if v != v or amax != amax:
                    amax = F(np.nan)
                elif v > amax:
                    amax = v
        if amax > F(0) and amax < F(np.inf):
            new_scale = F(F(fp8_max[role]) / amax)
            if divisor != F(1):
                new_scale = F(new_scale / divisor)
            scales[c] = _FLOAT32_MAX if new_scale == F(np.inf) else new_scale
        first = bits[0, c]
        for i in range(length - 1):
            bits[i, c] = bits[i + 1, c]
        bits[length - 1, c] = first
        bits[0, c] = U(0)
