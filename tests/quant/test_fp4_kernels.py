"""The numba 4-bit kernel (fp8train.quant.fp4_kernels) against the reference path of
fp8train.quant.fp4_quantize, bit for bit (data bytes, scale bytes, global amax): every input
class of the 4-bit numerics tests, three input dtypes, rank 3, strided input, odd shapes;
and where it steps aside for the reference path."""

from __future__ import annotations

import pytest
import torch

import fp8train
from fp8train.quant import fp4_kernels
from fp8train.quant.settings import use_quant_settings
from fp8train.spec.rule import QuantRule

from .test_fp4_quantize import _classes

pytest.importorskip("numba")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture
def kernel_calls(monkeypatch):
    """How many times the kernel ran (a spy on its entry)."""
    calls = []
    real = fp4_kernels.quantize_fp4_blocks

    def spy(*args, **kwargs):
        calls.append(args[1].granularity)
        return real(*args, **kwargs)

    monkeypatch.setattr(fp4_kernels, "quantize_fp4_blocks", spy)
    return calls


def _same(x, granularity, axis=-1):
    """Quantize ``x`` on the default path and the reference path; assert equal bytes."""
    rule = QuantRule(granularity=granularity)
    fast = fp8train.quant.quantize.quantize(x, rule, axis=axis)
    with use_quant_settings(quantize_kernel="reference"):
        slow = fp8train.quant.quantize.quantize(x, rule, axis=axis)
    assert fast.data.dtype == slow.data.dtype and fast.data.shape == slow.data.shape
    assert torch.equal(fast.data.view(torch.uint8), slow.data.view(torch.uint8))
    assert fast.scale_inv.dtype == slow.scale_inv.dtype
    assert torch.equal(fast.scale_inv.view(torch.uint8), slow.scale_inv.view(torch.uint8))
    if slow.global_amax is None:
        assert fast.global_amax is None
    else:
        assert fast.global_amax.dtype == slow.global_amax.dtype == torch.float32
        assert torch.equal(fast.global_amax.view(torch.int32), slow.global_amax.view(torch.int32))
    assert (fast.axis, fast.granularity, fast.power_2_scales) == (slow.axis, slow.granularity, slow.power_2_scales)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("axis", [-1, 0])
@pytest.mark.parametrize("granularity", ["nvfp4", "mxfp4"])
def test_every_input_class_matches_the_reference_bit_for_bit(granularity, axis, dtype, kernel_calls):
    classes = _classes(dtype)
    for x in classes.values():
        _same(x, granularity, axis)
        _same(x.t().contiguous(), granularity, axis)
    # NVFP4 with a NaN anywhere (every scale NaN) is left to the reference path.
    expected = 2 * (len(classes) - (granularity == "nvfp4"))
    assert len(kernel_calls) == expected


@pytest.mark.parametrize("granularity", ["nvfp4", "mxfp4"])
def test_ties_round_to_even_and_negatives_keep_their_sign(granularity, kernel_calls):
    x = torch.zeros(32, 64)
    # NVFP4: global amax 2688 and a block amax of 6 scale by exactly 1.
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0]
    x[0, :16] = torch.tensor(ties + [-t for t in ties[:7]] + [-0.1])
    x[0, 16:32] = torch.tensor([0.2, -0.2, -0.0, 5.5] + [0.0] * 12)
    x[1, 0] = 2688.0
    _same(x, granularity)
    _same(x.t().contiguous(), granularity, axis=0)
    if granularity == "mxfp4":
        return
    codes = fp8train.quantize(x, granularity).data.view(torch.uint8)[0, :8]
    low, high = codes & 0xF, codes >> 4
    assert torch.stack((low, high), 1).flatten().tolist() == [0, 2, 2, 4, 4, 6, 6, 7, 8, 10, 10, 12, 12, 14, 14, 8]
    assert kernel_calls


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("axis", [-1, 0])
@pytest.mark.parametrize("granularity", ["nvfp4", "mxfp4"])
def test_rank3_strided_and_odd_shapes(granularity, axis, dtype, kernel_calls):
    gen = torch.Generator().manual_seed(3)
    _same(torch.randn(3, 32, 96, generator=gen).to(dtype), granularity, axis)
    _same(torch.randn(96, 64, generator=gen).to(dtype).t(), granularity, axis)  # strided (a transpose)
    _same(torch.randn(32, 4096 + 64, generator=gen).to(dtype)[:, ::2] * 1e3, granularity, axis)
    _same(torch.randn(32, 17 * 64, generator=gen).to(dtype), granularity, axis)
    assert len(kernel_calls) == 4


@pytest.mark.parametrize(
    "granularity, axis, options",
    [
        ("nvfp4_2d", -1, {}),
        ("nvfp4", -1, {"rht": True}),
        ("nvfp4", -1, {"stochastic_rounding": True}),
    ],
)
def test_the_reference_path_runs_where_the_kernel_does_not_apply(granularity, axis, options, kernel_calls):
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(4))
    assert fp4_kernels.try_quantize_fp4(x, QuantRule(granularity=granularity, **options), axis) is None
    fp8train.quant.quantize.quantize(x, QuantRule(granularity=granularity, **options), axis=axis)
    assert kernel_calls == []


def test_quantize_kernel_reference_forces_the_reference_path(kernel_calls):
    x = torch.randn(64, 64)
    with use_quant_settings(quantize_kernel="reference"):
        fp8train.quantize(x, "nvfp4")
    assert kernel_calls == []
    fp8train.quantize(x, "nvfp4")
    assert len(kernel_calls) == 1
