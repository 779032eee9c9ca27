"""The FP8 cast at and beyond each format's largest value, on the device: it saturates
(finite overflow and infinities become +-max), NaN stays NaN, from float32, bfloat16 and
float16 alike (NUMERICS.md 1). PyTorch's own CUDA cast to E4M3 gives NaN from 464 up (an
H200, torch 2.11), and so did its CPU cast before 2.12: checked against a hand table, against
ml_dtypes where it is installed, and against the CPU. Then ``fp8train.quant.quantize`` with a
scale it is given (delayed scaling's path), whose values exceed the format's range.
"""

from __future__ import annotations

import math

import pytest
import torch

import fp8train

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}
# At and beyond the largest finite value: each becomes +-max (its sign's), NaN stays NaN.
# E4M3: 447 rounds to 448; 464 is the midpoint to the next binade's first code (a NaN code),
# where a non-saturating cast turns to NaN. E5M2: 61440 is the midpoint to inf.
OVERFLOWING = {
    E4M3: (447.0, 448.0, 449.0, 464.0, 470.0, 479.0, 480.0, 500.0, 1e6, math.inf),
    E5M2: (57343.0, 57344.0, 57345.0, 61439.0, 61440.0, 65504.0, 1e6, math.inf),
}
# Values each format holds exactly: unchanged.
EXACT = {E4M3: (0.0, 1.0, -2.5, 240.0, 2.0**-9), E5M2: (0.0, 1.0, -2.5, 40960.0, 2.0**-16)}
SOURCE_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
FORMATS = [pytest.param(E4M3, id="e4m3"), pytest.param(E5M2, id="e5m2")]


def _hand_table(fp8_dtype: torch.dtype) -> tuple[list[float], list[float]]:
    """``(inputs, expected values)``: overflow both signs, exact values, NaN."""
    top = FP8_MAX[fp8_dtype]
    inputs, expected = [], []
    for value in OVERFLOWING[fp8_dtype]:
        inputs += [value, -value]
        expected += [top, -top]
    inputs += [*EXACT[fp8_dtype], math.nan]
    expected += [*EXACT[fp8_dtype], math.nan]
    return inputs, expected


def _assert_values(out: torch.Tensor, expected: list[float], inputs: list[float], what: str) -> None:
    values = out.float().cpu().tolist()
    for got, want, given in zip(values, expected, inputs):
        if math.isnan(want):
            assert math.isnan(got), f"{what}: {given!r} -> {got!r}, expected NaN"
        else:
            assert got == want, f"{what}: {given!r} -> {got!r}, expected {want!r} (saturating)"


@pytest.mark.parametrize("source", SOURCE_DTYPES, ids=str)
@pytest.mark.parametrize("fp8_dtype", FORMATS)
def test_cast_saturates_at_and_beyond_the_largest_value(fp8_dtype, source, device):
    inputs, expected = _hand_table(fp8_dtype)
    x = torch.tensor(inputs, dtype=torch.float32).to(source)  # 1e6 is inf in float16: saturates too
    out = fp8train.quant.cast_to_fp8(x.to(device), fp8_dtype)
    assert out.dtype == fp8_dtype and out.device.type == device.type
    _assert_values(out, expected, inputs, f"{source} -> {fp8_dtype} on {device}")
    _assert_values(fp8train.quant.cast_to_fp8(x, fp8_dtype), expected, inputs, f"{source} -> {fp8_dtype} on cpu")


def _oracle_codes(x_f32: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """The contract's cast, independently of fp8train: clamp to +-max (exact; NaN kept), then
    round to nearest even by ml_dtypes where installed, else by PyTorch's CPU conversion
    (in range, every release rounds right)."""
    clamped = x_f32.clamp(-FP8_MAX[fp8_dtype], FP8_MAX[fp8_dtype])
    try:
        import ml_dtypes
    except ImportError:
        return clamped.to(fp8_dtype).view(torch.uint8)
    import numpy as np

    ml_type = ml_dtypes.float8_e4m3fn if fp8_dtype == E4M3 else ml_dtypes.float8_e5m2
    with np.errstate(invalid="ignore"):  # NaN in, NaN out
        return torch.from_numpy(clamped.numpy().astype(ml_type).view(np.uint8))


@pytest.mark.parametrize("source", SOURCE_DTYPES, ids=str)
@pytest.mark.parametrize("fp8_dtype", FORMATS)
def test_cast_of_random_bit_patterns_matches_the_oracle(fp8_dtype, source, device):
    """Every kind of value: 2^20 random bit patterns of the source dtype (NaN, inf,
    subnormals, huge), bit for bit (NaN only as NaN: its code may differ)."""
    bits = 16 if source != torch.float32 else 32
    generator = torch.Generator().manual_seed(7)
    raw = torch.randint(-(2 ** (bits - 1)), 2 ** (bits - 1), (1 << 20,), generator=generator)
    x = raw.to(torch.int16 if bits == 16 else torch.int32).view(source)
    x_f32 = x.float()  # exact from bfloat16 and float16
    codes = fp8train.quant.cast_to_fp8(x.to(device), fp8_dtype).view(torch.uint8).cpu()
    expected = _oracle_codes(x_f32, fp8_dtype)
    nan = torch.isnan(x_f32)
    assert torch.isnan(codes.view(fp8_dtype).float()[nan]).all(), "a NaN input must give NaN"
    wrong = (codes != expected) & ~nan
    assert not wrong.any(), (
        f"{int(wrong.sum())} codes differ; first: {x_f32[wrong][0].item()!r} -> "
        f"{codes[wrong][0].item():#04x}, expected {expected[wrong][0].item():#04x}"
    )


@pytest.mark.parametrize("source", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fp8_dtype", FORMATS)
def test_quantize_with_a_given_scale_saturates_what_exceeds_it(fp8_dtype, source, device):
    """Delayed scaling quantizes with the scale of earlier steps' amax: a value this step
    larger than that amax lands beyond the format's range, and must saturate, not turn to NaN."""
    top = FP8_MAX[fp8_dtype]
    x = torch.tensor([[1.0, 1.5, 10.0, 100.0, 1e4, -3.0, -1e6, 0.5]], dtype=source)
    scale = torch.tensor(top, dtype=torch.float32)  # last step's amax was 1
    expected_values = [top, top, top, top, top, -top, -top, top / 2]
    for where in (device, torch.device("cpu")):
        qt = fp8train.quant.quantize(x.to(where), "tensor", dtype=fp8_dtype, scale=scale.to(where))
        _assert_values(qt.data.reshape(-1), expected_values, x.reshape(-1).tolist(), f"quantize(scale=) on {where}")
        assert qt.scale_inv.float().item() == torch.reciprocal(scale).item()
    on_device = fp8train.quant.quantize(x.to(device), "tensor", dtype=fp8_dtype, scale=scale.to(device))
    on_cpu = fp8train.quant.quantize(x, "tensor", dtype=fp8_dtype, scale=scale)
    assert torch.equal(on_device.data.view(torch.uint8).cpu(), on_cpu.data.view(torch.uint8))
