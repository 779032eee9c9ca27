"""amax_to_scale and delayed_scaling_update in fewer ops (issue 31: each op on a one-element
tensor is a GPU launch) give, bit for bit, what the rule as written gives: the ``torch.where``
chains below are the docstrings' rules op by op, over every kind of special value."""

from __future__ import annotations

import math

import pytest
import torch

from fp8train.quant.scaling import FLOAT32_MAX, amax_to_scale, delayed_scaling_update

SPECIAL = [0.0, -0.0, math.inf, -math.inf, math.nan, 1.0, -3.0, 448.0, 500.0, FLOAT32_MAX, -FLOAT32_MAX]
SPECIAL += [2.0**-110, 2.0**-119, 2.0**-120, 2.0**-126, 1e-40, 2.0**-149, -(2.0**-149), -1e-40, 1e-30]


def _amaxes(dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    spread = torch.randn(2000, generator=generator) * torch.exp2(torch.randint(-140, 120, (2000,), generator=generator))
    return torch.cat([torch.tensor(SPECIAL), spread]).to(dtype)


def _rule_as_written(amax, fp8_max, power_2_scales, amax_epsilon, inf_scale_value):
    amax = amax.to(torch.float32)
    if amax_epsilon > 0:
        amax = torch.where(amax < amax_epsilon, torch.full_like(amax, amax_epsilon), amax)
    scale = torch.full_like(amax, fp8_max) / amax
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, inf_scale_value), scale)
    scale = torch.where((amax != 0) & torch.isfinite(amax), scale, torch.ones_like(scale))
    if power_2_scales:
        scale = (scale.view(torch.int32) & -0x800000).view(torch.float32)
    return scale


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("fp8_max", [448.0, 57344.0, 1e-30])
@pytest.mark.parametrize("power_2_scales", [False, True])
@pytest.mark.parametrize("amax_epsilon, inf_scale_value", [(0.0, FLOAT32_MAX), (1e-12, FLOAT32_MAX), (0.0, 65504.0)])
def test_amax_to_scale_matches_the_rule_as_written(dtype, fp8_max, power_2_scales, amax_epsilon, inf_scale_value):
    amax = _amaxes(dtype)
    options = dict(power_2_scales=power_2_scales, amax_epsilon=amax_epsilon, inf_scale_value=inf_scale_value)
    expected = _rule_as_written(amax, fp8_max, **options)
    assert torch.equal(_bits(amax_to_scale(amax, fp8_max, **options)), _bits(expected))


def _update_as_written(amax_history, scale, fp8_max, margin):
    amax = amax_history.amax(dim=0)
    ran = amax_history[0] != 0
    new_scale = (torch.as_tensor(fp8_max, dtype=torch.float32) / amax) / (2.0**margin)
    new_scale = torch.where(torch.isinf(new_scale), torch.full_like(new_scale, FLOAT32_MAX), new_scale)
    usable = ran & torch.isfinite(amax) & (amax > 0)
    scale.copy_(torch.where(usable, new_scale, scale))
    rolled = torch.roll(amax_history, -1, dims=0)
    rolled[0] = 0
    amax_history.copy_(torch.where(ran, rolled, amax_history))


@pytest.mark.parametrize("margin", [0, 3])
def test_delayed_update_matches_the_rule_as_written(margin):
    generator = torch.Generator().manual_seed(1)
    values = _amaxes(torch.float32)
    columns = values.numel()
    history = values[torch.randint(0, columns, (4, columns), generator=generator)]
    history[0] = values  # every special value as the current amax
    history[:, :3] = 0.0  # columns whose module did not run
    scale = torch.rand(columns, generator=generator) + 0.5
    expected_history, expected_scale = history.clone(), scale.clone()
    _update_as_written(expected_history, expected_scale, 448.0, margin)
    delayed_scaling_update(history, scale, 448.0, margin=margin)
    assert torch.equal(_bits(scale), _bits(expected_scale))
    assert torch.equal(_bits(history), _bits(expected_history))
