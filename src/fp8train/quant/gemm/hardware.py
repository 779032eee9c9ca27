"""The hardware scaled GEMM: ``torch._scaled_mm`` on a CUDA device with FP8 tensor cores,
with each GEMM family's arguments laid out as PyTorch checks them and cuBLAS reads them.

Which calls come here is decided by :mod:`fp8train.quant.gemm.hardware_support`; every layout
built here is pinned by a CPU test against the emulation (tests/quant/gemm/test_gemm_hardware.py,
tests/quant/gemm/test_hardware_layouts.py, through an independent float64 reading of the
arguments as PyTorch and cuBLAS document them).

The 4-bit route (NVFP4, MXFP4 on SM 10.x) is written against PyTorch's documented
``torch._scaled_mm`` (``float4_e2m1fn_x2`` operands, block scales swizzled in 128x4 tiles,
its shape checks exercised on the ``meta`` device in the tests) and has not run on a
Blackwell GPU here: see docs/numerics.md."""

from __future__ import annotations

from typing import NamedTuple

import torch

from ...spec.granularities import GemmFamily, round_up
from ..cast import scale_dtype
from ..layouts import blockwise_gemm_scales, swizzle_mx_scales
from ..tensor import QuantizedTensor
from .fp4 import fp4_alpha

__all__ = ["ScaledMmArguments", "hardware_arguments", "hardware_mm", "hardware_scales", "hardware_fp4_arguments"]

_BLOCK_K_MULTIPLE = 4  # 128x128 scales: PyTorch wants stride K/128, cuBLAS reads stride pad4(K/128)
_OUTER_MULTIPLE = 4  # 1x128 scales: the outer dim's stride, 16-byte aligned


class ScaledMmArguments(NamedTuple):
    """The FP8 arguments of ``torch._scaled_mm`` for ``a @ b^T``.

    Attributes:
        a_data: ``[M', K']`` row-major (``M' >= M`` and ``K' >= K`` where padded with zeros).
        b_data: ``[K', N]`` column-major.
        scale_a: ``scale_a`` as PyTorch checks it (shape and strides).
        scale_b: ``scale_b`` likewise.
        rows: ``M``, the output rows to keep.
    """

    a_data: torch.Tensor
    b_data: torch.Tensor
    scale_a: torch.Tensor
    scale_b: torch.Tensor
    rows: int


def hardware_arguments(a: QuantizedTensor, b: QuantizedTensor) -> ScaledMmArguments:
    """The arguments of the FP8 ``torch._scaled_mm`` for ``a @ b^T``: ``a`` row-major,
    ``b`` column-major (``b.data.t()`` of a row-major ``[N, K]``), scales per family
    (:func:`hardware_scales`).

    Raises:
        NotImplementedError: operands of different families.
    """
    family = GemmFamily.of(a.granularity, b.granularity)
    if family is GemmFamily.BLOCKWISE:
        return _blockwise_arguments(a, b)
    scale_a, scale_b = _scales(a, b, family)
    return ScaledMmArguments(a.data.contiguous(), b.data.contiguous().t(), scale_a, scale_b, a.data.shape[0])


def hardware_mm(
    a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype, bias: torch.Tensor | None
) -> torch.Tensor:
    """``torch._scaled_mm`` with :func:`hardware_arguments` (the 4-bit route through
    :func:`hardware_fp4_arguments`). The bias goes into the GEMM for a 16-bit output and
    is added after it for float32 (``_scaled_mm`` takes no bias with a float32 output)."""
    if a.granularity.fp4:
        return _hardware_fp4_mm(a, b, out_dtype, bias)
    args = hardware_arguments(a, b)
    gemm_bias = bias.to(out_dtype) if bias is not None and out_dtype != torch.float32 else None
    # use_fast_accum=False: the accurate accumulation (on an H200 fp32-out errors of 2e-4
    # of max|result| against 2.6e-3 with fast accumulation).
    out = torch._scaled_mm(
        args.a_data, args.b_data, args.scale_a, args.scale_b,
        bias=gemm_bias, out_dtype=out_dtype, use_fast_accum=False,
    )  # fmt: skip
    if out.shape[0] != args.rows:
        out = out[: args.rows]
    if bias is not None and gemm_bias is None:
        out = out + bias.to(out_dtype)
    return out


