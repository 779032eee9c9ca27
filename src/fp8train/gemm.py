"""Scaled FP8 GEMMs: ``out = dequant(a) @ dequant(b)^T``, emulated on any device or on
FP8 hardware through ``torch._scaled_mm``.

Both operands are in "K-last" orientation: ``a`` is ``[M, K]``, ``b`` is ``[N, K]``, and any
per-group scales run along K (``axis=-1``). Use :func:`transpose` to feed a tensor
quantized along its first dim (``axis=0``) as the K-last operand of a grad GEMM.

The emulated backend computes exactly what the hardware computes, up to float32
accumulation order:

* ``tensor`` / ``row`` operands (scales constant along K): GEMM of the FP8 values (exact
  in bfloat16), float32 accumulation; power-of-two scales fold into the values, other
  scales multiply the float32 output.
* ``block*`` / ``mx`` operands: every K chunk (128 or 32) is promoted with its own scales.
  With power-of-two scales (the default of every block recipe, always for MX) the scales
  fold exactly into the operands, so one GEMM computes the same sum; other scales take the
  literal per-chunk loop in float32.

Outputs are rounded once, as the hardware rounds them: with power-of-two scales and a
bfloat16 output the GEMM runs in bfloat16 (float32 accumulation, bias folded into the
accumulation); otherwise it runs in float32 and the scales and bias are applied in
float32 before the one rounding. (A bfloat16 GEMM cannot give the float32 value of the
sum that a non-power-of-two scale must multiply, so ``tensorwise`` and ``delayed``, whose
scales are ``fp8_max / amax``, pay for float32 GEMMs in emulation.)
"""

from __future__ import annotations

import functools
import logging

import torch

from .quantize import _BLOCK, _CHUNK_ELEMENTS, QuantizedTensor, _view_2d_shape
from .layouts import blockwise_to_gemm_layout, swizzle_mx_scales

__all__ = ["BACKENDS", "scaled_mm", "transpose", "fp8_to_hp", "hardware_support"]

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "emulated", "hardware")
_K_UNIFORM = ("tensor", "row")
_HP_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def transpose(qt: QuantizedTensor) -> QuantizedTensor:
    """The transpose of a 2-D-viewed :class:`QuantizedTensor`, as a view.

    Data ``[A, B]`` becomes ``[B, A]`` and the scales follow, so a tensor quantized along
    its first dim (``axis=0``) becomes a K-last operand (``axis=-1``) and vice versa.
    ``tensor`` scales are unchanged; ``block128x128`` tiles transpose with the data.
    """
    data = qt.data.reshape(_view_2d_shape(qt.data.shape)).t()
    scale_inv = qt.scale_inv if qt.granularity == "tensor" else qt.scale_inv.t()
    axis = qt.axis
    if qt.granularity not in ("tensor", "block128x128"):
        axis = 0 if qt.axis == -1 else -1
    transposed = QuantizedTensor(
        data=data, scale_inv=scale_inv, granularity=qt.granularity, axis=axis, power_2_scales=qt.power_2_scales
    )
    cached = qt.__dict__.get("_emulated_operand")
    if cached is not None and qt.granularity in ("tensor", "block128x128"):
        # Values with one scale, or scales folded per tile, transpose as they are.
        compute_dtype, values, out_scale = cached
        transposed.__dict__["_emulated_operand"] = (compute_dtype, values.t(), out_scale)
    return transposed


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


