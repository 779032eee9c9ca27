"""FP8 and FP4 number formats: facts only, no framework.

A format is a handful of facts (exponent and mantissa bits, bias, whether it has
infinities); everything else is a derived property named like ``torch.finfo``. Each
frontend maps a format to its own dtype by :attr:`FloatFormat.dtype_name`, the name
PyTorch, JAX and ``ml_dtypes`` share (``fp8train.quant.cast.torch_dtype`` for PyTorch).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from .checks import check_bool, check_int, check_type
from .hash_once import hash_once, state_without_hash

__all__ = ["FloatFormat", "E4M3", "E5M2", "E8M0", "E2M1", "FORMATS", "DATA_FORMATS", "FP8_DATA_FORMATS", "Format"]


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
        dtype_name: Name of the matching dtype in PyTorch, JAX and ``ml_dtypes``. For E2M1
            it is PyTorch's packed ``float4_e2m1fn_x2`` (two values a byte); ``ml_dtypes``
            and JAX name the unpacked one ``float4_e2m1fn``.
        has_nan: Whether some code is NaN (E2M1 has none: every code is finite).
    """

    name: str
    exponent_bits: int
    mantissa_bits: int
    bias: int
    has_infinities: bool
    has_sign: bool
    has_subnormals: bool
    nan_uses_top_mantissa_only: bool
    dtype_name: str
    has_nan: bool = True

    __hash__ = hash_once  # kernels cache per rule and format: hashed once
    __getstate__ = state_without_hash

    def __post_init__(self) -> None:
        check_type("name", self.name, str, "a string")
        check_int("exponent_bits", self.exponent_bits, minimum=1)
        check_int("mantissa_bits", self.mantissa_bits, minimum=0)
        check_int("bias", self.bias)
        for flag in ("has_infinities", "has_sign", "has_subnormals", "nan_uses_top_mantissa_only", "has_nan"):
            check_bool(flag, getattr(self, flag))
        check_type("dtype_name", self.dtype_name, str, "a string")

    @property
    def bits(self) -> int:
        """Total number of bits (8 for the FP8 formats and E8M0, 4 for E2M1)."""
        return int(self.has_sign) + self.exponent_bits + self.mantissa_bits

    @property
    def max(self) -> float:
        """Largest finite value."""
        top_exponent = (1 << self.exponent_bits) - 1
        if self.has_infinities:
            # The all-ones exponent is reserved for inf/NaN.
            return 2.0 ** (top_exponent - 1 - self.bias) * (2 - 2.0**-self.mantissa_bits)
        if not self.has_nan and self.has_sign:
            # E2M1: every code is finite, the top code is the max.
            return 2.0 ** (top_exponent - self.bias) * (2 - 2.0**-self.mantissa_bits)
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
    dtype_name="float8_e4m3fn",
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
    dtype_name="float8_e5m2",
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
    dtype_name="float8_e8m0fnu",
)

E2M1 = FloatFormat(
    name="E2M1",
    exponent_bits=2,
    mantissa_bits=1,
    bias=1,
    has_infinities=False,
    has_sign=True,
    has_subnormals=True,
    nan_uses_top_mantissa_only=False,
    dtype_name="float4_e2m1fn_x2",
    has_nan=False,
)

FORMATS = (E4M3, E5M2, E8M0, E2M1)
"""Every format fp8train knows: the two FP8 data formats, the E8M0 scale format and the
4-bit E2M1 data format."""

FP8_DATA_FORMATS = (E4M3, E5M2)
"""The 8-bit formats a tensor's values are quantized to."""

DATA_FORMATS = (E4M3, E5M2, E2M1)
"""The formats a tensor's values are quantized to (E8M0 only holds scales); E2M1 only with
a 4-bit granularity (``nvfp4``, ``nvfp4_2d``, ``mxfp4``)."""


class Format(enum.Enum):
    """Which FP8 format each role of a training step uses.

    ``E4M3`` everywhere, ``E5M2`` everywhere (rejected by every recipe), or ``HYBRID``:
    E4M3 for input and weight (forward), E5M2 for grad_output (backward).
    """

    E4M3 = "E4M3"
    E5M2 = "E5M2"
    HYBRID = "HYBRID"

    @property
    def forward(self) -> FloatFormat:
        """Format of the input and weight operands."""
        return E5M2 if self is Format.E5M2 else E4M3

    @property
    def backward(self) -> FloatFormat:
        """Format of the grad_output operand."""
        return E4M3 if self is Format.E4M3 else E5M2
