"""fp8train: FP8 training for PyTorch with every scaling recipe in one API.

The public surface is small; everything else is internal. See ``docs/numerics.md``.
"""

from . import recipes
from .arguments import TrainingArguments
from .autocast import autocast
from .convert import convert_to_float8_training, convert_to_linear, drop_fp8_state
from .formats import E4M3, E5M2, E8M0, FloatFormat, Format, cast_to_fp8
from .gemm import scaled_mm
from .layouts import (
    blockwise_from_gemm_layout,
    blockwise_to_gemm_layout,
    swizzle_mx_scales,
    unswizzle_mx_scales,
)
from .linear import Float8Linear
from .quantize import GRANULARITIES, QuantizedTensor, quantize
from .recipes import (
    BlockScaling,
    DelayedScaling,
    MXFP8Scaling,
    Recipe,
    RowwiseScaling,
    TensorwiseScaling,
)
from .scaling import amax_to_scale, delayed_scaling_update
from .trainer import Trainer

__version__ = "0.1.0"

__all__ = [
    "E4M3",
    "E5M2",
    "E8M0",
    "FloatFormat",
    "Format",
    "cast_to_fp8",
    "recipes",
    "Recipe",
    "TensorwiseScaling",
    "DelayedScaling",
    "RowwiseScaling",
    "BlockScaling",
    "MXFP8Scaling",
    "GRANULARITIES",
    "QuantizedTensor",
    "quantize",
    "amax_to_scale",
    "delayed_scaling_update",
    "blockwise_to_gemm_layout",
    "blockwise_from_gemm_layout",
    "swizzle_mx_scales",
    "unswizzle_mx_scales",
    "scaled_mm",
    "Float8Linear",
    "convert_to_float8_training",
    "convert_to_linear",
    "drop_fp8_state",
    "autocast",
    "Trainer",
    "TrainingArguments",
]
