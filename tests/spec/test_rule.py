"""QuantRule: one frozen, hashable value for how a slot is quantized, validated once with
the errors the public quantize gives; its shape rules, shared by both frontends."""

from __future__ import annotations

import dataclasses
import math

import pytest

from fp8train.spec import DATA_FORMATS, E4M3, E5M2, E8M0, Granularity, QuantRule
from fp8train.spec.formats import E2M1
from fp8train.spec.rule import build_quantize_rule

G = Granularity


@pytest.mark.parametrize(
    "granularity, power_2_scales",
    [(G.TENSOR, False), (G.ROW, True), (G.BLOCK_1X128, True), (G.BLOCK_128X128, True), (G.MX, True)],
)
def test_defaults_follow_the_granularity(granularity, power_2_scales):
    rule = QuantRule(granularity=str(granularity))
    assert rule.granularity is granularity  # names become members
    assert rule.power_2_scales is power_2_scales
    assert (rule.format, rule.amax_epsilon, rule.mx_scale_rule) == (E4M3, 0.0, "ceil")
    assert rule.fp8_max == 448.0
    assert QuantRule(granularity=granularity, format=E5M2).fp8_max == 57344.0


def test_frozen_equal_and_hashable():
    a = QuantRule(granularity="row", amax_epsilon=1e-3)
    b = QuantRule(granularity=G.ROW, power_2_scales=True, amax_epsilon=1e-3)
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a != dataclasses.replace(a, format=E5M2)
    assert a != dataclasses.replace(a, mx_scale_rule="ocp")
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.amax_epsilon = 0.0


def test_replace_revalidates():
    with pytest.raises(ValueError, match=r"power_2_scales=False is not possible for 'mx'"):
        dataclasses.replace(QuantRule(granularity="mx"), power_2_scales=False)


@pytest.mark.parametrize(
    "options, error, match",
    [
        (dict(granularity="tile"), ValueError, r"granularity='tile' is not one of tensor, row, "),
        (dict(granularity="row", format=E8M0), ValueError, r"format=E8M0 is not a data format; use one of E4M3, E5M2, E2M1"),
        (dict(granularity="row", format="E4M3"), TypeError, r"format must be a FloatFormat \(E4M3, E5M2 or E2M1\), got str"),
        (dict(granularity="row", power_2_scales="yes"), TypeError, r"power_2_scales='yes' must be True or False"),
        (dict(granularity="mx", power_2_scales=False), ValueError, r"power_2_scales=False is not possible for 'mx': E8M0"),
        (dict(granularity="row", amax_epsilon=-1.0), ValueError, r"amax_epsilon=-1.0 must be a finite number >= 0"),
        (dict(granularity="row", amax_epsilon=math.nan), ValueError, r"amax_epsilon=nan must be a finite number"),
        (dict(granularity="row", amax_epsilon=math.inf), ValueError, r"amax_epsilon=inf must be a finite number"),
        (dict(granularity="row", amax_epsilon="0"), TypeError, r"amax_epsilon='0' must be a finite number"),
        (dict(granularity="mx", mx_scale_rule="floor"), ValueError, r"mx_scale_rule='floor' must be 'ceil' or 'ocp'"),
        (dict(granularity="mx", mx_scale_rule=None), ValueError, r"mx_scale_rule=None must be 'ceil' or 'ocp'"),
        # 4-bit: the data format goes with the granularity, and the options with 4 bits
        (dict(granularity="nvfp4", format=E4M3), ValueError, r"granularity 'nvfp4' takes 4-bit E2M1 data, not format=E4M3; use format=E2M1"),
        (dict(granularity="mx", format=E2M1), ValueError, r"format=E2M1 needs a 4-bit granularity \('nvfp4', 'nvfp4_2d' or 'mxfp4'\), not 'mx'"),
        (dict(granularity="row", rht=True), ValueError, r"rht=True is a 4-bit option; 'row' takes FP8 data"),
        (dict(granularity="mx", stochastic_rounding=True), ValueError, r"stochastic_rounding=True is a 4-bit option; 'mx'"),
        (dict(granularity="nvfp4", rht=1), TypeError, r"rht=1 must be True or False"),
        (dict(granularity="nvfp4", stochastic_rounding="no"), TypeError, r"stochastic_rounding='no' must be True or False"),
        (dict(granularity="mxfp4", rht=True), ValueError, r"rht=True is not possible for 'mxfp4': the transform runs along"),
        (dict(granularity="nvfp4_2d", rht=True), ValueError, r"rht=True is not possible for 'nvfp4_2d'"),
        (dict(granularity="nvfp4", power_2_scales=True), ValueError, r"power_2_scales=True is not possible for 'nvfp4': its block scales are E4M3"),
        (dict(granularity="mxfp4", power_2_scales=False), ValueError, r"power_2_scales=False is not possible for 'mxfp4'"),
        (dict(granularity="nvfp4", amax_epsilon=1e-6), ValueError, r"amax_epsilon=1e-06 is not an option of 'nvfp4'; leave it 0"),
    ],
)
def test_bad_rules_name_the_field(options, error, match):
    with pytest.raises(error, match=match):
        QuantRule(**options)


