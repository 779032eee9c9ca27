"""Float8Conv1D: transformers' Conv1D (W[in, out]) with FP8 GEMMs. Its FP8 arithmetic is
Float8Linear's on the transposed weight, bit for bit; FP8 off it is Conv1D bit for bit;
gradients reach the [in, out] parameter; same state_dict; reversal."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

transformers_utils = pytest.importorskip("transformers.pytorch_utils")

import fp8train  # noqa: E402
from tests.helpers.tolerances import min_sqnr_db
from fp8train.nn.config import Float8ModuleConfig
from fp8train.nn.modules.conv1d import Float8Conv1D, is_transformers_conv1d  # noqa: E402
from fp8train.nn.modules.linear import Float8Linear  # noqa: E402
from fp8train.spec import recipes  # noqa: E402
from fp8train.spec.roles import Usage  # noqa: E402

Conv1D = transformers_utils.Conv1D
NX, NF = 128, 384  # in, out: GPT-2's c_attn at n_embd=128; every recipe's alignment
MIN_SQNR_DB = 20


def _sqnr_db(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.detach().double(), expected.detach().double()
    return 10 * math.log10(expected.square().sum() / (actual - expected).square().sum())


def _conv1d(seed=0) -> nn.Module:
    torch.manual_seed(seed)
    conv1d = Conv1D(NF, NX)
    nn.init.normal_(conv1d.bias)
    return conv1d


def _step(module: nn.Module, x: torch.Tensor):
    """Output, grad_input, grad_weight, grad_bias of ``sum(y * dy)`` for a fixed ``dy``."""
    x = x.detach().requires_grad_()
    module.zero_grad()
    y = module(x)
    grad_output = torch.randn(y.shape, generator=torch.Generator().manual_seed(7))
    (y * grad_output).sum().backward()
    return y.detach(), x.grad, module.weight.grad.clone(), module.bias.grad.clone()


@pytest.mark.parametrize("recipe_name", recipes.RECIPE_NAMES)
def test_fp8_gemms_are_float8_linear_on_the_transposed_weight(recipe_name):
    """Same FP8 arithmetic bit for bit: output, grad_input, and grad_weight transposed."""
    conv1d = _conv1d()
    linear = nn.Linear(NX, NF)
    with torch.no_grad():
        linear.weight.copy_(conv1d.weight.t())
        linear.bias.copy_(conv1d.bias)
    fp8_conv1d = Float8Conv1D.from_conv1d(conv1d, config=Float8ModuleConfig(recipe=recipe_name, backend="emulated"))
    fp8_linear = Float8Linear.from_linear(linear, config=Float8ModuleConfig(recipe=recipe_name, backend="emulated"))
    x = torch.randn(3, 50, NX)  # 150 tokens: padded to the recipe's block
    for step in range(2):  # delayed: the second step runs on the first one's scales
        with fp8train.autocast():
            torch.manual_seed(step)  # nvfp4's stochastic rounding: the same draws for both
            got = _step(fp8_conv1d, x)
            torch.manual_seed(step)
            want = _step(fp8_linear, x)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert got[2].shape == (NX, NF) and torch.equal(got[2], want[2].t())
    assert torch.equal(got[3], want[3])


@pytest.mark.parametrize("recipe_name", recipes.RECIPE_NAMES)
def test_close_to_conv1d_and_exactly_conv1d_with_fp8_off(recipe_name):
    conv1d = _conv1d()
    fp8_conv1d = Float8Conv1D.from_conv1d(conv1d, recipe_name)
    x = torch.randn(4, 24, NX)
    expected = _step(conv1d, x)
    with fp8train.autocast(enabled=False):
        assert all(torch.equal(a, b) for a, b in zip(_step(fp8_conv1d, x), expected))
    with fp8train.autocast():
        _step(fp8_conv1d, x)  # delayed scaling's first step
    got = _step(fp8_conv1d, x)
    # The bias gradient is a sum of grad_output; rowwise_with_gw_hp computes grad_weight in float32.
    gw_in_fp8 = recipes.from_name(recipe_name).operand_plan.quantizes_usage(Usage.GRAD_WEIGHT_INPUT)
    in_fp8 = {"output": True, "grad_input": True, "grad_weight": gw_in_fp8, "grad_bias": False}
    for name, a, b in zip(in_fp8, got, expected):
        assert torch.equal(a, b) != in_fp8[name], name
        assert _sqnr_db(a, b) > min_sqnr_db(recipe_name, MIN_SQNR_DB), name


def test_any_strides_and_bfloat16_autocast():
    conv1d = _conv1d()
    fp8_conv1d = Float8Conv1D.from_conv1d(conv1d, "rowwise")
    x = torch.randn(NX, 10, 3).permute(2, 1, 0)  # not contiguous
    torch.testing.assert_close(fp8_conv1d(x), fp8_conv1d(x.contiguous()), rtol=0, atol=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = fp8_conv1d(x)
        expected = conv1d(x.contiguous())  # Conv1D takes only inputs it can view as 2-D
    assert y.dtype == expected.dtype == torch.bfloat16
    assert _sqnr_db(y.float(), expected.float()) > MIN_SQNR_DB
    y.float().sum().backward()
    assert conv1d.weight.grad.dtype == torch.float32 and conv1d.weight.grad.shape == (NX, NF)


def test_same_parameters_and_state_dict_and_back():
    conv1d = _conv1d()
    fp8_conv1d = Float8Conv1D.from_conv1d(conv1d, "blockwise")
    assert fp8_conv1d.weight is conv1d.weight and fp8_conv1d.bias is conv1d.bias
    assert {k: v.shape for k, v in fp8_conv1d.state_dict().items()} == {k: v.shape for k, v in conv1d.state_dict().items()}
    assert (fp8_conv1d.in_features, fp8_conv1d.out_features) == (NX, NF)
    assert "nf=384, nx=128, recipe=blockwise" in repr(fp8_conv1d)
    back = fp8_conv1d.to_conv1d()
    assert is_transformers_conv1d(back) and back.weight is conv1d.weight and back.bias is conv1d.bias
    delayed = Float8Conv1D.from_conv1d(_conv1d(), "delayed")
    assert set(delayed.state_dict()) == {"weight", "bias", "fp8_scale", "fp8_amax_history"}
    delayed.load_state_dict(conv1d.state_dict())  # a plain checkpoint: FP8 state starts fresh
    assert torch.equal(delayed.weight, conv1d.weight)


def test_recognizes_only_transformers_conv1d():
    class MyConv1D(Conv1D):
        pass

    assert is_transformers_conv1d(Conv1D(4, 4)) and not is_transformers_conv1d(MyConv1D(4, 4))
    assert not is_transformers_conv1d(nn.Conv1d(4, 4, 1)) and not is_transformers_conv1d(nn.Linear(4, 4))
    with pytest.raises(TypeError, match="conv1d must be a transformers Conv1D, got Linear"):
        Float8Conv1D.from_conv1d(nn.Linear(4, 4))
    with pytest.raises(ValueError, match="nf=0 must be an int >= 1"):
        Float8Conv1D(0, 4)
