"""The GEMM operand the CPU's 4-bit quantizer writes in its launch (``values=``, issue 38)
against the emulated GEMM's own fold of the codes, bit for bit: the fold kernel exactly (NaN
payloads too) and the PyTorch ops up to a NaN's payload; every 4-bit rule (``nvfp4``,
``nvfp4_2d``, ``mxfp4``), both axes, the transform, stochastic rounding, both input and operand
dtypes, zero and subnormal blocks, infinities and NaN; the codes and the draws unchanged."""

from __future__ import annotations

import pytest
import torch

import fp8train
from fp8train.quant.gemm.fp4 import fp4_operand_values
from fp8train.quant.kernels import fp4 as fp4_kernels
from fp8train.quant.kernels import operands, use_quant_settings
from fp8train.quant.tensor import transpose
from fp8train.spec.rule import QuantRule

pytest.importorskip("numba")

RULES = [
    QuantRule(granularity="nvfp4"),
    QuantRule(granularity="nvfp4", stochastic_rounding=True),
    QuantRule(granularity="nvfp4", rht=True),
    QuantRule(granularity="nvfp4", rht=True, stochastic_rounding=True),
    QuantRule(granularity="nvfp4_2d"),
    QuantRule(granularity="mxfp4"),
    QuantRule(granularity="mxfp4", mx_scale_rule="ocp"),
]
DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.float16, torch.float32)]
"""``(input dtype, operand dtype)``."""


def _name(rule: QuantRule) -> str:
    return f"{rule.granularity}{'-rht' if rule.rht else ''}{'-sr' if rule.stochastic_rounding else ''}-{rule.mx_scale_rule}"


def _input(kind: str, dtype: torch.dtype) -> torch.Tensor:
    """Values over 12 decades, a zero row and a zero column block, signed zeros, tiny blocks;
    ``edge``: also an infinity (NVFP4: every scale NaN-free but saturated; MXFP4: one block)
    and, for MXFP4, a NaN (one block's scale NaN)."""
    x = torch.randn(64, 96, generator=torch.Generator().manual_seed(3)) * torch.logspace(-4, 4, 96)
    x[3], x[16:32, 32:48], x[5, :32] = 0.0, 0.0, -0.0
    x[40:48] *= 2.0**-100
    if kind == "edge":
        x[7, 40] = float("inf")
        x[9, 70] = float("nan")
    return x.to(dtype)


def _k_last(qt):
    return qt if qt.axis == -1 or qt.granularity.symmetric else transpose(qt)


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.float()
    return torch.where(t.isnan(), torch.full_like(t, float("nan")), t).view(torch.int32)


