"""Recipe dataclasses: defaults, frozenness, from_name, validation (NUMERICS.md section 3)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fp8train.quant.cast import torch_dtype
from fp8train.spec import recipes
from fp8train.spec.formats import Format
from fp8train.spec.recipes import (
    BlockScaling,
    DelayedScaling,
    MXFP8Scaling,
    RowwiseScaling,
    TensorwiseScaling,
)
from fp8train.spec.roles import Role

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
ALL_RECIPE_CLASSES = [TensorwiseScaling, DelayedScaling, RowwiseScaling, BlockScaling, MXFP8Scaling]
CANONICAL_NAMES = ("tensorwise", "delayed", "rowwise", "rowwise_with_gw_hp", "blockwise", "mxfp8", "nvfp4", "mxfp4")


# ---------------------------------------------------------------- defaults


def test_tensorwise_defaults():
    recipe = TensorwiseScaling()
    assert recipe.fp8_format is Format.HYBRID
    assert recipe.power_2_scales is False
    assert recipe.amax_epsilon == 0.0
    assert recipe.name == "tensorwise"


def test_delayed_defaults():
    recipe = DelayedScaling()
    assert recipe.fp8_format is Format.HYBRID
    assert recipe.margin == 0
    assert recipe.amax_history_len == 1024
    assert recipe.amax_compute_algo == "max"
    assert recipe.reduce_amax is True
    assert recipe.name == "delayed"


def test_rowwise_defaults():
    recipe = RowwiseScaling()
    assert recipe.fp8_format is Format.E4M3
    assert recipe.power_2_scales is True
    assert recipe.grad_weight_hp is False
    assert recipe.amax_epsilon == 0.0
    assert recipe.name == "rowwise"


def test_rowwise_with_gw_hp_defaults():
    recipe = RowwiseScaling(grad_weight_hp=True)
    assert recipe.fp8_format is Format.E4M3
    assert recipe.power_2_scales is True
    assert recipe.grad_weight_hp is True
    assert recipe.name == "rowwise_with_gw_hp"


def test_blockwise_defaults():
    recipe = BlockScaling()
    assert recipe.fp8_format is Format.E4M3
    assert (recipe.x_block_scaling_dim, recipe.w_block_scaling_dim, recipe.grad_block_scaling_dim) == (1, 2, 1)
    assert recipe.power_2_scales is True
    assert recipe.amax_epsilon == 0.0
    assert recipe.block_size == 128
    assert recipe.name == "blockwise"
    assert recipe.granularity("input") == "block1x128"
    assert recipe.granularity("weight") == "block128x128"
    assert recipe.granularity("grad_output") == "block1x128"


def test_mxfp8_defaults():
    recipe = MXFP8Scaling()
    assert recipe.fp8_format is Format.E4M3
    assert recipe.scale_rule == "ceil"
    assert recipe.block_size == 32
    assert recipe.name == "mxfp8"


@pytest.mark.parametrize("recipe_cls", ALL_RECIPE_CLASSES, ids=lambda c: c.__name__)
def test_recipes_are_frozen(recipe_cls):
    recipe = recipe_cls()
    with pytest.raises(dataclasses.FrozenInstanceError):
        recipe.fp8_format = Format.E4M3
    with pytest.raises(dataclasses.FrozenInstanceError):
        recipe.new_field = 1


@pytest.mark.parametrize("recipe_cls", ALL_RECIPE_CLASSES, ids=lambda c: c.__name__)
def test_recipes_are_keyword_only(recipe_cls):
    with pytest.raises(TypeError):
        recipe_cls(Format.E4M3)


def test_delayed_accepts_other_valid_fields():
    recipe = DelayedScaling(
        margin=2, amax_history_len=1, amax_compute_algo="most_recent", reduce_amax=False, fp8_format="e4m3"
    )
    assert (recipe.margin, recipe.amax_history_len, recipe.amax_compute_algo, recipe.reduce_amax) == (
        2,
        1,
        "most_recent",
        False,
    )
    assert recipe.fp8_format is Format.E4M3

    def first_amax(history: torch.Tensor) -> torch.Tensor:
        return history[0]

    assert DelayedScaling(amax_compute_algo=first_amax).amax_compute_algo is first_amax


# ---------------------------------------------------------------- from_name


@pytest.mark.parametrize(
    "name, recipe_cls, fields",
    [
        ("tensorwise", TensorwiseScaling, {}),
        ("current", TensorwiseScaling, {}),
        ("delayed", DelayedScaling, {}),
        ("rowwise", RowwiseScaling, {"grad_weight_hp": False}),
        ("rowwise_with_gw_hp", RowwiseScaling, {"grad_weight_hp": True}),
        ("blockwise", BlockScaling, {}),
        ("mxfp8", MXFP8Scaling, {}),
    ],
)
def test_from_name_builds_defaults(name, recipe_cls, fields):
    for spelling in (name, name.upper(), f"  {name.title()} "):
        recipe = recipes.from_name(spelling)
        assert type(recipe) is recipe_cls
        assert recipe == recipe_cls(**fields)
    expected_name = "tensorwise" if name == "current" else name
    assert recipes.from_name(name).name == expected_name


def test_recipe_names_are_the_canonical_ones():
    assert set(recipes.RECIPE_NAMES) == set(CANONICAL_NAMES)


@pytest.mark.parametrize("name", ["fp8", "", "block", "mx", None, 3])
def test_from_name_rejects_unknown_names_and_lists_valid_ones(name):
    with pytest.raises(ValueError, match=r"unknown FP8 recipe") as excinfo:
        recipes.from_name(name)
    message = str(excinfo.value)
    assert repr(name) in message
    for valid in (*CANONICAL_NAMES, "current"):
        assert valid in message


# ---------------------------------------------------------------- fp8_format


@pytest.mark.parametrize("recipe_cls", ALL_RECIPE_CLASSES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("spelling", ["hybrid", "HYBRID", "Hybrid", Format.HYBRID])
def test_fp8_format_string_is_coerced(recipe_cls, spelling):
    recipe = recipe_cls(fp8_format=spelling)
    assert recipe.fp8_format is Format.HYBRID
    assert torch_dtype(recipe.role_format(Role.INPUT)) == E4M3
    assert torch_dtype(recipe.role_format(Role.WEIGHT)) == E4M3
    assert torch_dtype(recipe.role_format(Role.GRAD_OUTPUT)) == E5M2


@pytest.mark.parametrize("recipe_cls", ALL_RECIPE_CLASSES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("fmt", [Format.E5M2, "e5m2", "E5M2"], ids=str)
def test_pure_e5m2_is_rejected_by_every_recipe(recipe_cls, fmt):
    message = rf"fp8_format=E5M2: pure E5M2 training is not supported by {recipe_cls.__name__}"
    with pytest.raises(ValueError, match=message):
        recipe_cls(fp8_format=fmt)


@pytest.mark.parametrize("recipe_cls", ALL_RECIPE_CLASSES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("fmt", ["e3m4", "", 1, None, torch.float8_e4m3fn])
def test_fp8_format_must_be_a_format(recipe_cls, fmt):
    with pytest.raises(ValueError, match=r"fp8_format=.* is not a Format; use one of E4M3, E5M2, HYBRID"):
        recipe_cls(fp8_format=fmt)


@pytest.mark.parametrize(
    "recipe, input_dtype, weight_dtype, grad_output_dtype",
    [
        (TensorwiseScaling(), E4M3, E4M3, E5M2),
        (TensorwiseScaling(fp8_format=Format.E4M3), E4M3, E4M3, E4M3),
        (DelayedScaling(), E4M3, E4M3, E5M2),
        (DelayedScaling(fp8_format=Format.E4M3), E4M3, E4M3, E4M3),
        (RowwiseScaling(), E4M3, E4M3, E4M3),
        (RowwiseScaling(fp8_format=Format.HYBRID), E4M3, E4M3, E5M2),
        (RowwiseScaling(grad_weight_hp=True), E4M3, E4M3, E4M3),
        (BlockScaling(), E4M3, E4M3, E4M3),
        (BlockScaling(fp8_format=Format.HYBRID), E4M3, E4M3, E5M2),
        (MXFP8Scaling(), E4M3, E4M3, E4M3),
        (MXFP8Scaling(fp8_format=Format.HYBRID), E4M3, E4M3, E5M2),
    ],
    ids=repr,
)
def test_operand_dtypes_per_recipe_and_format(recipe, input_dtype, weight_dtype, grad_output_dtype):
    assert torch_dtype(recipe.role_format(Role.INPUT)) == input_dtype
    assert torch_dtype(recipe.role_format(Role.WEIGHT)) == weight_dtype
    assert torch_dtype(recipe.role_format(Role.GRAD_OUTPUT)) == grad_output_dtype


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize("value", [0, -1, 1.5, True, False, "8", None])
def test_delayed_rejects_bad_amax_history_len(value):
    with pytest.raises(ValueError, match=r"amax_history_len=.* must be an int >= 1"):
        DelayedScaling(amax_history_len=value)


@pytest.mark.parametrize("value", [-1, 0.5, True, "1", None])
def test_delayed_rejects_bad_margin(value):
    with pytest.raises(ValueError, match=r"margin=.* must be an int >= 0"):
        DelayedScaling(margin=value)


@pytest.mark.parametrize("value", ["mean", "MAX", "", None, 3])
def test_delayed_rejects_bad_amax_compute_algo(value):
    with pytest.raises(ValueError, match=r"amax_compute_algo=.* must be 'max', 'most_recent' or a callable"):
        DelayedScaling(amax_compute_algo=value)


@pytest.mark.parametrize("value", [1, 0, "yes", None])
def test_delayed_rejects_non_bool_reduce_amax(value):
    with pytest.raises(ValueError, match=r"reduce_amax=.* must be True or False"):
        DelayedScaling(reduce_amax=value)


BLOCK_DIM_FIELDS = ("x_block_scaling_dim", "w_block_scaling_dim", "grad_block_scaling_dim")


@pytest.mark.parametrize(
    "dims, first, second",
    [
        ((2, 2, 1), "x_block_scaling_dim", "w_block_scaling_dim"),
        ((1, 2, 2), "grad_block_scaling_dim", "w_block_scaling_dim"),
        ((2, 1, 2), "grad_block_scaling_dim", "x_block_scaling_dim"),
        ((2, 2, 2), "x_block_scaling_dim", "w_block_scaling_dim"),
    ],
)
def test_block_rejects_2d_by_2d_gemms(dims, first, second):
    with pytest.raises(ValueError, match=rf"{first}=2 with {second}=2 makes a 2-D x 2-D block GEMM"):
        BlockScaling(**dict(zip(BLOCK_DIM_FIELDS, dims)))


@pytest.mark.parametrize("dims", [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2)])
def test_block_accepts_at_most_one_2d_operand_per_gemm(dims):
    recipe = BlockScaling(**dict(zip(BLOCK_DIM_FIELDS, dims)))
    expected = {1: "block1x128", 2: "block128x128"}
    assert recipe.granularity("input") == expected[dims[0]]
    assert recipe.granularity("weight") == expected[dims[1]]
    assert recipe.granularity("grad_output") == expected[dims[2]]


@pytest.mark.parametrize("field_name", BLOCK_DIM_FIELDS)
# (A float 1.0 or 2.0 compares equal to the int and is accepted as it stands.)
@pytest.mark.parametrize("value", [0, 3, 128, True, 1.5, "1", None])
def test_block_rejects_bad_block_dims(field_name, value):
    with pytest.raises(ValueError, match=rf"{field_name}=.* must be 1 \(1x128 blocks\) or 2"):
        BlockScaling(**{field_name: value})


@pytest.mark.parametrize("value", ["floor", "CEIL", "", None])
def test_mxfp8_rejects_bad_scale_rule(value):
    with pytest.raises(ValueError, match=r"scale_rule=.* must be one of ceil, ocp"):
        MXFP8Scaling(scale_rule=value)


def test_mxfp8_accepts_ocp_rule():
    assert MXFP8Scaling(scale_rule="ocp").scale_rule == "ocp"


@pytest.mark.parametrize("recipe_cls", [TensorwiseScaling, RowwiseScaling, BlockScaling], ids=lambda c: c.__name__)
@pytest.mark.parametrize("value", [-1e-12, -1.0, float("nan"), True, "0", None])
def test_bad_amax_epsilon_is_rejected(recipe_cls, value):
    with pytest.raises(ValueError, match=r"amax_epsilon=.* must be a float >= 0"):
        recipe_cls(amax_epsilon=value)


@pytest.mark.parametrize("recipe_cls", [TensorwiseScaling, RowwiseScaling, BlockScaling], ids=lambda c: c.__name__)
def test_amax_epsilon_accepts_non_negative_numbers(recipe_cls):
    assert recipe_cls(amax_epsilon=0).amax_epsilon == 0
    assert recipe_cls(amax_epsilon=1e-12).amax_epsilon == 1e-12


@pytest.mark.parametrize("recipe_cls", [TensorwiseScaling, RowwiseScaling, BlockScaling], ids=lambda c: c.__name__)
@pytest.mark.parametrize("value", [1, 0, "True", None])
def test_non_bool_power_2_scales_is_rejected(recipe_cls, value):
    with pytest.raises(ValueError, match=r"power_2_scales=.* must be True or False"):
        recipe_cls(power_2_scales=value)


@pytest.mark.parametrize("value", [1, "yes"])
def test_non_bool_grad_weight_hp_is_rejected(value):
    with pytest.raises(ValueError, match=r"grad_weight_hp=.* must be True or False"):
        RowwiseScaling(grad_weight_hp=value)
