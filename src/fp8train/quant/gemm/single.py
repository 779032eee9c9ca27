"""The emulated block-scaled GEMM on CUDA as one GEMM (issue 40): the folded operands in
bfloat16, one ``torch.mm(..., out_dtype=torch.float32)``, then the scales left for the
output, NVFP4's ``alpha`` and the bias in float32, and one rounding to the output dtype.

Why it is exact (NUMERICS.md 4 and 6): every operand value the emulation multiplies is
exact in bfloat16 (an FP8 value times a power-of-two scale; an E2M1 value times its E4M3
or E8M0 block scale, at most 6 significant bits; an FP8 value alone where its scale is
applied to the output), so each product is exact in float32, and a bfloat16 GEMM with a
float32 output accumulates in float32 and writes the float32 sum: the sum the float32 GEMM
of the same values gives, up to the order of its float32 additions, at bfloat16 speed.
The bfloat16 output of the older path rounded before NVFP4's ``alpha`` or a tensorwise
scale could be applied, so those took a float32 GEMM; MXFP8 and MXFP4 with a bias copied
both operands to append the bias column. Here neither: the bias is added to the float32
sum, before the one rounding, as ``torch._scaled_mm`` adds it.

The same holds under ``torch.compile`` (inductor lowers ``aten.mm.dtype`` on CUDA), and
``torch.autocast`` leaves that overload alone. The CPU has no ``mm`` with ``out_dtype``
(``aten.mm.dtype`` is CUDA and XPU only): CPU GEMMs keep their paths, bits and speed.
"""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["one_gemm_runs", "float32_product", "one_gemm"]


def one_gemm_runs(data: torch.Tensor, gemm_dtype: torch.dtype) -> bool:
    """Whether an emulated GEMM of operands whose codes are ``data`` (the first operand's)
    runs as :func:`one_gemm`: on CUDA, with bfloat16 chosen for the GEMM (the settings'
    ``emulated_gemm``; ``float32`` keeps the float32 GEMM)."""
    return gemm_dtype is torch.bfloat16 and data.is_cuda


def float32_product(a_values: torch.Tensor, b_values_t: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of bfloat16 operands accumulated and written in float32 (CUDA)."""
    return torch.mm(a_values, b_values_t, out_dtype=torch.float32)


def one_gemm(
    a_values: torch.Tensor,
    b_values: torch.Tensor,
    out_dtype: torch.dtype,
    a_scale: torch.Tensor | None = None,
    b_scale: torch.Tensor | None = None,
    alpha: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    product: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = float32_product,
) -> torch.Tensor:
    """``a_values @ b_values^T`` (``[M, K]``, ``[N, K]``, bfloat16, scales folded) in float32,
    times the scales left for the output (``a_scale``: per tensor or per row ``[M]``;
    ``b_scale``: per tensor or per column ``[N]``) and ``alpha``, plus ``bias`` (in
    ``out_dtype`` already, as ``torch._scaled_mm`` takes it), rounded once to ``out_dtype``.
    ``product``: the GEMM (the tests pass the CPU's equivalent)."""
    out = product(a_values, b_values.t())
    if a_scale is not None:
        out = out * (a_scale if a_scale.dim() == 0 else a_scale.reshape(-1, 1))
    if b_scale is not None:
        out = out * (b_scale if b_scale.dim() == 0 else b_scale.reshape(1, -1))
    if alpha is not None:
        out = out * alpha
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out if out_dtype == torch.float32 else out.to(out_dtype)
