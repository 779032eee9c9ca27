"""Every recipe's operand plan, slot by slot, against a hand table; and the questions the
rest of the library asks a plan."""

import dataclasses

import pytest

from fp8train.spec import E4M3, E5M2, Format, Gemm, Granularity, QuantRule, Role, Usage
from fp8train.spec.recipes import BlockScaling, DelayedScaling, MXFP8Scaling, RowwiseScaling, TensorwiseScaling, from_name

G = Granularity
U = Usage
T, R, B1, B2, MX = G.TENSOR, G.ROW, G.BLOCK_1X128, G.BLOCK_128X128, G.MX
SLOTS = (
    U.OUTPUT_INPUT,
    U.OUTPUT_WEIGHT,
    U.GRAD_INPUT_GRAD_OUTPUT,
    U.GRAD_INPUT_WEIGHT,
    U.GRAD_WEIGHT_GRAD_OUTPUT,
    U.GRAD_WEIGHT_INPUT,
)
# recipe name: granularity per slot in SLOTS order (None: high precision)
PLANS = {
    "tensorwise": (T, T, T, T, T, T),
    "delayed": (T, T, T, T, T, T),
    "rowwise": (R, R, R, R, R, R),
    "rowwise_with_gw_hp": (R, R, R, T, None, None),
    "blockwise": (B1, B2, B1, B2, B1, B1),
    "mxfp8": (MX, MX, MX, MX, MX, MX),
}
# recipe name: (alignment, block, delayed, slots whose first-dim usage reuses the last-dim one)
PLAN_FACTS = {
    "tensorwise": (16, 0, False, {U.GRAD_INPUT_WEIGHT, U.GRAD_WEIGHT_GRAD_OUTPUT, U.GRAD_WEIGHT_INPUT}),
    "delayed": (16, 0, True, {U.GRAD_INPUT_WEIGHT, U.GRAD_WEIGHT_GRAD_OUTPUT, U.GRAD_WEIGHT_INPUT}),
    "rowwise": (16, 0, False, set()),
    "rowwise_with_gw_hp": (16, 0, False, set()),
    "blockwise": (128, 128, False, {U.GRAD_INPUT_WEIGHT}),
    "mxfp8": (32, 32, False, set()),
}


@pytest.mark.parametrize("name", list(PLANS))
def test_plan_granularities(name):
    plan = from_name(name).operand_plan
    for usage, granularity in zip(SLOTS, PLANS[name]):
        if granularity is None:
            assert not plan.quantizes_usage(usage)
            with pytest.raises(KeyError, match="runs in high precision"):
                plan.operand(usage)
        else:
            op = plan.operand(usage)
            assert op.granularity is granularity and op.usage is usage
            assert op.role is usage.role and op.axis == usage.axis


@pytest.mark.parametrize("name", list(PLANS))
def test_plan_facts(name):
    recipe = from_name(name)
    plan = recipe.operand_plan
    alignment, block, delayed, reused = PLAN_FACTS[name]
    assert plan.alignment == alignment == recipe.alignment
    assert plan.block == block
    assert plan.delayed is delayed
    assert {u for u in SLOTS if plan.reuses_last_dim(u)} == reused
    assert plan.quantizes(Gemm.GRAD_WEIGHT) is (name != "rowwise_with_gw_hp")
    assert plan.quantizes(Gemm.OUTPUT) and plan.quantizes(Gemm.GRAD_INPUT)


def test_formats_and_power_2_per_slot():
    plan = TensorwiseScaling(fp8_format=Format.HYBRID).operand_plan
    assert [plan.operand(u).format for u in SLOTS] == [E4M3, E4M3, E5M2, E4M3, E5M2, E4M3]
    assert not any(op.power_2_scales for op in plan.operands)
    assert all(op.power_2_scales for op in TensorwiseScaling(power_2_scales=True).operand_plan.operands)
    assert all(op.format is E4M3 for op in RowwiseScaling().operand_plan.operands)
    # E8M0 scales are powers of two whatever the recipe's power_2_scales says
    assert all(op.power_2_scales for op in MXFP8Scaling().operand_plan.operands)
    assert not any(op.power_2_scales for op in BlockScaling(power_2_scales=False).operand_plan.operands)