def hardware_scales(a: QuantizedTensor, b: QuantizedTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``scale_a``, ``scale_b`` arguments of ``torch._scaled_mm`` for ``a @ b^T``.

    tensorwise: float32 scalars. rowwise: ``(M, 1)`` and ``(1, N)``, contiguous; a
    tensorwise operand beside a rowwise one has its scale expanded to that vector.
    blockwise: 1x128 scales ``(M', K'/128)`` with strides ``(1, M')`` (``b``: ``(K'/128, N)``,
    strides ``(N, 1)``), 128x128 tiles ``(M/128, K'/128)`` with strides ``(K'/128, 1)``
    (``b``: ``(K'/128, N/128)``, strides ``(1, K'/128)``), where K' pads K to a multiple of
    512 beside a 128x128 operand and M' pads M to a multiple of 4. MXFP8, MXFP4, NVFP4: the
    swizzled block scales of both operands, E8M0 (MX; uint8 inside ``torch.compile`` viewed
    as E8M0) or E4M3 (NVFP4).

    Raises:
        NotImplementedError: operands of different families.
    """
    family = GemmFamily.of(a.granularity, b.granularity)
    if family is GemmFamily.BLOCKWISE:
        layout = _blockwise_layout(a, b)
        return layout.scale_a, layout.scale_b
    return _scales(a, b, family)


def _scales(a: QuantizedTensor, b: QuantizedTensor, family: GemmFamily) -> tuple[torch.Tensor, torch.Tensor]:
    if family is GemmFamily.TENSORWISE_ROWWISE:
        if a.granularity.per_tensor and b.granularity.per_tensor:
            return a.scale_inv.float(), b.scale_inv.float()
        # A tensorwise operand beside a rowwise one: its scale as the rowwise vector.
        m, n = a.data.shape[0], b.data.shape[0]
        scale_a = a.scale_inv.float().reshape(-1, 1).expand(m, 1).contiguous()
        return scale_a, b.scale_inv.float().reshape(1, -1).expand(1, n).contiguous()
    if a.granularity.fp4:
        return _fp4_scales(a), _fp4_scales(b)
    # MXFP8: E8M0 whatever the dtype they arrive in (uint8 inside torch.compile).
    return (
        swizzle_mx_scales(a.scale_inv).view(scale_dtype(a.granularity)).reshape(-1),
        swizzle_mx_scales(b.scale_inv).view(scale_dtype(b.granularity)).reshape(-1),
    )


def _fp4_scales(qt: QuantizedTensor) -> torch.Tensor:
    """A K-last 4-bit operand's block scales as the FP4 GEMM takes them: one per (row, K
    block) (16x16 tiles repeated over their rows), swizzled in 128x4 tiles as MXFP8's, flat."""
    rows_per_group = qt.group_shape[0]
    scale_inv = qt.scale_inv.view(torch.uint8)
    if rows_per_group > 1:
        scale_inv = scale_inv.repeat_interleave(rows_per_group, dim=0)
    # E8M0 (MXFP4) or E4M3 (NVFP4) whatever they arrive as (uint8 inside torch.compile).
    return swizzle_mx_scales(scale_inv).view(scale_dtype(qt.granularity)).reshape(-1)


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


class _BlockwiseLayout(NamedTuple):
    """Where a blockwise GEMM's operands go: the scales as PyTorch checks them, and the
    padded shape of the data (``rows`` x ``k_padded`` for ``a``, ``N`` x ``k_padded`` for ``b``)."""

    scale_a: torch.Tensor
    scale_b: torch.Tensor
    rows: int
    k_padded: int


def _blockwise_layout(a: QuantizedTensor, b: QuantizedTensor) -> _BlockwiseLayout:
    """PyTorch (2.10 to 2.14) checks a 128x128 operand's scales for stride K/128 exactly
    while cuBLAS reads them with stride pad4(K/128) (torch refused K/128 = 1, 2, 3, 5 on an
    H200; the unpadded stride ran and gave wrong results): beside a 128x128 operand K is
    padded with zero blocks to a multiple of 4 blocks, where both agree. PyTorch checks a
    1x128 ``a``'s scales for stride M; M is padded to a multiple of 4, where that stride is
    the 16-byte aligned one too. Padded scales are zero. Reads the scales only."""
    m, k = a.data.shape
    n = b.data.shape[0]
    k_blocks = k // a.granularity.block
    if a.granularity.symmetric or b.granularity.symmetric:
        k_blocks = round_up(k_blocks, _BLOCK_K_MULTIPLE)
    rows = m if a.granularity.symmetric else round_up(m, _OUTER_MULTIPLE)
    scale_a = blockwise_gemm_scales(a, rows, k_blocks)
    scale_b = blockwise_gemm_scales(b, n, k_blocks)
    # 1x128: [K'/128, M'] storage seen as (M', K'/128); 128x128: [M/128, K'/128] as it is.
    scale_a = scale_a if a.granularity.symmetric else scale_a.t()
    scale_b = scale_b.t() if b.granularity.symmetric else scale_b
    return _BlockwiseLayout(scale_a, scale_b, rows, k_blocks * a.granularity.block)


def _blockwise_arguments(a: QuantizedTensor, b: QuantizedTensor) -> ScaledMmArguments:
    """The blockwise GEMM's arguments: :func:`_blockwise_layout`'s scales and the data
    zero-padded to its shape (padded data is zero)."""
    layout = _blockwise_layout(a, b)
    a_data = _zero_padded(a.data, layout.rows, layout.k_padded)
    b_data = _zero_padded(b.data, b.data.shape[0], layout.k_padded).t()
    return ScaledMmArguments(a_data, b_data, layout.scale_a, layout.scale_b, a.data.shape[0])


def _zero_padded(data: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``data`` contiguous, zero-padded to ``[rows, cols]`` (FP8 zero is the zero byte)."""
    if tuple(data.shape) == (rows, cols):
        return data.contiguous()
    padded = torch.zeros(rows, cols, dtype=torch.uint8, device=data.device)
    padded[: data.shape[0], : data.shape[1]] = data.view(torch.uint8)
    return padded.view(data.dtype)
