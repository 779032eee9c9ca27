"""Accuracy floors shared by the tests that hold every recipe to a high-precision reference.

A 4-bit recipe's GEMM loses far more than an FP8 one: E2M1 has 15 values, so one operand of
Gaussian values quantized in 16- or 32-element blocks keeps about 15 dB of SQNR, and a GEMM
of two such operands (measured on the shapes of these tests: 10.5-14 dB; grad_weight with
stochastic rounding lowest) about 3 dB less. The tests keep their FP8 floors and take
:data:`FP4_MIN_SQNR_DB` for the 4-bit recipes: well above what a wrong scale, a lost
global scale or an unpacked nibble order gives (below 0 dB).
"""

from __future__ import annotations

from fp8train.spec.recipes import resolve_recipe

FP4_MIN_SQNR_DB = 8.0
"""SQNR floor (dB) of a 4-bit recipe's output or gradient against high precision."""


def is_fp4(recipe) -> bool:
    """Whether ``recipe`` (a Recipe or name; ``None``: no recipe) quantizes to 4 bits."""
    if recipe is None or recipe == "bf16":
        return False
    return any(op.granularity.fp4 for op in resolve_recipe(recipe).operand_plan.operands)


def min_sqnr_db(recipe, fp8_floor: float) -> float:
    """``fp8_floor`` for an FP8 recipe, :data:`FP4_MIN_SQNR_DB` for a 4-bit one."""
    return FP4_MIN_SQNR_DB if is_fp4(recipe) else fp8_floor
