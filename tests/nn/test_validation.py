"""Bad arguments to Float8Linear, convert, autocast and drop_fp8_state: typed errors that
name the argument, checked before any module is changed."""

import pytest
import torch
from torch import nn

import fp8train
from fp8train import Float8Linear
from fp8train.parallel import enable_fp8_all_gather, precompute_fp8_scales_for_fsdp


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(in_features=0, out_features=16), ValueError, r"in_features=0 must be an int >= 1"),
        (dict(in_features=16.0, out_features=16), TypeError, r"in_features=16.0 must be an int >= 1"),
        (dict(in_features=16, out_features=-16), ValueError, r"out_features=-16 must be an int >= 1"),
        (dict(in_features=16, out_features=16, bias="no"), TypeError, r"bias='no' must be True or False"),
        (dict(in_features=16, out_features=16, recipe=3), TypeError, r"recipe=3 must be a Recipe or a recipe name"),
        (dict(in_features=16, out_features=16, recipe="fp4"), ValueError, r"unknown FP8 recipe 'fp4'"),
    ],
)
def test_bad_float8_linear_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        Float8Linear(**kwargs)


def test_from_linear_needs_a_linear():
    with pytest.raises(TypeError, match=r"linear must be an nn.Linear, got Conv1d"):
        Float8Linear.from_linear(nn.Conv1d(16, 16, 1))
    with pytest.raises(TypeError, match=r"config='rowwise' must be a Float8ModuleConfig or None"):
        Float8Linear.from_linear(nn.Linear(16, 16), config="rowwise")


@pytest.mark.parametrize(
    "model, kwargs, error, match",
    [
        ("gpt2", {}, TypeError, r"model must be an nn.Module, got str 'gpt2'"),
        (None, dict(recipe=object()), TypeError, r"recipe=<object object.*> must be a Recipe or a recipe name"),
        (None, dict(module_filter_fn="lm_head"), TypeError, r"module_filter_fn='lm_head' must be a callable \(module, fqn\) -> bool"),
        (None, dict(backend="gpu"), ValueError, r"backend='gpu' must be one of auto, emulated, hardware"),
        (None, dict(dim_alignment=-16), ValueError, r"dim_alignment=-16 must be an int >= 0"),
        (None, dict(dim_alignment=16.0), TypeError, r"dim_alignment=16.0 must be an int >= 0"),
        (None, dict(save_fp8_activations="yes"), TypeError, r"save_fp8_activations='yes' must be True or False"),
    ],
)
def test_bad_convert_arguments_leave_the_model_alone(model, kwargs, error, match):
    original = nn.Sequential(nn.Linear(32, 32)) if model is None else model
    with pytest.raises(error, match=match):
        fp8train.convert_to_float8_training(original, **kwargs)
    if model is None:
        assert type(original[0]) is nn.Linear


def test_bad_model_arguments_elsewhere():
    with pytest.raises(TypeError, match=r"model must be an nn.Module, got dict"):
        fp8train.convert_to_linear({})
    with pytest.raises(TypeError, match=r"state_dict must be a mapping of names to tensors"):
        fp8train.drop_fp8_state([("weight", torch.zeros(1))])
    with pytest.raises(TypeError, match=r"model must be an nn.Module, got str"):
        enable_fp8_all_gather("model")
    with pytest.raises(ValueError, match=r"shard_world_size=0 must be an int >= 1 or None"):
        enable_fp8_all_gather(nn.Linear(16, 16), shard_world_size=0)
    with pytest.raises(TypeError, match=r"model must be an nn.Module, got NoneType"):
        precompute_fp8_scales_for_fsdp(None)
