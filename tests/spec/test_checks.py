"""The shared argument checks: what each accepts, and the error and wording of the rest."""

import math

import pytest

from fp8train.spec.checks import (
    ArgumentTypeError,
    check_bool,
    check_callable,
    check_choice,
    check_int,
    check_number,
    check_type,
)
from fp8train.spec.formats import FloatFormat


def test_argument_type_error_is_both_a_type_and_a_value_error():
    assert issubclass(ArgumentTypeError, TypeError) and issubclass(ArgumentTypeError, ValueError)


@pytest.mark.parametrize("value", [True, False])
def test_check_bool_accepts_bools(value):
    assert check_bool("flag", value) is value


@pytest.mark.parametrize("value", [0, 1, "True", None, 1.0])
def test_check_bool_rejects_the_rest(value):
    with pytest.raises(TypeError, match=rf"flag={value!r} must be True or False"):
        check_bool("flag", value)


def test_check_int():
    assert check_int("n", 3, minimum=1) == 3
    assert check_int("n", None, allow_none=True) is None
    with pytest.raises(TypeError, match=r"n=True must be an int >= 1"):
        check_int("n", True, minimum=1)
    with pytest.raises(TypeError, match=r"n=2.0 must be an int"):
        check_int("n", 2.0)
    with pytest.raises(TypeError, match=r"n=None must be an int >= 0"):
        check_int("n", None, minimum=0)
    with pytest.raises(ValueError, match=r"n=0 must be an int >= 1 or None"):
        check_int("n", 0, minimum=1, allow_none=True)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_check_number_rejects_non_finite(value):
    with pytest.raises(ValueError, match=rf"x={value!r} must be a finite number"):
        check_number("x", value)


def test_check_number_bounds_and_kinds():
    assert check_number("x", 0, minimum=0) == 0
    assert check_number("x", 1.5, minimum=0, exclusive=True, maximum=2) == 1.5
    with pytest.raises(ValueError, match=r"x=0 must be a finite number > 0"):
        check_number("x", 0, minimum=0, exclusive=True)
    with pytest.raises(ValueError, match=r"x=3 must be a finite number >= 0 and <= 2"):
        check_number("x", 3, minimum=0, maximum=2)
    with pytest.raises(TypeError, match=r"x='1' must be a float >= 0"):
        check_number("x", "1", minimum=0, kind="a float")
    with pytest.raises(TypeError, match=r"x=False must be a finite number"):
        check_number("x", False)


def test_check_choice():
    assert check_choice("mode", "a", ("a", "b")) == "a"
    for bad in ("c", None, ["a"], True):
        with pytest.raises(ValueError, match=r"mode=.* must be one of a, b"):
            check_choice("mode", bad, ("a", "b"))


def test_check_callable_and_type():
    assert check_callable("fn", len) is len
    assert check_callable("fn", None, allow_none=True) is None
    with pytest.raises(TypeError, match=r"fn=3 must be a callable \(x\) -> y"):
        check_callable("fn", 3, signature="(x) -> y")
    assert check_type("x", 3, int, "an int") == 3
    with pytest.raises(TypeError, match=r"model must be an nn.Module, got str 'gpt2'"):
        check_type("model", "gpt2", FloatFormat, "an nn.Module")
    long_value = "x" * 100
    with pytest.raises(TypeError, match=r"got str 'x{56}\.\.\.$"):
        check_type("model", long_value, int, "an nn.Module")


def test_float_format_facts_are_checked():
    facts = dict(name="E3M4", exponent_bits=3, mantissa_bits=4, bias=3, has_infinities=False, has_sign=True,
                 has_subnormals=True, nan_uses_top_mantissa_only=True, dtype_name="float8_e3m4")
    assert FloatFormat(**facts).max == 2.0 ** (7 - 3) * (2 - 2.0**-3)
    with pytest.raises(ValueError, match=r"exponent_bits=0 must be an int >= 1"):
        FloatFormat(**{**facts, "exponent_bits": 0})
    with pytest.raises(TypeError, match=r"has_sign=1 must be True or False"):
        FloatFormat(**{**facts, "has_sign": 1})
    with pytest.raises(TypeError, match=r"has_nan='no' must be True or False"):
        FloatFormat(**{**facts, "has_nan": "no"})
