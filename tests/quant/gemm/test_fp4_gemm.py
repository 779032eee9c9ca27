"""The emulated 4-bit GEMM (NUMERICS.md 6) against float64, and the arguments of the SM 10.x
``torch._scaled_mm`` route, checked by PyTorch's own shape rules on the meta device."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fp8train
from fp8train.quant.gemm.hardware import hardware_fp4_arguments
from fp8train.quant.tensor import transpose
from fp8train.spec.checks import UnsupportedHardwareError

FLOAT32_EPS = 2.0**-24  # unit roundoff


def _float64_reference(a, b):
    """``(sum over K blocks of (sa * sb) * (A_k @ B_k^T)`` in float64, float32 alpha or None)``,
    from the operands' codes and scales read back independently of the GEMM."""
    block = 32 if a.granularity == "mxfp4" else 16
    av, bv = a.values_float32().double(), b.values_float32().double()

    def per_block(qt, rows):
        s = qt.scale_inv.float().double()
        return s.repeat_interleave(rows // s.shape[0], dim=0)

    sa, sb = per_block(a, av.shape[0]), per_block(b, bv.shape[0])
    terms = [
        (sa[:, c : c + 1] * sb[:, c].reshape(1, -1)) * (av[:, c * block : (c + 1) * block] @ bv[:, c * block : (c + 1) * block].t())
        for c in range(av.shape[1] // block)
    ]
    # sum |products| over K: what bounds a float32 sum of the K products in any order.
    magnitudes = [
        (sa[:, c : c + 1] * sb[:, c].reshape(1, -1)).abs()
        * (av[:, c * block : (c + 1) * block].abs() @ bv[:, c * block : (c + 1) * block].abs().t())
        for c in range(av.shape[1] // block)
    ]
    alpha = None
    if a.global_amax is not None:
        alpha = (a.global_amax.numpy().astype(np.float32) * b.global_amax.numpy().astype(np.float32)) / np.float32(7225344)
    return terms, sum(magnitudes), alpha


@pytest.mark.parametrize("granularity", ["nvfp4", "nvfp4_2d", "mxfp4"])
def test_bit_exact_where_the_partial_sums_are_exact(granularity):
    # Values on the E2M1 grid times one power of two per tensor: every block's scale is the
    # same power of two, every term and every partial sum an exact float32.
    gen = torch.Generator().manual_seed(0)
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    a_hp = grid[torch.randint(0, 8, (32, 128), generator=gen)] * torch.where(torch.rand(32, 128, generator=gen) < 0.5, -1, 1)
    b_hp = grid[torch.randint(0, 8, (64, 128), generator=gen)]
    a_hp[:, ::16] = 6.0  # every block's amax is 6
    b_hp[:, ::16] = 6.0
    a, b = fp8train.quant.quantize(a_hp, granularity), fp8train.quant.quantize(b_hp, granularity)
    out = fp8train.quant.scaled_mm(a, b, torch.float32, backend="emulated")
    terms, _, alpha = _float64_reference(a, b)
    acc = sum(terms)
    assert torch.equal(acc.float().double(), acc)  # exact in float32
    expected = acc.float().numpy() if alpha is None else (acc.float().numpy() * alpha).astype(np.float32)
    np.testing.assert_array_equal(out.numpy(), expected)


@pytest.mark.parametrize("granularity", ["nvfp4", "nvfp4_2d", "mxfp4"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_within_float32_accumulation_error(granularity, out_dtype):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(32, 128, generator=gen) * torch.logspace(-3, 3, 128)
    w = torch.randn(32, 128, generator=gen)
    bias = torch.randn(32, generator=gen)
    a, b = fp8train.quant.quantize(x, granularity), fp8train.quant.quantize(w, granularity)
    out = fp8train.quant.scaled_mm(a, b, out_dtype, bias=bias, backend="emulated")
    terms, magnitude, alpha = _float64_reference(a, b)
    acc = sum(terms)
    # The GEMM adds the K products in float32 in its own order (the contract allows it).
    bound = x.shape[1] * FLOAT32_EPS * magnitude
    scale = 1.0 if alpha is None else float(alpha)
    expected = acc * scale + bias.to(out_dtype).double()
    tolerance = bound * scale + expected.abs() * FLOAT32_EPS * 2
    if out_dtype == torch.bfloat16:
        tolerance = tolerance + expected.abs() * 2.0**-8
    assert out.dtype == out_dtype
    assert ((out.double() - expected).abs() <= tolerance).all()


def test_nvfp4_pairs_1d_with_2d_tiles_and_its_transpose():
    gen = torch.Generator().manual_seed(2)
    x, w = torch.randn(32, 64, generator=gen), torch.randn(48, 64, generator=gen)
    a, b = fp8train.quant.quantize(x, "nvfp4"), fp8train.quant.quantize(w, "nvfp4_2d")
    out = fp8train.quant.scaled_mm(a, b, torch.float32)
    reference = a.dequantize().double() @ b.dequantize().double().t()
    assert torch.allclose(out.double(), reference, rtol=1e-5, atol=1e-5)
    # grad_input's weight: the transpose of the 2-D tiles, K-last for the other GEMM
    dy = fp8train.quant.quantize(torch.randn(32, 48, generator=gen), "nvfp4")
    dx = fp8train.quant.scaled_mm(dy, transpose(b), torch.float32)
    assert torch.allclose(dx.double(), dy.dequantize().double() @ b.dequantize().double(), rtol=1e-5, atol=1e-5)


def test_a_nan_global_amax_makes_the_output_nan():
    x = torch.randn(16, 32)
    x[0, 0] = float("nan")
    out = fp8train.quant.scaled_mm(fp8train.quant.quantize(x, "nvfp4"), fp8train.quant.quantize(torch.randn(16, 32), "nvfp4"), torch.float32)
    assert torch.isnan(out).all()


@pytest.mark.parametrize(
    "a, b",
    [("nvfp4", "mx"), ("mxfp4", "mx"), ("nvfp4", "mxfp4"), ("tensor", "nvfp4")],
)
def test_mixed_families_are_rejected(a, b):
    qa = fp8train.quant.quantize(torch.randn(32, 64), a)
    qb = fp8train.quant.quantize(torch.randn(32, 64), b)
    with pytest.raises(NotImplementedError, match=rf"no FP8 GEMM mixes '{a}' with '{b}'"):
        fp8train.quant.scaled_mm(qa, qb)


def test_first_dim_operand_must_be_transposed():
    qa = fp8train.quant.quantize(torch.randn(32, 64), "nvfp4", axis=0)
    with pytest.raises(ValueError, match=r"a \(nvfp4\) is scaled along its first dim \(axis=0\)"):
        fp8train.quant.scaled_mm(qa, fp8train.quant.quantize(torch.randn(32, 64), "nvfp4"))


def test_hardware_backend_on_cpu_says_what_it_needs():
    qa = fp8train.quant.quantize(torch.randn(32, 64), "nvfp4")
    with pytest.raises(UnsupportedHardwareError, match=r"no FP8 GEMM on this device: nvfp4 4-bit GEMMs need a CUDA device with SM 10.x \(Blackwell\) and CUDA >= 12.8; the operands are on cpu. Use backend='emulated'"):
        fp8train.quant.scaled_mm(qa, qa, backend="hardware")


def _meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


@pytest.mark.parametrize("granularity, scale_dtype", [("nvfp4", torch.float8_e4m3fn), ("nvfp4_2d", torch.float8_e4m3fn), ("mxfp4", torch.float8_e8m0fnu)])
def test_hardware_arguments_pass_torchs_shape_rules(granularity, scale_dtype):
    gen = torch.Generator().manual_seed(3)
    a = fp8train.quant.quantize(torch.randn(160, 96, generator=gen), granularity)  # M not a multiple of 128: padded
    b = fp8train.quant.quantize(torch.randn(64, 96, generator=gen), granularity)
    a_data, b_data, scale_a, scale_b, alpha = hardware_fp4_arguments(a, b)
    assert a_data.dtype == b_data.dtype == torch.float4_e2m1fn_x2
    assert a_data.shape == (160, 48) and a_data.is_contiguous()
    assert b_data.shape == (48, 64) and b_data.stride() == (1, 48)  # column-major
    assert scale_a.dtype == scale_b.dtype == scale_dtype
    assert (alpha is None) == (granularity == "mxfp4")
    out = torch._scaled_mm(_meta(a_data), _meta(b_data), _meta(scale_a), _meta(scale_b), out_dtype=torch.float32)
    assert out.shape == (160, 64)
    with pytest.raises(RuntimeError, match=r"Invalid blockwise scaling configuration"):
        torch._scaled_mm(_meta(a_data), _meta(b_data), _meta(scale_a[:-4]), _meta(scale_b), out_dtype=torch.float32)


@pytest.mark.parametrize("granularity", ["nvfp4", "mxfp4"])
def test_hardware_arguments_of_a_transposed_operand(granularity):
    # grad_weight's operands: first-dim quantizations, transposed (views), laid out afresh
    x = torch.randn(128, 64, generator=torch.Generator().manual_seed(4))
    a = transpose(fp8train.quant.quantize(x, granularity, axis=0))  # [64, 128] K-last view
    b = fp8train.quant.quantize(torch.randn(32, 128, generator=torch.Generator().manual_seed(5)), granularity)
    a_data, b_data, scale_a, scale_b, _ = hardware_fp4_arguments(a, b)
    assert a_data.is_contiguous() and torch.equal(a_data.view(torch.uint8), a.data.view(torch.uint8))
    out = torch._scaled_mm(_meta(a_data), _meta(b_data), _meta(scale_a), _meta(scale_b), out_dtype=torch.float32)
    assert out.shape == (64, 32)
