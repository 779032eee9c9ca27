"""The reference FP8 quantizer's calls for a layer's bound path (issue 38): both usages in one
call (:func:`quantize_fp8_usages`), held bit for bit to the two :func:`quantize_fp8` calls, and
the emulated GEMM's operand values it writes on the CPU (``values``), held bit for bit to the
GEMM's own conversion of the same codes (:func:`fp8train.quant.gemm.emulated._operand`)."""

from __future__ import annotations

import pickle

import pytest
import torch

from fp8train.quant.cast import checked_fp8_to_hp
from fp8train.quant.fp8_quantize import _PLANS_KEY, group_amax, group_scales, quantize_fp8, quantize_fp8_usages
from fp8train.quant.gemm import emulated
from fp8train.spec.formats import E5M2
from fp8train.spec.rule import QuantRule

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (rows, cols): at most DIRECT_ELEMENTS codes (PyTorch's conversion) and more (the bit path)
SHAPES = [(16, 256), (256, 384)]


def _input(shape, dtype, special: bool) -> torch.Tensor:
    generator = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=generator) * torch.logspace(-30, 30, shape[1])
    x[1] = 0.0  # a zero row
    x[2, :3] = torch.tensor([1e-42, 3e38, -3e38])  # a subnormal amax's neighbour, saturation
    if special:
        x[3, 5], x[4, 7], x[0, 0] = float("nan"), float("inf"), float("-inf")
    return x.to(dtype)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8).reshape(-1) if t.element_size() == 1 else t.reshape(-1).contiguous().view(torch.uint8)


def _same(a, b) -> None:
    assert (a.granularity, a.axis, a.power_2_scales) == (b.granularity, b.axis, b.power_2_scales)
    assert a.data.shape == b.data.shape and a.data.stride() == b.data.stride()
    assert a.scale_inv.dtype == b.scale_inv.dtype and a.scale_inv.shape == b.scale_inv.shape
    assert torch.equal(_bytes(a.data), _bytes(b.data)) and torch.equal(_bytes(a.scale_inv), _bytes(b.scale_inv))


@pytest.mark.parametrize("granularity", ["row", "block1x128", "mx"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("special", [False, True])
def test_usages_in_one_call_are_the_two_calls_bits(granularity, dtype, special):
    x, rule = _input((256, 384), dtype, special), QuantRule(granularity=granularity)
    last, first = quantize_fp8_usages(x, rule)
    _same(last, quantize_fp8(x, rule, -1, None))
    _same(first, quantize_fp8(x, rule, 0, None))


@pytest.mark.parametrize("granularity", ["tensor", "block128x128"])
def test_usages_in_one_call_leave_a_symmetric_granularity_to_its_transpose(granularity):
    assert quantize_fp8_usages(_input((256, 384), torch.float32, False), QuantRule(granularity=granularity)) is None


RULES = [
    QuantRule(granularity="row"), QuantRule(granularity="row", format=E5M2), QuantRule(granularity="block1x128"), QuantRule(granularity="block128x128"),
    QuantRule(granularity="mx"), QuantRule(granularity="tensor"), QuantRule(granularity="tensor", power_2_scales=True),
]


@pytest.mark.parametrize("rule", RULES, ids=str)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("values", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("axis", [-1, 0])
def test_operand_values_are_the_emulated_gemms_conversion(rule, shape, dtype, values, axis):
    if rule.granularity.symmetric and axis == 0:
        pytest.skip("a symmetric granularity's first-dim usage is its last-dim one transposed")
    try:
        rule.check_input(shape, axis, scale_given=False, noun="tensor")
    except ValueError:
        pytest.skip("the granularity does not tile the shape")
    x = _input(shape, dtype, special=True)
    written = quantize_fp8(x, rule, axis, None, traced=False, values=values)
    plain = quantize_fp8(x, rule, axis, None, traced=False)
    _same(written, plain)
    cache = written.gemm_cache
    assert cache.compute_dtype == values
    expected, out_scale = emulated._operand(plain, values, kernels=False)
    assert cache.values.dtype == expected.dtype and cache.values.stride() == expected.stride()
    assert torch.equal(_bytes(cache.values), _bytes(expected))
    assert (cache.out_scale is None) == (out_scale is None)
    assert out_scale is None or torch.equal(cache.out_scale, out_scale)


def test_operand_values_refuse_scales_that_do_not_fold():
    x = _input((16, 256), torch.float32, special=False)
    with pytest.raises(ValueError, match="do not fold"):
        quantize_fp8(x, QuantRule(granularity="row", power_2_scales=False), -1, None, traced=False, values=torch.float32)


def test_a_rule_keeps_its_plans_and_a_trace_builds_its_own():
    x, rule = _input((16, 256), torch.float32, False), QuantRule(granularity="row")
    quantize_fp8(x, rule, -1, None, traced=False)
    plans = rule.__dict__[_PLANS_KEY]
    assert (-1, x.shape, x.device) in plans
    quantize_fp8(x, rule, 0, None, traced=True)  # built afresh: not kept
    assert (0, x.shape, x.device) not in plans
    assert _PLANS_KEY not in pickle.loads(pickle.dumps(rule)).__dict__  # a memo is not pickled


@pytest.mark.parametrize("granularity", ["block1x128", "block128x128"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("axis", [-1, 0])
def test_compact_block_scales_are_the_kept_dims_scales(granularity, dtype, axis):
    """A block quantization's amax keeps no dims (its scales compact, spread by an index: no
    reshape, issue 38): the bits of the four-dim amax's scales and codes."""
    x, rule = _input((256, 384), dtype, special=True), QuantRule(granularity=granularity)
    qt = quantize_fp8(x, rule, axis, None, traced=False)
    rows, cols = rule.granularity.group_shape(axis, tuple(x.shape))
    x_view = x.reshape(256 // rows, rows, 384 // cols, cols)
    scale, scale_inv = group_scales(group_amax(x_view), rule, dtype)
    data = (x_view * scale).clamp_(-rule.fp8_max, rule.fp8_max).to(qt.data.dtype)
    assert torch.equal(_bytes(qt.scale_inv), _bytes(scale_inv.reshape(qt.scale_inv.shape)))
    assert torch.equal(_bytes(qt.data), _bytes(data.reshape(x.shape)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("code_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_codes_converted_with_their_count_given_are_the_asked_counts(dtype, code_dtype):
    """``checked_fp8_to_hp``'s ``numel`` (a quantizer's 4-D view of blocks): the same values,
    NaN (and inf) codes included, as where it asks for the count and the layout."""
    codes = torch.arange(256, dtype=torch.uint8).repeat(64).view(code_dtype).reshape(8, 16, 8, 16)
    given = checked_fp8_to_hp(codes, dtype, False, codes.numel())
    asked = checked_fp8_to_hp(codes, dtype, False)
    assert given.stride() == asked.stride() and torch.equal(_bytes(given), _bytes(asked))
