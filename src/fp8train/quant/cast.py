"""PyTorch's side of the formats: dtypes, the saturating cast to FP8, the exact (fast on
CPU) conversion back, and E8M0's decoding (exact powers of two from bits)."""

from __future__ import annotations

import torch

from ..spec.checks import ArgumentTypeError
from ..spec.formats import E4M3, E5M2, E8M0, FloatFormat
from ..spec.granularities import Granularity

__all__ = [
    "check_tensor",
    "FP8_DATA_DTYPES",
    "HIGH_PRECISION_DTYPES",
    "CHUNK_ELEMENTS",
    "torch_dtype",
    "DTYPE_BY_NAME",
    "scale_dtype",
    "format_of",
    "cast_to_fp8",
    "cast_scratch_to_fp8",
    "fp8_to_hp",
    "checked_fp8_to_hp",
    "exp2_int",
    "e8m0_to_float32",
    "e8m0_float32_bits",
]

_FORMATS = (E4M3, E5M2, E8M0)
_DTYPES_BY_NAME = {fmt.dtype_name: getattr(torch, fmt.dtype_name) for fmt in _FORMATS}
_FORMATS_BY_DTYPE = {_DTYPES_BY_NAME[fmt.dtype_name]: fmt for fmt in _FORMATS}
DTYPE_BY_NAME = _DTYPES_BY_NAME
"""The ``torch`` dtype of each format by its ``dtype_name``: :func:`torch_dtype` without its
check, for a format already checked (a rule's), in one subscript (issue 38)."""
FP8_DATA_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
HIGH_PRECISION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
CHUNK_ELEMENTS = 1 << 20
"""Elements per step of the chunked CPU kernels: a few MB, so intermediates stay in cache."""


def check_tensor(name: str, value: object) -> torch.Tensor:
    """``value`` if it is a ``torch.Tensor``.

    Raises:
        TypeError: anything else (a list or NumPy array: convert with ``torch.as_tensor``).
    """
    if not isinstance(value, torch.Tensor):
        raise ArgumentTypeError(
            f"{name} must be a torch.Tensor, got {type(value).__name__}; convert it with torch.as_tensor"
        )
    return value


def torch_dtype(fmt: FloatFormat) -> torch.dtype:
    """The ``torch`` dtype of a :class:`~fp8train.spec.formats.FloatFormat`.

    Raises:
        ValueError: ``fmt`` is not one of E4M3, E5M2, E8M0.
    """
    dtype = _DTYPES_BY_NAME.get(getattr(fmt, "dtype_name", None))
    if dtype is None or (_FORMATS_BY_DTYPE[dtype] is not fmt and _FORMATS_BY_DTYPE[dtype] != fmt):
        raise ValueError(f"{fmt!r} is not an fp8train format; use E4M3, E5M2 or E8M0")
    return dtype


def scale_dtype(granularity: Granularity) -> torch.dtype:
    """The ``torch`` dtype of ``granularity``'s ``scale_inv``."""
    return getattr(torch, granularity.scale_dtype_name)


def format_of(dtype: torch.dtype) -> FloatFormat:
    """Return the :class:`~fp8train.spec.formats.FloatFormat` of an FP8 ``torch`` dtype.

    Raises:
        ValueError: if ``dtype`` is not one of ``float8_e4m3fn``, ``float8_e5m2``,
            ``float8_e8m0fnu``.
    """
    try:
        return _FORMATS_BY_DTYPE[dtype]
    except KeyError:
        valid = ", ".join(str(d) for d in _FORMATS_BY_DTYPE)
        raise ValueError(f"dtype {dtype} is not an fp8train format; use one of {valid}") from None


def _check_fp8_data_dtype(dtype: torch.dtype) -> FloatFormat:
    if dtype not in FP8_DATA_DTYPES:
        raise ValueError(
            f"dtype {dtype} is not an FP8 data format; use torch.float8_e4m3fn or torch.float8_e5m2"
        )
    return _FORMATS_BY_DTYPE[dtype]


