"""The numba 4-bit kernels (fp8train.quant.kernels.fp4) against the reference path of
fp8train.quant.fp4_quantize, bit for bit (data bytes, scale bytes, global amax, and the
stochastic-rounding generator's state after the call): every input class of the 4-bit
numerics tests, three input dtypes, both axes, every 4-bit rule (16x16 tiles, the Hadamard
transform, stochastic rounding), rank 3, strided input, odd shapes, the transform's rounding
ties; and where the kernels step aside for the reference path."""

from __future__ import annotations

import math

import pytest
import torch

import fp8train
from fp8train.quant.kernels import fp4 as fp4_kernels
from fp8train.quant.hadamard import RHT_SIGNS, random_hadamard_transform
from fp8train.quant.kernels import use_quant_settings
from fp8train.quant.quantize import quantize as quantize_by_rule
from fp8train.spec.rule import QuantRule

from ..test_fp4_quantize import _classes

pytest.importorskip("numba")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture
def kernel_calls(monkeypatch):
    """The rules the kernel quantized by (a spy on its entry: the calls that returned the
    tensors, not those that left a NaN global amax to the reference path)."""
    calls = []
    real = fp4_kernels.quantize_fp4_blocks

    def spy(*args, **kwargs):
        quantized = real(*args, **kwargs)
        if quantized is not None:
            calls.append(args[1])
        return quantized

    monkeypatch.setattr(fp4_kernels, "quantize_fp4_blocks", spy)
    return calls


def _same(x, granularity, axis=-1, **options):
    """Quantize ``x`` by ``QuantRule(granularity, **options)`` on the default path and the
    reference path, each drawing from a generator seeded alike; assert equal bytes and equal
    generator states after. Returns whether the kernel should have run (the reference's
    global amax, if any, is not NaN)."""
    rule = QuantRule(granularity=granularity, **options)
    generators = torch.Generator().manual_seed(11), torch.Generator().manual_seed(11)
    fast = quantize_by_rule(x, rule, axis=axis, generator=generators[0])
    with use_quant_settings(quantize_kernel="reference"):
        slow = quantize_by_rule(x, rule, axis=axis, generator=generators[1])
    assert torch.equal(generators[0].get_state(), generators[1].get_state())
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
    return slow.global_amax is None or not bool(slow.global_amax.isnan())


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
    codes = fp8train.quant.quantize(x, granularity).data.view(torch.uint8)[0, :8]
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


SR = {"stochastic_rounding": True}
RHT = {"rht": True}
RULES = [
    ("nvfp4", -1, SR),
    ("nvfp4", 0, SR),
    ("mxfp4", -1, SR),
    ("mxfp4", 0, SR),
    ("nvfp4_2d", -1, {}),
    ("nvfp4_2d", -1, SR),
    ("nvfp4", -1, RHT),
    ("nvfp4", 0, RHT),
    ("nvfp4", -1, RHT | SR),
    ("nvfp4", 0, RHT | SR),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("granularity, axis, options", RULES)
def test_tiles_transform_and_stochastic_rounding_match_the_reference(granularity, axis, options, dtype, kernel_calls):
    ran = 0
    for name, x in _classes(dtype).items():
        try:
            ran += _same(x, granularity, axis, **options)
        except AssertionError as error:
            raise AssertionError(f"input class {name!r}") from error
    assert ran > 0 and len(kernel_calls) == ran
    assert all(rule == QuantRule(granularity=granularity, **options) for rule in kernel_calls)


@pytest.mark.parametrize("granularity, axis, options", RULES)
def test_rank3_strided_odd_shapes_for_every_rule(granularity, axis, options, kernel_calls):
    gen = torch.Generator().manual_seed(5)
    _same(torch.randn(3, 32, 64, generator=gen).to(torch.bfloat16), granularity, axis, **options)
    _same(torch.randn(96, 64, generator=gen).t(), granularity, axis, **options)  # strided (a transpose)
    _same(torch.randn(32, 17 * 32, generator=gen).to(torch.float16) * 100, granularity, axis, **options)
    assert len(kernel_calls) == 3


def _transform_ties(dtype):
    """16x16 tensors whose largest transformed value (float32) lies exactly halfway between
    two values of ``dtype``, with the value it rounds to (nearest even), both axes alike."""
    half_ulp_of_one = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[dtype]
    cases = []
    for multiple, rounded in ((1, 1.0), (3, 1.0 + 4 * half_ulp_of_one)):  # ties down, ties up (to even)
        x = torch.zeros(16, 16)
        x[0, 0], x[0, 1] = 4.0, 4 * multiple * half_ulp_of_one  # y = +-1 +- multiple * half an ulp
        cases.append((x, 1.0 + multiple * half_ulp_of_one, rounded))
    if dtype == torch.float16:
        x = torch.zeros(16, 16)
        x[0, 0], x[0, 1] = 2.0**-22, 2.0**-23  # y = 2^-24 +- 2^-25: float16 subnormal ties
        cases.append((x, 1.5 * 2.0**-24, 2.0**-23))
        x = torch.zeros(16, 16)
        x[0] = 65504.0 * torch.tensor(RHT_SIGNS, dtype=torch.float32)  # y_0 = 4 * 65504: past float16's max
        cases.append((x, 4 * 65504.0, math.inf))
    return [(x.to(dtype), tie, rounded) for x, tie, rounded in cases]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_transform_rounds_once_to_nearest_even_like_the_reference(dtype, kernel_calls):
    for x, tie, rounded in _transform_ties(dtype):
        unrounded = random_hadamard_transform(x.float(), -1)
        assert unrounded.abs().amax().item() == tie  # the case is a tie (or an overflow)
        for y, axis in ((x, -1), (x.t().contiguous(), 0)):
            assert fp4_kernels.transformed_amax(y, axis).item() == rounded
            _same(y, "nvfp4", axis, rht=True)
            _same(y, "nvfp4", axis, rht=True, stochastic_rounding=True)
    assert len(kernel_calls) == 4 * len(_transform_ties(dtype))


def test_stochastic_rounding_draws_the_default_generator_like_the_reference(kernel_calls):
    x = torch.randn(64, 96, generator=torch.Generator().manual_seed(6))
    rule = QuantRule(granularity="nvfp4", stochastic_rounding=True, rht=True)
    torch.manual_seed(12)
    fast = quantize_by_rule(x, rule, axis=0)
    fast_state = torch.get_rng_state()
    torch.manual_seed(12)
    with use_quant_settings(quantize_kernel="reference"):
        slow = quantize_by_rule(x, rule, axis=0)
    assert torch.equal(fast_state, torch.get_rng_state())
    assert torch.equal(fast.data.view(torch.uint8), slow.data.view(torch.uint8))
    assert len(kernel_calls) == 1


def test_a_transformed_nan_goes_to_the_reference_path_before_any_draw(kernel_calls):
    # +inf and -inf in one run of 16: the transform sums them to NaN, so every NVFP4 scale is NaN.
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(4))
    x[0, 0], x[0, 1] = math.inf, -math.inf
    rule = QuantRule(granularity="nvfp4", rht=True, stochastic_rounding=True)
    generator = torch.Generator().manual_seed(3)
    state = generator.get_state()
    assert fp4_kernels.quantize(x, rule, -1, None, generator) is None
    assert torch.equal(generator.get_state(), state)
    assert fp4_kernels.quantize(x, QuantRule(granularity="nvfp4", stochastic_rounding=True), -1, None, generator) is not None
    assert not _same(x, "nvfp4", -1, rht=True, stochastic_rounding=True)
    assert len(kernel_calls) == 1  # the transform-free call


