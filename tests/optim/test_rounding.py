"""Stochastic rounding to bfloat16: exact where bfloat16 is, unbiased between neighbours,
reproducible from torch.manual_seed; and why a bfloat16 moment needs it."""

from __future__ import annotations

import pytest
import torch

from fp8train.optim.rounding import round_to_bfloat16_stochastically, store_rounded

DRAWS = 20000
SIGMAS = 5  # a binomial mean is within 5 standard deviations with probability 1 - 6e-7


def test_values_bfloat16_holds_are_unchanged():
    x = torch.tensor([0.0, -0.0, 1.0, -3.5, 2.0**-133, 3.3895e38, float("inf"), float("-inf")])
    x = x.to(torch.bfloat16).float()
    rounded = round_to_bfloat16_stochastically(x)
    assert torch.equal(rounded.float().view(torch.int32), x.view(torch.int32))
    assert torch.isnan(round_to_bfloat16_stochastically(torch.tensor([float("nan")]))).all()


@pytest.mark.parametrize("fraction", [0.25, 0.5, 0.75, 1 / 65536])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_rounds_away_from_zero_with_the_probability_of_the_dropped_bits(fraction, sign):
    # Between 1 and the next bfloat16, 1 + 2^-7: x = 1 + fraction * 2^-7.
    x = torch.full((DRAWS,), sign * (1 + fraction * 2.0**-7))
    torch.manual_seed(0)
    rounded = round_to_bfloat16_stochastically(x).float()
    assert set(rounded.abs().unique().tolist()) <= {1.0, 1 + 2.0**-7}
    up = (rounded.abs() > 1).double().mean().item()
    assert abs(up - fraction) <= SIGMAS * (fraction * (1 - fraction) / DRAWS) ** 0.5 + 1 / DRAWS


def test_reproducible_from_torch_manual_seed():
    x = torch.randn(1000)
    torch.manual_seed(3)
    first = round_to_bfloat16_stochastically(x)
    torch.manual_seed(3)
    assert torch.equal(round_to_bfloat16_stochastically(x), first)
    assert not torch.equal(round_to_bfloat16_stochastically(x), first)  # the generator moved on


def test_refuses_anything_but_float32():
    with pytest.raises(ValueError, match=r"takes float32, got torch.bfloat16"):
        round_to_bfloat16_stochastically(torch.zeros(2, dtype=torch.bfloat16))


def test_store_rounded_rounds_to_nearest_without_stochastic():
    dst = torch.zeros(3, dtype=torch.bfloat16)
    value = torch.tensor([1 + 2.0**-9, 1 + 3 * 2.0**-9, -(1 + 2.0**-9)])
    store_rounded(dst, value, stochastic=False)
    assert dst.tolist() == [1.0, 1 + 2.0**-7, -1.0]


# A bfloat16 second moment under beta2 = 0.999 and zero gradients (a spike passed): float32
# decays it to 0.999^N; round to nearest gives 0.999 * v back to v every step (the decay is
# under half of bfloat16's ulp), so it never decays; stochastic rounding follows float32 on
# average.
BETA2 = 0.999
DECAY_STEPS = 200
MAX_MEAN_ERROR = 0.01


def test_a_bfloat16_second_moment_decays_only_with_stochastic_rounding():
    expected = BETA2**DECAY_STEPS
    torch.manual_seed(0)
    nearest = torch.ones(DRAWS // 10, dtype=torch.bfloat16)
    stochastic = nearest.clone()
    for _ in range(DECAY_STEPS):
        for v, is_stochastic in ((nearest, False), (stochastic, True)):
            store_rounded(v, v.float().mul_(BETA2), stochastic=is_stochastic)
    assert torch.equal(nearest, torch.ones_like(nearest))
    assert abs(stochastic.float().mean().item() - expected) / expected < MAX_MEAN_ERROR
