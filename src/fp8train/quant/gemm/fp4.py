"""The emulated 4-bit GEMM (NUMERICS.md 6), as Blackwell's block-scaled FP4 GEMM computes
it, on any device, in PyTorch ops, up to float32 accumulation order (which the contract
allows).

For ``a[M, K]`` and ``b[N, K]`` (both NVFP4, or both MXFP4, scaled along K) the contract
sums, over the K blocks (16 for NVFP4, 32 for MXFP4), ``(sa[:, k] * sb[:, k]^T) * (A_k @ B_k^T)``
in float32, then NVFP4 multiplies by ``alpha = (global_amax_a * global_amax_b) / 7225344``
(``7225344 = 2688^2``: the two global decode scales), and the bias is added, in float32,
before the one rounding to the output dtype.

Every block scale folds exactly into its operand's values: an E2M1 value has 2 significant
bits and an E4M3 scale 4 (an E8M0 scale 1), so their product has at most 6, exact in
bfloat16 and in float32. Every product of two folded values (at most 12 bits) is then exact
in float32, so one GEMM of the folded operands with float32 accumulation computes the
contract's sum up to the order of the float32 additions
(:func:`fp8train.quant.gemm.emulated.emulated_mm` runs it, as for MXFP8). This module gives the
folded operands and ``alpha``.
"""

from __future__ import annotations

import numpy as np
import torch

from ..cast import e8m0_float32_bits
from ..e2m1 import E2M1_CONSTANTS
from ..kernels import try_fp4_operand_values
from ..tensor import QuantizedTensor

__all__ = ["NVFP4_ALPHA_DIVISOR", "fp4_alpha", "fp4_operand_values"]

NVFP4_ALPHA_DIVISOR = 7225344.0
"""``6 * 6 * 448 * 448``: the global amaxes' product over this is the GEMM's ``alpha``."""

_FLOAT32_SMALLEST_NORMAL = 2.0**-126
_FLOAT32_PRODUCT_BOUND = 2.0**128 * (1 - 2.0**-25)
"""Where a double rounds to float32's largest finite value or below (half an ulp above it
rounds to infinity)."""


def fp4_alpha(a: QuantizedTensor, b: QuantizedTensor, host: bool = False) -> torch.Tensor | float | None:
    """NVFP4's float32 ``alpha = (global_amax_a * global_amax_b) / 7225344``; ``None`` for MXFP4 and the FP8 families (no global amax).

    ``host``: the amaxes are CPU tensors outside a trace (a bound layer's CPU kernels), so
    ``alpha`` may come back as a Python float holding the same float32 value, computed
    without the two tensor ops (issue 38: about 5 us of a layer's three GEMMs each). The
    product of two float32 values is exact in a double and rounds once to float32; the
    quotient, computed in float32, is the correctly rounded one, as the tensor op's. A
    product outside float32's normal range (zero, subnormal, overflowing, NaN) takes the
    tensor ops, where the float32 edge cases are theirs."""
    a_amax, b_amax = a.global_amax, b.global_amax
    if a_amax is None:
        return None
    if host:
        product = a_amax.item() * b_amax.item()  # exact: two float32 values' product in a double
        if _FLOAT32_SMALLEST_NORMAL <= product < _FLOAT32_PRODUCT_BOUND:
            return float(np.float32(product) / np.float32(NVFP4_ALPHA_DIVISOR))
    a_amax = a_amax if a_amax.dtype == torch.float32 else a_amax.to(torch.float32)
    b_amax = b_amax if b_amax.dtype == torch.float32 else b_amax.to(torch.float32)
    return a_amax * b_amax / NVFP4_ALPHA_DIVISOR


def fp4_operand_values(qt: QuantizedTensor, dtype: torch.dtype, kernels: bool | None = None) -> torch.Tensor:
    """The values of a K-last 4-bit operand with its block scales folded in, ``[rows, K]``
    of ``dtype`` (bfloat16 or float32: exact in both, see the module docstring); cached in
    its ``gemm_cache``, so a weight the backward reuses (transposed) is unpacked once.
    ``kernels``: whether the CPU kernels unpack it (the caller has checked), ``None`` to ask."""
    cache = qt.gemm_cache
    if cache is not None and cache.values is not None and cache.compute_dtype == dtype:
        return cache.values  # as cache.get, without its call
    # On CPU one pass from the packed codes (bit-identical to the PyTorch ops below).
    values = None if kernels is False else try_fp4_operand_values(qt, dtype, kernels)
    if values is None:
        rows, k = qt.unpacked_shape_2d
        if rows == 0 or k == 0:
            return torch.zeros(rows, k, dtype=dtype, device=qt.data.device)
        values = _folded_values(qt, rows, k, dtype, kernels is None and torch.compiler.is_compiling())
    if cache is not None:
        cache.put(dtype, values, None)
    return values


def _folded_values(qt: QuantizedTensor, rows: int, k: int, dtype: torch.dtype, traced: bool) -> torch.Tensor:
    """``(e2m1 values * block scales)`` of the K-last 4-bit ``qt``, ``[rows, K]`` of ``dtype``,
    in PyTorch ops: the reference the kernels are held to. Each packed byte's two values by
    a table, each block's scale broadcast over its ``(group rows, block)`` values: the
    products of ``values_float32()`` times ``scales_per_k_chunk()``, in fewer calls, both
    operands contiguous as theirs are (a NaN's bits follow the layouts)."""
    granularity = qt.granularity  # its groups' shape (group_shape: 4-bit groups span no whole dim)
    group_rows, block = (granularity.across, granularity.along) if qt.axis == -1 else (granularity.along, granularity.across)
    byte = qt.data.view(torch.uint8)
    byte = byte if byte.ndim == 2 else byte.reshape(rows, k // 2)
    byte_values = (E2M1_CONSTANTS.build(byte.device) if traced else E2M1_CONSTANTS[(byte.device,)]).byte_values
    values = torch.embedding(byte_values, byte.to(torch.int32, memory_format=torch.contiguous_format))  # [rows, K/2, 2]
    scale_inv = qt.scale_inv
    if qt.granularity.e8m0_scales:  # as e8m0_to_float32, from contiguous codes
        codes = scale_inv.view(torch.uint8).to(torch.int32, memory_format=torch.contiguous_format)
        scales = e8m0_float32_bits(codes).view(torch.float32)[:, None, :, None]
    else:
        scales = scale_inv.to(torch.float32, memory_format=torch.contiguous_format)[:, None, :, None]
    folded = values.view(rows // group_rows, group_rows, k // block, block) * scales
    folded = folded.reshape(rows, k)
    return folded if dtype == torch.float32 else folded.to(dtype)
