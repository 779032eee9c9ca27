"""FP8 number formats and the saturating cast.

A format is a handful of facts (exponent and mantissa bits, bias, whether it has
infinities); everything else is a derived property named like ``torch.finfo``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

__all__ = [
    "FloatFormat",
    "E4M3",
    "E5M2",
    "E8M0",
    "Format",
    "format_of",
    "cast_to_fp8",
]


@dataclass(frozen=True, kw_only=True)
class FloatFormat:
    """The facts that define a small binary float format.

    Attributes:
        name: Short name, e.g. ``"E4M3"``.
        exponent_bits: Number of exponent bits.
        mantissa_bits: Number of explicit mantissa bits.
        bias: Exponent bias.
        has_infinities: Whether the all-ones exponent encodes infinities (E5M2).
        has_sign: Whether the format has a sign bit (E8M0 has none).
        has_subnormals: Whether the zero exponent encodes subnormals.
        nan_uses_top_mantissa_only: E4M3 "fn" style: only ``S.1111.111`` is NaN, so the
            top exponent also holds finite values.
        dtype: The matching ``torch`` dtype.
    """

    name: str
    exponent_bits: int
    mantissa_bits: int
    bias: int
    has_infinities: bool
    has_sign: bool
    has_subnormals: bool
    nan_uses_top_mantissa_only: bool
    dtype: torch.dtype

    @property
    def bits(self) -> int:
        """Total number of bits (8 for every format here)."""
        return int(self.has_sign) + self.exponent_bits + self.mantissa_bits

    @property
    def max(self) -> float:
        """Largest finite value."""
        top_exponent = (1 << self.exponent_bits) - 1
        if self.has_infinities:
            # The all-ones exponent is reserved for inf/NaN.
            return 2.0 ** (top_exponent - 1 - self.bias) * (2 - 2.0**-self.mantissa_bits)
        if self.nan_uses_top_mantissa_only:
            # All-ones mantissa at the top exponent is NaN: one code below it is the max.
            return 2.0 ** (top_exponent - self.bias) * (2 - 2.0 ** (1 - self.mantissa_bits))
        # E8M0: 0xFF is NaN, 0xFE the max.
        return 2.0 ** (top_exponent - 1 - self.bias)

    @property
    def min(self) -> float:
        """Most negative finite value (``-max``, or the smallest value when unsigned)."""
        return -self.max if self.has_sign else self.smallest_normal

    @property
    def smallest_normal(self) -> float:
        """Smallest positive normal value (``tiny`` in ``torch.finfo``)."""
        if not self.has_subnormals and self.mantissa_bits == 0:
            # E8M0 has no zero: exponent field 0 is 2^-bias.
            return 2.0**-self.bias
        return 2.0 ** (1 - self.bias)

    @property
    def tiny(self) -> float:
        """Alias of :attr:`smallest_normal`, as in ``torch.finfo``."""
        return self.smallest_normal

    @property
    def smallest_subnormal(self) -> float | None:
        """Smallest positive subnormal value, or ``None`` for formats without subnormals."""
        if not self.has_subnormals:
            return None
        return 2.0 ** (1 - self.bias - self.mantissa_bits)

    @property
    def eps(self) -> float:
        """Difference between 1.0 and the next representable value."""
        return 2.0**-self.mantissa_bits

    def __repr__(self) -> str:
        return f"FloatFormat({self.name}, max={self.max}, bias={self.bias})"


E4M3 = FloatFormat(
    name="E4M3",
    exponent_bits=4,
    mantissa_bits=3,
    bias=7,
    has_infinities=False,
    has_sign=True,
    has_subnormals=True,
    nan_uses_top_mantissa_only=True,
    dtype=torch.float8_e4m3fn,
)
E5M2 = FloatFormat(
    name="E5M2",
    exponent_bits=5,
    mantissa_bits=2,
    bias=15,
    has_infinities=True,
    has_sign=True,
    has_subnormals=True,
    nan_uses_top_mantissa_only=False,
    dtype=torch.float8_e5m2,
)
E8M0 = FloatFormat(
    name="E8M0",
    exponent_bits=8,
    mantissa_bits=0,
    bias=127,
    has_infinities=False,
    has_sign=False,
    has_subnormals=False,
    nan_uses_top_mantissa_only=False,
    dtype=torch.float8_e8m0fnu,
)

_FORMATS_BY_DTYPE = {f.dtype: f for f in (E4M3, E5M2, E8M0)}
FP8_DATA_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_CASTABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def format_of(dtype: torch.dtype) -> FloatFormat:
    """Return the :class:`FloatFormat` of an FP8 ``torch`` dtype.

    Raises:
        ValueError: if ``dtype`` is not one of ``float8_e4m3fn``, ``float8_e5m2``,
            ``float8_e8m0fnu``.
    """
    try:
        return _FORMATS_BY_DTYPE[dtype]
    except KeyError:
        valid = ", ".join(str(d) for d in _FORMATS_BY_DTYPE)
        raise ValueError(f"dtype {dtype} is not an fp8train format; use one of {valid}") from None


class Format(enum.Enum):
    """Which FP8 format each role of a training step uses.

    ``E4M3`` everywhere, ``E5M2`` everywhere (rejected by every recipe), or ``HYBRID``:
    E4M3 for input and weight (forward), E5M2 for grad_output (backward).
    """

    E4M3 = "E4M3"
    E5M2 = "E5M2"
    HYBRID = "HYBRID"

    @property
    def forward_dtype(self) -> torch.dtype:
        """Dtype of the input and weight operands."""
        return torch.float8_e5m2 if self is Format.E5M2 else torch.float8_e4m3fn

    @property
    def backward_dtype(self) -> torch.dtype:
        """Dtype of the grad_output operand."""
        return torch.float8_e4m3fn if self is Format.E4M3 else torch.float8_e5m2


def _check_fp8_data_dtype(dtype: torch.dtype) -> FloatFormat:
    if dtype not in FP8_DATA_DTYPES:
        raise ValueError(
            f"dtype {dtype} is not an FP8 data format; use torch.float8_e4m3fn or torch.float8_e5m2"
        )
    return _FORMATS_BY_DTYPE[dtype]


def cast_to_fp8(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cast to FP8 with round-to-nearest-even, saturating.

    Finite values and infinities beyond the largest finite value become +-max; NaN stays
    NaN. (PyTorch's own cast to ``float8_e5m2`` overflows to inf instead.)

    Args:
        x: float32, bfloat16 or float16 tensor of any shape.
        dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.

    Returns:
        A tensor of ``dtype`` with the shape of ``x``.

    Raises:
        ValueError: on an unsupported target or source dtype.
    """
    fmt = _check_fp8_data_dtype(dtype)
    if x.dtype not in _CASTABLE_DTYPES:
        raise ValueError(
            f"cast_to_fp8 takes float32, bfloat16 or float16 input, got {x.dtype}; convert it first"
        )
    if dtype == torch.float8_e4m3fn:
        # PyTorch's E4M3 conversion already rounds to nearest even and saturates (its "fn"
        # format has no inf); tests hold it to ml_dtypes on every code, tie and overflow.
        return x.to(dtype)
    # E5M2 conversion overflows to inf: clamp first. +-max is exact in all three source
    # dtypes and clamp keeps NaN, so the conversion's rounding is the only one.
    return x.clamp(-fmt.max, fmt.max).to(dtype)
