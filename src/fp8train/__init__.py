"""fp8train: FP8 training for PyTorch with every scaling recipe in one API.

The top level is what training needs: the recipes (and :class:`Format`, the FP8 formats a
recipe takes), converting a model (:func:`convert_to_float8_training`, :class:`Float8Linear`),
:func:`autocast`, the non-finite sentinel, :func:`inspect`, the :class:`Trainer`, the
optimizer (:mod:`fp8train.optim`) and FP8 checkpoints for serving. The numerics kit
(``quantize``, ``scaled_mm``, ``QuantizedTensor``, casts, scales, layouts, format facts)
is :mod:`fp8train.quant`. Everything else is internal. See ``docs/numerics.md`` for the
arithmetic and ``docs/architecture.md`` for the layers (spec -> quant -> nn -> diagnostics -> parallel ->
optim -> train).
"""

import sys

from . import optim, quant
from .moved_names import MovedModules, MovedNames
from .nn.autocast import autocast
from .nn.config import Float8ModuleConfig
from .nn.convert import conversion_report, convert_to_float8_training, convert_to_linear, drop_fp8_state
from .nn.store_weights import restore_high_precision_weights, store_frozen_weights_in_fp8
from .nn.modules.linear import Float8Linear
from .diagnostics.nonfinite import NonFiniteError, detect_nonfinite
from .spec import recipes
from .spec.formats import Format
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
from .train.arguments import TrainingArguments
from .diagnostics.inspector import inspect
from .train.trainer import Trainer

# ``fp8train.recipes`` is the public name of the recipe module: importable as such too.
sys.modules[__name__ + ".recipes"] = recipes

__version__ = "0.1.0"

# Public names whose modules import an optional framework: imported on first use, so that
# ``import fp8train`` never imports transformers.
_LAZY = {
    "save_pretrained_fp8": "fp8train.integrations.fp8_checkpoint",
    "save_pretrained_quantized": "fp8train.integrations.fp8_checkpoint",
    "calibrate_input_amax": "fp8train.integrations.calibration",
}

# The numerics kit left the top level for fp8train.quant in 0.1.0; the old names still
# resolve, warning once each, until 0.2.0 (docs/errors.md, "Deprecated names").
_MOVED_TO_QUANT = MovedNames("fp8train", "fp8train.quant", tuple(quant.__all__), removed_in="0.2.0")

# Modules that moved in 0.1.0 (the FP8 modules into nn/modules/, the tools that show what
# low precision does into diagnostics/, the commands into train/commands/): their old
# dotted names still import, warning once each, until 0.2.0 (docs/errors.md).
_MOVED_MODULES = MovedModules(
    {
        **{f"fp8train.nn.{name}": f"fp8train.nn.modules.{name}"
           for name in ("linear", "conv1d", "attention", "attention_masks", "experts", "routing")},
        "fp8train.nn.gemm_capture": "fp8train.diagnostics.gemm_capture",
        "fp8train.nn.nonfinite": "fp8train.diagnostics.nonfinite",
        "fp8train.quant.statistics": "fp8train.diagnostics.statistics",
        "fp8train.quant.log_once": "fp8train.log_once",
        **{f"fp8train.train.{name}": f"fp8train.diagnostics.{name}"
           for name in ("inspector", "inspection", "inspect_report", "markdown")},
        **{f"fp8train.train.{name}": f"fp8train.train.commands.{name}"
           for name in ("cli", "compare", "compare_seeds", "export_command", "inspect_command", "selfcheck")},
    },
    removed_in="0.2.0",
)
_MOVED_MODULES.install()


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in _MOVED_TO_QUANT:
        return _MOVED_TO_QUANT.resolve(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    # The lazy names are public too; the moved ones are not listed.
    return sorted(set(globals()) | set(__all__))


__all__ = [
    # Recipes, and the FP8 formats they take
    "recipes",
    "Recipe",
    "TensorwiseScaling",
    "DelayedScaling",
    "RowwiseScaling",
    "BlockScaling",
    "MXFP8Scaling",
    "NVFP4Scaling",
    "MXFP4Scaling",
    "Format",
    # Converting a model
    "convert_to_float8_training",
    "conversion_report",
    "convert_to_linear",
    "drop_fp8_state",
    "Float8Linear",
    "Float8ModuleConfig",
    "store_frozen_weights_in_fp8",
    "restore_high_precision_weights",
    # Running it
    "autocast",
    "detect_nonfinite",
    "NonFiniteError",
    "inspect",
    "Trainer",
    "TrainingArguments",
    "optim",
    "save_pretrained_fp8",
    "save_pretrained_quantized",
    "calibrate_input_amax",
    # The numerics kit
    "quant",
]
