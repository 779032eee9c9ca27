"""E2M1, the 4-bit data format of NVFP4 and MXFP4 (NUMERICS.md 6): the cast to its codes
(round to nearest even, or stochastic), the codes' values, and the packing of two codes a
byte (``torch.float4_e2m1fn_x2``) along one axis.

A code is 4 bits: bit 3 the sign, bits 0-2 the magnitude index into
``0, 0.5, 1, 1.5, 2, 3, 4, 6``. E2M1 has no inf and no NaN.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .constants import ConstantMemo, device_constant

__all__ = [
    "E2M1_VALUES", "cast_to_e2m1", "e2m1_to_float32", "pack_e2m1", "unpack_e2m1", "E2M1Constants",
    "E2M1_CONSTANTS", "e2m1_constants", "e2m1_codes", "pack_codes",
]

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


def _build_signed_rne(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Round to nearest even of signed ``v`` in one bucketize: ``(boundaries [16], codes [17])``
    with ``codes[bucketize(v, boundaries)]`` the code of ``v``.

    For ``v >= 0`` (``-0.0`` too) the magnitude index is the number of magnitude boundaries
    ``b`` below ``v``. For ``v < 0`` it is the number of ``b`` below ``-v``, that is of ``-b``
    above ``v``; bucketize counts from below, so each ``-b`` moves down one float32 step (``v``
    passes it where ``v >= -b``) and the count runs the other way: ``7 - index``. Between the
    two sides ``-2^-149``, the float32 just below zero, which every ``v >= -0.0`` passes. Last
    ``+inf``, which no ``v`` passes and NaN does (bucketize sorts NaN above every boundary):
    NaN's code, 0.
    """
    magnitude = _build_rne_boundaries(device)
    below = torch.full_like(magnitude, -math.inf)
    boundaries = torch.cat(
        (
            torch.nextafter(-magnitude.flip(0), below),
            torch.nextafter(torch.zeros_like(magnitude[:1]), below[:1]),
            magnitude,
            torch.full_like(magnitude[:1], math.inf),
        )
    )
    index = torch.arange(17, device=device)
    codes = torch.where(index < 8, (15 - index), (index - 8) % 8)  # 15..8 (negative), 0..7, 0 (NaN)
    return boundaries, codes.to(torch.uint8)


def _code_values(values: torch.Tensor) -> torch.Tensor:
    """The float32 value of each of the 16 codes (code 8 is ``-0.0``), from the magnitudes."""
    codes = torch.arange(16, device=values.device)
    magnitudes = values[codes & 7]
    return torch.where((codes & _SIGN_BIT) != 0, -magnitudes, magnitudes)


class E2M1Constants(NamedTuple):
    """E2M1's constant tensors on one device, built once (:data:`E2M1_CONSTANTS`): a cast or
    a GEMM operand looks them up instead of building them (issue 38).

    Attributes:
        rne_boundaries, rne_codes: float32 ``[16]`` and uint8 ``[17]``: round to nearest even
            of signed values by one bucketize (:func:`_build_signed_rne`).
        steps: float32 ``[7]``: the magnitudes past 0 (``E2M1_VALUES[1:]``), which
            stochastic rounding counts.
        values: float32 ``[8]``: :data:`E2M1_VALUES`.
        gaps: float32 ``[8]``: from each magnitude to the next (1 past the largest).
        code_values: float32 ``[16]``: each code's value (:func:`e2m1_to_float32`).
        byte_values: float32 ``[256, 2]``: a packed byte's two values, low nibble first.
    """

    rne_boundaries: torch.Tensor
    rne_codes: torch.Tensor
    steps: torch.Tensor
    values: torch.Tensor
    gaps: torch.Tensor
    code_values: torch.Tensor
    byte_values: torch.Tensor


def _build_constants(device: torch.device) -> E2M1Constants:
    values = device_constant(E2M1_VALUES, torch.float32, device)
    low, high = values, values[(torch.arange(len(E2M1_VALUES), device=device) + 1).clamp(max=len(E2M1_VALUES) - 1)]
    code_values = _code_values(values)
    byte = torch.arange(256, device=device)
    rne_boundaries, rne_codes = _build_signed_rne(device)
    return E2M1Constants(
        rne_boundaries=rne_boundaries,
        rne_codes=rne_codes,
        steps=values[1:].contiguous(),
        values=values,
        gaps=torch.where(high > low, high - low, torch.ones_like(high)),
        code_values=code_values,
        byte_values=torch.stack((code_values[byte & 0x0F], code_values[byte >> 4]), dim=-1),
    )


