"""A quick end-to-end check: quantize one random tensor with every recipe's operands and
report the error of each, so a new install shows at a glance that the numerics run."""

from __future__ import annotations

import torch

from ..quant.cast import format_of, torch_dtype
from ..quant.quantize import quantize
from ..quant.statistics import sqnr_db
from ..quant.scaling import delayed_scaling_update
from ..spec.recipes import RECIPE_NAMES, from_name
from ..spec.roles import Role, Usage
from .markdown import markdown_table

# Each role's last-dim usage: the operand the self-check shows.
_SHOWN_USAGE = {Role.INPUT: Usage.OUTPUT_INPUT, Role.WEIGHT: Usage.OUTPUT_WEIGHT, Role.GRAD_OUTPUT: Usage.GRAD_INPUT_GRAD_OUTPUT}

__all__ = ["recipe_operands", "run_selfcheck"]


def recipe_operands(name: str) -> list[tuple[str, str, torch.dtype, int]]:
    """``(role, granularity, dtype, axis)`` of the forward operands and grad_output of a recipe."""
    plan = from_name(name).operand_plan
    operands = [plan.operand(_SHOWN_USAGE[role]) for role in Role]
    return [(op.role.value, str(op.granularity), torch_dtype(op.format), op.axis) for op in operands]


def run_selfcheck(rows: int = 512, cols: int = 1024, seed: int = 0) -> list[dict]:
    """Quantize a random heavy-tailed ``rows x cols`` tensor with each recipe's operands.

    Rows span six orders of magnitude, so the worst row's SQNR shows what a single
    per-tensor scale costs small rows. Returns one dict per (recipe, role) with its
    granularity, dtype, SQNR and worst-row SQNR in dB.
    """
    generator = torch.Generator().manual_seed(seed)
    # Heavy tails and a spread of row magnitudes, as activations have.
    x = torch.randn(rows, cols, generator=generator) * torch.logspace(-3, 3, rows).unsqueeze(1)
    x[:, :4] *= 50
    results = []
    for name in RECIPE_NAMES:
        recipe = from_name(name)
        for role, granularity, dtype, axis in recipe_operands(name):
            if recipe.operand_plan.delayed:
                # Step 1 quantizes with the initial scale of 1 and records the amax; show
                # step 2, which uses the scale updated from that history.
                fp8_max = format_of(dtype).max
                scale = torch.tensor(1.0)
                amax_history = torch.zeros(recipe.amax_history_len)
                amax_history[0] = x.abs().amax()
                delayed_scaling_update(amax_history, scale, fp8_max, margin=recipe.margin)
                qt = quantize(x, granularity, dtype=dtype, scale=scale)
                note = "step 2 (scale from step 1's amax)"
            else:
                qt = quantize(x, granularity, dtype=dtype, axis=axis)
                note = ""
            x_dq = qt.dequantize()
            results.append(
                {
                    "recipe": name,
                    "role": role,
                    "granularity": granularity,
                    "dtype": str(dtype).removeprefix("torch."),
                    "sqnr_db": sqnr_db(x, x_dq),
                    "worst_row_sqnr_db": min(sqnr_db(x[i], x_dq[i]) for i in range(rows)),
                    "note": note,
                }
            )
    return results


def format_table(results: list[dict]) -> str:
    """Render :func:`run_selfcheck` results as a Markdown table."""
    headers = ("recipe", "operand", "granularity", "dtype", "SQNR (dB)", "worst row SQNR (dB)", "note")
    rows = [
        (r["recipe"], r["role"], r["granularity"], r["dtype"], f"{r['sqnr_db']:.1f}", f"{r['worst_row_sqnr_db']:.1f}",
         r["note"])
        for r in results
    ]
    return markdown_table(headers, rows, align="llllrrl")
