"""Quantizing with a scale that was given, not measured (delayed scaling's last-step scale,
``quantize(scale=)``, MX's ``ocp`` rule) puts values past the format's max, and those must
saturate on every device. On CUDA, PyTorch's E4M3 conversion gives NaN there: delayed
scaling trained to NaN at step 2 on an H200. These tests run each path under
:class:`~tests.helpers.nonsaturating_cast.NonSaturatingFP8Conversion` (CUDA's conversion, on the CPU)
through the PyTorch-ops quantization path a GPU takes, and require the bits of the
saturating run."""

from __future__ import annotations

import pytest
import torch

import fp8train
from fp8train.nn.config import Float8ModuleConfig
from fp8train.quant.kernels import use_quant_settings
from fp8train.spec.roles import Role

from ..helpers.nonsaturating_cast import NonSaturatingFP8Conversion

E4M3_MAX = 448.0
IN_FEATURES, OUT_FEATURES, TOKENS = 32, 48, 40
NUM_STEPS = 4


def _delayed_run(nonsaturating: bool) -> tuple[list[torch.Tensor], list[float]]:
    """Outputs and input gradients of NUM_STEPS delayed-scaling steps whose inputs grow 4x a
    step, so each step's input exceeds what last step's scale maps to 448; and, per step,
    ``amax(input) * scale`` (how far past 448 the cast is asked to go)."""
    torch.manual_seed(0)
    config = Float8ModuleConfig(recipe="delayed", backend="emulated")
    module = fp8train.Float8Linear(IN_FEATURES, OUT_FEATURES, config=config)
    results, overshoot = [], []
    for step in range(NUM_STEPS):
        x = torch.randn(TOKENS, IN_FEATURES, generator=torch.Generator().manual_seed(step)) * 4.0**step
        x.requires_grad_(True)
        overshoot.append(float(x.detach().abs().amax() * module.fp8_scale[Role.INPUT.index]))
        with NonSaturatingFP8Conversion() if nonsaturating else torch.enable_grad():
            with fp8train.autocast(enabled=True):
                out = module(x)
            out.square().sum().backward()
        results += [out.detach(), x.grad]
    return results, overshoot


def test_delayed_scaling_saturates_under_cudas_conversion():
    with use_quant_settings(quantize_kernel="reference"):
        expected, overshoot = _delayed_run(nonsaturating=False)
        actual, _ = _delayed_run(nonsaturating=True)
    assert max(overshoot[1:]) > 2 * E4M3_MAX, "the steps must quantize past the format's max"
    for step, (a, e) in enumerate(zip(actual, expected)):
        assert torch.isfinite(a).all(), f"non-finite result at step {step // 2}"
        assert torch.equal(a, e), f"result {step % 2} of step {step // 2} differs from the saturating run"


@pytest.mark.parametrize("source_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "granularity, kwargs",
    [("tensor", {"scale": torch.tensor(4.0)}), ("mx", {"mx_scale_rule": "ocp"})],
    ids=["given_scale", "mx_ocp"],
)
def test_quantize_saturates_under_cudas_conversion(granularity, kwargs, source_dtype):
    # 500 * 4 and the OCP rule's |x * scale| up to 511 both overshoot 448.
    x = torch.linspace(-500.0, 500.0, 64 * 32).reshape(64, 32).to(source_dtype)
    x[0, :4] = torch.tensor([float("inf"), -float("inf"), 1e30, 479.0])
    with use_quant_settings(quantize_kernel="reference"):
        expected = fp8train.quant.quantize(x, granularity, **kwargs)
        with NonSaturatingFP8Conversion() as conversion:
            actual = fp8train.quant.quantize(x, granularity, **kwargs)
    assert conversion.num_conversions > 0
    assert (expected.data.float().abs() == E4M3_MAX).any()
    assert torch.equal(actual.data.view(torch.uint8), expected.data.view(torch.uint8))
    assert torch.equal(actual.scale_inv.float(), expected.scale_inv.float())
