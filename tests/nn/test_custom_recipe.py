"""A recipe defined outside the library is one class: its operand plan drives Float8Linear,
convert and the FSDP gather plan without any other change."""

from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

import fp8train
from fp8train.nn.config import Float8ModuleConfig
from fp8train.parallel import gather_plan
from fp8train.spec import Format, Gemm, Granularity, OperandPlan, Recipe


@dataclass(frozen=True, kw_only=True)
class MXFP8WithGradWeightHP(Recipe):
    """MXFP8 for the output and grad_input GEMMs, grad_weight in high precision."""

    fp8_format: Format = Format.E4M3
    name: ClassVar[str] = "mxfp8_with_gw_hp"

    def build_plan(self) -> OperandPlan:
        return self.plan_from_roles(Granularity.MX, power_2_scales=True, high_precision=(Gemm.GRAD_WEIGHT,))


def _run(recipe, x, weight):
    layer = fp8train.Float8Linear(64, 32, bias=False, config=Float8ModuleConfig(recipe=recipe, backend="emulated"))
    with torch.no_grad():
        layer.weight.copy_(weight)
    x = x.clone().requires_grad_()
    out = layer(x)
    grad_output = torch.linspace(-1, 1, out.numel()).reshape(out.shape)
    out.backward(grad_output)
    return out.detach(), x.grad, layer.weight.grad, grad_output


def test_custom_recipe_trains_with_its_own_plan():
    torch.manual_seed(0)
    x, weight = torch.randn(96, 64), torch.randn(32, 64)
    out, grad_input, grad_weight, grad_output = _run(MXFP8WithGradWeightHP(), x, weight)
    mx_out, mx_grad_input, mx_grad_weight, _ = _run(fp8train.MXFP8Scaling(), x, weight)
    # output and grad_input: exactly MXFP8's GEMMs
    assert torch.equal(out, mx_out) and torch.equal(grad_input, mx_grad_input)
    # grad_weight: the high-precision GEMM, which MXFP8 does not give
    assert torch.equal(grad_weight, grad_output.t() @ x)
    assert not torch.equal(grad_weight, mx_grad_weight)


def test_custom_recipe_converts_and_plans_its_gather():
    recipe = MXFP8WithGradWeightHP()
    model = fp8train.convert_to_float8_training(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 48)), recipe)
    assert [type(m).__name__ for m in model] == ["Float8Linear", "Linear"]  # 48 is not a multiple of 32
    gather = gather_plan(recipe)
    assert gather.rowwise.granularity is Granularity.MX and gather.columnwise.granularity is Granularity.MX


def test_a_recipe_without_a_plan_says_what_is_missing():
    @dataclass(frozen=True, kw_only=True)
    class Planless(Recipe):
        name: ClassVar[str] = "planless"

    with pytest.raises(NotImplementedError, match="Planless declares no operand plan: a Recipe subclass defines build_plan"):
        Planless()
