"""fp8train.autocast: FP8 off, recipe override, nesting and exception safety, and the timing
of delayed scaling's updates (NUMERICS.md section 3, "delayed")."""

from __future__ import annotations

import copy
import importlib

import numpy as np
import pytest
import torch
from torch import nn

import fp8train
from fp8train.nn.convert import convert_to_float8_training
from fp8train.nn.modules.linear import Float8Linear
from fp8train.quant.gemm import scaled_mm
from fp8train.quant import quantize
from fp8train.spec.recipes import DelayedScaling

ac = importlib.import_module("fp8train.nn.autocast")  # the module; fp8train.autocast is the function

IN_FEATURES, OUT_FEATURES, NUM_TOKENS = 128, 256, 64
HISTORY_LEN = 4
E4M3_MAX, E5M2_MAX = 448.0, 57344.0
INPUT, WEIGHT, GRAD_OUTPUT = 0, 1, 2


def _linear(seed=0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(IN_FEATURES, OUT_FEATURES)


def _converted(linear: nn.Linear, recipe) -> Float8Linear:
    return convert_to_float8_training(copy.deepcopy(linear), recipe, backend="emulated")


def _x(seed=1, scale=1.0) -> torch.Tensor:
    return scale * torch.randn(NUM_TOKENS, IN_FEATURES, generator=torch.Generator().manual_seed(seed))


def _forward_backward(module, x, grad_output):
    module.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    out = module(x)
    out.backward(grad_output)
    return out.detach(), x.grad, module.weight.grad, module.bias.grad


# ---------------------------------------------------------------- enabled / recipe


def test_disabled_is_exactly_nn_linear():
    reference = _linear()
    model = _converted(reference, "tensorwise")
    x, grad_output = _x(), torch.randn(NUM_TOKENS, OUT_FEATURES)
    with fp8train.autocast(enabled=False):
        got = _forward_backward(model, x, grad_output)
    expected = _forward_backward(reference, x, grad_output)
    for g, e in zip(got, expected):
        assert torch.equal(g, e)
    # ... and FP8 is back on outside the block.
    assert not torch.equal(model(x), reference(x))


def test_disabled_delayed_module_records_nothing():
    model = _converted(_linear(), DelayedScaling(amax_history_len=HISTORY_LEN))
    with fp8train.autocast(enabled=False):
        model(_x())
    assert torch.equal(model.fp8_amax_history, torch.zeros(HISTORY_LEN, 3))
    assert torch.equal(model.fp8_scale, torch.ones(3))


@pytest.mark.parametrize("override", ["rowwise", "blockwise", "mxfp8"])
def test_recipe_override_equals_direct_conversion(override):
    linear = _linear()
    model = _converted(linear, "tensorwise")
    direct = _converted(linear, override)
    x, grad_output = _x(), torch.randn(NUM_TOKENS, OUT_FEATURES)
    with fp8train.autocast(recipe=override):
        out = model(x.requires_grad_(True))
    # Backward outside the block still follows the recipe the forward ran with.
    out.backward(grad_output)
    got = (out.detach(), x.grad, model.weight.grad, model.bias.grad)
    expected = _forward_backward(direct, x, grad_output)
    for g, e in zip(got, expected):
        assert torch.equal(g, e)
    assert not torch.equal(model(x), out)  # the module's own recipe differs
    assert model.recipe.name == "tensorwise"  # the override does not stick


def test_recipe_override_accepts_a_recipe_object():
    linear = _linear()
    model = _converted(linear, "tensorwise")
    recipe = fp8train.TensorwiseScaling(power_2_scales=True)
    direct = _converted(linear, recipe)
    x = _x()
    with fp8train.autocast(recipe=recipe) as state:
        assert state.recipe is recipe
        assert torch.equal(model(x), direct(x))


# ---------------------------------------------------------------- nesting and state


def test_nesting_restores_the_outer_settings():
    linear = _linear()
    model = _converted(linear, "tensorwise")
    x = _x()
    fp8_out, hp_out = model(x), linear(x)
    assert ac.current_state() is None
    with fp8train.autocast() as outer:
        assert ac.current_state() == outer and outer.enabled and outer.recipe is None
        assert torch.equal(model(x), fp8_out)
        with fp8train.autocast(enabled=False) as inner:
            assert ac.current_state() == inner and not inner.enabled
            assert torch.equal(model(x), hp_out)
        assert ac.current_state() == outer
        assert torch.equal(model(x), fp8_out)
    assert ac.current_state() is None


def test_inner_recipe_override_is_restored_and_inherited():
    with fp8train.autocast(recipe="rowwise") as outer:
        with fp8train.autocast() as inherits:
            assert inherits.recipe.name == "rowwise" and inherits.enabled
            with fp8train.autocast(recipe="mxfp8", enabled=False) as inner:
                assert inner.recipe.name == "mxfp8" and not inner.enabled
                with fp8train.autocast(enabled=True) as innermost:
                    assert innermost.recipe.name == "mxfp8" and innermost.enabled
            assert ac.current_state() == inherits
        assert ac.current_state() == outer and outer.recipe.name == "rowwise"
    assert ac.current_state() is None


def test_exception_inside_restores_state():
    with fp8train.autocast(recipe="rowwise") as outer:
        with pytest.raises(KeyError):
            with fp8train.autocast(enabled=False, recipe="mxfp8"):
                raise KeyError("boom")
        assert ac.current_state() == outer and outer.enabled and outer.recipe.name == "rowwise"
    with pytest.raises(RuntimeError, match="boom"):
        with fp8train.autocast(enabled=False):
            raise RuntimeError("boom")
    assert ac.current_state() is None


def test_exception_still_updates_delayed_modules():
    model = _converted(_linear(), DelayedScaling(amax_history_len=HISTORY_LEN))
    x = _x()
    with pytest.raises(ValueError):
        with fp8train.autocast():
            model(x)
            raise ValueError
    assert ac.current_state() is None
    assert model.fp8_scale[INPUT] == _expected_scale(E4M3_MAX, x.abs().max())


def test_bad_arguments():
    for enabled in ("yes", 1, None):
        with pytest.raises(TypeError, match=r"enabled=.* must be True or False"):
            with fp8train.autocast(enabled=enabled):
                pass
    with pytest.raises(TypeError, match=r"recipe=42 must be a Recipe, a recipe name or None"):
        with fp8train.autocast(recipe=42):
            pass
    with pytest.raises(ValueError, match=r"unknown FP8 recipe 'fp6'"):
        with fp8train.autocast(recipe="fp6"):
            pass
    assert ac.current_state() is None


# ---------------------------------------------------------------- delayed scaling timing


def _expected_scale(fp8_max: float, amax) -> float:
    """float32(fp8_max / amax), computed in numpy float32 (margin 0)."""
    return float(np.float32(fp8_max) / np.float32(float(amax)))


def _delayed(seed=0) -> Float8Linear:
    return _converted(_linear(seed), DelayedScaling(amax_history_len=HISTORY_LEN))


def test_forward_inside_autocast_updates_at_outermost_exit():
    model = _delayed()
    x = _x(scale=3.0)
    amax_x, amax_w = x.abs().max(), model.weight.detach().abs().max()
    with fp8train.autocast():
        with fp8train.autocast():
            model(x)
        # Recorded, not applied: not at the inner exit either.
        assert model.fp8_amax_history[0, INPUT] == amax_x
        assert model.fp8_amax_history[0, WEIGHT] == amax_w
        assert torch.equal(model.fp8_scale, torch.ones(3))
        assert torch.equal(model.fp8_amax_history[1:], torch.zeros(HISTORY_LEN - 1, 3))
    assert model.fp8_scale[INPUT] == _expected_scale(E4M3_MAX, amax_x)
    assert model.fp8_scale[WEIGHT] == _expected_scale(E4M3_MAX, amax_w)
    assert model.fp8_scale[GRAD_OUTPUT] == 1  # no backward ran
    # Rolled by one: the step's amax moved to the end, row 0 cleared for the next step.
    assert torch.equal(model.fp8_amax_history[:, INPUT], torch.tensor([0, 0, 0, amax_x]))
    assert torch.equal(model.fp8_amax_history[:, WEIGHT], torch.tensor([0, 0, 0, amax_w]))
    assert torch.equal(model.fp8_amax_history[:, GRAD_OUTPUT], torch.zeros(HISTORY_LEN))


def test_first_step_quantizes_with_scale_1_and_the_next_with_the_update():
    model = _delayed()
    weight = model.weight.detach()
    x1, x2 = _x(seed=1, scale=3.0), _x(seed=2, scale=0.5)

    def expected_output(x, input_scale, weight_scale):
        input_fp8 = quantize(x, "tensor", scale=torch.tensor(input_scale))
        weight_fp8 = quantize(weight, "tensor", scale=torch.tensor(weight_scale))
        return scaled_mm(input_fp8, weight_fp8, torch.float32, backend="emulated", bias=model.bias.detach())

    with fp8train.autocast():
        out1 = model(x1)
    assert torch.equal(out1, expected_output(x1, 1.0, 1.0))
    with fp8train.autocast():
        out2 = model(x2)
    scale_x1 = _expected_scale(E4M3_MAX, x1.abs().max())
    scale_w = _expected_scale(E4M3_MAX, weight.abs().max())
    assert torch.equal(out2, expected_output(x2, scale_x1, scale_w))
    # "max" over the history: x1's larger amax still sets the scale after step 2.
    assert model.fp8_scale[INPUT] == scale_x1
    assert torch.equal(model.fp8_amax_history[:, INPUT], torch.tensor([0, 0, x1.abs().max(), x2.abs().max()]))


def test_forward_outside_autocast_updates_at_the_next_forward():
    model = _delayed()
    x1, x2 = _x(seed=1, scale=3.0), _x(seed=2, scale=0.5)
    amax_x1, amax_x2 = x1.abs().max(), x2.abs().max()
    model(x1)
    assert model.fp8_amax_history[0, INPUT] == amax_x1
    assert torch.equal(model.fp8_scale, torch.ones(3))
    model(x2)
    # Step 1's update ran first, then step 2 recorded its amax in the cleared row 0.
    assert model.fp8_scale[INPUT] == _expected_scale(E4M3_MAX, amax_x1)
    assert torch.equal(model.fp8_amax_history[:, INPUT], torch.tensor([amax_x2, 0, 0, amax_x1]))


def test_two_forwards_in_one_step_record_the_max_and_roll_once():
    model = _delayed()
    x1, x2 = _x(seed=1, scale=0.5), _x(seed=2, scale=3.0)
    with fp8train.autocast():
        model(x1)
        model(x2)
        assert torch.equal(model.fp8_scale, torch.ones(3))
    amax = torch.maximum(x1.abs().max(), x2.abs().max())
    assert torch.equal(model.fp8_amax_history[:, INPUT], torch.tensor([0, 0, 0, amax]))
    assert model.fp8_scale[INPUT] == _expected_scale(E4M3_MAX, amax)


def test_grad_output_updates_right_after_backward():
    model = _delayed()
    x = _x(scale=3.0).requires_grad_(True)
    grad_output = 1e-3 * torch.randn(NUM_TOKENS, OUT_FEATURES, generator=torch.Generator().manual_seed(9))
    amax_dy = grad_output.abs().max()
    out = model(x)
    assert model.fp8_scale[GRAD_OUTPUT] == 1
    assert torch.equal(model.fp8_amax_history[:, GRAD_OUTPUT], torch.zeros(HISTORY_LEN))
    out.backward(grad_output)
    # HYBRID: grad_output is E5M2.
    assert model.fp8_scale[GRAD_OUTPUT] == _expected_scale(E5M2_MAX, amax_dy)
    assert torch.equal(model.fp8_amax_history[:, GRAD_OUTPUT], torch.tensor([0, 0, 0, amax_dy]))
    # No autocast here: the end of the backward applies the forward update, so nothing
    # is owed that the state_dict lacks.
    amax_x = x.detach().abs().max()
    assert model.fp8_scale[INPUT] == _expected_scale(E4M3_MAX, amax_x)
    assert torch.equal(model.fp8_amax_history[:, INPUT], torch.tensor([0, 0, 0, amax_x]))
    assert not model.delayed_state.forward_pending


@pytest.mark.parametrize("pattern", ["backward_after_autocast_exit", "two_forwards_in_autocast", "two_forwards_no_autocast"])
def test_backward_after_the_forward_scales_were_updated(pattern):
    """The usual loop runs the forward inside fp8train.autocast and the backward after it
    exits (when the forward scales have just been updated); gradient accumulation runs
    several forwards before one backward."""
    model = _delayed()
    x = _x(scale=3.0).requires_grad_(True)
    grad_output = 1e-3 * torch.randn(NUM_TOKENS, OUT_FEATURES, generator=torch.Generator().manual_seed(9))
    if pattern == "backward_after_autocast_exit":
        with fp8train.autocast():
            out = model(x)
        assert model.fp8_scale[INPUT] != 1  # updated at the exit
    elif pattern == "two_forwards_in_autocast":
        with fp8train.autocast():
            out = model(x) + model(2 * x)
    else:
        out = model(x) + model(2 * x)
    out.backward(grad_output)
    assert x.grad is not None and model.weight.grad is not None
    assert model.fp8_scale[GRAD_OUTPUT] != 1


def test_grad_output_of_first_step_is_quantized_with_scale_1():
    """grad_input of step 1 = dequant(E5M2(dy * 1)) @ dequant(W_fp8 with scale 1)."""
    model = _delayed()
    x = _x().requires_grad_(True)
    grad_output = torch.randn(NUM_TOKENS, OUT_FEATURES, generator=torch.Generator().manual_seed(9))
    model(x).backward(grad_output)
    dy_fp8 = quantize(grad_output, "tensor", dtype=torch.float8_e5m2, scale=torch.tensor(1.0))
    weight_fp8 = quantize(model.weight.detach(), "tensor", scale=torch.tensor(1.0))
    expected = dy_fp8.dequantize().double() @ weight_fp8.dequantize().double()
    torch.testing.assert_close(x.grad.double(), expected, rtol=0, atol=1e-6 * expected.abs().max().item())


def test_module_that_did_not_run_is_not_updated():
    ran, idle = _delayed(seed=0), _delayed(seed=1)
    x = _x()
    with fp8train.autocast():
        ran(x)
        idle(x)
    idle_scale, idle_history = idle.fp8_scale.clone(), idle.fp8_amax_history.clone()
    ran_scale = ran.fp8_scale.clone()
    assert idle_history[-1, INPUT] > 0
    with fp8train.autocast():
        ran(2 * x)
    assert torch.equal(idle.fp8_scale, idle_scale)
    assert torch.equal(idle.fp8_amax_history, idle_history)  # not rolled
    assert ran.fp8_scale[INPUT] != ran_scale[INPUT]
    assert ran.fp8_amax_history[-1, INPUT] == 2 * x.abs().max()
    fresh = _delayed(seed=2)
    with fp8train.autocast():
        ran(x)
    assert torch.equal(fresh.fp8_scale, torch.ones(3))
    assert torch.equal(fresh.fp8_amax_history, torch.zeros(HISTORY_LEN, 3))


def test_module_run_before_autocast_is_updated_at_its_exit():
    model = _delayed()
    x = _x()
    model(x)  # e.g. a sanity check outside any autocast
    with fp8train.autocast():
        model(3 * x)
    # Both forwards are behind us: the latest amax reached the scale.
    assert model.fp8_scale[INPUT] == _expected_scale(E4M3_MAX, 3 * x.abs().max())


def test_forward_without_grad_reads_delayed_state_and_leaves_it_alone():
    """Evaluation (no grad) must not change training: it uses the scales, records nothing."""
    model = _delayed()
    x = _x()
    with fp8train.autocast():
        model(x)  # a training forward: records, then updates at exit
    scale, history = model.fp8_scale.clone(), model.fp8_amax_history.clone()
    with torch.no_grad(), fp8train.autocast():
        out = model(5 * x)
        model(5 * x)
    assert torch.equal(model.fp8_scale, scale)
    assert torch.equal(model.fp8_amax_history, history)
    assert not model.delayed_state.forward_pending
    # The forward did use the calibrated scale (not 1): 5x saturates at 448 / scale.
    assert out.abs().max() > 0
