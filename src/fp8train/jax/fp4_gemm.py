"""The emulated 4-bit GEMM in JAX (NUMERICS.md 6), the twin of :mod:`fp8train.quant.gemm.fp4`.

For ``a[M, K]`` and ``b[N, K]`` (both NVFP4, or both MXFP4, scaled along K) and each K block
(16 for NVFP4, 32 for MXFP4) in order::

    acc += (sa[:, k] * sb[:, k]^T) * (A_k @ B_k^T)        (float32; each term exact)

then NVFP4 multiplies by ``alpha = (global_amax_a * global_amax_b) / 7225344``, and the bias
(rounded to the output dtype) is added in float32 before the one rounding to the output
dtype. A block's partial product is a sum of at most 32 products of E2M1 values (multiples
of 1/4, at most 36): exact in float32 in any order, so one batched GEMM gives every block's
partial and only the accumulation runs in order (a ``lax.scan``), each step an IEEE
product and sum (:mod:`fp8train.jax.ieee`: MXFP4's scales reach 2^-127, and XLA's CPU
would flush a subnormal), so the result is PyTorch's bit for bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from .ieee import exact_add, exact_divide, exact_multiply
from .quantize import QuantizedArray

__all__ = ["NVFP4_ALPHA_DIVISOR", "fp4_alpha", "fp4_matmul"]

NVFP4_ALPHA_DIVISOR = 7225344.0
"""``6 * 6 * 448 * 448``: the global amaxes' product over this is the GEMM's ``alpha``."""


def fp4_alpha(a: QuantizedArray, b: QuantizedArray) -> jax.Array | None:
    """NVFP4's float32 ``alpha = (global_amax_a * global_amax_b) / 7225344``; ``None`` for
    MXFP4. Subnormal products and quotients are IEEE's, as PyTorch computes them."""
    if a.global_amax is None:
        return None
    return exact_divide(exact_multiply(a.global_amax, b.global_amax), NVFP4_ALPHA_DIVISOR)


def fp4_matmul(a: QuantizedArray, b: QuantizedArray, out_dtype, bias32: jax.Array | None = None) -> jax.Array:
    """``a @ b^T (+ bias)`` of two K-last 4-bit operands of one family (validated by
    :func:`fp8train.jax.scaled_matmul`), as the module docstring says; ``bias32`` already
    rounded to ``out_dtype`` and back to float32. Returns ``[M, N]`` of ``out_dtype``."""
    block = a.granularity.block
    a_values, b_values = a.values_float32(), b.values_float32()
    (m, k), n = a_values.shape, b_values.shape[0]
    # [K/block, M, N]: every block's partial product, exact.
    partials = lax.dot_general(
        a_values.reshape(m, k // block, block),
        b_values.reshape(n, k // block, block),
        (((2,), (2,)), ((1,), (1,))),
        precision=lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )
    a_scales, b_scales = a.scales_per_k_chunk(block).T[:, :, None], b.scales_per_k_chunk(block).T[:, None, :]
    # NVFP4's terms are exact products of E4M3 scales (>= 2^-9) and partials (multiples of
    # 1/4): normal, so plain float32 ops are IEEE's (a fused multiply-add too: the product
    # is exact). MXFP4's scales reach 2^-127: its terms and sums may be subnormal.
    multiply, add = (exact_multiply, exact_add) if a.granularity.e8m0_scales else (jnp.multiply, jnp.add)

    def accumulate(acc, block_step):
        partial, a_scale, b_scale = block_step
        return add(acc, multiply(multiply(a_scale, b_scale), partial)), None

    acc, _ = lax.scan(accumulate, jnp.zeros((m, n), jnp.float32), (partials, a_scales, b_scales))
    alpha = fp4_alpha(a, b)
    out = acc if alpha is None else exact_multiply(acc, alpha)
    if bias32 is not None:
        out = exact_add(out, bias32)
    return out.astype(out_dtype)
