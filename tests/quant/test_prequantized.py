"""PrequantizedTensor: the one type of a tensor that arrived quantized (FSDP2's FP8 weight
gather, sequence parallelism's FP8 activation gather), its high-precision face, what it
keeps through aliasing and reshapes, and the operands it gives the layer."""

import pytest
import torch

from fp8train.nn.function import NO_DELAYED_STATE, Float8LinearFunction, LinearCall
from fp8train.quant.operand import quantize_usage
from fp8train.quant.prequantized import PrequantizedTensor
from fp8train.quant.tensor import transpose
from fp8train.spec import Role, Usage
from fp8train.spec.recipes import RECIPE_NAMES, from_name
from fp8train.parallel import gather_plan

# Recipes with current scaling whose weight FSDP2 gathers in FP8 (delayed scaling takes the
# same path with a stored scale, and records the shard amax: tests/parallel/test_fsdp.py).
FP8_GATHERED = [
    name for name in RECIPE_NAMES if gather_plan(from_name(name)) is not None and not from_name(name).operand_plan.delayed
]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _prequantized(name: str, role: Role, t: torch.Tensor) -> PrequantizedTensor:
    """``t`` quantized as ``name``'s plan quantizes ``role``, both usages where they differ."""
    gather = gather_plan(from_name(name), role)
    last, first = (op.usage for op in gather.plan.usages_of(role))
    rowwise = quantize_usage(gather.plan, last, t)
    columnwise = None if gather.columnwise is None else quantize_usage(gather.plan, first, t)
    return PrequantizedTensor(rowwise, columnwise, t.dtype, torch.tensor(3.0))


def test_aliases_and_dtype_moves_keep_the_payload():
    tensor = _prequantized("mxfp8", Role.WEIGHT, torch.randn(64, 64))
    for alias in (tensor.detach(), tensor.view(64, 64), tensor.to(torch.bfloat16)):
        assert isinstance(alias, PrequantizedTensor)
        assert alias.fp8_rowwise is tensor.fp8_rowwise and alias.fp8_columnwise is tensor.fp8_columnwise
        assert alias.fp8_shard_amax is tensor.fp8_shard_amax
    assert tensor.to(torch.bfloat16).dtype == torch.bfloat16


def test_reshapes_that_keep_the_last_dim_keep_the_payload():
    activation = _prequantized("mxfp8", Role.INPUT, torch.randn(2, 32, 64))
    rowwise = activation.fp8_rowwise
    flat = activation.reshape(-1, 64)
    assert isinstance(flat, PrequantizedTensor) and flat.fp8_rowwise.data.shape == (64, 64)
    assert torch.equal(_bits(flat.fp8_rowwise.scale_inv), _bits(rowwise.scale_inv))
    assert flat.fp8_columnwise is activation.fp8_columnwise
    # Anything else sees the dequantized tensor.
    torch.testing.assert_close(activation * 1, rowwise.dequantize())
    assert not isinstance(activation.reshape(2, 64, 32), PrequantizedTensor)


def test_first_dim_operand_is_its_own_or_the_transpose_of_the_last_dim_one():
    own = _prequantized("mxfp8", Role.WEIGHT, torch.randn(64, 64))
    assert own.fp8_columnwise is not None and own.first_dim_operand() is own.fp8_columnwise
    shared = _prequantized("tensorwise", Role.WEIGHT, torch.randn(64, 64))
    assert shared.fp8_columnwise is None
    expected = transpose(shared.fp8_rowwise)
    assert torch.equal(_bits(shared.first_dim_operand().data), _bits(expected.data))


def test_an_operand_quantized_for_another_recipe_is_refused():
    weight = _prequantized("mxfp8", Role.WEIGHT, torch.randn(64, 64))
    slot = from_name("blockwise").operand_plan.operand(Usage.OUTPUT_WEIGHT)
    with pytest.raises(ValueError, match=r"weight arrived all-gathered in FP8 as 'mx'.*quantizes it as 'block128x128'"):
        weight.last_dim_operand(slot)


@pytest.mark.parametrize("name", FP8_GATHERED)
def test_a_prequantized_weight_gives_the_gemms_of_the_plain_weight(name):
    """The layer takes the operands as they are: output and grad_input bit-equal to
    quantizing the high-precision weight in the layer."""
    plan = from_name(name).operand_plan
    generator = torch.Generator().manual_seed(0)
    input_hp = torch.randn(128, 256, generator=generator)
    weight_hp = torch.randn(128, 256, generator=generator)
    grad_output = torch.randn(128, 128, generator=generator)
    weights = (weight_hp, _prequantized(name, Role.WEIGHT, weight_hp))
    results = []
    for weight in weights:
        torch.manual_seed(1)  # NVFP4 rounds grad_output stochastically: the same draws for both
        x = input_hp.clone().requires_grad_()
        call = LinearCall(plan=plan, backend="emulated", save_fp8_input=False)
        output = Float8LinearFunction.apply(x, weight, None, call, NO_DELAYED_STATE)
        output.backward(grad_output)
        results.append((output, x.grad))
    (expected_output, expected_grad_input), (output, grad_input) = results
    assert torch.equal(_bits(output), _bits(expected_output))
    assert torch.equal(_bits(grad_input), _bits(expected_grad_input))
