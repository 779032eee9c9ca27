"""Each GEMM family through ``fp8train.quant.scaled_mm`` (backend ``auto``) at the shapes that
broke or may break the hardware path: K from 128 to 640 (blockwise refused K/128 not a
multiple of 4), M not a multiple of 128, N a vocabulary size, one not a multiple of 16
(which ``_scaled_mm`` refuses: ``auto`` must fall back, not fail), float32 and bfloat16
out, with and without a bias; against the float64 product of the dequantized operands.

Bounds: :data:`~tests.helpers.tolerances.HARDWARE_GEMM_REL_ERR` of max |result| where the device
runs the family in hardware, :data:`~tests.helpers.tolerances.EMULATED_GEMM_REL_ERR` where it runs
emulated, plus one rounding to the output dtype.
"""

from __future__ import annotations

import pytest
import torch

import fp8train
from fp8train.spec.granularities import Granularity, round_up

from ._suite import assert_close, gemm_rel_err, reference_mm

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2

# (a, b, a's dtype): a is [M, K] (an input or grad_output), b is [N, K] (a weight or input).
PAIRINGS = [
    ("tensor", "tensor", E4M3),  # tensorwise, delayed: output GEMM
    ("tensor", "tensor", E5M2),  # their grad_input GEMM: E5M2 grad_output x E4M3 weight
    ("row", "row", E4M3),  # rowwise
    ("row", "tensor", E4M3),  # rowwise_with_gw_hp's grad_input: grad_output rows x weight tensor
    ("tensor", "row", E4M3),
    ("block1x128", "block128x128", E4M3),  # blockwise output and grad_input
    ("block1x128", "block1x128", E4M3),  # blockwise grad_weight
    ("block128x128", "block1x128", E4M3),  # BlockScaling(x_block_scaling_dim=2, w_block_scaling_dim=1)
    ("mx", "mx", E4M3),  # mxfp8
    ("nvfp4", "nvfp4", None),  # nvfp4 grad_weight
    ("nvfp4", "nvfp4_2d", None),  # nvfp4 output and grad_input (16x16 weight tiles)
    ("mxfp4", "mxfp4", None),
]
GEMM_KS = (128, 256, 384, 512, 640)  # K/128 = 1, 2, 3, 4, 5: the hardware refused 1, 2, 3 and 5 (blockwise)


def _random(rows: int, cols: int, seed: int, device: torch.device) -> torch.Tensor:
    """Normal float32 values whose magnitude varies by row and column (so every scale
    differs), drawn on ``device`` (a vocabulary-sized operand is 32M values)."""
    generator = torch.Generator(device).manual_seed(seed)
    row_scale = torch.exp(torch.randn(rows, 1, generator=generator, device=device))
    col_scale = torch.exp(0.7 * torch.randn(1, cols, generator=generator, device=device))
    return torch.randn(rows, cols, generator=generator, device=device) * row_scale * col_scale / 8


def _shapes(a_name: str, b_name: str, sizes) -> tuple[list[int], list[int]]:
    """``(Ms, Ns)``: the requested Ms rounded up to the rows the family's quantization needs
    (128 for blocks, 32 MX, 16 NVFP4: it cannot quantize fewer), the Ns it can quantize."""
    block = max(Granularity(a_name).block, Granularity(b_name).block, 1)
    return sorted({round_up(m, block) for m in sizes.gemm_ms}), [n for n in sizes.gemm_ns if n % block == 0]


@pytest.mark.parametrize("k", GEMM_KS)
@pytest.mark.parametrize(
    "a_name, b_name, a_dtype", PAIRINGS, ids=[f"{a}x{b}" + ("-e5m2" if d is E5M2 else "") for a, b, d in PAIRINGS]
)
def test_scaled_mm_matches_float64(a_name, b_name, a_dtype, k, device, sizes):
    ms, ns = _shapes(a_name, b_name, sizes)
    b_dtype = None if a_dtype is None else E4M3  # None: the 4-bit granularity's E2M1
    for n in ns:
        b = fp8train.quant.quantize(_random(n, k, n + k, device), b_name, dtype=b_dtype)
        for m in ms:
            a = fp8train.quant.quantize(_random(m, k, m + k + 1, device), a_name, dtype=a_dtype)
            _check_gemm(a, b, f"{a_name} x {b_name} M={m} N={n} K={k}")


def _check_gemm(a, b, what: str) -> None:
    """Every output dtype, with and without a bias, against float64."""
    gemm = reference_mm(a, b)
    n, device = b.data.shape[0], b.data.device
    for out_dtype in (torch.float32, torch.bfloat16):
        rel_err = gemm_rel_err(a, b, out_dtype)
        for bias in (None, torch.randn(n, generator=torch.Generator().manual_seed(n)).to(device, out_dtype)):
            out = fp8train.quant.scaled_mm(a, b, out_dtype, bias=bias)
            expected = gemm if bias is None else gemm + bias.double()
            case = f"{what} out={str(out_dtype).removeprefix('torch.')} bias={bias is not None}"
            assert out.device == device and out.dtype == out_dtype, case
            assert_close(out, expected, rel_err=rel_err, roundings=1, what=case)


@pytest.mark.parametrize("granularity, amax, value", [("mx", 2.0**-118, 0.75 * 2.0**-126), ("mxfp4", 2.0**-124, 2.0**-127)])
def test_the_emulated_bfloat16_gemm_keeps_a_subnormal_product(device, granularity, amax, value):
    # The CPU's bfloat16 GEMM flushes subnormals, so the CPU checks each GEMM's scales first
    # (docs/numerics.md); on a GPU the emulation trusts its bfloat16 GEMM with a float32
    # output (no read, no sync). This holds it to the exact value: a block scaled by 2^-126
    # holding a value below 2^-126, picked out alone.
    a = torch.zeros(32, 64, device=device)
    a[0, 0], a[0, 1] = amax, value
    b = torch.zeros(32, 64, device=device)
    b[0, 1] = 1.0
    with fp8train.quant.kernels.use_quant_settings(emulated_gemm="bfloat16"):
        qa, qb = fp8train.quant.quantize(a, granularity), fp8train.quant.quantize(b, granularity)
        out = fp8train.quant.scaled_mm(qa, qb, torch.bfloat16, backend="emulated")
    assert out[0, 0].item() == value
