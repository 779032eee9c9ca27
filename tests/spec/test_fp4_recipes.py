"""The 4-bit recipes' plans, slot by slot, against NUMERICS.md section 6 (TE's
NVFP4BlockScaling defaults and its disable_* options; MXFP4 1x32 everywhere), and their
validation."""

from __future__ import annotations

import dataclasses

import pytest

from fp8train.spec import E2M1, Format, Granularity, Role, Usage
from fp8train.spec.recipes import MXFP4Scaling, NVFP4Scaling, from_name

G = Granularity
# slot -> (granularity, rht, stochastic rounding) of the default nvfp4 plan (NUMERICS.md 6).
NVFP4_PLAN = {
    Usage.OUTPUT_INPUT: (G.NVFP4, False, False),
    Usage.OUTPUT_WEIGHT: (G.NVFP4_2D, False, False),
    Usage.GRAD_INPUT_GRAD_OUTPUT: (G.NVFP4, False, True),
    Usage.GRAD_INPUT_WEIGHT: (G.NVFP4_2D, False, False),
    Usage.GRAD_WEIGHT_GRAD_OUTPUT: (G.NVFP4, True, True),
    Usage.GRAD_WEIGHT_INPUT: (G.NVFP4, True, False),
}


def _slots(recipe):
    plan = recipe.operand_plan
    return {op.usage: (op.granularity, op.rule.rht, op.rule.stochastic_rounding) for op in plan.operands}


def test_nvfp4_default_plan_is_transformer_engines():
    recipe = from_name("nvfp4")
    assert isinstance(recipe, NVFP4Scaling) and recipe.name == "nvfp4"
    assert _slots(recipe) == NVFP4_PLAN
    plan = recipe.operand_plan
    assert all(op.format is E2M1 and not op.power_2_scales for op in plan.operands)
    # The weight's 16x16 tiles serve grad_input transposed; nothing else is reused.
    reused = {usage for usage in Usage if plan.reuses_last_dim(usage)}
    assert reused == {Usage.GRAD_INPUT_WEIGHT}
    assert plan.alignment == 32 and plan.block == 16 and not plan.delayed


@pytest.mark.parametrize(
    "option, changed",
    [
        ("disable_rht", {Usage.GRAD_WEIGHT_GRAD_OUTPUT: (G.NVFP4, False, True), Usage.GRAD_WEIGHT_INPUT: (G.NVFP4, False, False)}),
        (
            "disable_stochastic_rounding",
            {Usage.GRAD_INPUT_GRAD_OUTPUT: (G.NVFP4, False, False), Usage.GRAD_WEIGHT_GRAD_OUTPUT: (G.NVFP4, True, False)},
        ),
        ("disable_2d_quantization", {Usage.OUTPUT_WEIGHT: (G.NVFP4, False, False), Usage.GRAD_INPUT_WEIGHT: (G.NVFP4, False, False)}),
    ],
)
def test_each_nvfp4_option_switches_only_its_part(option, changed):
    recipe = NVFP4Scaling(**{option: True})
    assert _slots(recipe) == {**NVFP4_PLAN, **changed}
    if option == "disable_2d_quantization":
        # 1x16 weights along K (output GEMM) and along N (grad_input): two quantizations.
        assert not any(recipe.operand_plan.reuses_last_dim(usage) for usage in Usage)
        assert recipe.operand_plan.operand(Usage.GRAD_INPUT_WEIGHT).axis == 0


def test_mxfp4_plan_is_1x32_everywhere():
    recipe = from_name("mxfp4")
    assert isinstance(recipe, MXFP4Scaling) and recipe.name == "mxfp4"
    assert _slots(recipe) == dict.fromkeys(NVFP4_PLAN, (G.MXFP4, False, False))
    assert all(op.rule.mx_scale_rule == "ceil" and op.power_2_scales for op in recipe.operand_plan.operands)
    assert MXFP4Scaling(scale_rule="ocp").operand_plan.operands[0].rule.mx_scale_rule == "ocp"
    assert recipe.alignment == 32


@pytest.mark.parametrize("recipe_cls", [NVFP4Scaling, MXFP4Scaling], ids=lambda c: c.__name__)
def test_every_role_is_e2m1_and_fp8_format_is_fixed(recipe_cls):
    recipe = recipe_cls()
    assert {recipe.role_format(role) for role in Role} == {E2M1}
    assert recipe.role_format("grad_output") is E2M1
    with pytest.raises(ValueError, match=rf"fp8_format=HYBRID is not an option of the {recipe.name} recipe"):
        recipe_cls(fp8_format=Format.HYBRID)
    with pytest.raises(ValueError, match=r"pure E5M2 training is not supported"):
        recipe_cls(fp8_format="e5m2")
    with pytest.raises(dataclasses.FrozenInstanceError):
        recipe.fp8_format = Format.E4M3
    with pytest.raises(TypeError):
        recipe_cls(Format.E4M3)  # keyword-only


@pytest.mark.parametrize("option", ["disable_rht", "disable_stochastic_rounding", "disable_2d_quantization"])
def test_nvfp4_options_must_be_bools(option):
    with pytest.raises(TypeError, match=rf"{option}=1 must be True or False"):
        NVFP4Scaling(**{option: 1})


def test_mxfp4_scale_rule_is_checked():
    with pytest.raises(ValueError, match=r"scale_rule='round' must be one of ceil, ocp"):
        MXFP4Scaling(scale_rule="round")


def test_recipes_compare_and_hash_by_fields():
    assert NVFP4Scaling() == from_name("NVFP4") and hash(NVFP4Scaling()) == hash(from_name("nvfp4"))
    assert NVFP4Scaling(disable_rht=True) != NVFP4Scaling()
