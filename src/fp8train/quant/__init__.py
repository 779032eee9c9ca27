"""The numerics kit: quantize a tensor, multiply two quantized tensors, and the pieces in
between, for users who build their own FP8 layers or check fp8train's arithmetic
(``docs/numerics.md`` states every rule). Training needs none of it: a model converts
with :func:`fp8train.convert_to_float8_training`.

* :func:`quantize` -> :class:`QuantizedTensor` (FP8 or 4-bit data, one scale per
  scaling group of a granularity in :data:`GRANULARITIES`); :func:`cast_to_fp8`, the
  saturating cast; the format facts :data:`E4M3`, :data:`E5M2`, :data:`E8M0`
  (:class:`FloatFormat`).
* :func:`scaled_mm`: the scaled GEMM of two quantized tensors (emulated or hardware).
* Scales: :func:`amax_to_scale`, :func:`delayed_scaling_update`.
* The hardware's scale layouts: :func:`blockwise_to_gemm_layout`,
  :func:`blockwise_from_gemm_layout`, :func:`swizzle_mx_scales`, :func:`unswizzle_mx_scales`.

Inside, by the road a tensor takes: dtypes and casts (:mod:`.cast`), scales
(:mod:`.scaling`), the quantized tensor (:mod:`.tensor`), quantization by a rule
(``fp8train.quant.quantize``, the door that asks each format family for its quantizer,
whose module this package's :func:`quantize` shadows as an attribute:
``from fp8train.quant.quantize import ...`` reaches the module; the references in
``fp8_quantize`` and ``fp4_quantize``, the CPU kernels in :mod:`.kernels`), layouts
(:mod:`.layouts`) and the scaled GEMM (:mod:`.gemm`: the dispatch, emulated and hardware).
"""

from ..spec.formats import E4M3, E5M2, E8M0, FloatFormat
from ..spec.granularities import GRANULARITIES
from .cast import cast_to_fp8
from .gemm import scaled_mm
from .layouts import blockwise_from_gemm_layout, blockwise_to_gemm_layout, swizzle_mx_scales, unswizzle_mx_scales
from .public import quantize
from .scaling import amax_to_scale, delayed_scaling_update
from .tensor import QuantizedTensor

__all__ = [
    "quantize",
    "QuantizedTensor",
    "GRANULARITIES",
    "cast_to_fp8",
    "E4M3",
    "E5M2",
    "E8M0",
    "FloatFormat",
    "scaled_mm",
    "amax_to_scale",
    "delayed_scaling_update",
    "blockwise_to_gemm_layout",
    "blockwise_from_gemm_layout",
    "swizzle_mx_scales",
    "unswizzle_mx_scales",
]
