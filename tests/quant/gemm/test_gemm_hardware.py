"""scaled_mm's hardware path and backends (NUMERICS.md section 4): the CPU
``torch._scaled_mm`` path against the emulated one, the hardware scale layouts, backend
selection and its log line, and errors."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

import fp8train
from fp8train.quant import gemm as gemm_module
from fp8train.quant.gemm import scaled_mm
from fp8train.quant.gemm.hardware import hardware_mm, hardware_scales
from fp8train.quant.layouts import swizzle_mx_scales
from fp8train.quant import quantize

from .._gemm_reference import E4M3, MAX_REL_ERR_F32, _assert_matches, _pair, _random, _reference

BF16_MANTISSA_BITS = 7
HARDWARE_SHAPE = (96, 144, 320)  # multiples of 16, as torch._scaled_mm needs


# ---------------------------------------------------------------- hardware path on CPU


def _bf16_ulp(values: torch.Tensor) -> torch.Tensor:
    """One bfloat16 ulp at each value's magnitude (float64), at least the subnormal spacing."""
    magnitude = values.abs().clamp_min(2.0**-126)
    return torch.exp2(torch.floor(torch.log2(magnitude)) - BF16_MANTISSA_BITS)


@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("power_2_scales", [False, True])
@pytest.mark.parametrize(
    "a_gran, b_gran",
    # row x tensor: rowwise_with_gw_hp's grad_input (grad_output rows x the weight's one scale)
    [("tensor", "tensor"), ("row", "row"), ("row", "tensor"), ("tensor", "row")],
)
def test_cpu_scaled_mm_matches_emulated(a_gran, b_gran, power_2_scales, out_dtype, with_bias):
    m, n, k = HARDWARE_SHAPE
    a = quantize(_random((m, k), 51), a_gran, power_2_scales=power_2_scales)
    b = quantize(_random((n, k), 52), b_gran, power_2_scales=power_2_scales)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(5)).to(out_dtype) if with_bias else None
    hardware = hardware_mm(a, b, out_dtype, bias)
    emulated = scaled_mm(a, b, out_dtype, backend="emulated", bias=bias)
    assert hardware.dtype == emulated.dtype == out_dtype
    assert hardware.shape == emulated.shape == (m, n)
    gemm_ref = _reference(a, b)
    ref = gemm_ref + (0 if bias is None else bias.double().reshape(1, -1))
    # The hardware path's arguments are right: one rounding of the exact result.
    _assert_matches(hardware, ref, out_dtype)
    hardware, emulated = hardware.double(), emulated.double()
    slack = MAX_REL_ERR_F32 * gemm_ref.abs().max()
    if out_dtype == torch.float32:
        assert (hardware - emulated).abs().max() <= 2 * slack
    else:
        # One ulp, at the magnitude of the GEMM or of the output, whichever is larger.
        magnitude = torch.maximum(torch.maximum(hardware.abs(), emulated.abs()), gemm_ref.abs())
        assert ((hardware - emulated).abs() <= _bf16_ulp(magnitude) + slack).all()


def test_hardware_scales_tensorwise_and_rowwise():
    m, n, k = HARDWARE_SHAPE
    a, b = quantize(_random((m, k), 61), "tensor"), quantize(_random((n, k), 62), "tensor")
    scale_a, scale_b = hardware_scales(a, b)
    assert scale_a.shape == scale_b.shape == () and scale_a.dtype == torch.float32
    assert scale_a.item() == a.scale_inv.item() and scale_b.item() == b.scale_inv.item()

    a, b = quantize(_random((m, k), 61), "row"), quantize(_random((n, k), 62), "row")
    scale_a, scale_b = hardware_scales(a, b)
    assert scale_a.shape == (m, 1) and scale_b.shape == (1, n)
    assert scale_a.is_contiguous() and scale_b.is_contiguous()
    assert torch.equal(scale_a, a.scale_inv.reshape(m, 1)) and torch.equal(scale_b, b.scale_inv.reshape(1, n))



@pytest.mark.parametrize("a_gran, b_gran", [("row", "tensor"), ("tensor", "row")])
def test_hardware_scales_expand_a_tensorwise_scale_beside_a_rowwise_one(a_gran, b_gran):
    m, n, k = HARDWARE_SHAPE
    a, b = quantize(_random((m, k), 61), a_gran), quantize(_random((n, k), 62), b_gran)
    scale_a, scale_b = hardware_scales(a, b)
    assert scale_a.shape == (m, 1) and scale_b.shape == (1, n)
    for scale in (scale_a, scale_b):
        assert scale.dtype == torch.float32 and scale.is_contiguous()
    assert torch.equal(scale_a, a.scale_inv.reshape(-1, 1).expand(m, 1))
    assert torch.equal(scale_b, b.scale_inv.reshape(1, -1).expand(1, n))


