"""The 4-bit family's GPU quantizer (:mod:`fp8train.quant.kernels.compiled_fp4`, inductor's
fused kernels) byte for byte against the reference: on the device itself from generators
seeded alike (stochastic rounding's draws are the reference's, drawn eagerly), and, for the
rules that round to nearest, against the CPU's bytes; the first-dim usage in the layout its
GEMM takes. On the CPU dry run both sides run on the CPU (inductor's C++ backend)."""

from __future__ import annotations

import pytest
import torch

from fp8train.quant.fp4_quantize import quantize_fp4
from fp8train.quant.kernels import compiled_fp4, use_quant_settings
from fp8train.quant.quantize import quantizers_for
from fp8train.quant.tensor import QuantizedTensor, transpose
from fp8train.spec.rule import QuantRule

RULES = {
    "nvfp4": dict(granularity="nvfp4"),
    "nvfp4_rht_sr": dict(granularity="nvfp4", rht=True, stochastic_rounding=True),
    "nvfp4_rht": dict(granularity="nvfp4", rht=True),
    "nvfp4_2d": dict(granularity="nvfp4_2d"),
    "mxfp4": dict(granularity="mxfp4"),
    "mxfp4_sr": dict(granularity="mxfp4", stochastic_rounding=True),
}


def _x(dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(256, 384, generator=generator) * torch.exp(3 * torch.randn(1, 384, generator=generator))
    x[:, :32] = 0.0
    x[:16, 32:64] *= 1e-30
    return x.to(dtype)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().view(torch.uint8).cpu().contiguous().reshape(-1)  # float4 copies go through uint8


def _same(actual: QuantizedTensor, expected: QuantizedTensor, what: str) -> None:
    for name in ("data", "scale_inv"):
        a, e = getattr(actual, name), getattr(expected, name)
        assert a.shape == e.shape and a.dtype == e.dtype, (what, name)
        assert torch.equal(_bytes(a), _bytes(e)), f"{what} {name}: {int((_bytes(a) != _bytes(e)).sum())} bytes differ"
    if expected.global_amax is not None:
        actual_amax, expected_amax = actual.global_amax.cpu().reshape(1), expected.global_amax.cpu().reshape(1)
        assert torch.equal(actual_amax.view(torch.int32), expected_amax.view(torch.int32)), (what, "global_amax")


def test_the_door_picks_the_fused_4bit_kernel_on_cuda(device):
    kernel, _ = quantizers_for(QuantRule(granularity="nvfp4"), torch.ones(32, 32, device=device))
    if device.type == "cuda":
        assert kernel is not None and kernel.name == "inductor"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("name", list(RULES))
def test_the_fused_4bit_quantizer_matches_the_reference_byte_for_byte(device, name, dtype):
    rule = QuantRule(**RULES[name])
    axes = (-1,) if rule.axis_free else (-1, 0)
    x = _x(dtype).to(device)
    generators = [torch.Generator(device=device).manual_seed(7) for _ in range(2)]
    fused = compiled_fp4.quantize_usages(x, rule, axes, generators[0])
    assert fused is not None, "the kernel failed to compile (see the warning)"
    with use_quant_settings(quantize_kernel="reference"):
        for axis, actual in zip(axes, fused):
            _same(actual, quantize_fp4(x, rule, axis, None, generators[1]), f"{name} axis {axis} on {device}")
            if not rule.stochastic_rounding:  # the CPU draws from its own generator: RNE only
                _same(actual, quantize_fp4(x.cpu(), rule, axis), f"{name} axis {axis} against the CPU")
    assert torch.equal(generators[0].get_state(), generators[1].get_state())
    if 0 in axes:
        assert transpose(fused[1]).data.is_contiguous()  # the K-last operand: no copy before the GEMM