def fp8_to_hp(data: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Exact FP8 -> ``dtype`` conversion (float32, bfloat16 or float16), NaN and inf kept.

    Equal, bit for bit, to ``data.to(dtype)`` and several times faster on CPU.
    """
    if data.dtype not in _RESTORE:
        raise ValueError(f"fp8_to_hp takes float8_e4m3fn or float8_e5m2 data, got {data.dtype}")
    if dtype not in _HP_DTYPES:
        raise ValueError(f"fp8_to_hp converts to float32, bfloat16 or float16, not {dtype}")
    if data.device.type != "cpu":
        return data.to(dtype)
    if data.dim() == 2 and not data.is_contiguous() and data.t().is_contiguous():
        # Convert in memory order; the GEMM takes the transposed view as it is.
        return fp8_to_hp(data.t(), dtype).t()
    work_dtype = torch.float32 if dtype == torch.float32 else torch.bfloat16
    src = data.contiguous().view(-1)
    if torch.compiler.is_compiling():
        values = torch.empty(src.shape, dtype=work_dtype, device=src.device)
        _convert_bits(src, values)
    else:
        values = torch.empty(src.shape, dtype=work_dtype)
        for start in range(0, src.numel(), _CHUNK_ELEMENTS):
            _convert_bits(src[start : start + _CHUNK_ELEMENTS], values[start : start + _CHUNK_ELEMENTS])
    special_code = _SPECIAL_CODE[data.dtype]
    # NaN (and E5M2 inf) codes come only from NaN inputs: check cheaply before fixing up
    # (a compiled graph fuses the fix-up, so it always takes it rather than branch on data).
    # Positive specials are the largest int8 codes, negative ones the largest uint8 codes.
    has_special = src.numel() > 0 and (
        torch.compiler.is_compiling()
        or bool(src.view(torch.int8).amax() >= special_code)
        or bool(src.view(torch.uint8).amax() >= 0x80 | special_code)
    )
    if has_special:
        exact = src.to(torch.float32).to(work_dtype)
        values = torch.where((src.view(torch.uint8) & 0x7F) >= special_code, exact, values)
    values = values.view(data.shape)
    return values if dtype == work_dtype else values.to(dtype)


@functools.lru_cache(maxsize=None)
def _log_backend_once(message: str) -> None:
    logger.info(message)


_HARDWARE_CAPABILITY = {
    # granularity family: (predicate on the CUDA capability, what it needs)
    "tensorwise/rowwise": (lambda cap: cap >= (8, 9), "SM 8.9+ (Ada, Hopper, Blackwell)"),
    "blockwise": (lambda cap: cap == (9, 0), "SM 9.0 (Hopper)"),
    "mxfp8": (lambda cap: cap[0] == 10, "SM 10.x (Blackwell)"),
}


def _family(a: QuantizedTensor, b: QuantizedTensor) -> str:
    grans = {a.granularity, b.granularity}
    if grans <= set(_K_UNIFORM):
        return "tensorwise/rowwise"
    if grans <= {"block1x128", "block128x128"}:
        return "blockwise"
    if grans == {"mx"}:
        return "mxfp8"
    raise NotImplementedError(
        f"no FP8 GEMM mixes {a.granularity!r} with {b.granularity!r}; quantize both operands "
        "with granularities of one recipe"
    )


def hardware_support(a: QuantizedTensor, b: QuantizedTensor) -> tuple[bool, str]:
    """Whether ``torch._scaled_mm`` on the operands' device runs this GEMM, and why not."""
    family = _family(a, b)
    predicate, needs = _HARDWARE_CAPABILITY[family]
    device = a.data.device
    if device.type != "cuda":
        return False, f"{family} FP8 GEMMs need a CUDA device with {needs}; the operands are on {device}"
    capability = torch.cuda.get_device_capability(device)
    if not predicate(capability):
        return False, f"{family} FP8 GEMMs need {needs}; {torch.cuda.get_device_name(device)} is SM {capability[0]}.{capability[1]}"
    return True, ""


def scaled_mm(
    a: QuantizedTensor,
    b: QuantizedTensor,
    out_dtype: torch.dtype = torch.bfloat16,
    *,
    backend: str = "auto",
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``dequant(a) @ dequant(b)^T (+ bias)`` as ``out_dtype``.

    Args:
        a: ``[M, K]`` operand, scaling groups along K (``axis=-1``) where it matters.
        b: ``[N, K]`` operand, likewise.
        out_dtype: float32, bfloat16 or float16.
        backend: ``"emulated"`` (any device), ``"hardware"`` (``torch._scaled_mm`` on a
            CUDA device that supports the recipe) or ``"auto"`` (hardware where supported,
            else emulated; the choice is logged once).
        bias: optional ``[N]`` tensor added to the output.

    Returns:
        ``[M, N]`` tensor of ``out_dtype``.

    Raises:
        ValueError: mismatched shapes, operands not K-last, bad dtype or backend.
        NotImplementedError: operands of different recipe families.
        RuntimeError: ``backend="hardware"`` on a device without FP8 GEMMs for the recipe.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} must be one of {', '.join(BACKENDS)}")
    if out_dtype not in _HP_DTYPES:
        raise ValueError(f"out_dtype={out_dtype} must be float32, bfloat16 or float16")
    for name, qt in (("a", a), ("b", b)):
        if qt.data.dim() != 2:
            raise ValueError(f"{name} must be 2-D, got shape {tuple(qt.data.shape)}")
        if qt.axis != -1 and qt.granularity not in ("tensor", "block128x128"):
            raise ValueError(
                f"{name} ({qt.granularity}) is scaled along its first dim (axis=0); the GEMM "
                f"contracts the last dim. Pass transpose({name}) of a tensor quantized along K"
            )
    if a.data.shape[1] != b.data.shape[1]:
        raise ValueError(
            f"contraction dims differ: a is {tuple(a.data.shape)}, b is {tuple(b.data.shape)} (both [*, K])"
        )
    family = _family(a, b)
    supported, reason = hardware_support(a, b)
    if backend == "hardware" and not supported:
        raise RuntimeError(f"no FP8 GEMM on this device: {reason}. Use backend='emulated'")
    use_hardware = supported and backend != "emulated"
    if backend == "auto":
        where = "hardware (torch._scaled_mm)" if use_hardware else f"emulated ({reason})"
        _log_backend_once(f"fp8train: {family} GEMMs on {a.data.device.type} run {where}")
    if use_hardware:
        return _hardware_mm(a, b, out_dtype, bias)
    return _emulated_mm(a, b, out_dtype, bias)


def _k_chunk(qt: QuantizedTensor) -> int:
    return _BLOCK.get(qt.granularity, 0)


def _scales_are_powers_of_2(qt: QuantizedTensor) -> bool:
    # Static (no look at the data), so compiled graphs do not break here.
    return qt.power_2_scales or qt.granularity == "mx"


def _per_k_scales(qt: QuantizedTensor, chunk: int) -> torch.Tensor:
    """Scales of every (row, K chunk) pair as float32 ``[rows, K / chunk]``."""
    rows, k = qt.data.shape
    group_rows, group_cols = qt.group_shape
    scale_inv = qt.scale_inv_float32().reshape(rows // group_rows, k // group_cols)
    scale_inv = scale_inv.repeat_interleave(group_rows, dim=0)
    if group_cols == k:
        return scale_inv.expand(rows, k // chunk)
    return scale_inv.repeat_interleave(group_cols // chunk, dim=1)


def _operand(qt: QuantizedTensor, compute_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """GEMM-ready values of an operand and the scale left to apply to the output.

    Power-of-two scales fold exactly into the values (one multiply in ``compute_dtype``);
    other scales of K-uniform operands are returned for the output instead.
    """
    cached = qt.__dict__.get("_emulated_operand")
    if cached is not None and cached[0] == compute_dtype:
        return cached[1], cached[2]
    values = fp8_to_hp(qt.data, compute_dtype)
    rows, k = qt.data.shape
    out_scale = None
    if values.numel() == 0:  # e.g. a grad_weight GEMM over zero tokens: the GEMM gives zeros
        return values, None
    if not _scales_are_powers_of_2(qt):
        out_scale = qt.scale_inv.reshape(-1, 1) if qt.granularity == "row" else qt.scale_inv
    elif qt.granularity == "tensor":
        values = values * qt.scale_inv.to(compute_dtype)
    else:
        group_rows, group_cols = qt.group_shape
        grouped = values.reshape(rows // group_rows, group_rows, k // group_cols, group_cols)
        scale_inv = qt.scale_inv_float32().to(compute_dtype)
        scale_inv = scale_inv.reshape(rows // group_rows, 1, k // group_cols, 1)
        values = (grouped * scale_inv).reshape(rows, k)
    if not torch.compiler.is_compiling():
        # A tensor reused by the backward (its transpose) skips a second conversion.
        qt.__dict__["_emulated_operand"] = (compute_dtype, values, out_scale)
    return values, out_scale


def _emulated_mm(
    a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Like the hardware: float32 accumulation, scales and bias applied in float32, one
    rounding to ``out_dtype``."""
    # _scaled_mm takes the bias in the output dtype; round it there first, as it does.
    bias = bias.to(out_dtype) if bias is not None else None
    chunk = max(_k_chunk(a), _k_chunk(b))
    all_powers_of_2 = _scales_are_powers_of_2(a) and _scales_are_powers_of_2(b)
    if chunk and not all_powers_of_2:
        out = _chunked_mm(a, b, chunk)
        return (out if bias is None else out + bias.to(torch.float32)).to(out_dtype)
    if all_powers_of_2 and out_dtype == torch.bfloat16:
        # Scales fold exactly into bfloat16 operands, and a bfloat16 GEMM accumulates in
        # float32 and rounds once: exactly the hardware's result, at bfloat16 speed.
        a_values, _ = _operand(a, torch.bfloat16)
        b_values, _ = _operand(b, torch.bfloat16)
        if bias is None:
            return torch.mm(a_values, b_values.t())
        return torch.mm(*_append_bias_column(a_values, b_values, bias))
    # Scales that are not powers of two (or a float16/float32 output) need the float32
    # value of the GEMM before the one rounding: run it in float32.
    a_values, a_scale = _operand(a, torch.float32)
    b_values, b_scale = _operand(b, torch.float32)
    out = torch.mm(a_values, b_values.t())
    if a_scale is not None:
        out = out * (a_scale if a_scale.dim() == 0 else a_scale.reshape(-1, 1))
    if b_scale is not None:
        out = out * (b_scale if b_scale.dim() == 0 else b_scale.reshape(1, -1))
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(out_dtype)


_BIAS_COLUMNS = 16  # keeps K a multiple of 16 for the GEMM


def _append_bias_column(a_values: torch.Tensor, b_values: torch.Tensor, bias: torch.Tensor):
    """``[a, 1, 0...]`` and ``[b, bias, 0...]``: their GEMM adds the bias inside the float32
    accumulation, so the output is still rounded once."""
    (m, k), n = a_values.shape, b_values.shape[0]
    a_ext = a_values.new_zeros(m, k + _BIAS_COLUMNS)
    b_ext = b_values.new_zeros(n, k + _BIAS_COLUMNS)
    a_ext[:, :k] = a_values
    a_ext[:, k] = 1
    b_ext[:, :k] = b_values
    b_ext[:, k] = bias.to(b_values.dtype)
    return a_ext, b_ext.t()


def _chunked_mm(a: QuantizedTensor, b: QuantizedTensor, chunk: int) -> torch.Tensor:
    """The literal per-chunk promotion: float32 partial product per K chunk, times both
    operands' chunk scales, added into a float32 accumulator."""
    a_values, b_values = fp8_to_hp(a.data, torch.float32), fp8_to_hp(b.data, torch.float32)
    a_scales, b_scales = _per_k_scales(a, chunk), _per_k_scales(b, chunk)
    out = torch.zeros(a.data.shape[0], b.data.shape[0], dtype=torch.float32, device=a.data.device)
    for c in range(a.data.shape[1] // chunk):
        k = slice(c * chunk, (c + 1) * chunk)
        partial = a_values[:, k] @ b_values[:, k].t()
        out += partial * a_scales[:, c : c + 1] * b_scales[:, c].reshape(1, -1)
    return out


def _hardware_mm(
    a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype, bias: torch.Tensor | None
) -> torch.Tensor:
    """``torch._scaled_mm`` with the operands laid out as cuBLAS wants them: ``a`` row-major,
    ``b`` column-major (``b.data.t()`` of a row-major ``[N, K]``), scales per recipe."""
    scale_a, scale_b = hardware_scales(a, b)
    a_data = a.data.contiguous()
    b_data = b.data.contiguous().t()
    if bias is not None and out_dtype == torch.float32:
        # _scaled_mm takes a bias only in the output's 16-bit dtype.
        return torch._scaled_mm(a_data, b_data, scale_a, scale_b, out_dtype=out_dtype) + bias.to(out_dtype)
    bias = bias.to(out_dtype) if bias is not None else None
    return torch._scaled_mm(a_data, b_data, scale_a, scale_b, bias=bias, out_dtype=out_dtype)


def hardware_scales(a: QuantizedTensor, b: QuantizedTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``scale_a``, ``scale_b`` arguments of ``torch._scaled_mm`` for ``a @ b^T``.

    tensorwise: float32 scalars. rowwise: ``(M, 1)`` and ``(1, N)``. blockwise: GEMM-ready
    scales (outer-dim-major, padded to 4) viewed as ``(M, K/128)`` / ``(K/128, N)`` or
    ``(K/128, N/128)``. MXFP8: the swizzled E8M0 scales of both operands.
    """
    family = _family(a, b)
    if family == "tensorwise/rowwise":
        if a.granularity != b.granularity:
            raise NotImplementedError(
                f"torch._scaled_mm takes tensorwise x tensorwise or rowwise x rowwise, not "
                f"{a.granularity} x {b.granularity}; use backend='emulated'"
            )
        if a.granularity == "tensor":
            return a.scale_inv.float(), b.scale_inv.float()
        return a.scale_inv.reshape(-1, 1).float().contiguous(), b.scale_inv.reshape(1, -1).float().contiguous()
    if family == "mxfp8":
        return swizzle_mx_scales(a.scale_inv).reshape(-1), swizzle_mx_scales(b.scale_inv).reshape(-1)
    # blockwise: GEMM-ready scales, transposed views into their padded storage.
    m, n = a.data.shape[0], b.data.shape[0]
    _, scales_a = blockwise_to_gemm_layout(a)
    _, scales_b = blockwise_to_gemm_layout(b)
    if a.granularity == "block1x128":
        scale_a = scales_a[:, :m].t()  # [K/128, pad4(M)] -> (M, K/128), stride (1, pad4(M))
    else:
        scale_a = scales_a[:, : a.data.shape[1] // 128]  # [M/128, pad4(K/128)] -> (M/128, K/128)
    if b.granularity == "block1x128":
        scale_b = scales_b[:, :n]  # [K/128, pad4(N)] -> (K/128, N)
    else:
        scale_b = scales_b[:, : b.data.shape[1] // 128].t()  # [N/128, pad4(K/128)] -> (K/128, N/128)
    return scale_a, scale_b

