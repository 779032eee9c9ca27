"""Delayed scaling in a mixture (issue 41): a hybrid with a delayed direction runs that
direction's slots on the module's amax history, as the plain delayed recipe does, and the
other direction's as its own recipe does; the oracles are the plain recipes, run on their
own over the same steps (scales move away from 1 after the first)."""

from __future__ import annotations

import functools

import pytest
import torch

import fp8train
from fp8train import recipes
from fp8train.spec import Role

DIM, TOKENS, STEPS = 64, 64, 3
DELAYED = recipes.DelayedScaling(amax_history_len=4)  # a short history: its roll is seen in 3 steps


def _inputs(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(10 + step)
    x = torch.randn(TOKENS, DIM, generator=generator) * (1 + step)  # amaxes grow: scales move
    return x, torch.randn(TOKENS, DIM, generator=generator) * (2 + step)


@functools.lru_cache(maxsize=None)
def _steps(recipe, autocast: bool = True):
    """Each step's output, grad_input, grad_weight (the weights stay put: no optimizer), and
    the buffers after the last."""
    torch.manual_seed(0)
    layer = fp8train.Float8Linear(DIM, DIM, recipe=recipe)
    results = []
    for step in range(STEPS):
        x, grad_output = _inputs(step)
        x.requires_grad_()
        layer.weight.grad = None
        if autocast:
            with fp8train.autocast():
                out = layer(x)
        else:
            out = layer(x)
        out.backward(grad_output)
        results.append((out.detach(), x.grad, layer.weight.grad))
    buffers = (layer.fp8_scale.clone(), layer.fp8_amax_history.clone()) if hasattr(layer, "fp8_scale") else None
    return results, buffers


FORWARD_COLUMNS = [Role.INPUT.index, Role.WEIGHT.index]


@pytest.mark.parametrize(
    "backward", ["mxfp8", pytest.param("tensorwise", marks=pytest.mark.slow), pytest.param("nvfp4", marks=pytest.mark.slow)]
)
def test_a_delayed_forward_runs_delayed_scalings_output_gemm_and_the_backward_recipes_grads(backward):
    mixed, (scale, history) = _steps(recipes.hybrid(forward=DELAYED, backward=backward))
    delayed, (delayed_scale, delayed_history) = _steps(DELAYED)
    current, _ = _steps(recipes.from_name(backward))
    for step in range(STEPS):
        assert torch.equal(mixed[step][0], delayed[step][0]), step
        assert torch.equal(mixed[step][1], current[step][1]), step
        assert torch.equal(mixed[step][2], current[step][2]), step
    assert torch.equal(scale[FORWARD_COLUMNS], delayed_scale[FORWARD_COLUMNS])
    assert torch.equal(history[:, FORWARD_COLUMNS], delayed_history[:, FORWARD_COLUMNS])
    # grad_output's scale is the backward recipe's own: its column is never recorded.
    assert scale[Role.GRAD_OUTPUT.index] == 1 and not history[:, Role.GRAD_OUTPUT.index].any()
    assert delayed_scale[Role.INPUT.index] != 1  # the oracle's scales did move


@pytest.mark.parametrize("forward", ["mxfp8", "tensorwise"])
def test_a_delayed_backward_runs_the_forward_recipes_output_and_delayed_scalings_grads(forward):
    mixed, (scale, history) = _steps(recipes.hybrid(forward=forward, backward=DELAYED))
    delayed, (delayed_scale, delayed_history) = _steps(DELAYED)
    current, _ = _steps(recipes.from_name(forward))
    for step in range(STEPS):
        assert torch.equal(mixed[step][0], current[step][0]), step
        assert torch.equal(mixed[step][1], delayed[step][1]), step
        assert torch.equal(mixed[step][2], delayed[step][2]), step
    assert torch.equal(scale, delayed_scale) and torch.equal(history, delayed_history)


def test_outside_an_autocast_a_delayed_mixture_updates_as_delayed_scaling_does():
    """No fp8train.autocast: each backward's end applies the forward update (a mixture whose
    backward is not delayed still queues it)."""
    for recipe in (recipes.hybrid(forward=DELAYED, backward="mxfp8"), recipes.hybrid(forward="mxfp8", backward=DELAYED)):
        mixed, (scale, history) = _steps(recipe, autocast=False)
        _, (delayed_scale, delayed_history) = _steps(DELAYED, autocast=False)
        assert torch.equal(scale[FORWARD_COLUMNS], delayed_scale[FORWARD_COLUMNS])
        assert torch.equal(history[:, FORWARD_COLUMNS], delayed_history[:, FORWARD_COLUMNS])


def test_a_delayed_mixture_keeps_the_delayed_recipes_state_and_refuses_two_histories():
    recipe = recipes.hybrid(forward="delayed", backward="mxfp8")
    assert recipe.delayed_scaling == recipes.from_name("delayed") and recipe.describe() == "hybrid(forward=delayed,backward=mxfp8)"
    assert recipes.from_name("hybrid(forward=tensorwise,backward=delayed)").operand_plan.delayed_roles == set(Role)
    assert recipe.operand_plan.delayed_roles == {Role.INPUT, Role.WEIGHT}
    assert recipes.hybrid(forward="nvfp4", backward="mxfp8").delayed_scaling is None
    layer = fp8train.Float8Linear(DIM, DIM, recipe=recipe)
    assert layer.delayed_state.recipe == recipes.from_name("delayed")
    assert recipes.hybrid(forward="delayed", backward="delayed").operand_plan == recipes.from_name("delayed").operand_plan
    with pytest.raises(ValueError, match=r"are two delayed-scaling recipes, but a module keeps one amax history"):
        recipes.hybrid(forward="delayed", backward=DELAYED)


def test_a_current_slot_and_a_delayed_slot_of_one_rule_are_not_one_quantization():
    """tensorwise's weight rule is delayed scaling's, but its scale is the tensor's own: the
    backward does not reuse the forward's quantization."""
    plan = recipes.hybrid(forward="tensorwise", backward="delayed").operand_plan
    assert plan.operand(fp8train.spec.Usage.OUTPUT_WEIGHT).rule == plan.operand(fp8train.spec.Usage.GRAD_INPUT_WEIGHT).rule
    assert not plan.reuses_last_dim(fp8train.spec.Usage.GRAD_INPUT_WEIGHT)
    with pytest.raises(ValueError, match=r"OUTPUT_INPUT: delayed scaling takes one scale per tensor, not granularity 'mx'"):
        fp8train.spec.plan.Operand(
            usage=fp8train.spec.Usage.OUTPUT_INPUT, rule=fp8train.spec.QuantRule(granularity="mx"), delayed=True
        )


def test_a_recipe_map_runs_delayed_scaling_in_some_modules():
    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(DIM, DIM), torch.nn.Linear(DIM, DIM))

    mixed = fp8train.convert_to_float8_training(model(), {"0": "delayed", "*": "mxfp8"})
    plain = fp8train.convert_to_float8_training(model(), "delayed")
    assert hasattr(mixed[0], "fp8_scale") and not hasattr(mixed[1], "fp8_scale")
    for step in range(STEPS):
        x, _ = _inputs(step)
        with fp8train.autocast():
            assert torch.equal(mixed[0](x), plain[0](x)), step  # module 0's scales are delayed scaling's
            mixed(x).sum().backward()
            plain(x).sum().backward()
    # (grad_output's column differs: module 1 of each model computes module 0's grad_output its own way.)
    assert torch.equal(mixed[0].fp8_scale[FORWARD_COLUMNS], plain[0].fp8_scale[FORWARD_COLUMNS])
    assert torch.equal(mixed[0].fp8_amax_history[:, FORWARD_COLUMNS], plain[0].fp8_amax_history[:, FORWARD_COLUMNS])


