"""The emulated 4-bit GEMM (NUMERICS.md 6), exactly as Blackwell's block-scaled FP4 GEMM
computes it, on any device, in PyTorch ops.

For ``a[M, K]`` and ``b[N, K]`` (both NVFP4, or both MXFP4, scaled along K) and each K block
(16 for NVFP4, 32 for MXFP4) in order::

    acc += (sa[:, k] * sb[:, k]^T) * (A_k @ B_k^T)        (float32; each term exact)

then NVFP4 multiplies by ``alpha = (global_amax_a * global_amax_b) / 7225344``
(``7225344 = 2688^2``: the two global decode scales), and the bias is added, in float32,
before the one rounding to the output dtype. A block's partial product is a sum of at most
32 products of E2M1 values (multiples of 1/4, at most 36): exact in float32 in any order,
so the blocks' partials are computed together and only their accumulation runs in order.
"""

from __future__ import annotations

import torch

from .tensor import QuantizedTensor

__all__ = ["NVFP4_ALPHA_DIVISOR", "emulated_fp4_mm", "fp4_alpha", "per_block_scales"]

NVFP4_ALPHA_DIVISOR = 7225344.0
"""``6 * 6 * 448 * 448``: the global amaxes' product over this is the GEMM's ``alpha``."""

_PARTIALS_PER_STEP = 1 << 22  # elements of the blocks' partial products held at once


def fp4_alpha(a: QuantizedTensor, b: QuantizedTensor) -> torch.Tensor | None:
    """NVFP4's float32 ``alpha = (global_amax_a * global_amax_b) / 7225344``; ``None`` for MXFP4."""
    if a.global_amax is None:
        return None
    product = a.global_amax.to(torch.float32) * b.global_amax.to(torch.float32)
    return product / NVFP4_ALPHA_DIVISOR


def per_block_scales(qt: QuantizedTensor) -> torch.Tensor:
    """The float32 scale of every (row, K block) of a K-last 4-bit operand: ``[rows, K/block]``
    (16x16 tiles repeated over their 16 rows)."""
    rows, k = qt.unpacked_shape_2d
    group_rows, group_cols = qt.group_shape
    scales = qt.scale_inv_float32().reshape(rows // group_rows, k // group_cols)
    return scales.repeat_interleave(group_rows, dim=0)


def _block_values(qt: QuantizedTensor, block: int) -> torch.Tensor:
    """The E2M1 values of a K-last operand as float32 ``[K/block, rows, block]``."""
    values = qt.values_float32()
    rows, k = values.shape
    return values.reshape(rows, k // block, block).transpose(0, 1)


def emulated_fp4_mm(
    a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``a @ b^T (+ bias)`` of two K-last 4-bit operands of one family (validated by
    :func:`fp8train.quant.gemm.scaled_mm`), as the module docstring says; ``[M, N]`` of
    ``out_dtype``."""
    block = a.granularity.block
    a_blocks, b_blocks = _block_values(a, block), _block_values(b, block)
    num_blocks, m, n = a_blocks.shape[0], a_blocks.shape[1], b_blocks.shape[1]
    a_scales, b_scales = per_block_scales(a).t().unsqueeze(2), per_block_scales(b).t().unsqueeze(1)
    acc = torch.zeros(m, n, dtype=torch.float32, device=a.data.device)
    step = max(1, _PARTIALS_PER_STEP // max(1, m * n))
    for start in range(0, num_blocks, step):
        blocks = slice(start, start + step)
        partials = torch.bmm(a_blocks[blocks], b_blocks[blocks].transpose(1, 2))
        terms = (a_scales[blocks] * b_scales[blocks]) * partials
        for term in terms:
            acc += term
    alpha = fp4_alpha(a, b)
    out = acc if alpha is None else acc * alpha
    if bias is not None:
        # As the FP8 GEMMs: the bias rounded to the output dtype, then added in float32.
        out = out + bias.to(out_dtype).to(torch.float32)
    return out.to(out_dtype)
