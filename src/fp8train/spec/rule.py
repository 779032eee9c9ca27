"""Quantization rules: how one operand slot is quantized, as one frozen value.

A :class:`QuantRule` is everything that decides a slot's FP8 codes and scales except the
tensor itself and the axis its groups run along: the scaling groups (granularity), the FP8
data format, how a group's amax becomes its scale (power-of-two rounding, the amax floor,
the E8M0 exponent rule). A recipe's :class:`~fp8train.spec.plan.OperandPlan` holds one per
slot; both frontends' ``quantize(x, rule, axis=..., scale=...)`` take it whole, and so do
the CPU kernels. A new option (a 4-bit format's Hadamard transform, stochastic rounding, a
second-level scale) is a new field here, validated here, with no signature change below.
"""

from __future__ import annotations

from dataclasses import dataclass

from .checks import check_bool, check_number, check_type
from .formats import DATA_FORMATS, E4M3, FloatFormat
from .granularities import Granularity, normalize_axis, view_2d_shape

__all__ = ["MX_SCALE_RULES", "QuantRule"]

MX_SCALE_RULES = ("ceil", "ocp")
"""E8M0 exponent rules: ``"ceil"`` (never saturates: ``e = ceil(log2(amax/fp8_max))``) or
``"ocp"`` (the OCP MX spec's ``floor(log2(amax)) - emax``, which may saturate)."""


@dataclass(frozen=True, kw_only=True)
class QuantRule:
    """How one operand slot is quantized. Frozen, validated once, hashable (fast paths
    cache what they derive from it per rule).

    Attributes:
        granularity: the scaling groups (a :class:`Granularity` or its name).
        format: the FP8 data format (:data:`~fp8train.spec.formats.E4M3` or ``E5M2``).
        power_2_scales: round every scale down to a power of two. ``None`` (the default)
            takes the granularity's default (off for ``tensor``, on for the others);
            always on for E8M0 scales (``mx``), where ``False`` is an error.
        amax_epsilon: lower bound applied to each group's amax (>= 0).
        mx_scale_rule: the E8M0 exponent rule, one of :data:`MX_SCALE_RULES` (``mx`` only).

    Raises:
        ValueError: an unknown granularity or ``mx_scale_rule``; a format that is not an
            FP8 data format (E8M0 is a scale format); ``power_2_scales=False`` with E8M0
            scales; a negative or non-finite ``amax_epsilon``.
        TypeError: ``format`` not a :class:`FloatFormat`, ``power_2_scales`` not a bool,
            ``amax_epsilon`` not a number.
    """

    granularity: Granularity
    format: FloatFormat = E4M3
    power_2_scales: bool | None = None
    amax_epsilon: float = 0.0
    mx_scale_rule: str = "ceil"

    def __post_init__(self) -> None:
        granularity = Granularity.coerce(self.granularity)
        object.__setattr__(self, "granularity", granularity)
        check_type("format", self.format, FloatFormat, "a FloatFormat (E4M3 or E5M2)")
        if self.format not in DATA_FORMATS:
            raise ValueError(
                f"format={self.format.name} is not an FP8 data format; use one of "
                f"{', '.join(f.name for f in DATA_FORMATS)} ({self.format.name} is a scale format)"
            )
        if self.power_2_scales is None:
            object.__setattr__(self, "power_2_scales", granularity.default_power_2_scales)
        check_bool("power_2_scales", self.power_2_scales)
        if granularity.always_power_2 and not self.power_2_scales:
            raise ValueError(
                f"power_2_scales=False is not possible for {str(granularity)!r}: E8M0 scales are powers of two"
            )
        check_number("amax_epsilon", self.amax_epsilon, minimum=0)
        if not isinstance(self.mx_scale_rule, str) or self.mx_scale_rule not in MX_SCALE_RULES:
            raise ValueError(f"mx_scale_rule={self.mx_scale_rule!r} must be 'ceil' or 'ocp'")

    @property
    def fp8_max(self) -> float:
        """Largest finite value of :attr:`format`: the amax a scale maps to."""
        return self.format.max

    def check_input(self, shape: tuple[int, ...], axis: int, *, scale_given: bool, noun: str) -> int:
        """The shape rules of quantizing an input of ``shape`` along ``axis`` with this
        rule, for both frontends; returns the normalized axis (-1 or 0; -1 for a
        per-tensor rule, where the axis means nothing).

        Args:
            shape: the input's shape.
            axis: the requested axis.
            scale_given: a precomputed scale was passed (per-tensor rules only).
            noun: the input's kind in messages (``"tensor"``, ``"array"``).

        Raises:
            ValueError: an unsupported axis; a rank below the granularity's; dims the
                blocks do not tile; a precomputed scale with a granularity that is not
                per-tensor.
            TypeError: ``axis`` not an int.
        """
        granularity = self.granularity
        article = "an" if noun[:1] in "aeiou" else "a"
        axis = -1 if granularity.per_tensor else normalize_axis(axis, len(shape))
        shape = tuple(shape)
        if len(shape) < granularity.min_rank:
            raise ValueError(
                f"granularity {str(granularity)!r} needs {article} {noun} of rank >= {granularity.min_rank}, got shape {shape}"
            )
        block = granularity.block
        m, k = view_2d_shape(shape)
        if block and (k % block or m % block):
            raise ValueError(
                f"granularity {str(granularity)!r} needs the last dim and the product of the other dims to "
                f"be divisible by {block}; shape {shape} gives {m} x {k}. Pad the {noun}, or skip FP8 "
                "for this layer"
            )
        if scale_given and not granularity.per_tensor:
            raise ValueError(
                f"a precomputed scale is only supported for granularity 'tensor', not {str(granularity)!r}"
            )
        return axis