@pytest.mark.parametrize("axis", [-1, 0])
@pytest.mark.parametrize("rht", [False, True])
@pytest.mark.parametrize("given", [False, True], ids=["default_generator", "given_generator"])
def test_stochastic_rounding_draws_before_its_one_launch_and_a_nan_puts_the_generator_back(axis, rht, given, monkeypatch):
    """Stochastic NVFP4 draws before the launch that computes the amax and quantizes (one
    launch); where that amax is NaN the generator (given, or PyTorch's default) is as it
    was, and the reference path then draws as it would have. Without the NaN: the
    reference's bits and generator state, from one launch."""
    rule = QuantRule(granularity="nvfp4", rht=rht, stochastic_rounding=True)
    launches, real_plan = [], fp4_kernels.launch_plan

    def spied_plan(*args):
        plan = real_plan(*args)
        return plan._replace(kernel=lambda *launch: launches.append(launch[8]) or plan.kernel(*launch))

    monkeypatch.setattr(fp4_kernels, "launch_plan", spied_plan)
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(5))
    assert _same(x, "nvfp4", axis, rht=rht, stochastic_rounding=True)
    assert launches == [fp4_kernels.COMPUTE_AMAX]  # the amax and the codes in one launch
    x[3, 7] = float("nan")
    generator = torch.Generator().manual_seed(3) if given else None
    state = generator.get_state() if given else torch.get_rng_state()
    assert fp4_kernels.quantize(x, rule, axis, None, generator) is None
    assert torch.equal(generator.get_state() if given else torch.get_rng_state(), state)
    assert not _same(x, "nvfp4", axis, rht=rht, stochastic_rounding=True)


def test_quantize_kernel_reference_forces_the_reference_path(kernel_calls):
    x = torch.randn(64, 64)
    with use_quant_settings(quantize_kernel="reference"):
        fp8train.quant.quantize(x, "nvfp4")
    assert kernel_calls == []
    fp8train.quant.quantize(x, "nvfp4")
    assert len(kernel_calls) == 1


@pytest.mark.parametrize("options", [{}, SR])
def test_a_given_global_amax_sets_the_scales_and_a_nan_one_is_left_to_the_reference_before_any_draw(options, kernel_calls):
    x = torch.randn(32, 32, generator=torch.Generator().manual_seed(8))
    rule = QuantRule(granularity="nvfp4", **options)
    fast = fp4_kernels.quantize(x, rule, -1, None, torch.Generator().manual_seed(1), torch.tensor(40.0))
    with use_quant_settings(quantize_kernel="reference"):
        slow = quantize_by_rule(x, rule, generator=torch.Generator().manual_seed(1), global_amax=torch.tensor(40.0))
    assert torch.equal(fast.data.view(torch.uint8), slow.data.view(torch.uint8))
    assert torch.equal(fast.scale_inv.view(torch.uint8), slow.scale_inv.view(torch.uint8))
    assert fast.global_amax.item() == 40.0
    generator = torch.Generator().manual_seed(3)
    state = generator.get_state()
    assert fp4_kernels.quantize(x, rule, -1, None, generator, torch.tensor(float("nan"))) is None
    assert torch.equal(generator.get_state(), state)
    assert len(kernel_calls) == 1


def test_the_transform_kept_for_the_quantization_and_past_the_limit_computed_again(kernel_calls):
    """Along the columns with its own amax, one launch keeps the transform from its amax's
    pass for the quantization (up to ``KEEP_LIMIT`` values); past it, computes it again."""
    from fp8train.quant.kernels.numba_fp4_transform import KEEP_LIMIT

    gen = torch.Generator().manual_seed(7)
    for rows, cols in ((64, 96), (16, KEEP_LIMIT // 16 + 64)):
        _same(torch.randn(rows, cols, generator=gen) * 10, "nvfp4", 0, rht=True)
    assert len(kernel_calls) == 2
