"""MXFP8's E8M0 exponent when ``t = amax * float32(1/fp8_max)`` is a float32 subnormal:
the smallest power of two >= t (NUMERICS.md), at the bit boundary 0x400000 = 2^-127."""

import pytest
import torch

from fp8train.quant import quantize
from fp8train.quant.scaling import mx_scale_exponent


def _from_bits(bits: int) -> torch.Tensor:
    return torch.tensor([bits], dtype=torch.int32).view(torch.float32)


# With fp8_max = 1 the reciprocal is exactly 1, so t = amax bit for bit.
@pytest.mark.parametrize(
    "t_bits, expected",
    [
        (0x00000001, 0),  # 2^-149, the smallest subnormal
        (0x003FFFFF, 0),  # just below 2^-127
        (0x00400000, 0),  # 2^-127 exactly: E8M0's smallest value
        (0x00400001, 1),  # just above 2^-127 -> 2^-126
        (0x007FFFFF, 1),  # the largest subnormal -> 2^-126
        (0x00800000, 1),  # 2^-126, the smallest normal: exact
        (0x00800001, 2),  # a normal with mantissa bits rounds up
    ],
)
def test_subnormal_t_takes_smallest_power_of_two_at_or_above(t_bits, expected):
    assert int(mx_scale_exponent(_from_bits(t_bits), 1.0).item()) == expected


def test_quantize_block_at_2_pow_minus_127_uses_the_smallest_scale():
    # amax = 448 * 2^-127: t = 2^-127 exactly, so e = 0, scale_inv = 2^-127 and the block's
    # largest value lands on 448 itself (code 0x7E); the old round-up gave 224.
    x = torch.zeros(32, 32)
    x[0, 0] = 448.0 * 2.0**-127
    x[0, 1] = -224.0 * 2.0**-127
    qt = quantize(x, "mx")
    assert qt.scale_inv.shape == (32, 1)
    assert qt.scale_inv[0, 0].view(torch.uint8).item() == 0
    assert qt.data[0, 0].view(torch.uint8).item() == 0x7E
    assert qt.data[0, 1].float().item() == -224.0
    assert torch.equal(qt.dequantize(), x)
