"""``fp8train.inspect`` and ``fp8train selfcheck`` with mixed recipes (issue 41): a hybrid is
measured as its directions' recipes measure each GEMM (the oracle: the plain recipes), a
recipe map as one column whose every layer runs its pattern's recipe, and both name each
module's recipe."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fp8train
from fp8train import recipes
from fp8train.diagnostics.inspect_report import format_report
from fp8train.train.commands.cli import main
from fp8train.train.commands.selfcheck import labelled_recipes, run_selfcheck

DIM = 64
HYBRID = "hybrid(forward=nvfp4,backward=mxfp8)"


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(DIM, DIM)
        self.mlp = nn.Linear(DIM, DIM)
        self.lm_head = nn.Linear(DIM, DIM)

    def forward(self, x):
        return self.lm_head(self.mlp(self.attn(x)))


def _inspect(recipe_list, model=None):
    torch.manual_seed(0)
    model = _Block() if model is None else model
    x = torch.randn(64, DIM, generator=torch.Generator().manual_seed(1))
    return fp8train.inspect(model, x, recipes=recipe_list)


def _by_key(inspection, recipe):
    return {(r.layer, r.gemm, r.operand): r.sqnr_db for r in inspection if r.recipe == recipe}


def test_inspect_measures_a_hybrid_gemm_by_gemm_as_its_two_recipes():
    inspection = _inspect([HYBRID, "nvfp4", "mxfp8"], nn.Sequential(nn.Linear(DIM, DIM)))
    assert inspection.recipes == [HYBRID, "nvfp4", "mxfp8"]
    mixed, forward, backward = (_by_key(inspection, name) for name in inspection.recipes)
    assert mixed and set(mixed) == set(backward)
    for key, sqnr in mixed.items():
        assert sqnr == (forward if key[1] == "output" else backward)[key], key


def test_inspect_measures_a_recipe_map_as_one_column_and_names_each_modules_recipe():
    line = "attn=mxfp8;mlp=hybrid(forward=nvfp4,backward=mxfp8);lm_head=bf16"
    inspection = _inspect([line, "mxfp8", HYBRID])
    label = inspection.recipes[0]
    assert label == line
    assert inspection.module_recipes == {label: {"attn": "mxfp8", "mlp": HYBRID, "lm_head": "bf16"}}
    mixed = _by_key(inspection, label)
    assert {k: v for k, v in mixed.items() if k[0] == "attn"} == {
        k: v for k, v in _by_key(inspection, "mxfp8").items() if k[0] == "attn"
    }
    assert {k: v for k, v in mixed.items() if k[0] == "mlp"} == {
        k: v for k, v in _by_key(inspection, HYBRID).items() if k[0] == "mlp"
    }
    assert not any(k[0] == "lm_head" for k in mixed)
    assert "pattern 'lm_head'" in inspection.skipped[label]["lm_head"]
    report = format_report(inspection)
    assert f"## Recipe per module under {label}" in report and f"- mlp: {HYBRID}" in report
    with pytest.raises(ValueError, match=r"recipe map pattern 'attn': unknown FP8 recipe 'mxfp9'"):
        _inspect(["attn=mxfp9"])


def test_selfcheck_checks_a_hybrid_as_its_directions_and_a_map_pattern_by_pattern():
    results = run_selfcheck(128, 128, 0, recipes=[HYBRID, "nvfp4", "mxfp8", "*.attn=mxfp8;lm_head=bf16"])
    rows = {(r["recipe"], r["role"]): r for r in results}
    for role, source in (("input", "nvfp4"), ("weight", "nvfp4"), ("grad_output", "mxfp8")):
        assert rows[HYBRID, role] == {**rows[source, role], "recipe": HYBRID}
    assert rows["*.attn=mxfp8", "input"] == {**rows["mxfp8", "input"], "recipe": "*.attn=mxfp8"}
    assert not any(recipe.startswith("lm_head") for recipe, _ in rows)  # high precision: nothing to check
    delayed = {r["role"]: r for r in run_selfcheck(128, 128, 0, recipes=["hybrid(forward=delayed,backward=mxfp8)"])}
    assert delayed["input"]["note"].startswith("step 2") and delayed["grad_output"]["granularity"] == "mx"
    assert [label for label, _ in labelled_recipes([recipes.hybrid(forward="mxfp8", backward="tensorwise")])] == [
        "hybrid(forward=mxfp8,backward=tensorwise)"
    ]


def test_the_selfcheck_command_takes_mixtures_and_names_a_bad_one(capsys):
    assert main(["selfcheck", "--rows", "128", "--cols", "128", "--recipes", f"{HYBRID},attn=mxfp8"]) == 0
    out = capsys.readouterr().out
    assert f"| {HYBRID} | grad_output | mx |" in out and "| attn=mxfp8 | input | mx |" in out
    assert main(["selfcheck", "--rows", "128", "--cols", "128", "--recipes", "hybrid(forward=nvfp4,backward=nope)"]) == 2
    assert "--recipes: backward: unknown FP8 recipe 'nope'" in capsys.readouterr().err
