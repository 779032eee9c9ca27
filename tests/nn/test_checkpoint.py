"""Checkpoints of converted models: original-precision weights plus, for delayed scaling
only, plain FP8 state tensors; loadable across FP8/plain models and across recipes."""

import copy

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import fp8train
from fp8train.spec.recipes import RECIPE_NAMES, DelayedScaling

FP8_KEYS = {"fp8_scale", "fp8_amax_history"}
# The model of every test: small_model(*LAYERS) (see tests/conftest.py).
LAYERS = ((128, 256), "relu", (256, 128, False))


def _train_steps(model: nn.Module, steps: int = 3) -> None:
    for step in range(steps):
        x = torch.randn(64, 128, generator=torch.Generator().manual_seed(step))
        model(x).square().mean().backward()


def _leaf_names(state_dict) -> set:
    return {key.rpartition(".")[2] for key in state_dict}


@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_state_dict_holds_original_precision_weights_and_only_delayed_state(recipe, small_model):
    plain = small_model(*LAYERS, dtype=torch.bfloat16)
    converted = fp8train.convert_to_float8_training(copy.deepcopy(plain), recipe, backend="emulated")
    state = converted.state_dict()
    assert {k: v.dtype for k, v in state.items() if k in plain.state_dict()} == {
        k: v.dtype for k, v in plain.state_dict().items()
    }
    extra = _leaf_names(state) - _leaf_names(plain.state_dict())
    assert extra == (FP8_KEYS if recipe == "delayed" else set())
    for key, value in state.items():
        assert type(value) is torch.Tensor, key  # plain tensors: safetensors can hold them


@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_plain_model_loads_converted_weights_and_back(recipe, small_model):
    plain = small_model(*LAYERS)
    converted = fp8train.convert_to_float8_training(small_model(*LAYERS), recipe, backend="emulated")
    _train_steps(converted)
    with torch.no_grad():
        for p in converted.parameters():
            p.add_(0.5)  # make the weights differ from plain's
    plain.load_state_dict(fp8train.drop_fp8_state(converted.state_dict()), strict=True)
    for (name, p_plain), p_conv in zip(plain.named_parameters(), converted.parameters()):
        assert torch.equal(p_plain, p_conv), name

    fresh = fp8train.convert_to_float8_training(small_model(*LAYERS), recipe, backend="emulated")
    with torch.no_grad():
        for p in plain.parameters():
            p.mul_(2)
    fresh.load_state_dict(plain.state_dict(), strict=True)  # delayed: FP8 state starts fresh
    for p_plain, p_fresh in zip(plain.parameters(), fresh.parameters()):
        assert torch.equal(p_plain, p_fresh)


def test_delayed_state_round_trips_bit_exactly_through_safetensors(tmp_path, small_model):
    recipe = DelayedScaling(amax_history_len=8)
    model = fp8train.convert_to_float8_training(small_model(*LAYERS), recipe, backend="emulated")
    _train_steps(model, steps=4)
    model(torch.randn(8, 128))  # leave a forward update pending as well
    path = tmp_path / "model.safetensors"
    save_file(model.state_dict(), str(path))

    restored = fp8train.convert_to_float8_training(small_model(*LAYERS), recipe, backend="emulated")
    restored.load_state_dict(load_file(str(path)), strict=True)
    for (key, expected), actual in zip(model.state_dict().items(), restored.state_dict().values()):
        assert torch.equal(expected.view(torch.uint8), actual.view(torch.uint8)), key
    scales = [m.fp8_scale for m in restored.modules() if isinstance(m, fp8train.Float8Linear)]
    assert all((s != 1).any() for s in scales)  # the state is real, not the initial value


def test_delayed_state_is_dropped_by_other_recipes_and_kept_across_delayed(small_model):
    delayed = fp8train.convert_to_float8_training(small_model(*LAYERS), "delayed", backend="emulated")
    _train_steps(delayed)
    tensorwise = fp8train.convert_to_float8_training(small_model(*LAYERS), "tensorwise", backend="emulated")
    tensorwise.load_state_dict(delayed.state_dict(), strict=True)
    assert not (_leaf_names(tensorwise.state_dict()) & FP8_KEYS)
    for p_src, p_dst in zip(delayed.parameters(), tensorwise.parameters()):
        assert torch.equal(p_src, p_dst)


def test_mismatched_history_length_is_a_clear_error(small_model):
    source = fp8train.convert_to_float8_training(
        small_model(*LAYERS), DelayedScaling(amax_history_len=8), backend="emulated"
    )
    target = fp8train.convert_to_float8_training(
        small_model(*LAYERS), DelayedScaling(amax_history_len=4), backend="emulated"
    )
    with pytest.raises(RuntimeError, match="amax_history_len=8"):
        target.load_state_dict(source.state_dict())


def test_drop_fp8_state_keeps_everything_else(small_model):
    model = fp8train.convert_to_float8_training(small_model(*LAYERS), "delayed", backend="emulated")
    stripped = fp8train.drop_fp8_state(model.state_dict())
    assert set(stripped) == set(small_model(*LAYERS).state_dict())
