"""amax -> scale, delayed scaling's history update and MXFP8's E8M0 exponent, against
hand-computed tables (NUMERICS.md sections 2 and 3)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fp8train.quant.scaling import (
    amax_to_scale,
    delayed_scaling_update,
    exp2_int,
    floor_to_power_of_2,
    mx_scale_exponent,
)

E4M3_MAX = 448.0
E5M2_MAX = 57344.0
FLOAT32_MAX = float.fromhex("0x1.fffffep+127")
BFLOAT16_MAX = float.fromhex("0x1.fep+127")
FLOAT16_MAX = 65504.0
INF = math.inf
NAN = math.nan
# float32(448 / 3): 149.333... = 10010101.0101..., rounded down at the 24th bit.
E4M3_MAX_OVER_3 = float.fromhex("0x1.2aaaaap+7")
# float32(448 / 500) = 0.896 rounded.
E4M3_MAX_OVER_500 = float.fromhex("0x1.cac084p-1")
NUM_RANDOM_VALUES = 20_000


def _scale(amax: float, **kwargs) -> float:
    out = amax_to_scale(torch.tensor(amax, dtype=torch.float32), kwargs.pop("fp8_max", E4M3_MAX), **kwargs)
    assert out.dtype == torch.float32 and out.shape == ()
    return out.item()


# ---------------------------------------------------------------- amax_to_scale


@pytest.mark.parametrize(
    "amax, expected, expected_power_2",
    [
        (0.0, 1.0, 1.0),
        (INF, 1.0, 1.0),
        (NAN, 1.0, 1.0),
        (1.0, 448.0, 256.0),
        (3.0, E4M3_MAX_OVER_3, 128.0),
        (500.0, E4M3_MAX_OVER_500, 0.5),
        (448.0, 1.0, 1.0),
        (896.0, 0.5, 0.5),
        # exact powers of two stay where they are under flooring
        (1.75, 256.0, 256.0),
        (3.5, 128.0, 128.0),
        (7.0, 64.0, 64.0),
        (0.4375, 1024.0, 1024.0),
        (2.0**-110, 1.75 * 2.0**118, 2.0**118),
        # 448 / 2^-119 = 1.75 * 2^127 is still finite ...
        (2.0**-119, 1.75 * 2.0**127, 2.0**127),
        # ... 448 / 2^-120 = 1.75 * 2^128 overflows: largest finite float32
        (2.0**-120, FLOAT32_MAX, 2.0**127),
        (1e-40, FLOAT32_MAX, 2.0**127),  # float32 subnormal amax
        (2.0**-149, FLOAT32_MAX, 2.0**127),
    ],
)
def test_amax_to_scale_table(amax, expected, expected_power_2):
    assert _scale(amax) == expected
    assert _scale(amax, power_2_scales=True) == expected_power_2


@pytest.mark.parametrize(
    "amax, expected, expected_power_2",
    [(1.0, 57344.0, 32768.0), (57344.0, 1.0, 1.0), (3.5, 16384.0, 16384.0), (2.0**-114, FLOAT32_MAX, 2.0**127)],
)
def test_amax_to_scale_e5m2(amax, expected, expected_power_2):
    assert _scale(amax, fp8_max=E5M2_MAX) == expected
    assert _scale(amax, fp8_max=E5M2_MAX, power_2_scales=True) == expected_power_2


@pytest.mark.parametrize(
    "amax, epsilon, expected",
    [
        (0.25, 0.5, 896.0),  # below epsilon: amax := epsilon
        (0.0, 0.5, 896.0),  # epsilon applies before the amax == 0 rule
        (1.0, 0.5, 448.0),  # above epsilon: unchanged
        (0.5, 0.5, 896.0),
        (INF, 0.5, 1.0),
        (NAN, 0.5, 1.0),
        (1e-40, 0.5, 896.0),  # epsilon also prevents the overflow
    ],
)
def test_amax_to_scale_epsilon(amax, epsilon, expected):
    assert _scale(amax, amax_epsilon=epsilon) == expected


@pytest.mark.parametrize(
    "inf_scale_value, power_2_scales, expected",
    [
        (FLOAT16_MAX, False, 65504.0),
        (FLOAT16_MAX, True, 32768.0),
        (BFLOAT16_MAX, False, BFLOAT16_MAX),
        (BFLOAT16_MAX, True, 2.0**127),
    ],
)
def test_amax_to_scale_inf_scale_value_override(inf_scale_value, power_2_scales, expected):
    assert _scale(1e-40, inf_scale_value=inf_scale_value, power_2_scales=power_2_scales) == expected
    # Only an overflowing scale is replaced.
    assert _scale(1.0, inf_scale_value=inf_scale_value, power_2_scales=power_2_scales) == (
        256.0 if power_2_scales else 448.0
    )


def test_amax_to_scale_is_elementwise_and_float32():
    amax = torch.tensor([[0.0, 1.0, 3.0], [INF, 7.0, 2.0**-120]], dtype=torch.float64)
    scale = amax_to_scale(amax, E4M3_MAX, power_2_scales=True)
    assert scale.dtype == torch.float32
    expected = torch.tensor([[1.0, 256.0, 128.0], [1.0, 64.0, 2.0**127]])
    assert torch.equal(scale, expected)
    bf16 = amax_to_scale(torch.tensor([3.0], dtype=torch.bfloat16), E4M3_MAX)
    assert bf16.dtype == torch.float32 and bf16.item() == E4M3_MAX_OVER_3


# ---------------------------------------------------------------- floor_to_power_of_2 / exp2_int


def test_floor_to_power_of_2_against_float64_reference():
    rng = np.random.default_rng(1)
    exponents = rng.integers(-126, 128, size=NUM_RANDOM_VALUES)
    mantissas = rng.integers(0, 2**23, size=NUM_RANDOM_VALUES)
    values = (((exponents + 127) << 23) | mantissas).astype(np.uint32).view(np.float32)
    values = np.concatenate([values, -values[:100]])
    out = floor_to_power_of_2(torch.from_numpy(values)).numpy().astype(np.float64)
    expected = [math.copysign(2.0 ** math.floor(math.log2(abs(v))), v) for v in values.astype(np.float64)]
    np.testing.assert_array_equal(out, np.array(expected))


@pytest.mark.parametrize(
    "value, expected",
    [
        (1.0, 1.0),
        (1.9999999, 1.0),
        (2.0, 2.0),
        (448.0, 256.0),
        (0.3, 0.25),
        (-3.0, -2.0),
        (FLOAT32_MAX, 2.0**127),
        (2.0**-126, 2.0**-126),
        (0.0, 0.0),
        (1e-40, 0.0),  # float32 subnormals have no exponent bits: documented to become 0
        (INF, INF),
    ],
)
def test_floor_to_power_of_2_table(value, expected):
    assert floor_to_power_of_2(torch.tensor(value, dtype=torch.float32)).item() == expected


def test_exp2_int_exact_over_whole_range():
    exponents = torch.arange(-149, 128)
    out = exp2_int(exponents)
    assert out.dtype == torch.float32
    expected = torch.tensor([math.ldexp(1.0, int(e)) for e in exponents], dtype=torch.float64)
    assert torch.equal(out.to(torch.float64), expected)
    assert out[0].item() == 2.0**-149 and out[-1].item() == 2.0**127


# ---------------------------------------------------------------- mx_scale_exponent

# float32(1/448) is slightly *above* 1/448 (by a relative 4.5e-8), and 448 * float32(1/448)
# rounds to exactly 1.0 in float32. So t = amax * float32(1/448) is exactly 2^k when
# amax = 448 * 2^k (no round-up), and any amax above it has a non-zero mantissa.


def _exponent(amax: float, fp8_max: float = E4M3_MAX, rule: str = "ceil") -> int:
    out = mx_scale_exponent(torch.tensor([amax], dtype=torch.float32), fp8_max, rule)
    assert out.dtype == torch.uint8
    return int(out.item())


def _next_float32_up(value: float) -> float:
    return float(np.nextafter(np.float32(value), np.float32(np.inf)))


def _next_float32_down(value: float) -> float:
    return float(np.nextafter(np.float32(value), np.float32(0)))


@pytest.mark.parametrize("k", [-126, -100, -20, -1, 0, 1, 10, 100, 119])
def test_mx_ceil_exact_multiple_of_fp8_max_does_not_round_up(k):
    amax = 448.0 * 2.0**k
    assert _exponent(amax) == 127 + k
    assert _exponent(_next_float32_up(amax)) == 128 + k
    # just below 448 * 2^k: t rounds to 2^k or just below it, ceil is 2^k either way
    assert _exponent(_next_float32_down(amax)) == 127 + k


@pytest.mark.parametrize(
    "amax, expected",
    [
        (0.0, 0),
        (INF, 0xFE),
        (NAN, 0xFF),
        (448.0, 127),
        (449.0, 128),
        (896.0, 128),
        (224.0, 126),
        (300.0, 127),
        # 1/448 = 2^-8.807: floor exponent -9 (biased 118) with a non-zero mantissa -> 119
        (1.0, 119),
        (0.4375, 117),  # 0.4375 / 448 = 2^-10 exactly: -10 + 127
        (FLOAT32_MAX, 247),  # t = 2^128 / 448 ~ 2^119.2 -> 119 + 1 + 127
        # t = 2^-126 exactly: smallest normal, no round-up
        (448.0 * 2.0**-126, 1),
        # t = 2^-127 is a float32 subnormal (mantissa 0x400000): the smallest power of two
        # >= t is 2^-127 itself -> 0 (round toward +inf, as cvt.rp...ue8m0 gives it)
        (448.0 * 2.0**-127, 0),
        # t = 2^-127 * (1 + 2^-21): mantissa 0x400002 > 0x400000 -> 2^-126 -> 1
        (448.0 * 2.0**-127 * (1 + 2.0**-21), 1),
        # t = 2^-130 / 448 ~ 2^-138.8: a subnormal below 2^-127 -> 0
        (2.0**-130, 0),
        # t = 2^-150 * (1 + 4.5e-8): just above the tie with 0, so it rounds to 2^-149 -> 0
        (448.0 * 2.0**-150, 0),
        # t ~ 2^-151 and 2^-157.8 underflow to 0 -> 0
        (448.0 * 2.0**-151, 0),
        (2.0**-149, 0),
    ],
)
def test_mx_ceil_table_e4m3(amax, expected):
    assert _exponent(amax) == expected


@pytest.mark.parametrize(
    "amax, expected",
    [
        (57344.0, 127),
        (_next_float32_up(57344.0), 128),
        (28672.0, 126),
        (1.0, 112),  # 1/57344 = 2^-15.807 -> floor -16 (biased 111), round up -> 112
        (0.0, 0),
        (INF, 0xFE),
        (NAN, 0xFF),
    ],
)
def test_mx_ceil_table_e5m2(amax, expected):
    assert _exponent(amax, E5M2_MAX) == expected


@pytest.mark.parametrize(
    "amax, fp8_max, expected",
    [
        # e = floor(log2(amax)) - emax + 127, emax = 8 (E4M3) or 15 (E5M2)
        (448.0, E4M3_MAX, 127),
        (480.0, E4M3_MAX, 127),  # 480 * 2^0 saturates to 448 under this rule
        (511.0, E4M3_MAX, 127),
        (512.0, E4M3_MAX, 128),
        (255.0, E4M3_MAX, 126),
        (1.0, E4M3_MAX, 119),
        (1.5, E4M3_MAX, 119),
        (FLOAT32_MAX, E4M3_MAX, 246),
        (2.0**-118, E4M3_MAX, 1),
        (2.0**-119, E4M3_MAX, 0),
        (2.0**-130, E4M3_MAX, 0),  # clamped at 0
        (1e-40, E4M3_MAX, 0),  # subnormal amax, clamped
        (0.0, E4M3_MAX, 0),
        (INF, E4M3_MAX, 0xFE),
        (NAN, E4M3_MAX, 0xFF),
        (57344.0, E5M2_MAX, 127),
        (65535.0, E5M2_MAX, 127),
        (65536.0, E5M2_MAX, 128),
        (1.0, E5M2_MAX, 112),
    ],
)
def test_mx_ocp_table(amax, fp8_max, expected):
    assert _exponent(amax, fp8_max, "ocp") == expected


def test_mx_scale_exponent_keeps_shape():
    amax = torch.tensor([[0.0, 448.0], [1.0, NAN], [INF, 896.0]])
    out = mx_scale_exponent(amax, E4M3_MAX)
    assert out.dtype == torch.uint8
    assert out.tolist() == [[0, 127], [119, 0xFF], [0xFE, 128]]
    decoded = out.view(torch.float8_e8m0fnu).float()
    assert decoded[0, 1].item() == 1.0 and decoded[2, 1].item() == 2.0


def test_mx_scale_exponent_rejects_unknown_rule():
    with pytest.raises(ValueError, match=r"rule='floor' must be 'ceil' or 'ocp'"):
        mx_scale_exponent(torch.tensor([1.0]), E4M3_MAX, "floor")


# ---------------------------------------------------------------- delayed_scaling_update

# A hand-worked sequence: history length 3, margin 1 (scale = 448 / amax / 2), E4M3.
# Each row: amax recorded during the step (None: the module did not run), then the
# expected scale and history after the update. The amaxes divide 448 into powers of two,
# so every expected scale is exact. The history is rolled by -1 and slot 0 zeroed.
DELAYED_STEPS_MAX = [
    (7.0, 32.0, [0.0, 0.0, 7.0]),
    (14.0, 16.0, [0.0, 7.0, 14.0]),
    (None, 16.0, [0.0, 7.0, 14.0]),  # did not run: neither rolled nor rescaled
    (3.5, 16.0, [0.0, 14.0, 3.5]),  # max over [3.5, 7, 14] is still 14
    (INF, 16.0, [0.0, 3.5, INF]),  # inf amax: scale unchanged, inf rolls into history
    (28.0, 16.0, [0.0, INF, 28.0]),  # max is inf: frozen
    (7.0, 16.0, [0.0, 28.0, 7.0]),  # still frozen: [7, inf, 28] before the roll
    (3.5, 8.0, [0.0, 7.0, 3.5]),  # inf has fallen out: max over [3.5, 28, 7] = 28
]
DELAYED_STEPS_MOST_RECENT = [
    (7.0, 32.0, [0.0, 0.0, 7.0]),
    (14.0, 16.0, [0.0, 7.0, 14.0]),
    (None, 16.0, [0.0, 7.0, 14.0]),
    (3.5, 64.0, [0.0, 14.0, 3.5]),
    (INF, 64.0, [0.0, 3.5, INF]),  # inf amax: scale unchanged
    (28.0, 8.0, [0.0, INF, 28.0]),  # only the current amax counts: recovers at once
    (7.0, 32.0, [0.0, 28.0, 7.0]),
    (3.5, 64.0, [0.0, 7.0, 3.5]),
]


@pytest.mark.parametrize(
    "algo, steps", [("max", DELAYED_STEPS_MAX), ("most_recent", DELAYED_STEPS_MOST_RECENT)]
)
def test_delayed_update_hand_worked_sequence(algo, steps):
    amax_history = torch.zeros(3)
    scale = torch.tensor(1.0)
    for step, (amax, expected_scale, expected_history) in enumerate(steps):
        if amax is not None:
            amax_history[0] = amax
        returned = delayed_scaling_update(amax_history, scale, E4M3_MAX, margin=1, algo=algo)
        assert returned is scale
        assert scale.item() == expected_scale, f"step {step}"
        assert torch.equal(amax_history, torch.tensor(expected_history)), f"step {step}: {amax_history}"


def test_delayed_update_skips_a_tensor_that_did_not_run_even_with_a_full_history():
    amax_history = torch.tensor([0.0, 1.0, 2.0, 3.0])
    scale = torch.tensor(5.0)
    delayed_scaling_update(amax_history, scale, E4M3_MAX)
    assert scale.item() == 5.0
    assert amax_history.tolist() == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.parametrize("margin, expected", [(0, 64.0), (1, 32.0), (3, 8.0)])
def test_delayed_update_margin(margin, expected):
    scale = torch.tensor(1.0)
    delayed_scaling_update(torch.tensor([7.0, 0.0]), scale, E4M3_MAX, margin=margin)
    assert scale.item() == expected


@pytest.mark.parametrize("margin", [0, 1])
def test_delayed_update_overflowing_scale_becomes_float32_max(margin):
    # 448 / 2^-120 = 1.75 * 2^128 overflows, before or after dividing by 2^margin
    scale = torch.tensor(1.0)
    delayed_scaling_update(torch.tensor([2.0**-120, 0.0]), scale, E4M3_MAX, margin=margin)
    assert scale.item() == FLOAT32_MAX


def test_delayed_update_batched_with_per_tensor_fp8_max():
    # Three tensors (columns): E4M3, E5M2, and an E4M3 one whose module did not run.
    amax_history = torch.tensor([[7.0, 7.0, 0.0], [0.0, 3.5, 14.0]])
    scale = torch.tensor([1.0, 1.0, 2.0])
    fp8_max = torch.tensor([E4M3_MAX, E5M2_MAX, E4M3_MAX])
    delayed_scaling_update(amax_history, scale, fp8_max, algo="max")
    # 448/7 = 64; 57344/7 = 8192; third unchanged
    assert scale.tolist() == [64.0, 8192.0, 2.0]
    assert amax_history.tolist() == [[0.0, 0.0, 0.0], [7.0, 7.0, 14.0]]


def test_delayed_update_callable_algo():
    def sum_of_history(history: torch.Tensor) -> torch.Tensor:
        return history.sum(dim=0)

    amax_history = torch.tensor([3.5, 3.5, 7.0])
    scale = torch.tensor(1.0)
    delayed_scaling_update(amax_history, scale, E4M3_MAX, algo=sum_of_history)
    assert scale.item() == 32.0  # 448 / (3.5 + 3.5 + 7)
    assert amax_history.tolist() == [0.0, 7.0, 3.5]


@pytest.mark.parametrize(
    "history_shape, scale_shape",
    [((4,), (2,)), ((4, 3), ()), ((4, 3), (2,)), ((), ())],
)
def test_delayed_update_rejects_mismatched_shapes(history_shape, scale_shape):
    with pytest.raises(ValueError, match=r"amax_history of shape .* does not match scale of shape"):
        delayed_scaling_update(torch.zeros(history_shape), torch.ones(scale_shape), E4M3_MAX)


def test_delayed_update_rejects_unknown_algo():
    with pytest.raises(ValueError, match=r"algo='mean' must be 'max', 'most_recent' or a callable"):
        delayed_scaling_update(torch.tensor([1.0, 0.0]), torch.tensor(1.0), E4M3_MAX, algo="mean")
