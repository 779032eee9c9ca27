"""The 4-bit family's GPU quantizer (:mod:`fp8train.quant.kernels.compiled_fp4`, inductor's
fused kernels) byte for byte against the reference: on the device itself from generators
seeded alike (stochastic rounding's draws are the reference's, drawn eagerly), and, for the
rules that round to nearest, against the CPU's bytes; the first-dim usage in the layout its
GEMM takes; two usages by two rules from one read (the NVFP4 recipe's input and
grad_output), and the emulated GEMM's operand written in the same pass, against the one the
GEMM computes from the codes, and the GEMMs that take it. On the CPU dry run both sides run
on the CPU (inductor's C++ backend)."""

from __future__ import annotations

import pytest
import torch

from fp8train.quant.fp4_quantize import quantize_fp4
from fp8train.quant.gemm import scaled_mm
from fp8train.quant.gemm.fp4 import fp4_operand_values
from fp8train.quant.kernels import compiled_fp4, use_quant_settings
from fp8train.quant.operand import bound_role_quantizers
from fp8train.quant.quantize import quantizers_for
from fp8train.quant.tensor import QuantizedTensor, transpose
from fp8train.recipes import from_name
from fp8train.spec.roles import Role, Usage
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


# The NVFP4 recipe's input and grad_output: a rule per usage (the transform on the grad_weight
# GEMM's), and MXFP4's grad_output (one rule, stochastic rounding on both).
PAIRS = {
    "nvfp4_input": (dict(granularity="nvfp4"), dict(granularity="nvfp4", rht=True)),
    "nvfp4_grad_output": (
        dict(granularity="nvfp4", stochastic_rounding=True),
        dict(granularity="nvfp4", rht=True, stochastic_rounding=True),
    ),
    "mxfp4_sr": (dict(granularity="mxfp4", stochastic_rounding=True),) * 2,
}


def _same_values(qt: QuantizedTensor, dtype: torch.dtype, what: str) -> None:
    """The GEMM operand ``qt`` holds is the one the GEMM computes from its codes (PyTorch's
    ops on the device, on a copy with nothing cached): bit for bit, NaN where NaN, contiguous."""
    cached = qt.gemm_cache.values
    assert cached is not None and cached.dtype == dtype and cached.is_contiguous(), what
    tensors, layout = qt.prepare_for_saving()
    with use_quant_settings(quantize_kernel="reference"):
        expected = fp4_operand_values(QuantizedTensor.restore_from_saved(layout, *tensors), dtype, False)
    assert cached.shape == expected.shape, what
    nan = expected.isnan()
    assert torch.equal(cached.isnan(), nan), f"{what}: NaN values differ"
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    differ = int((cached[~nan].view(bits) != expected[~nan].view(bits)).sum())
    assert differ == 0, f"{what}: {differ} values differ"


@pytest.mark.parametrize("name", list(PAIRS))
def test_two_rules_from_one_read_and_the_gemm_operand_in_the_same_pass(device, name):
    """The pair of rules from one compiled call against the reference's two calls on device
    generators seeded alike (the last-dim usage draws first), byte for byte; each usage's
    GEMM operand, written in the same pass, against the one the GEMM computes (bfloat16
    values for one usage, float32 for the other: one compile a pair)."""
    last_rule, first_rule = (QuantRule(**rule) for rule in PAIRS[name])
    dtypes = (torch.float32, torch.bfloat16) if name == "nvfp4_input" else (torch.bfloat16, torch.float32)
    last_dtype, first_dtype = dtypes
    x = _x(torch.bfloat16).to(device)
    generators = [torch.Generator(device=device).manual_seed(7) for _ in range(2)]
    usages = (compiled_fp4.Usage(last_rule, -1, last_dtype), compiled_fp4.Usage(first_rule, 0, first_dtype, True))
    fused = compiled_fp4.quantize_each(x, usages, generators[0])
    assert fused is not None, "the kernel failed to compile (see the warning)"
    with use_quant_settings(quantize_kernel="reference"):
        _same(fused[0], quantize_fp4(x, last_rule, -1, None, generators[1]), f"{name} last on {device}")
        _same(fused[1], quantize_fp4(x, first_rule, 0, None, generators[1]), f"{name} first on {device}")
    assert torch.equal(generators[0].get_state(), generators[1].get_state())
    _same_values(fused[0], last_dtype, f"{name} last")
    _same_values(transpose(fused[1]), first_dtype, f"{name} first (K-last)")


def test_a_layers_grad_output_takes_the_pair_and_its_gemms_the_written_operands(device):
    """The bound quantizer of the NVFP4 recipe's grad_output (what a Linear's backward calls
    on CUDA): both usages and the default generator's state after as the reference's two
    calls; the grad_input and grad_weight GEMMs from the written operands equal to the
    same GEMMs of the reference's operands, bit for bit (one bf16 GEMM each on CUDA)."""
    plan = from_name("nvfp4").operand_plan
    quantizers = bound_role_quantizers(plan, device.type)
    grad_output_role, input_role = quantizers[Role.GRAD_OUTPUT.index], quantizers[Role.INPUT.index]
    if device.type == "cuda":
        assert grad_output_role.quantize_pair is compiled_fp4.quantize_pair
    # grad_output [M, N], input [M, K], weight [N, K]: M = N = 256, K = 384.
    shapes = ((256, 256), (256, 384), (256, 384))
    grad_output, x, w = (_x(torch.bfloat16)[:rows, :cols].contiguous().to(device) for rows, cols in shapes)
    torch.manual_seed(3)
    dy, dy_t = grad_output_role.both(grad_output, None)
    x_t = input_role.first(x, None)
    state = torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()
    weight = quantize_fp4(w, QuantRule(granularity="nvfp4_2d"), -1)
    actual = scaled_mm(dy_t, x_t, torch.float32), scaled_mm(dy, transpose(weight), torch.bfloat16)
    torch.manual_seed(3)
    with use_quant_settings(quantize_kernel="reference"):
        last_rule = plan.operand(Usage.GRAD_INPUT_GRAD_OUTPUT).rule
        expected_dy = quantize_fp4(grad_output, last_rule, -1)
        expected_dy_t = transpose(quantize_fp4(grad_output, plan.operand(Usage.GRAD_WEIGHT_GRAD_OUTPUT).rule, 0))
        expected_x_t = transpose(quantize_fp4(x, plan.operand(Usage.GRAD_WEIGHT_INPUT).rule, 0))
        after = torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()
        expected_grad_weight = scaled_mm(expected_dy_t, expected_x_t, torch.float32)
        expected = expected_grad_weight, scaled_mm(expected_dy, transpose(weight), torch.bfloat16)
    pairs = ((dy, expected_dy, "grad_output"), (dy_t, expected_dy_t, "grad_output^T"), (x_t, expected_x_t, "input^T"))
    for got, want, what in pairs:
        _same(got, want, f"{what} on {device}")
    assert torch.equal(state, after)
    for got, want in zip(actual, expected):
        assert torch.equal(got, want)
