"""The CPU's bfloat16 GEMM flushes subnormals (AVX512-BF16, AMX): the emulation takes it only
where no operand value, product or partial sum can be subnormal, else the float32 GEMM, so
every CPU gives the hardware's bits (NUMERICS.md 4)."""

import pytest
import torch

from fp8train.quant import quantize
from fp8train.quant.gemm import scaled_mm
from fp8train.quant.gemm.emulated import cpu_bf16_gemm_keeps_every_bit
from fp8train.quant.kernels import use_quant_settings


# Per family: a block amax whose scale is 2^-126, and a value of that block below 2^-126.
_TINY = {"mx": (2.0**-118, 0.75 * 2.0**-126), "mxfp4": (2.0**-124, 2.0**-127)}


def _tiny_block_operands(granularity: str):
    """``a``'s first row: one block whose scale is 2^-126 holding a value below 2^-126, which
    ``b`` picks out alone: the exact output is that value, a float32 subnormal."""
    amax, value = _TINY[granularity]
    a = torch.zeros(32, 64)
    a[0, 0], a[0, 1] = amax, value
    b = torch.zeros(32, 64)
    b[0, 1] = 1.0
    return quantize(a, granularity), quantize(b, granularity), value


@pytest.mark.parametrize("kernel", ["auto", "reference"])
@pytest.mark.parametrize("granularity", sorted(_TINY))
def test_a_tiny_block_keeps_its_subnormal_product_in_a_bfloat16_output(kernel, granularity):
    with use_quant_settings(emulated_gemm="bfloat16", quantize_kernel=kernel):
        a, b, value = _tiny_block_operands(granularity)
        assert not cpu_bf16_gemm_keeps_every_bit(a, b, None)
        out = scaled_mm(a, b, torch.bfloat16)
    with use_quant_settings(emulated_gemm="float32", quantize_kernel=kernel):
        expected = scaled_mm(a, b, torch.bfloat16)
    assert out[0, 0].item() == value and torch.equal(out.view(torch.int16), expected.view(torch.int16))


def test_ordinary_operands_keep_the_bfloat16_gemm():
    generator = torch.Generator().manual_seed(0)
    a = quantize(torch.randn(32, 64, generator=generator), "mx")
    b = quantize(torch.randn(32, 64, generator=generator), "mx")
    assert cpu_bf16_gemm_keeps_every_bit(a, b, None)
    assert cpu_bf16_gemm_keeps_every_bit(a, b, torch.tensor([0.0, 1.5, -3.0] + [0.0] * 29, dtype=torch.bfloat16))


@pytest.mark.parametrize(
    "bias_value, keeps",
    [(2.0**-119, True), (-(2.0**-120), False), (1.5 * 2.0**-119, True), (0.0, True)],
)
def test_a_bias_too_small_for_the_bfloat16_gemm_takes_the_float32_one(bias_value, keeps):
    # The bias rides in the GEMM as a column: its lowest bit (7 below its exponent) must
    # reach 2^-126 too. Zeros are exact anywhere.
    generator = torch.Generator().manual_seed(1)
    a = quantize(torch.randn(32, 64, generator=generator), "mx")
    b = quantize(torch.randn(32, 64, generator=generator), "mx")
    bias = torch.full((32,), 1.0, dtype=torch.bfloat16)
    bias[3] = bias_value
    assert cpu_bf16_gemm_keeps_every_bit(a, b, bias) is keeps


def test_the_lowest_bits_of_both_operands_add_up():
    # Each operand alone is far from 2^-126, their products are not: 2^-60 * 2^-70.
    a = quantize(torch.full((32, 64), 2.0**-60), "mx")
    b = quantize(torch.full((32, 64), 2.0**-60), "mx")
    assert not cpu_bf16_gemm_keeps_every_bit(a, b, None)
    c = quantize(torch.full((32, 64), 2.0**-30), "mx")
    assert cpu_bf16_gemm_keeps_every_bit(a, c, None)


def test_an_all_zero_block_keeps_the_bfloat16_gemm():
    # A zero block takes the smallest scale, which fails the scales' bound, but adds
    # nothing: the folded values decide, and ordinary ones pass.
    from fp8train.quant.gemm.emulated import _operand

    generator = torch.Generator().manual_seed(2)
    x = torch.randn(32, 64, generator=generator)
    x[3, :32] = 0.0
    a, b = quantize(x, "mx"), quantize(torch.randn(32, 64, generator=generator), "mx")
    assert not cpu_bf16_gemm_keeps_every_bit(a, b, None)  # the scales alone cannot tell
    values = _operand(a, torch.bfloat16)[0], _operand(b, torch.bfloat16)[0]
    assert cpu_bf16_gemm_keeps_every_bit(a, b, None, *values)
    tiny = _tiny_block_operands("mx")
    tiny_values = _operand(tiny[0], torch.bfloat16)[0], _operand(tiny[1], torch.bfloat16)[0]
    assert not cpu_bf16_gemm_keeps_every_bit(tiny[0], tiny[1], None, *tiny_values)
