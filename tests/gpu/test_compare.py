"""``fp8train compare`` on the device: every recipe and bf16 from the same start on the
default model at width 1024, as a user runs it (the command line, backend ``auto``). No
loss may be NaN, every FP8 recipe must convert the model's Linear layers, and each
recipe's validation loss must be within the README's bound of bf16's
(:data:`~tests.helpers.tolerances.MAX_VAL_GAP_PERCENT`, at the command's default 150 steps).
"""

from __future__ import annotations

import importlib.util
import json
import math

import pytest

from fp8train.spec.recipes import RECIPE_NAMES
from fp8train.train.commands.cli import main
from tests.helpers.tolerances import MAX_VAL_GAP_PERCENT

from ._suite import is_finite_number


@pytest.fixture(scope="module")
def compare_results(device, sizes, tmp_path_factory) -> dict:
    output_dir = tmp_path_factory.mktemp("compare")
    argv = ["compare", "--recipes", ",".join(("bf16", *RECIPE_NAMES)), "--device", device.type,
            "--output_dir", str(output_dir), *sizes.compare_flags]
    code = main(argv)
    # Only the loss-curve plot needs matplotlib, drawn after results.json is written: a GPU
    # machine without it still gives every number (the exit code says the plot failed).
    if importlib.util.find_spec("matplotlib") is not None:
        assert code == 0, f"fp8train {' '.join(argv)} failed"
    return json.loads((output_dir / "results.json").read_text())


def test_compare_trains_every_recipe_without_nan(compare_results, device):
    assert compare_results["config"]["device"] == device.type
    assert set(compare_results["runs"]) == {"bf16", *RECIPE_NAMES}
    for name, run in compare_results["runs"].items():
        losses = run["losses"]
        bad = [step for step, loss in enumerate(losses, start=1) if not is_finite_number(loss)]
        assert not bad, f"{name}: non-finite training loss at steps {bad[:10]}"
        for key in ("final_train_loss", "final_val_loss", "tokens_per_second"):
            assert is_finite_number(run[key]), f"{name}: {key} = {run[key]!r}"
        if name != "bf16":
            assert run["converted_layers"] > 0, f"{name}: no Linear layer converted"


@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_compare_gap_to_bf16_is_within_the_readme_bound(recipe, compare_results):
    run = compare_results["runs"][recipe]
    gap = run["val_gap_percent"]
    assert not math.isnan(gap) and abs(gap) < MAX_VAL_GAP_PERCENT, (
        f"{recipe}: validation loss {run['final_val_loss']:.4f}, {gap:+.2f}% from bf16's "
        f"{compare_results['runs']['bf16']['final_val_loss']:.4f} (bound {MAX_VAL_GAP_PERCENT}%)"
    )
