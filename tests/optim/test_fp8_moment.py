"""The FP8 first moment: E4M3 codes with one float32 scale per block of the flattened
tensor, held to ml_dtypes, and measured against one scale per tensor."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch

from fp8train.optim.fp8_moment import dequantize_blocks, quantize_blocks, zero_blocks

E4M3_MAX = 448.0
HALF_ULP_RELATIVE = 2.0**-4  # E4M3 keeps 3 mantissa bits: a normal value is within 2^-4 of itself
E4M3_MIN_NORMAL = 2.0**-6


def _reference(x: torch.Tensor, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Codes (as uint8) and scale_inv per block by NumPy and ml_dtypes: scale = 448 / amax."""
    flat = x.reshape(-1).numpy().astype(np.float32)
    num_blocks = math.ceil(flat.size / block_size)
    blocks = np.zeros(num_blocks * block_size, dtype=np.float32)
    blocks[: flat.size] = flat
    blocks = blocks.reshape(num_blocks, block_size)
    amax = np.abs(blocks).max(axis=1, keepdims=True)
    scale = np.where(amax > 0, np.float32(E4M3_MAX) / np.where(amax > 0, amax, 1), np.float32(1)).astype(np.float32)
    scaled = np.clip(blocks * scale, -E4M3_MAX, E4M3_MAX).astype(np.float32)
    return scaled.astype(ml_dtypes.float8_e4m3fn).view(np.uint8), (np.float32(1) / scale).astype(np.float32)


@pytest.mark.parametrize("shape, block_size", [((3, 100), 128), ((1000,), 128), ((64, 64), 256), ((5,), 32)])
def test_codes_and_scales_equal_ml_dtypes(shape, block_size):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=generator) * torch.logspace(-6, 0, shape[-1])
    codes, scale_inv = quantize_blocks(x, block_size)
    num_blocks = math.ceil(x.numel() / block_size)
    assert codes.shape == (num_blocks, block_size) and codes.dtype == torch.float8_e4m3fn
    assert scale_inv.shape == (num_blocks, 1) and scale_inv.dtype == torch.float32
    expected_codes, expected_scale_inv = _reference(x, block_size)
    np.testing.assert_array_equal(codes.view(torch.uint8).numpy(), expected_codes)
    np.testing.assert_array_equal(scale_inv.numpy(), expected_scale_inv)
    assert not codes.view(torch.uint8).reshape(-1)[x.numel() :].any()  # the padded tail is zero


def test_dequantized_values_are_within_half_an_ulp():
    x = torch.randn(4096, generator=torch.Generator().manual_seed(1))
    codes, scale_inv = quantize_blocks(x, 128)
    restored = dequantize_blocks(codes, scale_inv, x.shape)
    assert restored.shape == x.shape and restored.dtype == torch.float32
    block_amax = x.abs().reshape(-1, 128).amax(dim=1, keepdim=True).expand(-1, 128).reshape(-1)
    normal = x.abs() * (E4M3_MAX / block_amax) >= E4M3_MIN_NORMAL
    relative = ((restored - x).abs() / x.abs())[normal]
    assert relative.max() <= HALF_ULP_RELATIVE * (1 + 1e-6)
    # Each block's largest value lands on 448 and comes back exactly up to the scale's rounding.
    assert torch.allclose(restored.abs().reshape(-1, 128).amax(dim=1), block_amax.reshape(-1, 128)[:, 0], rtol=1e-6)


def test_zeros_and_empty_tensors():
    codes, scale_inv = quantize_blocks(torch.zeros(300), 128)
    assert torch.equal(scale_inv, torch.ones(3, 1))
    assert torch.equal(dequantize_blocks(codes, scale_inv, torch.Size([300])), torch.zeros(300))
    for numel in (300, 256, 0):  # what a new state starts from, without the float32 zeros
        zeros = zero_blocks(numel, 128, torch.device("cpu"))
        for got, expected in zip(zeros, quantize_blocks(torch.zeros(numel), 128)):
            assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8)) and got.shape == expected.shape
    codes, scale_inv = quantize_blocks(torch.zeros(0, 4), 128)
    assert codes.shape == (0, 128)
    assert dequantize_blocks(codes, scale_inv, torch.Size([0, 4])).shape == (0, 4)


# A weight matrix's first moment: rows (output units) and columns (inputs) of very different
# magnitudes (dead and rarely active units, inputs of different scales): 6 decades across rows
# by 2 across columns. Per block of 128 along a row, a block sees only the columns' spread.
MAX_MEAN_ERROR_PER_BLOCK = 0.04
MAX_FLUSHED_PER_BLOCK = 0.001
MIN_FLUSHED_PER_TENSOR = 0.2


def _moment_like() -> torch.Tensor:
    generator = torch.Generator().manual_seed(2)
    rows = 10.0 ** (-2 - 6 * torch.rand(512, 1, generator=generator))
    cols = 10.0 ** (-2 * torch.rand(1, 256, generator=generator))
    return torch.randn(512, 256, generator=generator) * rows * cols


def _errors(x: torch.Tensor, block_size: int) -> tuple[float, float]:
    """Mean elementwise relative error of the stored moment (an entry stored as zero counts
    1), and the share of entries stored as zero."""
    restored = dequantize_blocks(*quantize_blocks(x, block_size), x.shape)
    relative = (restored - x).abs() / x.abs()
    return relative.mean().item(), (restored == 0).float().mean().item()


def test_per_block_scales_keep_a_moment_that_per_tensor_flushes():
    x = _moment_like()
    error_block, flushed_block = _errors(x, 128)
    error_tensor, flushed_tensor = _errors(x, x.numel())  # one block: one scale per tensor
    assert error_block < MAX_MEAN_ERROR_PER_BLOCK and flushed_block < MAX_FLUSHED_PER_BLOCK
    assert flushed_tensor > MIN_FLUSHED_PER_TENSOR
    assert error_tensor > 5 * error_block