@pytest.mark.parametrize("rule", RULES, ids=_name)
@pytest.mark.parametrize("axis", [-1, 0])
@pytest.mark.parametrize("x_dtype, values_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["random", "edge"])
def test_the_quantizer_writes_the_operand_the_gemm_would_fold(rule, axis, x_dtype, values_dtype, kind):
    if rule.axis_free and axis == 0:
        pytest.skip("16x16 tiles have no axis (the door quantizes them along -1)")
    x = _input(kind, x_dtype)
    if kind == "edge" and rule.granularity.two_level_scales:
        x[9, 70] = 1.0  # a NaN leaves NVFP4 to the reference path (no values): infinity only
    generators = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    with use_quant_settings(quantize_kernel="numba"):
        qt = fp4_kernels.quantize(x, rule, axis, None, generators[0], values=values_dtype)
        plain = fp4_kernels.quantize(x, rule, axis, None, generators[1])
    assert torch.equal(generators[0].get_state(), generators[1].get_state())
    assert torch.equal(qt.data.view(torch.uint8), plain.data.view(torch.uint8))
    assert torch.equal(qt.scale_inv.view(torch.uint8), plain.scale_inv.view(torch.uint8))
    cache = _k_last(qt).gemm_cache
    assert cache.compute_dtype == values_dtype and cache.out_scale is None
    written = cache.values
    assert written.dtype == values_dtype and written.is_contiguous()
    folded = operands.try_fp4_operand_values(_k_last(plain), values_dtype, True)
    assert torch.equal(written.view(torch.uint8), folded.view(torch.uint8))  # the fold kernel's bits
    reference = fp4_operand_values(_k_last(plain), values_dtype, kernels=False)
    assert torch.equal(_bits(written), _bits(reference))  # the PyTorch ops'
    if kind == "edge" and not rule.granularity.two_level_scales:
        assert written.float().isnan().any()


def test_a_nan_leaves_nvfp4_to_the_reference_path():
    x = _input("edge", torch.float32)
    with use_quant_settings(quantize_kernel="numba"):
        assert fp4_kernels.quantize(x, QuantRule(granularity="nvfp4"), -1, None, values=torch.float32) is None


@pytest.mark.parametrize("recipe", ["nvfp4", "mxfp4"])
def test_a_layer_folds_only_the_operand_it_saves_for_the_backward(monkeypatch, recipe):
    """The bound CPU path: every GEMM operand comes from its quantizer (or, for NVFP4's
    reused weight tiles, its transpose) but the input's grad_weight one (saved as codes)."""
    from tests.helpers.host_calls import LinearStep

    step = LinearStep(recipe)
    step.run()
    step.reset()
    calls = []
    kernel, *tables = operands._fold_kernel()
    monkeypatch.setattr(operands, "_fold_kernel", lambda: (lambda *args: calls.append(1) or kernel(*args), *tables))
    step.run()
    assert len(calls) == 1


@pytest.mark.parametrize("values_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", ["random", "edge", "nan"])
def test_the_reused_tiles_transpose_with_the_operand_the_gemm_would_fold(values_dtype, kind):
    """``transpose_with_values`` (a layer's reused ``nvfp4_2d`` weight, on CPU): the codes,
    scales and fields of ``transpose``, and the transpose's operand as the GEMM folds it;
    ``nan``: every scale NaN (quantized by the reference path)."""
    x = _input("edge" if kind == "nan" else kind, torch.float32)
    if kind == "edge":
        x[9, 70] = 1.0
    with use_quant_settings(quantize_kernel="reference" if kind == "nan" else "numba"):
        qt = fp8train.quant.quantize(x, "nvfp4_2d", axis=-1)
    fast, plain = fp4_kernels.transpose_with_values(qt, values_dtype), transpose(qt)
    assert torch.equal(fast.data.view(torch.uint8), plain.data.view(torch.uint8))
    assert fast.data.shape == plain.data.shape and fast.data.dtype == plain.data.dtype
    assert torch.equal(fast.scale_inv.view(torch.uint8), plain.scale_inv.view(torch.uint8))
    assert fast.scale_inv.stride() == plain.scale_inv.stride()
    assert (fast.axis, fast.granularity, fast.power_2_scales) == (plain.axis, plain.granularity, plain.power_2_scales)
    assert fast.global_amax is qt.global_amax
    written = fast.gemm_cache.values
    assert written.dtype == values_dtype and written.is_contiguous()
    folded = operands.try_fp4_operand_values(plain, values_dtype, True)
    assert torch.equal(written.view(torch.uint8), folded.view(torch.uint8))
    assert torch.equal(_bits(written), _bits(fp4_operand_values(plain, values_dtype, kernels=False)))
    assert written.float().isnan().any() == (kind == "nan")


def test_other_tensors_transpose_as_they_are():
    x = _input("random", torch.float32)
    qt = fp8train.quant.quantize(x, "mxfp4")
    assert fp4_kernels.transpose_with_values(qt, torch.float32).gemm_cache.values is None  # a view: no operand
    tiles = fp8train.quant.quantize(x, "nvfp4_2d")
    tiles.gemm_cache.put(torch.float32, fp4_operand_values(tiles, torch.float32), None)
    cached = fp4_kernels.transpose_with_values(tiles, torch.float32)
    assert torch.equal(cached.gemm_cache.values, tiles.gemm_cache.values.t())  # transpose()'s hand-over
