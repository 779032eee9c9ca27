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


# ---------------------------------------------------------------------------- GPU suite (tests/gpu)

HARDWARE_GEMM_REL_ERR = 1e-3
"""Error of a hardware FP8 GEMM (``torch._scaled_mm``) against the float64 product of its
dequantized operands, relative to max |result|, in float32 output. Measured on an H200
(torch 2.11, cu130, ``use_fast_accum=False``): 1.2e-4 to 2.3e-4 for tensorwise, rowwise and
both blockwise pairings; this bound leaves 4x over the worst. ``use_fast_accum=True``
measured 2.6e-3 and fails it, as does any wrong scale or layout (relative error ~1 and up)."""

EMULATED_GEMM_REL_ERR = 1e-5
"""The same for an emulated GEMM on a GPU (a bf16 GEMM of exact operands, float32
accumulation): float32 summation error only (the CPU tests hold the CPU path to 1e-6). A
GEMM that reduced in bfloat16 (split-K with reduced-precision reductions) is ~1e-2 off."""

OUTPUT_ROUNDING = {"float32": 2.0**-24, "bfloat16": 2.0**-8, "float16": 2.0**-11}
"""Unit roundoff of each output dtype (by name): one rounding moves a value by at most this
fraction of its magnitude."""

COMPILED_MIN_SQNR_DB = 30.0
"""SQNR floor (dB) of a compiled (inductor) FP8 model's outputs and gradients against the
same model eager: inductor rounds some float32 sums (bias gradients, GELU) an ulp
differently, and a few FP8 codes flip (the floor of tests/nn/test_compile.py's inductor
test). A NaN (the Triton 3.8 miscompile of compiled float8) or a wrong scale is far below."""

MAX_VAL_GAP_PERCENT = 1.0
"""Largest |validation-loss gap| of an FP8 or 4-bit recipe to bf16 in ``fp8train compare``
at its default 150 steps: the README's claim (tests/train/test_readme.py holds the CPU to it,
tests/gpu/test_compare.py a GPU at width 1024)."""
