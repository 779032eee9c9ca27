"""``fp8train selfcheck`` (train/commands/selfcheck.py) with the 4-bit recipes: their operands, the
E2M1 dtype, reproducible stochastic rounding, and what NVFP4's two-level scale costs rows
far below the tensor's amax."""

import pytest

from fp8train.spec.recipes import from_name
from fp8train.train.commands.selfcheck import format_table, run_selfcheck

FP4_RECIPES = ("nvfp4", "mxfp4")


def _check(seed: int = 0) -> list[dict]:
    return run_selfcheck(128, 256, seed, recipes=[from_name(name) for name in FP4_RECIPES])


def test_4bit_operands_and_their_errors():
    results = _check()
    rows = {(r["recipe"], r["role"]): r for r in results}
    assert set(rows) == {(name, role) for name in FP4_RECIPES for role in ("input", "weight", "grad_output")}
    assert {r["dtype"] for r in results} == {"float4_e2m1fn_x2"}
    assert rows["nvfp4", "weight"]["granularity"] == "nvfp4_2d"
    assert rows["nvfp4", "grad_output"]["note"] == "stochastic rounding"
    for r in results:
        assert 15 < r["sqnr_db"] < 25, r  # E2M1 keeps one mantissa bit
    # Rows span six decades. MXFP4's E8M0 block scales reach every row. NVFP4's E4M3 block
    # scales sit under one global scale (the amax / 2688): a 1x16 block 1e6 below the amax
    # has a scale under half E4M3's smallest subnormal, which rounds to 0, so the row
    # dequantizes to zero: SQNR = 10 log10(signal / signal) = 0 dB. (A 16x16 weight tile
    # takes the amax of 16 rows, so its smallest row keeps some signal.)
    for role in ("input", "weight", "grad_output"):
        assert rows["mxfp4", role]["worst_row_sqnr_db"] > 10
    for role in ("input", "grad_output"):
        assert rows["nvfp4", role]["worst_row_sqnr_db"] == 0.0
    assert 0 < rows["nvfp4", "weight"]["worst_row_sqnr_db"] < 10
    table = format_table(results)
    assert "| nvfp4 | grad_output | nvfp4 | float4_e2m1fn_x2 |" in table


def test_stochastic_rounding_draws_from_the_seed():
    assert _check(seed=3) == _check(seed=3)
    def grad_output_sqnr_db(results):
        return next(r["sqnr_db"] for r in results if (r["recipe"], r["role"]) == ("nvfp4", "grad_output"))

    assert grad_output_sqnr_db(_check(seed=3)) != pytest.approx(grad_output_sqnr_db(_check(seed=4)), abs=1e-9)
