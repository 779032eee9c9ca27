"""The FP8 family's GPU quantizer (:mod:`fp8train.quant.kernels.compiled_fp8`, inductor's
fused kernels) against the CPU: the same bytes from both usages at once, the first-dim
usage in the layout its GEMM takes (no copy), a given scale (delayed scaling's), and the
emulated GEMM's operands from their codes.

On the CPU dry run both sides run on the CPU (the CPU side by the reference): the same
checks of the door's choices and the layouts.
"""

from __future__ import annotations

import pytest
import torch

from fp8train.quant.gemm import emulated
from fp8train.quant.kernels import compiled_fp8, use_quant_settings
from fp8train.quant.quantize import quantize_both, quantizers_for
from fp8train.quant.tensor import QuantizedTensor, transpose
from fp8train.spec.formats import E4M3, E5M2
from fp8train.spec.rule import QuantRule

GRANULARITIES = ("tensor", "row", "block1x128", "block128x128", "mx")


def _x(dtype: torch.dtype) -> torch.Tensor:
    """Zeros, tiny, huge and a NaN among values whose magnitude varies by column."""
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(256, 384, generator=generator) * torch.exp(3 * torch.randn(1, 384, generator=generator))
    x[:, :32] = 0.0
    x[:16, 32:64] *= 1e-30
    x[16:32, 64:96] *= 1e30
    # Groups whose amax is so small that fp8_max / amax overflows float32: the scale takes
    # its largest value and 1 / scale is a float32 subnormal.
    x[128:256, 256:384] = 1e-38 * torch.randn(128, 128, generator=generator).sign()
    x[250, :] = -1e-38
    return x.to(dtype)


def _same_codes(actual: QuantizedTensor, expected: QuantizedTensor, what: str) -> None:
    """Byte-identical data and scales (a NaN's sign is not in the contract: none here)."""
    for name in ("data", "scale_inv"):
        a, e = getattr(actual, name), getattr(expected, name)
        assert a.shape == e.shape and a.dtype == e.dtype, (what, name, a.shape, e.shape, a.dtype, e.dtype)
        a_bytes = a.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        e_bytes = e.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(a_bytes, e_bytes), f"{what} {name}: {int((a_bytes != e_bytes).sum())} bytes differ"


def _rule(granularity: str, fmt: str = "e4m3") -> QuantRule:
    return QuantRule(granularity=granularity, format={"e4m3": E4M3, "e5m2": E5M2}[fmt])


def test_the_door_picks_the_fused_kernel_on_cuda(device):
    x = torch.ones(128, 128, device=device)
    kernel, reference = quantizers_for(_rule("row"), x)
    assert reference.name == "reference"
    if device.type == "cuda":
        assert kernel is not None and kernel.name == "inductor"
        with use_quant_settings(quantize_kernel="reference"):
            assert quantizers_for(_rule("row"), x)[0] is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_both_usages_are_the_cpu_bytes_in_the_gemm_layout(granularity, fmt, dtype, device):
    """Every granularity the kernel computes (the door hands it the served ones), through
    the door and directly."""
    rule = _rule(granularity, fmt)
    x = _x(dtype)
    with use_quant_settings(quantize_kernel="reference"):
        expected = quantize_both(x, rule)
    through_the_door = quantize_both(x.to(device), rule)
    for usage, a, e in zip(("last-dim", "first-dim"), through_the_door, expected):
        _same_codes(a, e, f"{granularity} {fmt} {dtype} {usage}")
    if device.type != "cuda":
        return
    direct = compiled_fp8.quantize_usages(x.to(device), rule, (-1, 0), None)
    for usage, a, e in zip(("last-dim", "first-dim"), direct, expected):
        _same_codes(a, e, f"{granularity} {fmt} {dtype} {usage}, the kernel itself")
    actual = through_the_door if granularity in compiled_fp8.SERVED_GRANULARITIES else direct
    assert actual[0].data.is_contiguous()
    # The first-dim usage's transpose is the K-last operand the GEMM takes: no copy.
    assert transpose(actual[1]).data.is_contiguous(), actual[1].data.stride()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_a_given_scale_beyond_range_saturates_as_on_the_cpu(dtype, device):
    """Delayed scaling's path: a per-tensor scale from last step, values beyond its range."""
    rule = _rule("tensor")
    x = _x(dtype)
    scale = torch.tensor(3.0e3)
    with use_quant_settings(quantize_kernel="reference"):
        expected = quantize_both(x, rule, scale=scale)
    actual = quantize_both(x.to(device), rule, scale=scale.to(device))
    for usage, a, e in zip(("last-dim", "first-dim"), actual, expected):
        _same_codes(a, e, f"given scale {dtype} {usage}")
    if device.type == "cuda":
        assert transpose(actual[1]).data.is_contiguous()


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_emulated_operands_from_codes_match_the_reference(granularity, device):
    """The emulated GEMM's bfloat16 operands (values times power-of-two scales), both
    orientations, from the fused kernel against PyTorch's ops on the same device."""
    rule = QuantRule(granularity=granularity, power_2_scales=True)
    last, first = quantize_both(_x(torch.bfloat16).to(device), rule)
    for qt in (last, transpose(first)):
        actual, _ = emulated._operand(_fresh(qt), torch.bfloat16)
        with use_quant_settings(quantize_kernel="reference"):
            expected, _ = emulated._operand(_fresh(qt), torch.bfloat16)
        assert torch.equal(actual.view(torch.int16), expected.view(torch.int16)), granularity


def _fresh(qt: QuantizedTensor) -> QuantizedTensor:
    """``qt`` without its cached GEMM operand."""
    return QuantizedTensor(
        data=qt.data, scale_inv=qt.scale_inv, granularity=qt.granularity, axis=qt.axis, power_2_scales=qt.power_2_scales
    )
