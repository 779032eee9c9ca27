"""A quick end-to-end check: quantize one random tensor with every recipe's operands and
report the error of each, so a new install shows at a glance that the numerics run.
``--recipes`` picks the recipes: names, mixtures (``hybrid(forward=nvfp4,backward=mxfp8)``:
each operand as its direction's recipe quantizes it) and recipe maps (each pattern's recipe,
labelled ``pattern=recipe``)."""

from __future__ import annotations

import argparse
from typing import Sequence

import torch

from ...quant.quantize import quantize
from ...quant.scaling import delayed_scaling_update
from ...diagnostics.statistics import sqnr_db
from ...spec.plan import Operand
from ...spec.recipe_map import RecipeMap, recipe_or_map
from ...spec.recipes import RECIPE_NAMES, Recipe, recipe_label
from ...spec.roles import Role, Usage
from ...diagnostics.markdown import markdown_table
from .compare import split_recipe_list
from .flags import UsageError

# Each role's last-dim usage: the operand the self-check shows.
_SHOWN_USAGE = {Role.INPUT: Usage.OUTPUT_INPUT, Role.WEIGHT: Usage.OUTPUT_WEIGHT, Role.GRAD_OUTPUT: Usage.GRAD_INPUT_GRAD_OUTPUT}

__all__ = ["recipe_operands", "labelled_recipes", "run_selfcheck", "format_table", "add_parser", "run"]


def recipe_operands(recipe: Recipe) -> list[Operand]:
    """The slots of ``recipe``'s plan the self-check shows: each role's last-dim usage."""
    plan = recipe.operand_plan
    return [plan.operand(_SHOWN_USAGE[role]) for role in Role]


def labelled_recipes(recipes: Sequence["Recipe | RecipeMap | str"]) -> list[tuple[str, Recipe]]:
    """``(label, recipe)`` of each of ``recipes``: a recipe by its name (a mixture's
    description), a recipe map's (or its one-line form's) every pattern with a recipe as
    ``pattern=recipe`` (its high-precision patterns have nothing to check).

    Raises:
        ValueError, TypeError: an unknown recipe name, a bad map (naming the pattern).
    """
    labelled = []
    for value in recipes:
        value = recipe_or_map(value) if isinstance(value, str) else value
        if isinstance(value, RecipeMap):
            labelled += [
                (f"{pattern}={label}", recipe)
                for (pattern, recipe), label in zip(value.entries, value.labels)
                if recipe is not None
            ]
        else:
            labelled.append((recipe_label(value), value))
    return labelled


def run_selfcheck(
    rows: int = 512, cols: int = 1024, seed: int = 0, recipes: Sequence["Recipe | RecipeMap | str"] | None = None
) -> list[dict]:
    """Quantize a random heavy-tailed ``rows x cols`` tensor by each recipe's operand rules.

    Rows span six orders of magnitude, so the worst row's SQNR shows what a single
    per-tensor scale costs small rows (and what NVFP4's one global scale over its E4M3
    block scales costs them: blocks far below the amax flush). ``recipes``: the recipes to
    check (default: every named recipe with its default fields), as :func:`labelled_recipes`
    takes them. Stochastic rounding (the
    NVFP4 grad_output) draws from a generator seeded with ``seed``. Returns one dict per
    (recipe, role) with its granularity, dtype, SQNR and worst-row SQNR in dB.
    """
    generator = torch.Generator().manual_seed(seed)
    # Heavy tails and a spread of row magnitudes, as activations have.
    x = torch.randn(rows, cols, generator=generator) * torch.logspace(-3, 3, rows).unsqueeze(1)
    x[:, :4] *= 50
    results = []
    for label, recipe in labelled_recipes(RECIPE_NAMES if recipes is None else recipes):
        for op in recipe_operands(recipe):
            if op.delayed:
                # Step 1 quantizes with the initial scale of 1 and records the amax; show
                # step 2, which uses the scale updated from that history.
                delayed = recipe.delayed_scaling
                scale = torch.tensor(1.0)
                amax_history = torch.zeros(delayed.amax_history_len)
                amax_history[0] = x.abs().amax()
                delayed_scaling_update(amax_history, scale, op.rule.fp8_max, margin=delayed.margin)
                qt = quantize(x, op.rule, scale=scale)
                note = "step 2 (scale from step 1's amax)"
            else:
                qt = quantize(x, op.rule, axis=op.axis, generator=generator)
                note = "stochastic rounding" if op.rule.stochastic_rounding else ""
            x_dq = qt.dequantize()
            results.append(
                {
                    "recipe": label,
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
    parser.add_argument(
        "--recipes",
        default=",".join(RECIPE_NAMES),
        help=(
            "comma-separated recipes to check (default: every named one); a mixture "
            "'hybrid(forward=nvfp4,backward=mxfp8)' and a recipe per module '*.attn.*=mxfp8;*.fc*=nvfp4' "
            "(each pattern's recipe) too"
        ),
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    for name, value in (("--rows", args.rows), ("--cols", args.cols)):
        if value <= 0 or value % 128:
            raise UsageError(f"{name} {value} must be a positive multiple of 128")
    names = [name for name in split_recipe_list(args.recipes) if name]
    try:
        recipes = [recipe_or_map(name) for name in names]
    except (TypeError, ValueError) as error:
        raise UsageError(f"--recipes: {error}") from None
    print(format_table(run_selfcheck(args.rows, args.cols, args.seed, recipes)))
    return 0