def test_data_formats_exclude_the_scale_format():
    assert DATA_FORMATS == (E4M3, E5M2, E2M1)


@pytest.mark.parametrize("granularity, power_2_scales", [(G.NVFP4, False), (G.NVFP4_2D, False), (G.MXFP4, True)])
def test_4bit_defaults(granularity, power_2_scales):
    rule = QuantRule(granularity=granularity)
    assert rule.format is E2M1 and rule.fp8_max == 6.0
    assert rule.power_2_scales is power_2_scales
    assert (rule.rht, rule.stochastic_rounding) == (False, False)
    assert QuantRule(granularity="nvfp4", rht=True, stochastic_rounding=True) != QuantRule(granularity="nvfp4")
    assert QuantRule(granularity=granularity, stochastic_rounding=True).stochastic_rounding


@pytest.mark.parametrize(
    "granularity, shape, axis, expected",
    [
        ("tensor", (), 0, -1),  # per-tensor: any rank, the axis means nothing
        ("tensor", (3, 5), 0, -1),
        ("row", (7,), -1, -1),
        ("row", (2, 3, 4), 2, -1),  # the last dim's index is the last-dim usage
        ("row", (2, 3, 4), 0, 0),
        ("mx", (2, 16, 64), 0, 0),
        ("block128x128", (128, 256), -1, -1),
        ("nvfp4", (32, 64), 0, 0),
        ("mxfp4", (2, 16, 64), 2, -1),
        ("nvfp4_2d", (32, 64), 0, -1),  # 16x16 tiles pack their codes along the last dim
    ],
)
def test_check_input_normalizes_the_axis(granularity, shape, axis, expected):
    assert QuantRule(granularity=granularity).check_input(shape, axis, scale_given=False, noun="tensor") == expected


@pytest.mark.parametrize(
    "granularity, shape, axis, scale_given, noun, error, match",
    [
        ("row", (4, 4), 1.0, False, "tensor", TypeError, r"axis=1.0 must be an int"),
        ("row", (2, 4, 4), 1, False, "array", ValueError, r"axis=1 is not supported for a rank-3 input"),
        ("row", (), -1, False, "tensor", ValueError, r"granularity 'row' needs a tensor of rank >= 1, got shape \(\)"),
        ("mx", (64,), -1, False, "array", ValueError, r"granularity 'mx' needs an array of rank >= 2, got shape \(64,\)"),
        ("block1x128", (3, 50, 128), 0, False, "tensor", ValueError, r"divisible by 128; shape \(3, 50, 128\) gives 150 x 128. Pad the tensor"),
        ("mx", (64, 100), -1, False, "array", ValueError, r"divisible by 32; shape \(64, 100\) gives 64 x 100. Pad the array"),
        ("row", (4, 4), -1, True, "tensor", ValueError, r"precomputed scale is only supported for granularity 'tensor', not 'row'"),
    ],
)
def test_check_input_errors(granularity, shape, axis, scale_given, noun, error, match):
    with pytest.raises(error, match=match):
        QuantRule(granularity=granularity).check_input(shape, axis, scale_given=scale_given, noun=noun)


_PUBLIC_DEFAULTS = dict(power_2_scales=None, amax_epsilon=0.0, mx_scale_rule="ceil", rht=False, stochastic_rounding=False)


def test_the_public_quantize_rule_is_built_in_one_place():
    # fp8train.quant.quantize and fp8train.jax.quantize both build their rule here.
    assert build_quantize_rule("row", None, **_PUBLIC_DEFAULTS) == QuantRule(granularity="row")
    options = {**_PUBLIC_DEFAULTS, "rht": True, "stochastic_rounding": True}
    assert build_quantize_rule("nvfp4", E2M1, **options) == QuantRule(
        granularity="nvfp4", format=E2M1, rht=True, stochastic_rounding=True
    )
    with pytest.raises(ValueError, match=r"rht=True is a 4-bit option; 'row' takes FP8 data"):
        build_quantize_rule("row", E5M2, **{**_PUBLIC_DEFAULTS, "rht": True})