@pytest.mark.parametrize(
    "recipe",
    [  # the backward's own delayed weight copy, stored: the default run's case
        "hybrid(forward=mxfp8,backward=delayed)",
        pytest.param("hybrid(forward=delayed,backward=mxfp8)", marks=pytest.mark.slow),
    ],
)
def test_a_delayed_mixture_with_its_weight_stored_in_fp8_trains_bit_for_bit(recipe):
    """Trainable (fp8_weights=True, re-quantized from the master at each step) and frozen
    (stored once): the runs with high-precision weights, state included."""
    from fp8train.optim import AdamW
    from tests.helpers.fp8_weight_runs import assert_equal_states, train_steps
    from tests.nn.weights.test_frozen_fp8 import drop_weight, frozen_pair, run_steps

    runs = []
    for fp8_weights in (False, True):
        torch.manual_seed(0)
        model = fp8train.convert_to_float8_training(
            torch.nn.Sequential(torch.nn.Linear(32, 32)), recipe=recipe, backend="emulated", fp8_weights=fp8_weights
        )
        optimizer = AdamW(model.parameters(), lr=1e-2)
        runs.append((train_steps(model, optimizer, (2, 16, 32), 3, autocast=True, seed=1), model.state_dict()))
    assert runs[0][0] == runs[1][0]
    assert_equal_states(*(state for _, state in runs))
    hp, fp8_only = frozen_pair(recipe)
    assert type(fp8_only.weight) is fp8train.nn.weights.float8_weight.Float8Weight
    x = torch.randn(32, fp8_only.in_features, generator=torch.Generator().manual_seed(0))
    for a, b in zip(run_steps(hp, x), run_steps(fp8_only, x)):
        assert torch.equal(a, b)
    for key, value in drop_weight(hp.state_dict()).items():
        assert torch.equal(value, fp8_only.state_dict()[key]), key
