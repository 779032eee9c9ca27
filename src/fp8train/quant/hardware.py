"""The hardware scaled GEMM: ``torch._scaled_mm`` on a CUDA device with FP8 tensor cores,
with each GEMM family's scale arguments laid out as cuBLAS wants them.

The 4-bit route (NVFP4, MXFP4 on SM 10.x) is written against PyTorch's documented
``torch._scaled_mm`` (``float4_e2m1fn_x2`` operands, block scales swizzled in 128x4 tiles,
its shape checks exercised on the ``meta`` device in the tests) and has not run on a
Blackwell GPU here: see docs/numerics.md."""

from __future__ import annotations

import torch

from ..spec.granularities import GemmFamily
from .fp4_gemm import fp4_alpha
from .layouts import blockwise_to_gemm_layout, swizzle_mx_scales
from .tensor import QuantizedTensor

__all__ = ["hardware_support", "hardware_mm", "hardware_scales", "hardware_fp4_arguments"]


def hardware_support(a: QuantizedTensor, b: QuantizedTensor) -> tuple[bool, str]:
    """Whether ``torch._scaled_mm`` on the operands' device runs this GEMM, and why not.

    Raises:
        NotImplementedError: operands of different GEMM families.
    """
    family = GemmFamily.of(a.granularity, b.granularity)
    device = a.data.device
    kind = "4-bit" if a.granularity.fp4 else "FP8"
    if device.type != "cuda":
        return False, f"{family.label} {kind} GEMMs need a CUDA device with {family.needs}; the operands are on {device}"
    capability = torch.cuda.get_device_capability(device)
    if not family.supports(capability):
        name = torch.cuda.get_device_name(device)
        return False, f"{family.label} {kind} GEMMs need {family.needs}; {name} is SM {capability[0]}.{capability[1]}"
    return True, ""


def hardware_mm(
    a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype, bias: torch.Tensor | None
) -> torch.Tensor:
    """``torch._scaled_mm`` with the operands laid out as cuBLAS wants them: ``a`` row-major,
    ``b`` column-major (``b.data.t()`` of a row-major ``[N, K]``), scales per family."""
    if a.granularity.fp4:
        return _hardware_fp4_mm(a, b, out_dtype, bias)
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
    ``(K/128, N/128)``. MXFP8, MXFP4, NVFP4: the swizzled block scales of both operands.

    Raises:
        NotImplementedError: operands of different families, or tensorwise x rowwise.
    """
    family = GemmFamily.of(a.granularity, b.granularity)
    if family is GemmFamily.TENSORWISE_ROWWISE:
        if a.granularity != b.granularity:
            raise NotImplementedError(
                f"torch._scaled_mm takes tensorwise x tensorwise or rowwise x rowwise, not "
                f"{a.granularity} x {b.granularity}; use backend='emulated'"
            )
        if a.granularity.per_tensor:
            return a.scale_inv.float(), b.scale_inv.float()
        return a.scale_inv.reshape(-1, 1).float().contiguous(), b.scale_inv.reshape(1, -1).float().contiguous()
    if family is GemmFamily.MXFP8:
        return swizzle_mx_scales(a.scale_inv).reshape(-1), swizzle_mx_scales(b.scale_inv).reshape(-1)
    if a.granularity.fp4:
        return _fp4_scales(a), _fp4_scales(b)
    return _blockwise_scales(a, b)


def _fp4_scales(qt: QuantizedTensor) -> torch.Tensor:
    """A K-last 4-bit operand's block scales as the FP4 GEMM takes them: one per (row, K
    block) (16x16 tiles repeated over their rows), swizzled in 128x4 tiles as MXFP8's, flat."""
    rows_per_group = qt.group_shape[0]
    scale_inv = qt.scale_inv.view(torch.uint8)
    if rows_per_group > 1:
        scale_inv = scale_inv.repeat_interleave(rows_per_group, dim=0)
    return swizzle_mx_scales(scale_inv).view(qt.scale_inv.dtype).reshape(-1)


def hardware_fp4_arguments(a: QuantizedTensor, b: QuantizedTensor) -> tuple:
    """``(a_data, b_data, scale_a, scale_b, alpha)`` of the 4-bit ``torch._scaled_mm``:
    ``a`` ``[M, K/2]`` row-major and ``b`` ``[K/2, N]`` column-major ``float4_e2m1fn_x2``,
    the swizzled E4M3 (NVFP4) or E8M0 (MXFP4) scales, and NVFP4's float32 ``alpha``
    (``None`` for MXFP4), which the caller applies to the float32 output."""
    scale_a, scale_b = hardware_scales(a, b)
    # Laid out through uint8: PyTorch (2.13) has no copy kernel for float4_e2m1fn_x2.
    a_data = a.data.view(torch.uint8).contiguous().view(torch.float4_e2m1fn_x2)
    b_data = b.data.view(torch.uint8).contiguous().view(torch.float4_e2m1fn_x2).t()
    return a_data, b_data, scale_a, scale_b, fp4_alpha(a, b)


def _hardware_fp4_mm(a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype, bias) -> torch.Tensor:
    """The block-scaled FP4 GEMM in float32, then ``* alpha`` and the bias in float32 and
    one rounding, as the emulation (``_scaled_mm`` (torch 2.13) takes no per-tensor alpha
    with block scales; applying it to a 16-bit output would round twice)."""
    a_data, b_data, scale_a, scale_b, alpha = hardware_fp4_arguments(a, b)
    out = torch._scaled_mm(a_data, b_data, scale_a, scale_b, out_dtype=torch.float32)
    if alpha is not None:
        out = out * alpha
    if bias is not None:
        out = out + bias.to(out_dtype).to(torch.float32)
    return out.to(out_dtype)


def _blockwise_scales(a: QuantizedTensor, b: QuantizedTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GEMM-ready block scales as transposed views into their padded storage."""
    m, n = a.data.shape[0], b.data.shape[0]
    _, scales_a = blockwise_to_gemm_layout(a)
    _, scales_b = blockwise_to_gemm_layout(b)
    if not a.granularity.symmetric:
        scale_a = scales_a[:, :m].t()  # [K/128, pad4(M)] -> (M, K/128), stride (1, pad4(M))
    else:
        scale_a = scales_a[:, : a.data.shape[1] // a.granularity.block]  # [M/128, pad4(K/128)] -> (M/128, K/128)
    if not b.granularity.symmetric:
        scale_b = scales_b[:, :n]  # [K/128, pad4(N)] -> (K/128, N)
    else:
        scale_b = scales_b[:, : b.data.shape[1] // b.granularity.block].t()  # [N/128, pad4(K/128)] -> (K/128, N/128)
    return scale_a, scale_b
