"""The emulated GEMM's dtype follows the machine (bfloat16 with native bf16, float32
without), can be overridden, and both choices compute the same GEMM: identical where every
partial sum is exact, and otherwise apart by float32 accumulation order only."""

import pytest
import torch

import fp8train.quant.gemm.emulated as emulated
from fp8train.quant import quantize
from fp8train.quant.gemm.emulated import emulated_gemm_dtype, emulated_mm
from fp8train.quant.kernels import QuantSettings, use_quant_settings

BF16_ULP_AT_ONE = 2.0**-7


@pytest.mark.parametrize(
    "native, choice, device, expected",
    [
        (True, None, "cpu", torch.bfloat16),
        (False, None, "cpu", torch.float32),
        (False, None, "cuda", torch.bfloat16),
        (False, "auto", "cpu", torch.float32),
        (True, "float32", "cpu", torch.float32),
        (False, "bfloat16", "cpu", torch.bfloat16),
    ],
)
def test_choice_follows_the_machine_and_the_override(native, choice, device, expected, monkeypatch):
    monkeypatch.setattr(emulated, "NATIVE_BF16", native)
    with use_quant_settings(emulated_gemm=choice or "auto"):
        assert emulated_gemm_dtype(device) == expected


def test_unknown_override_names_the_variable():
    with pytest.raises(ValueError, match=r"FP8TRAIN_EMULATED_GEMM='fp16' must be bfloat16, float32 or auto"):
        QuantSettings.from_environment({"FP8TRAIN_EMULATED_GEMM": "fp16"})
    with pytest.raises(ValueError, match=r"emulated_gemm='fp16' must be one of auto, bfloat16, float32"):
        with use_quant_settings(emulated_gemm="fp16"):
            pass


def _operands(granularities, x, w):
    a = quantize(x, granularities[0], power_2_scales=True)
    b = quantize(w, granularities[1], power_2_scales=True)
    return a, b


def _both(a, b, bias):
    """The GEMM in bfloat16 and in float32, each from fresh operands (no shared cache)."""
    outputs = []
    for gemm_dtype in (torch.bfloat16, torch.float32):
        fresh = [type(q)(data=q.data, scale_inv=q.scale_inv, granularity=q.granularity, axis=q.axis,
                         power_2_scales=q.power_2_scales) for q in (a, b)]
        outputs.append(emulated_mm(*fresh, torch.bfloat16, bias, gemm_dtype=gemm_dtype))
    return outputs


GRANULARITY_PAIRS = [("tensor", "tensor"), ("row", "row"), ("block1x128", "block128x128"), ("mx", "mx")]


@pytest.mark.parametrize("granularities", GRANULARITY_PAIRS, ids=lambda g: "x".join(g))
def test_identical_where_every_partial_sum_is_exact(granularities):
    # Small integers (exact in E4M3) with amax 8: every scale is 2^5 or 2^6, every product
    # and every partial sum a multiple of 2^-12 below 2^17, so both GEMMs sum exactly and
    # round once, to the same bfloat16.
    generator = torch.Generator().manual_seed(0)
    x = torch.randint(-8, 9, (256, 1024), generator=generator).float()
    w = torch.randint(-8, 9, (128, 1024), generator=generator).float()
    x[:, 0], w[:, 0] = 8, 8
    bias = torch.randint(-4, 5, (128,), generator=generator).float()
    for b in (None, bias):
        in_bf16, in_float32 = _both(*_operands(granularities, x, w), b)
        assert torch.equal(in_bf16, in_float32)


@pytest.mark.parametrize("granularities", GRANULARITY_PAIRS, ids=lambda g: "x".join(g))
def test_otherwise_apart_by_at_most_one_bfloat16_rounding(granularities):
    generator = torch.Generator().manual_seed(1)
    x, w = torch.randn(256, 2048, generator=generator) * 3, torch.randn(128, 2048, generator=generator)
    in_bf16, in_float32 = _both(*_operands(granularities, x, w), torch.randn(128, generator=generator))
    differs = in_bf16 != in_float32
    assert differs.float().mean() < 1e-3  # rare: a float32 sum next to a bfloat16 tie
    ulp = in_float32.float().abs().clamp(min=2.0**-126) * BF16_ULP_AT_ONE
    assert ((in_bf16.float() - in_float32.float()).abs() <= ulp).all()