def test_plan_follows_recipe_fields():
    plan = BlockScaling(x_block_scaling_dim=2, w_block_scaling_dim=1).operand_plan
    assert [plan.operand(u).granularity for u in SLOTS] == [B2, B1, B1, B1, B1, B2]
    assert {u for u in SLOTS if plan.reuses_last_dim(u)} == {U.GRAD_WEIGHT_INPUT}
    assert all(op.rule.amax_epsilon == 0.5 for op in BlockScaling(amax_epsilon=0.5).operand_plan.operands)
    assert all(op.rule.mx_scale_rule == "ocp" for op in MXFP8Scaling(scale_rule="ocp").operand_plan.operands)
    assert DelayedScaling(margin=2).operand_plan.delayed


def test_every_slot_holds_one_rule():
    plan = RowwiseScaling(fp8_format=Format.HYBRID, power_2_scales=False, amax_epsilon=1e-3).operand_plan
    rule = plan.operand(U.GRAD_INPUT_GRAD_OUTPUT).rule
    assert rule == QuantRule(granularity=R, format=E5M2, power_2_scales=False, amax_epsilon=1e-3)
    assert plan.operand(U.OUTPUT_INPUT).rule == dataclasses.replace(rule, format=E4M3)
    op = plan.operand(U.GRAD_INPUT_GRAD_OUTPUT)
    assert (op.granularity, op.format, op.power_2_scales) == (R, E5M2, False)


def test_same_quantization_compares_role_and_rule():
    plan = from_name("blockwise").operand_plan
    # the weight's two usages: one 128x128 rule; the input's: 1x128, another role
    assert plan.operand(U.OUTPUT_WEIGHT).same_quantization(plan.operand(U.GRAD_INPUT_WEIGHT))
    assert not plan.operand(U.OUTPUT_INPUT).same_quantization(plan.operand(U.GRAD_INPUT_GRAD_OUTPUT))
    hybrid = BlockScaling(fp8_format=Format.HYBRID).operand_plan
    tweaked = dataclasses.replace(hybrid.operand(U.OUTPUT_INPUT), usage=U.GRAD_WEIGHT_INPUT)
    assert tweaked.same_quantization(hybrid.operand(U.GRAD_WEIGHT_INPUT))
    other_rule = dataclasses.replace(tweaked, rule=dataclasses.replace(tweaked.rule, amax_epsilon=1.0))
    assert not other_rule.same_quantization(hybrid.operand(U.GRAD_WEIGHT_INPUT))


def test_plan_is_not_part_of_equality_or_repr():
    assert TensorwiseScaling() == TensorwiseScaling()
    assert hash(BlockScaling()) == hash(BlockScaling())
    assert "operand_plan" not in repr(MXFP8Scaling())


def test_usages_of_role_last_dim_first():
    plan = from_name("mxfp8").operand_plan
    assert [op.usage for op in plan.usages_of(Role.WEIGHT)] == [U.OUTPUT_WEIGHT, U.GRAD_INPUT_WEIGHT]
    assert [op.usage for op in plan.usages_of(Role.INPUT)] == [U.OUTPUT_INPUT, U.GRAD_WEIGHT_INPUT]


def test_roles_and_gemms():
    assert [r.index for r in Role] == [0, 1, 2]
    assert [r.value for r in Role] == ["input", "weight", "grad_output"]
    assert Role.coerce("weight") is Role.WEIGHT
    with pytest.raises(ValueError, match="role='bias' is not one of input, weight, grad_output"):
        Role.coerce("bias")
    assert Gemm.OUTPUT.usages == (U.OUTPUT_INPUT, U.OUTPUT_WEIGHT)
    assert Gemm.GRAD_INPUT.usages == (U.GRAD_INPUT_GRAD_OUTPUT, U.GRAD_INPUT_WEIGHT)
    assert Gemm.GRAD_WEIGHT.usages == (U.GRAD_WEIGHT_GRAD_OUTPUT, U.GRAD_WEIGHT_INPUT)
