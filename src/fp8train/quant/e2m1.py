"""E2M1, the 4-bit data format of NVFP4 and MXFP4 (NUMERICS.md 6): the cast to its codes
(round to nearest even, or stochastic), the codes' values, and the packing of two codes a
byte (``torch.float4_e2m1fn_x2``) along one axis.

A code is 4 bits: bit 3 the sign, bits 0-2 the magnitude index into
``0, 0.5, 1, 1.5, 2, 3, 4, 6``. E2M1 has no inf and no NaN.
"""

from __future__ import annotations

import torch

from .constants import ConstantCache, device_constant

__all__ = ["E2M1_VALUES", "cast_to_e2m1", "e2m1_to_float32", "pack_e2m1", "unpack_e2m1"]

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""The magnitudes of codes 0-7 (code | 8 is the negative)."""

# Round to nearest, ties to even: the magnitude index is the number of midpoints that |v|
# passes. A midpoint between an even and an odd index goes to the even one, so |v| passes the
# midpoint above an even index only strictly (">"), the one above an odd index with ">=".
# torch.bucketize counts the boundaries strictly below |v|; for float32 |v|, ">= m" is
# "> the float32 just below m", so those boundaries move down one float32 step.
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_SIGN_BIT = 8


def _build_rne_boundaries(device: torch.device) -> torch.Tensor:
    midpoints = torch.tensor(_MIDPOINTS, dtype=torch.float32, device=device)
    lower_index_is_odd = torch.arange(len(_MIDPOINTS), device=device) % 2 == 1
    return torch.where(lower_index_is_odd, torch.nextafter(midpoints, torch.zeros_like(midpoints)), midpoints)


_rne_boundaries = ConstantCache(_build_rne_boundaries)
"""The boundaries per device, built once (a step copies nothing from the host)."""


def _round_to_nearest_even(magnitude: torch.Tensor) -> torch.Tensor:
    index = torch.bucketize(magnitude.contiguous(), _rne_boundaries(magnitude.device), out_int32=True)
    # NaN sorts above every boundary: code 0, as the contract says.
    return torch.where(torch.isnan(magnitude), 0, index).to(torch.uint8)


def _round_stochastically(magnitude: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """``hi`` with probability ``(v - lo) / (hi - lo)``, else ``lo``; ``lo`` and ``hi`` the
    neighbours of ``v``. ``(v - lo)`` and the division by ``hi - lo`` (0.5, 1 or 2) are exact
    in float32, so the probability is exact; one uniform draw per value decides."""
    values = device_constant(E2M1_VALUES, torch.float32, magnitude.device)
    lower = torch.zeros(magnitude.shape, dtype=torch.int64, device=magnitude.device)
    for value in E2M1_VALUES[1:]:
        lower += (magnitude >= value).to(torch.int64)
    upper = (lower + 1).clamp(max=len(E2M1_VALUES) - 1)
    low, high = values[lower], values[upper]
    gap = torch.where(high > low, high - low, torch.ones_like(high))
    probability = (magnitude - low) / gap
    draw = torch.rand(magnitude.shape, generator=generator, dtype=torch.float32, device=magnitude.device)
    # A NaN probability (NaN input) compares false: code 0.
    return (lower + (draw < probability).to(torch.int64)).to(torch.uint8)


def cast_to_e2m1(
    v: torch.Tensor, *, stochastic_rounding: bool = False, generator: torch.Generator | None = None
) -> torch.Tensor:
    """The E2M1 codes (uint8, 0-15, one a byte, unpacked) of float32 ``v`` already clamped
    to ``[-6, 6]``.

    Round to nearest, ties to even (0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4),
    or with ``stochastic_rounding`` up with probability ``(v - lo) / (hi - lo)`` from
    ``generator`` (representable values unchanged). ``v < 0`` sets the sign bit, also when
    it rounds to zero; ``-0.0`` and NaN give code 0.
    """
    magnitude = v.abs()
    if stochastic_rounding:
        index = _round_stochastically(magnitude, generator)
    else:
        index = _round_to_nearest_even(magnitude)
    return index | (v < 0).to(torch.uint8) * _SIGN_BIT


def e2m1_to_float32(codes: torch.Tensor) -> torch.Tensor:
    """The float32 values of unpacked E2M1 ``codes`` (uint8, 0-15); code 8 is ``-0.0``."""
    magnitudes = device_constant(E2M1_VALUES, torch.float32, codes.device)
    values = magnitudes[(codes & 7).to(torch.int64)]
    return torch.where((codes & _SIGN_BIT) != 0, -values, values)


def pack_e2m1(codes: torch.Tensor, dim: int) -> torch.Tensor:
    """Two codes a byte along ``dim`` (even size): element ``2j`` in the low nibble and
    ``2j + 1`` in the high nibble of byte ``j``. Returns ``torch.float4_e2m1fn_x2`` with
    ``dim`` halved; inside ``torch.compile`` the same bytes as uint8 (inductor, torch 2.13,
    has no float4 dtype; every reader here takes either)."""
    dim = dim % codes.dim()
    pairs = codes.unflatten(dim, (-1, 2))
    low, high = pairs.select(dim + 1, 0), pairs.select(dim + 1, 1)
    packed = (low | (high << 4)).contiguous()
    return packed if torch.compiler.is_compiling() else packed.view(torch.float4_e2m1fn_x2)


def unpack_e2m1(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """The codes (uint8, one a byte) of ``torch.float4_e2m1fn_x2`` (or its uint8 bytes)
    ``packed``: ``dim`` doubled."""
    dim = dim % packed.dim()
    byte = packed.view(torch.uint8)
    return torch.stack((byte & 0x0F, byte >> 4), dim=dim + 1).flatten(dim, dim + 1)