E2M1_CONSTANTS = ConstantMemo(_build_constants)
"""``E2M1_CONSTANTS[(device,)]``: the :class:`E2M1Constants` of a device
(``E2M1_CONSTANTS.build(device)`` while ``torch.compile`` traces)."""


def e2m1_constants(device: torch.device, traced: bool) -> E2M1Constants:
    """:data:`E2M1_CONSTANTS` of ``device``, built afresh where ``traced`` (``torch.compile``)."""
    return E2M1_CONSTANTS.build(device) if traced else E2M1_CONSTANTS[(device,)]


def _round_stochastically(
    magnitude: torch.Tensor, generator: torch.Generator | None, constants: E2M1Constants
) -> torch.Tensor:
    """``hi`` with probability ``(v - lo) / (hi - lo)``, else ``lo``; ``lo`` and ``hi`` the
    neighbours of ``v``. ``(v - lo)`` and the division by ``hi - lo`` (0.5, 1 or 2) are exact
    in float32, so the probability is exact; one uniform draw per value decides."""
    # lo's index: how many magnitudes past 0 v reaches (bucketize counts the steps <= v); a
    # NaN reaches none, as it compares false with every step.
    lower = torch.bucketize(magnitude.contiguous(), constants.steps, right=True)
    lower.masked_fill_(magnitude != magnitude, 0)
    probability = (magnitude - constants.values[lower]) / constants.gaps[lower]
    draw = torch.rand(magnitude.shape, generator=generator, dtype=torch.float32, device=magnitude.device)
    # A NaN probability (NaN input) compares false: code 0.
    return lower + (draw < probability)


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
    constants = e2m1_constants(v.device, torch.compiler.is_compiling())
    return e2m1_codes(v, stochastic_rounding, generator, constants)


def e2m1_codes(
    v: torch.Tensor, stochastic_rounding: bool, generator: torch.Generator | None, constants: E2M1Constants
) -> torch.Tensor:
    """:func:`cast_to_e2m1` with the device's :class:`E2M1Constants` at hand."""
    if not stochastic_rounding:  # sign and magnitude from one bucketize (_build_signed_rne)
        return torch.take(constants.rne_codes, torch.bucketize(v.contiguous(), constants.rne_boundaries))
    index = _round_stochastically(v.abs(), generator, constants)
    return (index + (v < 0) * _SIGN_BIT).to(torch.uint8)


def e2m1_to_float32(codes: torch.Tensor) -> torch.Tensor:
    """The float32 values of unpacked E2M1 ``codes`` (uint8, 0-15); code 8 is ``-0.0``."""
    constants = e2m1_constants(codes.device, torch.compiler.is_compiling())
    return constants.code_values[(codes & 0x0F).to(torch.int32)]


def pack_codes(codes: torch.Tensor, dim: int) -> torch.Tensor:
    """:func:`pack_e2m1`'s bytes as uint8 (for a caller that knows whether it is traced),
    contiguous where ``codes`` is (a quantization's, from its cast)."""
    before = (slice(None),) * (dim % codes.ndim)
    low, high = codes[before + (slice(0, None, 2),)], codes[before + (slice(1, None, 2),)]
    return low | (high << 4)


def pack_e2m1(codes: torch.Tensor, dim: int) -> torch.Tensor:
    """Two codes a byte along ``dim`` (even size): element ``2j`` in the low nibble and
    ``2j + 1`` in the high nibble of byte ``j``. Returns ``torch.float4_e2m1fn_x2`` with
    ``dim`` halved; inside ``torch.compile`` the same bytes as uint8 (inductor, torch 2.13,
    has no float4 dtype; every reader here takes either)."""
    packed = pack_codes(codes, dim).contiguous()
    return packed if torch.compiler.is_compiling() else packed.view(torch.float4_e2m1fn_x2)


def unpack_e2m1(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """The codes (uint8, one a byte) of ``torch.float4_e2m1fn_x2`` (or its uint8 bytes)
    ``packed``: ``dim`` doubled."""
    dim = dim % packed.ndim
    byte = packed.view(torch.uint8)
    return torch.stack((byte & 0x0F, byte >> 4), dim=dim + 1).flatten(dim, dim + 1)
