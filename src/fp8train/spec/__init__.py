"""The framework-free specification: formats, roles, granularities, quantization rules,
recipes and their operand plans. Imports no array framework, so every frontend (PyTorch
here, JAX next) shares one definition of each."""

from .formats import DATA_FORMATS, E2M1, E4M3, E5M2, E8M0, FORMATS, FloatFormat, Format
from .granularities import FP4_GRANULARITIES, FP8_GRANULARITIES, GRANULARITIES, GemmFamily, Granularity, round_up
from .plan import Operand, OperandPlan
from .recipes import (
    RECIPE_NAMES,
    BlockScaling,
    DelayedScaling,
    MXFP4Scaling,
    MXFP8Scaling,
    NVFP4Scaling,
    Recipe,
    RowwiseScaling,
    TensorwiseScaling,
    from_name,
)
from .roles import FIRST_DIM, LAST_DIM, Gemm, Role, Usage
from .rule import MX_SCALE_RULES, QuantRule

__all__ = [
    "E4M3",
    "E5M2",
    "E8M0",
    "E2M1",
    "FORMATS",
    "DATA_FORMATS",
    "FloatFormat",
    "Format",
    "GRANULARITIES",
    "FP8_GRANULARITIES",
    "FP4_GRANULARITIES",
    "GemmFamily",
    "Granularity",
    "round_up",
    "QuantRule",
    "MX_SCALE_RULES",
    "Operand",
    "OperandPlan",
    "RECIPE_NAMES",
    "Recipe",
    "TensorwiseScaling",
    "DelayedScaling",
    "RowwiseScaling",
    "BlockScaling",
    "MXFP8Scaling",
    "NVFP4Scaling",
    "MXFP4Scaling",
    "from_name",
    "Gemm",
    "Role",
    "Usage",
    "FIRST_DIM",
    "LAST_DIM",
]
