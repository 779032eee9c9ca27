"""A quick end-to-end check: quantize one random tensor with every recipe's operands and
report the error of each, so a new install shows at a glance that the numerics run."""

from __future__ import annotations

import argparse
from typing import Sequence

import torch

from ...quant.quantize import quantize
from ...quant.scaling import delayed_scaling_update
from ...diagnostics.statistics import sqnr_db
from ...spec.plan import Operand
from ...spec.recipes import RECIPE_NAMES, Recipe, from_name
from ...spec.roles import Role, Usage
from ...diagnostics.markdown import markdown_table
from .flags import UsageError

# Each role's last-dim usage: the operand the self-check shows.
_SHOWN_USAGE = {Role.INPUT: Usage.OUTPUT_INPUT, Role.WEIGHT: Usage.OUTPUT_WEIGHT, Role.GRAD_OUTPUT: Usage.GRAD_INPUT_GRAD_OUTPUT}

__all__ = ["recipe_operands", "run_selfcheck", "format_table", "add_parser", "run"]


def recipe_operands(recipe: Recipe) -> list[Operand]:
    """The slots of ``recipe``'s plan the self-check shows: each role's last-dim usage."""
    plan = recipe.operand_plan
    return [plan.operand(_SHOWN_USAGE[role]) for role in Role]


def run_selfcheck(rows: int = 512, cols: int = 1024, seed: int = 0, recipes: Sequence[Recipe] | None = None) -> list[dict]:
    """Quantize a random heavy-tailed ``rows x cols`` tensor by each recipe's operand rules.

    Rows span six orders of magnitude, so the worst row's SQNR shows what a single
    per-tensor scale costs small rows (and what NVFP4's one global scale over its E4M3
    block scales costs them: blocks far below the amax flush). ``recipes``: the recipes to
    check (default: every named recipe with its default fields). Stochastic rounding (the
    NVFP4 grad_output) draws from a generator seeded with ``seed``. Returns one dict per
    (recipe, role) with its granularity, dtype, SQNR and worst-row SQNR in dB.
    """
    generator = torch.Generator().manual_seed(seed)
    # Heavy tails and a spread of row magnitudes, as activations have.
    x = torch.randn(rows, cols, generator=generator) * torch.logspace(-3, 3, rows).unsqueeze(1)
    x[:, :4] *= 50
    results = []
    for recipe in [from_name(name) for name in RECIPE_NAMES] if recipes is None else recipes:
        for op in recipe_operands(recipe):
            if recipe.operand_plan.delayed:
                # Step 1 quantizes with the initial scale of 1 and records the amax; show
                # step 2, which uses the scale updated from that history.
                scale = torch.tensor(1.0)
                amax_history = torch.zeros(recipe.amax_history_len)
                amax_history[0] = x.abs().amax()
                delayed_scaling_update(amax_history, scale, op.rule.fp8_max, margin=recipe.margin)
                qt = quantize(x, op.rule, scale=scale)
                note = "step 2 (scale from step 1's amax)"
            else:
                qt = quantize(x, op.rule, axis=op.axis, generator=generator)
                note = "stochastic rounding" if op.rule.stochastic_rounding else ""
            x_dq = qt.dequantize()
            results.append(
                {
                    "recipe": recipe.name,
                    "role": op.role.value,
                    "granularity": str(op.granularity),
                    "dtype": op.format.dtype_name,
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


def add_parser(commands: argparse._SubParsersAction) -> None:
    """The ``selfcheck`` sub-command of ``commands``."""
    parser = commands.add_parser(
        "selfcheck", help="quantize a random tensor with every recipe and print the error of each operand"
    )
    parser.add_argument("--rows", type=int, default=512, help="rows of the random tensor (multiple of 128)")
    parser.add_argument("--cols", type=int, default=1024, help="columns of the random tensor (multiple of 128)")
    parser.add_argument("--seed", type=int, default=0, help="random seed")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    for name, value in (("--rows", args.rows), ("--cols", args.cols)):
        if value <= 0 or value % 128:
            raise UsageError(f"{name} {value} must be a positive multiple of 128")
    print(format_table(run_selfcheck(args.rows, args.cols, args.seed)))
    return 0
