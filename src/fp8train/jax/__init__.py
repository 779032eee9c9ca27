"""fp8train's JAX frontend: every recipe for JAX and Flax (FP8, NVFP4, MXFP4), bit-identical
to the PyTorch path (stochastic rounding draws from a JAX key instead of PyTorch's generator).

Built on the framework-free :mod:`fp8train.spec` (recipes, formats, granularities and
operand plans: one definition for both frontends). Install with
``pip install 'fp8train[jax]'``; the core package does not need JAX. See ``docs/jax.md``.

* :func:`quantize` -> :class:`QuantizedArray` (data and ``scale_inv`` in the compact
  layouts of :func:`fp8train.quant.quantize`, bit for bit; 4-bit data packed two E2M1 codes a
  ``uint8``, NVFP4's ``global_amax``), :func:`cast_to_fp8`, :func:`transpose`;
  layouts :func:`blockwise_to_gemm_layout`, :func:`swizzle_mx_scales`, :func:`unswizzle_mx_scales`.
* :func:`scaled_matmul`: the exact emulated FP8 and 4-bit GEMMs.
* :func:`linear`: the three GEMMs of a dense layer per a recipe's plan (``jax.custom_vjp``).
* :class:`Dense`: a drop-in ``flax.linen.Dense``; delayed scaling's state in the
  :data:`FP8_STATE` collection, carried with :func:`update_fp8_state`.
* :func:`autocast`: turn FP8 off or override the recipe.
"""

from .autocast import autocast
from .cast import cast_to_fp8, jax_dtype
from .gemm import scaled_matmul
from .layouts import blockwise_to_gemm_layout, swizzle_mx_scales, unswizzle_mx_scales
from .linear import init_delayed_state, linear, update_fp8_state
from .public import quantize
from .quantize import QuantizedArray, transpose
from .scaling import amax_to_scale, delayed_scaling_update

__all__ = [
    "quantize",
    "QuantizedArray",
    "transpose",
    "cast_to_fp8",
    "jax_dtype",
    "amax_to_scale",
    "delayed_scaling_update",
    "blockwise_to_gemm_layout",
    "swizzle_mx_scales",
    "unswizzle_mx_scales",
    "scaled_matmul",
    "linear",
    "init_delayed_state",
    "update_fp8_state",
    "autocast",
    "Dense",
    "FP8_STATE",
    "STOCHASTIC_ROUNDING",
]


def __getattr__(name: str):
    # The Flax module loads on first use, so the array API works with JAX alone.
    if name in ("Dense", "FP8_STATE", "STOCHASTIC_ROUNDING"):
        from . import linen

        return getattr(linen, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
