"""The emulated scaled GEMM in JAX: ``dequant(a) @ dequant(b)^T (+ bias)`` as FP8 hardware
computes it, on any backend, with the rounding rules of :mod:`fp8train.quant.gemm.emulated`.

* K-uniform operands (``tensor``, ``row``): the FP8 values in float32; power-of-two scales
  fold into them exactly, other scales multiply the float32 sum (``a``'s, then ``b``'s).
* Block operands (``block*``, ``mx``): power-of-two scales fold exactly into the values,
  so one GEMM gives the per-chunk-promoted sum; other block scales take the literal
  per-chunk promotion: a float32 partial product per chunk of K, times both chunk scales,
  added into a float32 accumulator in chunk order.
* 4-bit operands (two NVFP4 or two MXFP4): :mod:`fp8train.jax.fp4_gemm`, with NVFP4's alpha.

The GEMM is ``jax.lax.dot_general`` with ``preferred_element_type=float32`` at the highest
precision; the bias (rounded to the output dtype first, as ``torch._scaled_mm`` takes it)
is added in float32 and the result rounded once to ``out_dtype``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from ..spec.checks import check_type
from ..spec.granularities import GemmFamily, check_gemm_operands
from .cast import HIGH_PRECISION_DTYPES, check_array, scaled_product
from .fp4_gemm import fp4_matmul
from .quantize import QuantizedArray

__all__ = ["scaled_matmul"]

_NT = (((1,), (1,)), ((), ()))  # a[M,K] . b[N,K] -> [M,N]


def _rounded(product: jax.Array) -> jax.Array:
    """``product`` as its own float32 rounding. XLA's CPU backend contracts a multiply
    followed by an add into one fused multiply-add (one rounding, not two); this select,
    an identity on values, keeps the two roundings that the PyTorch emulation (and the
    hardware's separate scale and bias steps) perform."""
    return jnp.where(jnp.isnan(product), jnp.float32(jnp.nan), product)


def _matmul_f32(a_values: jax.Array, b_values: jax.Array) -> jax.Array:
    return lax.dot_general(
        a_values, b_values, _NT, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32
    )


def _check_operands(a: QuantizedArray, b: QuantizedArray, bias) -> None:
    for name, qa in (("a", a), ("b", b)):
        check_type(name, qa, QuantizedArray, "a QuantizedArray (from fp8train.jax.quantize)")
    check_gemm_operands(a, b, None if bias is None else bias.shape, "an array")


def _powers_of_2(qa: QuantizedArray) -> bool:
    return qa.power_2_scales or qa.granularity.always_power_2


def _operand(qa: QuantizedArray) -> tuple[jax.Array, jax.Array | None]:
    """float32 GEMM values of an operand, and the scale left for the output (or ``None``)."""
    values = qa.data.astype(jnp.float32)
    rows, k = qa.data.shape
    if qa.data.size == 0:
        return values, None
    if not _powers_of_2(qa):
        assert qa.granularity.k_uniform, qa.granularity  # block scales take the chunked path
        return values, qa.scale_inv if qa.granularity.per_tensor else qa.scale_inv.reshape(-1, 1)
    group_rows, group_cols = qa.group_shape
    grouped = values.reshape(rows // group_rows, group_rows, k // group_cols, group_cols)
    scale_inv = qa.scale_inv_float32().reshape(rows // group_rows, 1, k // group_cols, 1)
    return scaled_product(grouped, scale_inv).reshape(rows, k), None


def _chunked_matmul(a: QuantizedArray, b: QuantizedArray, chunk: int) -> jax.Array:
    """The literal per-chunk promotion, accumulated in chunk order."""
    (m, k), n = a.data.shape, b.data.shape[0]
    a_values = a.data.astype(jnp.float32).reshape(m, k // chunk, chunk)
    b_values = b.data.astype(jnp.float32).reshape(n, k // chunk, chunk)
    # [chunks, M, N] partial products, one float32 GEMM per chunk (batched).
    partials = lax.dot_general(
        a_values, b_values, (((2,), (2,)), ((1,), (1,))), precision=lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )
    a_scales, b_scales = a.scales_per_k_chunk(chunk), b.scales_per_k_chunk(chunk)
    promoted = _rounded(partials * a_scales.T[:, :, None] * b_scales.T[:, None, :])

    def accumulate(out, term):
        return out + term, None

    out, _ = lax.scan(accumulate, jnp.zeros((m, n), jnp.float32), promoted)
    return out


def scaled_matmul(
    a: QuantizedArray, b: QuantizedArray, out_dtype=jnp.bfloat16, *, bias: jax.Array | None = None
) -> jax.Array:
    """``dequant(a) @ dequant(b)^T (+ bias)`` as ``out_dtype``, emulating FP8 (or 4-bit) hardware.

    The same rules as :func:`fp8train.quant.scaled_mm` with ``backend="emulated"``: float32
    accumulation of the exact FP8 values, scales (and bias) applied in float32, one
    rounding. Results equal the PyTorch emulation's up to float32 accumulation order; the
    4-bit GEMM's (two NVFP4 or two MXFP4 operands, NUMERICS.md 6) bit for bit.

    Args:
        a: ``[M, K]`` :class:`QuantizedArray`, scaling groups along K where it matters.
        b: ``[N, K]``, likewise.
        out_dtype: float32, bfloat16 or float16.
        bias: optional ``[N]`` array added to the output.

    Returns:
        ``[M, N]`` array of ``out_dtype``.

    Raises:
        ValueError: mismatched shapes, operands not K-last, a bad ``out_dtype``.
        NotImplementedError: operands of different recipe families.
    """
    if jnp.dtype(out_dtype) not in HIGH_PRECISION_DTYPES:
        raise ValueError(f"out_dtype={out_dtype} must be float32, bfloat16 or float16")
    if bias is not None:
        bias = check_array("bias", bias)
    _check_operands(a, b, bias)
    GemmFamily.of(a.granularity, b.granularity)
    bias32 = None if bias is None else bias.astype(out_dtype).astype(jnp.float32)
    if a.granularity.fp4:
        return fp4_matmul(a, b, out_dtype, bias32)
    chunk = max(a.granularity.block, b.granularity.block)
    if chunk and not (_powers_of_2(a) and _powers_of_2(b)):
        out = _chunked_matmul(a, b, chunk)
        return (out if bias32 is None else out + bias32).astype(out_dtype)
    a_values, a_scale = _operand(a)
    b_values, b_scale = _operand(b)
    out = _matmul_f32(a_values, b_values)
    if a_scale is not None:
        out = out * (a_scale if a_scale.ndim == 0 else a_scale.reshape(-1, 1))
    if b_scale is not None:
        out = out * (b_scale if b_scale.ndim == 0 else b_scale.reshape(1, -1))
    out = _rounded(out)
    if bias32 is not None:
        out = out + bias32
    return out.astype(out_dtype)
