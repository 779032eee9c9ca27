"""Float8ModuleConfig: the FP8 modules' options as one value, checked once, passed whole
through conversion and the from_* constructors; the adoption those share."""

import dataclasses

import pytest
import torch
from torch import nn

import fp8train
from fp8train import Float8Linear
from fp8train.nn.modules.attention import Float8MultiheadAttention
from fp8train.nn.config import Float8ModuleConfig
from fp8train.spec.recipes import from_name


def test_config_resolves_the_recipe_and_is_frozen():
    config = Float8ModuleConfig(recipe="delayed", backend="emulated", save_fp8_activations=False)
    assert config.recipe == from_name("delayed")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.backend = "auto"
    assert Float8ModuleConfig() == Float8ModuleConfig(recipe="tensorwise", backend="auto")


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(recipe="fp4"), ValueError, r"unknown FP8 recipe 'fp4'"),
        (dict(recipe=3), TypeError, r"recipe=3 must be a Recipe or a recipe name"),
        (dict(backend="cuda"), ValueError, r"backend='cuda' must be one of auto, emulated, hardware"),
        (dict(save_fp8_activations=1), TypeError, r"save_fp8_activations=1 must be True or False"),
    ],
)
def test_bad_config(kwargs, error, match):
    with pytest.raises(error, match=match):
        Float8ModuleConfig(**kwargs)


def test_config_or_recipe_not_both():
    config = Float8ModuleConfig(recipe="rowwise")
    fix = r"pass the options in one place, config=dataclasses.replace\(config, recipe='mxfp8'\), or leave config out"
    given = r"recipe='mxfp8' given beside config=Float8ModuleConfig\(recipe=Rowwise"
    with pytest.raises(TypeError, match=given + ".*" + fix):
        Float8Linear(16, 16, recipe="mxfp8", config=config)
    with pytest.raises(TypeError, match=fix):
        Float8MultiheadAttention.from_attention(nn.MultiheadAttention(16, 2), "mxfp8", config=config)
    with pytest.raises(TypeError, match=r"config='rowwise' must be a Float8ModuleConfig or None"):
        Float8Linear(16, 16, config="rowwise")


def test_conversion_takes_config_or_options_not_both():
    config = Float8ModuleConfig(recipe="rowwise")
    with pytest.raises(TypeError, match=r"backend='emulated', save_fp8_activations=False given beside config="):
        fp8train.convert_to_float8_training(
            nn.Linear(16, 16), config=config, backend="emulated", save_fp8_activations=False
        )
    # Options left at their defaults beside a config are not given.
    assert fp8train.convert_to_float8_training(nn.Linear(16, 16), config=config).fp8_config is config


def test_build_resolves_the_recipe_shorthand_in_one_place():
    assert Float8ModuleConfig.build() == Float8ModuleConfig()
    assert Float8ModuleConfig.build(recipe="delayed") == Float8ModuleConfig(recipe="delayed")
    assert Float8Linear(16, 16, recipe="mxfp8").fp8_config == Float8ModuleConfig(recipe="mxfp8")
    assert Float8Linear.from_linear(nn.Linear(16, 16), "rowwise").recipe == from_name("rowwise")


def test_modules_and_conversion_take_the_config_whole():
    config = Float8ModuleConfig(recipe="delayed", backend="emulated", save_fp8_activations=False)
    assert Float8Linear(16, 32, config=config).fp8_config is config
    model = nn.Sequential(nn.Linear(16, 32), nn.MultiheadAttention(16, 2))
    fp8train.convert_to_float8_training(model, config=config)
    assert model[0].fp8_config is config and model[1].fp8_config is config
    assert model[1].out_proj.fp8_config is config
    assert (model[0].recipe, model[0].backend, model[0].save_fp8_activations) == (config.recipe, "emulated", False)


def test_an_option_assigned_replaces_the_config_checked():
    module = Float8Linear(16, 16, recipe="rowwise")
    module.save_fp8_activations = False
    assert module.fp8_config == Float8ModuleConfig(recipe="rowwise", save_fp8_activations=False)
    with pytest.raises(ValueError, match=r"backend='gpu' must be one of"):
        module.backend = "gpu"


@pytest.mark.parametrize("training", [True, False])
def test_from_constructors_adopt_parameters_state_device_and_mode(training):
    linear, attention = nn.Linear(16, 32), nn.MultiheadAttention(16, 2)
    linear.train(training), attention.train(training)
    new_linear = Float8Linear.from_linear(linear, "delayed")
    new_attention = Float8MultiheadAttention.from_attention(attention, "delayed")
    assert new_linear.weight is linear.weight and new_linear.bias is linear.bias
    assert new_attention.in_proj_weight is attention.in_proj_weight
    assert new_attention.out_proj.weight is attention.out_proj.weight
    for module in (new_linear, new_attention, new_attention.out_proj):
        assert module.training is training
        assert module.fp8_scale.device == torch.device("cpu") and module.delayed_state.scale is module.fp8_scale