def cast_to_fp8(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cast to FP8 with round-to-nearest-even, saturating, on every device and torch release.

    Finite values and infinities beyond the largest finite value become +-max; NaN stays
    NaN. PyTorch's own conversion does not promise that: to ``float8_e5m2`` it overflows to
    inf, and to ``float8_e4m3fn`` it gives NaN past 448 on CUDA (and on every device before
    torch 2.12); only torch 2.12+ on the CPU saturates.

    Args:
        x: float32, bfloat16 or float16 tensor of any shape.
        dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.

    Returns:
        A tensor of ``dtype`` with the shape of ``x``.

    Raises:
        ValueError: on an unsupported target or source dtype.
    """
    fmt = _check_cast(x, dtype)
    # Clamp first, so the conversion never sees a value past +-max: +-max is exact in all
    # three source dtypes and clamp keeps NaN, so the conversion's rounding to nearest even
    # is the only rounding (tests hold it to ml_dtypes on every code, tie and overflow, also
    # under a conversion that turns overflow into NaN as CUDA's does).
    return x.clamp(-fmt.max, fmt.max).to(dtype)


def cast_scratch_to_fp8(scratch: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """:func:`cast_to_fp8` of a temporary the caller owns and drops after (quantization's
    ``x * scale``): clamped in place, so the cast allocates no second full-size temporary.
    ``scratch`` holds the clamped values after the call."""
    fmt = _check_cast(scratch, dtype)
    return scratch.clamp_(-fmt.max, fmt.max).to(dtype)


def _check_cast(x: torch.Tensor, dtype: torch.dtype) -> FloatFormat:
    """The format of a cast of ``x`` to ``dtype``, both checked."""
    check_tensor("x", x)
    fmt = _check_fp8_data_dtype(dtype)
    if x.dtype not in HIGH_PRECISION_DTYPES:
        raise ValueError(
            f"cast_to_fp8 takes float32, bfloat16 or float16 input, got {x.dtype}; convert it first"
        )
    return fmt


# fp8 -> bfloat16/float32 by bit arithmetic: PyTorch's own CPU conversion is scalar and
# ~10x slower. Shifting the code's exponent and mantissa into the target's fields gives
# value * 2^-bias_gap exactly (FP8 subnormals land on the target's subnormals), and one
# power-of-two multiply restores the value. Sign: sign-extend int8, shift, keep the top bit.
_FP8_BITS = {
    # (fp8 dtype, target): (integer dtype, shift, mask of sign + exponent + mantissa fields)
    (torch.float8_e4m3fn, torch.bfloat16): (torch.int16, 4, -30736),  # 0x87F0
    (torch.float8_e5m2, torch.bfloat16): (torch.int16, 5, -28704),  # 0x8FE0
    (torch.float8_e4m3fn, torch.float32): (torch.int32, 20, -2014314496),  # 0x87F00000
    (torch.float8_e5m2, torch.float32): (torch.int32, 21, -1881145344),  # 0x8FE00000
}
_RESTORE = {torch.float8_e4m3fn: 2.0**120, torch.float8_e5m2: 2.0**112}  # 2^(127 - bias)
_SPECIAL_CODE = {torch.float8_e4m3fn: 0x7F, torch.float8_e5m2: 0x7C}  # NaN (and E5M2 inf) from here


def _convert_bits(src: torch.Tensor, dst: torch.Tensor) -> None:
    """Fill ``dst`` (bfloat16 or float32, 1-D) with the values of FP8 ``src`` (1-D)."""
    int_dtype, shift, mask = _FP8_BITS[(src.dtype, dst.dtype)]
    bits = src.view(torch.int8).to(int_dtype)
    bits.bitwise_left_shift_(shift).bitwise_and_(mask)
    torch.mul(bits.view(dst.dtype), _RESTORE[src.dtype], out=dst)


DIRECT_ELEMENTS = 4096
"""Up to this many codes :func:`fp8_to_hp` on the CPU takes PyTorch's own conversion: scalar,
but one op where the bit arithmetic is five, and faster below about 8K codes (issue 38)."""


def fp8_to_hp(data: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Exact FP8 -> ``dtype`` conversion (float32, bfloat16 or float16), NaN and inf kept.

    Equal, bit for bit, to ``data.to(dtype)`` and several times faster on CPU.
    """
    if data.dtype not in _RESTORE:
        raise ValueError(f"fp8_to_hp takes float8_e4m3fn or float8_e5m2 data, got {data.dtype}")
    if dtype not in HIGH_PRECISION_DTYPES:
        raise ValueError(f"fp8_to_hp converts to float32, bfloat16 or float16, not {dtype}")
    if data.device.type != "cpu":
        return data.to(dtype)
    return checked_fp8_to_hp(data, dtype, torch.compiler.is_compiling())


def checked_fp8_to_hp(data: torch.Tensor, dtype: torch.dtype, traced: bool, numel: int | None = None) -> torch.Tensor:
    """:func:`fp8_to_hp` of FP8 ``data`` to a high-precision ``dtype``, both already checked (a
    quantized tensor's codes, a GEMM's compute dtype), without the checks' calls; ``traced``:
    whether ``torch.compile`` traces this, which the caller knows (issue 38). ``numel``:
    the count of codes of more than two dims (whose values come back contiguous), where the
    caller has it (a quantizer's 4-D view of blocks): no call asks for the count or the layout."""
    if data.device.type != "cpu":
        return data.to(dtype)
    if numel is not None:
        layout = torch.contiguous_format
    else:
        # In memory order: a 2-D transposed view's values come back transposed (the GEMM
        # takes them as they are), any other layout's contiguous.
        transposed = data.ndim == 2 and not data.is_contiguous() and data.T.is_contiguous()
        layout = torch.preserve_format if transposed else torch.contiguous_format
        try:  # a GEMM operand's 2-D codes: their count without a call (issue 38)
            rows, cols = data.shape
            numel = rows * cols
        except ValueError:
            numel = data.numel()
    if numel <= DIRECT_ELEMENTS and not traced:
        # Finite codes are exact in every target; NaN and inf as the bit path's fix-up
        # gives them (through float32, then bfloat16).
        values = data.to(torch.float32, memory_format=layout)
        if dtype == torch.float32:
            return values
        values = values.to(torch.bfloat16)
        return values if dtype == torch.bfloat16 else values.to(dtype)
    work_dtype = torch.float32 if dtype == torch.float32 else torch.bfloat16
    if numel > CHUNK_ELEMENTS and not traced:
        values = _chunked_values(data, work_dtype, layout)
    else:  # one chunk: no slices, no flattening (issue 38's host calls)
        src = data  # read in `layout`: no contiguous copy of its own
        int_dtype, shift, mask = _FP8_BITS[(src.dtype, work_dtype)]
        bits = src.view(torch.int8).to(int_dtype, memory_format=layout)
        magnitude = bits & 0x7F  # the codes' magnitude bits (the int8 was sign-extended)
        bits <<= shift
        bits &= mask
        values = bits.view(work_dtype) * _RESTORE[src.dtype]
        if numel > 0 and (traced or bool(magnitude.amax() >= _SPECIAL_CODE[src.dtype])):
            values = _with_special_codes(src, values, magnitude, layout)
    return values if dtype == work_dtype else values.to(dtype)


def _chunked_values(data: torch.Tensor, work_dtype: torch.dtype, layout: torch.memory_format) -> torch.Tensor:
    """:func:`checked_fp8_to_hp`'s values of a large CPU tensor, converted a chunk at a time."""
    if layout is torch.preserve_format:
        return _chunked_values(data.t(), work_dtype, torch.contiguous_format).t()
    src = data.contiguous().view(-1)
    values = torch.empty(src.shape, dtype=work_dtype, device=src.device)
    for start in range(0, src.numel(), CHUNK_ELEMENTS):
        _convert_bits(src[start : start + CHUNK_ELEMENTS], values[start : start + CHUNK_ELEMENTS])
    magnitude = src.view(torch.uint8) & 0x7F
    if bool(magnitude.amax() >= _SPECIAL_CODE[src.dtype]):
        values = _with_special_codes(src, values, magnitude, layout)
    return values.view(data.shape)


# NaN (and E5M2 inf) codes come only from NaN inputs: the bit paths check cheaply for them
# before fixing them up (a compiled graph fuses the fix-up, so it always takes it rather
# than branch on data). A code is special where its magnitude bits (the low 7) reach the
# first special code.


def _with_special_codes(src, values, magnitude, layout: torch.memory_format) -> torch.Tensor:
    """``values`` of the FP8 codes ``src`` with their NaN (and E5M2 inf) codes' values put
    right (``magnitude``: the codes' low 7 bits, in ``values``' layout)."""
    exact = src.to(torch.float32, memory_format=layout).to(values.dtype)
    return torch.where(magnitude >= _SPECIAL_CODE[src.dtype], exact, values)


def exp2_int(exponent: torch.Tensor) -> torch.Tensor:
    """Exactly ``2**exponent`` in float32 for integer ``exponent`` in ``[-149, 127]``.

    Built from bits (normal and subnormal) rather than ``torch.exp2``, whose vectorized
    CPU implementation need not be exact.
    """
    exponent = exponent.to(torch.int32)
    normal = ((exponent + 127).clamp(min=1) << 23).view(torch.float32)
    subnormal = (torch.ones_like(exponent) << (exponent + 149).clamp(0, 22)).view(torch.float32)
    return torch.where(exponent >= -126, normal, subnormal)


def e8m0_to_float32(scales: torch.Tensor) -> torch.Tensor:
    """Decode E8M0 scales (``float8_e8m0fnu`` or their uint8 bits) to float32: ``2**(e - 127)``,
    0xFF -> NaN. Pure integer arithmetic, so compiled graphs need no E8M0 kernels."""
    return e8m0_float32_bits(scales.view(torch.uint8).to(torch.int32)).view(torch.float32)


def e8m0_float32_bits(exponent: torch.Tensor) -> torch.Tensor:
    """The float32 bits (int32) of the E8M0 codes ``exponent`` (int32 in ``[0, 255]``), in
    operators only (issue 38: no Python call): a code ``e`` in 1..254 is the float32 whose
    exponent bits are ``e``, ``e << 23``; code 0 is the subnormal ``2^-127`` and 0xFF NaN,
    ``e << 23`` with bit 22 set too (0x00400000 and 0x7FC00000, ``float('nan')``'s bits)."""
    edge = (((exponent + 1) & 0xFF) - 2) >> 31  # all ones where exponent is 0 or 0xFF, else 0
    return (exponent << 23) | (edge & 0x400000)
