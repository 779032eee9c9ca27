"""fp8train: FP8 training for PyTorch with every scaling recipe in one API.

The public surface is small; everything else is internal. See ``docs/numerics.md`` for
the arithmetic and ``docs/architecture.md`` for the layers (spec -> quant -> nn ->
parallel -> optim -> train).
"""

import sys

from .nn.autocast import autocast
from .nn.convert import conversion_report, convert_to_float8_training, convert_to_linear, drop_fp8_state
from .nn.config import Float8ModuleConfig
from .nn.store_weights import restore_high_precision_weights, store_frozen_weights_in_fp8
from .nn.linear import Float8Linear
from .nn.nonfinite import NonFiniteError, detect_nonfinite
from .quant.cast import cast_to_fp8
from .quant.gemm import scaled_mm
from .quant.layouts import (
    blockwise_from_gemm_layout,
    blockwise_to_gemm_layout,
    swizzle_mx_scales,
    unswizzle_mx_scales,
)
from .quant.public import quantize
from .quant.scaling import amax_to_scale, delayed_scaling_update
from .quant.tensor import QuantizedTensor
from .spec import recipes
from .spec.formats import E4M3, E5M2, E8M0, FloatFormat, Format
from .spec.granularities import GRANULARITIES
from .spec.recipes import (
    BlockScaling,
    DelayedScaling,
    MXFP4Scaling,
    MXFP8Scaling,
    NVFP4Scaling,
    Recipe,
    RowwiseScaling,
    TensorwiseScaling,
)
from . import optim  # fp8train.optim.AdamW
from .train.arguments import TrainingArguments
from .train.inspector import inspect
from .train.trainer import Trainer

# ``fp8train.recipes`` is the public name of the recipe module: importable as such too.
sys.modules[__name__ + ".recipes"] = recipes

__version__ = "0.1.0"

# Public names whose modules import an optional framework: imported on first use, so that
# ``import fp8train`` never imports transformers.
_LAZY = {"save_pretrained_fp8": "fp8train.integrations.fp8_checkpoint"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
    "NVFP4Scaling",
    "MXFP4Scaling",
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
    "Float8ModuleConfig",
    "convert_to_float8_training",
    "conversion_report",
    "convert_to_linear",
    "drop_fp8_state",
    "store_frozen_weights_in_fp8",
    "restore_high_precision_weights",
    "autocast",
    "detect_nonfinite",
    "NonFiniteError",
    "inspect",
    "Trainer",
    "TrainingArguments",
    "save_pretrained_fp8",
]
