"""Argument checks shared by every layer: one wording for each kind of bad input.

Each check raises ``TypeError`` for a value of the wrong kind and ``ValueError`` for one
out of range, naming the argument, the value and what is accepted.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = [
    "ArgumentTypeError",
    "UnsupportedHardwareError",
    "check_bool",
    "check_int",
    "check_number",
    "check_choice",
    "check_callable",
    "check_type",
]


class ArgumentTypeError(TypeError, ValueError):
    """An argument of the wrong kind (a string where a number goes, say).

    A ``TypeError``, and also a ``ValueError``, so code that catches ``ValueError`` for
    every bad setting (as fp8train raised before it told the two apart) still catches it.
    """


class UnsupportedHardwareError(RuntimeError):
    """What was asked needs hardware this machine does not have (a CUDA device, FP8 tensor
    cores); the message says the way out (``device='cpu'``, ``backend='emulated'``)."""


def check_bool(name: str, value: Any) -> bool:
    """``value`` if it is ``True`` or ``False``.

    Raises:
        TypeError: anything else (``1``, ``"yes"``, ``None``).
    """
    if not isinstance(value, bool):
        raise ArgumentTypeError(f"{name}={value!r} must be True or False")
    return value


def check_int(name: str, value: Any, *, minimum: int | None = None, allow_none: bool = False) -> int | None:
    """``value`` if it is an int (not a bool) ``>= minimum``.

    Raises:
        TypeError: not an int (or ``None`` where not allowed).
        ValueError: below ``minimum``.
    """
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        kind = "an int" + (f" >= {minimum}" if minimum is not None else "") + (" or None" if allow_none else "")
        raise ArgumentTypeError(f"{name}={value!r} must be {kind}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name}={value!r} must be an int >= {minimum}" + (" or None" if allow_none else ""))
    return value


def check_number(
    name: str,
    value: Any,
    *,
    minimum: float | None = None,
    exclusive: bool = False,
    maximum: float | None = None,
    kind: str = "a finite number",
) -> float:
    """``value`` if it is a finite real number (not a bool) in range.

    Args:
        minimum: lower bound (inclusive, or exclusive with ``exclusive=True``).
        maximum: upper bound (inclusive).
        kind: the accepted kind in words, for the message.

    Raises:
        TypeError: not an int or float.
        ValueError: NaN, infinite, or out of range.
    """
    low = "" if minimum is None else f" {'>' if exclusive else '>='} {minimum}"
    high = "" if maximum is None else f" and <= {maximum}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ArgumentTypeError(f"{name}={value!r} must be {kind}{low}{high}")
    if (
        not math.isfinite(value)
        or (minimum is not None and (value <= minimum if exclusive else value < minimum))
        or (maximum is not None and value > maximum)
    ):
        raise ValueError(f"{name}={value!r} must be {kind}{low}{high}")
    return value


def check_choice(name: str, value: Any, choices: tuple) -> Any:
    """``value`` if it is one of ``choices``.

    Raises:
        ValueError: anything else; the message lists the choices.
    """
    try:
        known = value in choices
    except TypeError:  # unhashable or uncomparable
        known = False
    if not known or isinstance(value, bool):
        raise ValueError(f"{name}={value!r} must be one of {', '.join(map(str, choices))}")
    return value


def check_callable(name: str, value: Any, *, allow_none: bool = False, signature: str = "") -> Any:
    """``value`` if it is callable (or ``None`` where allowed).

    Raises:
        TypeError: not callable.
    """
    if (value is None and allow_none) or callable(value):
        return value
    raise ArgumentTypeError(f"{name}={value!r} must be a callable{' ' + signature if signature else ''}")


def check_type(name: str, value: Any, expected: type | tuple[type, ...], what: str) -> Any:
    """``value`` if it is an instance of ``expected``.

    Args:
        what: the accepted kind in words, e.g. ``"an nn.Module"``.

    Raises:
        TypeError: anything else, naming its type.
    """
    if not isinstance(value, expected):
        raise ArgumentTypeError(f"{name} must be {what}, got {type(value).__name__} {_short(value)}")
    return value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
