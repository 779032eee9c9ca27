"""Delayed scaling's CPU kernels (issue 38) against the PyTorch ops they replace, bit for bit:
an amax folded into a history element (``torch.maximum``: NaN, signed zeros), alone or in the
read of the cast that quantizes by a given scale (the codes and operand values unchanged), and a state's
update (``update_scale_and_history``: both algos, margins, columns that did not run, NaN,
inf, subnormal and overflowing amaxes, one-row and experts-shaped histories)."""

from __future__ import annotations

import math

import pytest
import torch

from fp8train.quant.kernels import fp8, launch
from fp8train.quant.kernels.delayed import fold_amax, try_update_delayed
from fp8train.spec.recipes import resolve_recipe
from fp8train.quant.scaling import update_scale_and_history
from fp8train.spec.recipes import DelayedScaling
from fp8train.spec.roles import Role

pytestmark = pytest.mark.skipif(not launch.kernels_enabled(), reason="the CPU kernels do not run here")

SPECIALS = [0.0, -0.0, math.nan, math.inf, 2.0**-140, 1e-40, 3.0, 448.0, 1e30]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fold_amax_is_torch_maximum(dtype):
    x = torch.randn(5, 7, generator=torch.Generator().manual_seed(0)).to(dtype)
    for current in SPECIALS:
        for special in (None, math.nan, -math.inf, 7.5):
            if special is not None:
                x[2, 3] = special
            expected = torch.tensor([current], dtype=torch.float32)
            expected[0].copy_(torch.maximum(expected[0], torch.linalg.vector_norm(x, math.inf).to(torch.float32)))
            got = torch.tensor([current], dtype=torch.float32)
            with launch.launch_kernels():
                fold_amax(x.t(), got[0])  # a transposed view: read as it is, once
            assert torch.equal(_bits(got), _bits(expected)), (current, special)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(5, 7), (1, 16), (4, 0)])
def test_the_cast_folds_the_amax_as_fold_amax(dtype, shape):
    """``quantize(..., scale, amax=element)`` (a delayed layer's CPU path): the codes, scale and
    operand values of the call without ``amax``, and the element as :func:`fold_amax` leaves it."""
    rule = resolve_recipe("delayed").operand_plan.operands[0].rule
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    scale = torch.tensor(3.0)
    for current in SPECIALS:
        for special in (None, math.nan, -math.inf, 7.5):
            if special is not None and x.numel():
                x[0, -1] = special
            expected = torch.tensor([current], dtype=torch.float32)
            got = expected.clone()
            with launch.launch_kernels():
                plain = fp8.quantize(x, rule, -1, scale, values=torch.float32)
                if x.numel():
                    fold_amax(x, expected[0])
                folded = fp8.quantize(x, rule, -1, scale, values=torch.float32, amax=got[0])
            assert torch.equal(_bits(got), _bits(expected)), (current, special)
            assert torch.equal(folded.data.view(torch.uint8), plain.data.view(torch.uint8))
            assert torch.equal(folded.scale_inv, plain.scale_inv)
            assert torch.equal(_bits(folded.gemm_cache.values), _bits(plain.gemm_cache.values))


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0, 1])
@pytest.mark.parametrize("length", [1, 2, 6])
def test_update_is_update_scale_and_history(algo, margin, length):
    recipe = DelayedScaling(amax_history_len=length, margin=margin, amax_compute_algo=algo)
    generator = torch.Generator().manual_seed(length)
    history = torch.rand(length, 4, 3, generator=generator) * 100
    values = torch.tensor(SPECIALS)
    picks = torch.randint(0, len(SPECIALS), history.shape, generator=generator)
    history = torch.where(torch.rand(history.shape, generator=generator) < 0.5, values[picks], history)
    scale = torch.rand(4, 3, generator=generator) + 0.5
    fp8_max = torch.tensor([recipe.role_format(role).max for role in Role])
    for roles in (slice(0, 2), slice(2, 3), slice(0, 3)):
        expected_history, expected_scale = history.clone(), scale.clone()
        update_scale_and_history(expected_history[..., roles], expected_scale[..., roles], fp8_max[roles], margin, algo)
        got_history, got_scale = history.clone(), scale.clone()
        assert try_update_delayed(got_history, got_scale, recipe, roles)
        assert torch.equal(_bits(got_scale), _bits(expected_scale)), roles
        assert torch.equal(_bits(got_history), _bits(expected_history)), roles


def test_update_leaves_what_the_kernel_does_not_take():
    history, scale = torch.ones(4, 3), torch.ones(3)
    assert not try_update_delayed(history, scale, DelayedScaling(amax_compute_algo=lambda h: h[0]), slice(0, 3))
    assert not try_update_delayed(history.t().contiguous().t(), scale, DelayedScaling(), slice(0, 3))
    assert not try_update_delayed(history.bfloat16(), scale.bfloat16(), DelayedScaling(), slice(0, 3))
    assert torch.equal(history, torch.ones(4, 3)) and torch.equal(scale, torch.ones(3))