def _pad4(value: int) -> int:
    return -(-value // 4) * 4


# (M, N, K): K/128 = 3 (pads to 4), and K/128 = 5 (pads to 8).
BLOCK_LAYOUT_SHAPES = [(256, 128, 384), (128, 384, 640)]


@pytest.mark.parametrize("m, n, k", BLOCK_LAYOUT_SHAPES)
@pytest.mark.parametrize(
    "a_gran, b_gran",
    [("block1x128", "block128x128"), ("block1x128", "block1x128"), ("block128x128", "block1x128")],
)
def test_hardware_scales_blockwise_layout(a_gran, b_gran, m, n, k):
    a, b = quantize(_random((m, k), 71), a_gran), quantize(_random((n, k), 72), b_gran)
    scale_a, scale_b = hardware_scales(a, b)
    kb = k // 128
    # Beside a 128x128 operand K is padded with zero blocks to a multiple of 4 blocks.
    kbp = _pad4(kb) if "block128x128" in (a_gran, b_gran) else kb
    if a_gran == "block1x128":  # (M, K'/128), outer-dim (M) fastest
        assert scale_a.shape == (m, kbp) and scale_a.stride() == (1, m)
    else:  # (M/128, K'/128), row-major
        assert scale_a.shape == (m // 128, kbp) and scale_a.stride() == (kbp, 1)
    assert torch.equal(scale_a[:, :kb], a.scale_inv) and not scale_a[:, kb:].any()
    if b_gran == "block1x128":  # (K'/128, N), N fastest
        assert scale_b.shape == (kbp, n) and scale_b.stride() == (n, 1)
    else:  # (K'/128, N/128) as the transpose of [N/128, K'/128]
        assert scale_b.shape == (kbp, n // 128) and scale_b.stride() == (1, kbp)
    assert torch.equal(scale_b[:kb], b.scale_inv.t()) and not scale_b[kb:].any()
    for scale in (scale_a, scale_b):
        assert scale.dtype == torch.float32


def _swizzled_position(row: int, col: int, padded_cols: int) -> int:
    """Flat index of scale (row, col) in the 128x4-tile layout of NUMERICS.md section 3."""
    tile = (row // 128) * (padded_cols // 4) + col // 4
    in_tile_row = row % 128
    return tile * 512 + (in_tile_row % 32) * 16 + (in_tile_row // 32) * 4 + col % 4


@pytest.mark.parametrize("m, n, k", [(160, 96, 416), (256, 32, 128)])
def test_hardware_scales_mx_swizzled(m, n, k):
    a, b = quantize(_random((m, k), 81), "mx"), quantize(_random((n, k), 82), "mx")
    scale_a, scale_b = hardware_scales(a, b)
    for qt, scale, rows in ((a, scale_a, m), (b, scale_b, n)):
        padded_rows, padded_cols = -(-rows // 128) * 128, _pad4(k // 32)
        assert scale.dtype == torch.float8_e8m0fnu and scale.dim() == 1
        assert scale.numel() == padded_rows * padded_cols
        codes = scale.view(torch.uint8)
        compact = qt.scale_inv.view(torch.uint8)
        expected = torch.zeros(padded_rows * padded_cols, dtype=torch.uint8)
        for r in range(rows):
            for c in range(k // 32):
                expected[_swizzled_position(r, c, padded_cols)] = compact[r, c]
        assert torch.equal(codes, expected)
        assert torch.equal(scale, swizzle_mx_scales(qt.scale_inv).reshape(-1))


@pytest.mark.parametrize("granularity, scale_dtype", [("mx", torch.float8_e8m0fnu), ("mxfp4", torch.float8_e8m0fnu), ("nvfp4", E4M3)])
def test_hardware_scales_of_uint8_scales_are_the_scale_dtype(granularity, scale_dtype):
    """Inside torch.compile E8M0 scales stay uint8 (quantize.py, fp4_quantize.py);
    torch._scaled_mm takes block scales by their dtype, so hardware_scales views them back."""
    a, b = (quantize(_random((rows, 256), seed), granularity) for rows, seed in ((128, 91), (64, 92)))
    as_bytes = [dataclasses.replace(qt, scale_inv=qt.scale_inv.view(torch.uint8)) for qt in (a, b)]
    for eager, compiled in zip(hardware_scales(a, b), hardware_scales(*as_bytes)):
        assert eager.dtype == compiled.dtype == scale_dtype
        assert torch.equal(eager.view(torch.uint8), compiled.view(torch.uint8))


# ---------------------------------------------------------------- backends and errors


@pytest.mark.parametrize("a_gran, b_gran", [("tensor", "tensor"), ("row", "row"), ("block1x128", "block128x128"), ("mx", "mx")])
def test_hardware_backend_on_cpu_raises_with_the_way_out(a_gran, b_gran):
    a, b = _pair(a_gran, b_gran)
    with pytest.raises(RuntimeError, match=r"no FP8 GEMM on this device.*emulated"):
        scaled_mm(a, b, backend="hardware")


def test_auto_backend_on_cpu_runs_emulated_and_logs_once(caplog):
    gemm_module.backend_log.forget()
    a, b = _pair("row", "row")
    with caplog.at_level(logging.INFO, logger="fp8train.quant.gemm"):
        auto = scaled_mm(a, b, torch.float32, backend="auto")
        scaled_mm(a, b, torch.float32)  # default backend is auto
    records = [r for r in caplog.records if r.name == "fp8train.quant.gemm"]
    assert len(records) == 1, [r.getMessage() for r in records]
    message = records[0].getMessage()
    assert "emulated" in message and "cpu" in message
    assert torch.equal(auto, scaled_mm(a, b, torch.float32, backend="emulated"))


def test_emulated_backend_does_not_log(caplog):
    gemm_module.backend_log.forget()
    a, b = _pair("tensor", "tensor")
    with caplog.at_level(logging.INFO, logger="fp8train.quant.gemm"):
        scaled_mm(a, b, torch.float32, backend="emulated")
    assert not [r for r in caplog.records if r.name == "fp8train.quant.gemm"]


def test_bad_arguments_raise_value_error():
    a, b = _pair("tensor", "tensor")
    with pytest.raises(ValueError, match="backend='cuda' must be one of auto, emulated, hardware"):
        scaled_mm(a, b, backend="cuda")
    for out_dtype in (torch.float64, torch.int32, E4M3):
        with pytest.raises(ValueError, match="out_dtype=.* must be float32, bfloat16 or float16"):
            scaled_mm(a, b, out_dtype)
    short_k = quantize(_random((64, 96), 1), "tensor")
    with pytest.raises(ValueError, match=r"contraction dims differ: a is \(200, 328\), b is \(64, 96\)"):
        scaled_mm(a, short_k)
    three_d = quantize(_random((64, 328), 1).reshape(2, 32, 328), "tensor")
    with pytest.raises(ValueError, match=r"a must be 2-D, got shape \(2, 32, 328\)"):
        scaled_mm(three_d, b)


@pytest.mark.parametrize("granularity", ["row", "block1x128", "mx"])
def test_axis0_operand_without_transpose_raises(granularity):
    m, n, k = 256, 128, 256
    a = quantize(_random((m, k), 1), granularity)
    b_axis0 = quantize(_random((n, k), 2), granularity, axis=0)
    with pytest.raises(ValueError, match=rf"b \({granularity}\) is scaled along its first dim \(axis=0\).*transpose\(b\)"):
        scaled_mm(a, b_axis0)
    with pytest.raises(ValueError, match=r"a .* \(axis=0\)"):
        scaled_mm(b_axis0, a)


@pytest.mark.parametrize(
    "a_gran, b_gran", [("row", "block1x128"), ("tensor", "mx"), ("mx", "block1x128"), ("block128x128", "tensor")]
)
@pytest.mark.parametrize("backend", ["emulated", "auto", "hardware"])
def test_mixing_recipe_families_is_not_implemented(a_gran, b_gran, backend):
    a = quantize(_random((128, 256), 1), a_gran)
    b = quantize(_random((128, 256), 2), b_gran)
    with pytest.raises(NotImplementedError, match=rf"no FP8 GEMM mixes '{a_gran}' with '{b_gran}'"):
        scaled_mm(a, b, backend=backend)


def test_scaled_mm_is_public():
    assert fp8train.quant.scaled_mm is scaled_mm
