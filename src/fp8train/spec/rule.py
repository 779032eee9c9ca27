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
from .formats import DATA_FORMATS, E2M1, E4M3, FloatFormat
from .granularities import Granularity, normalize_axis, view_2d_shape
from .hash_once import hash_once, state_without_hash

__all__ = ["MX_SCALE_RULES", "QuantRule", "build_quantize_rule"]

MX_SCALE_RULES = ("ceil", "ocp")
"""E8M0 exponent rules: ``"ceil"`` (never saturates: ``e = ceil(log2(amax/fp8_max))``) or
``"ocp"`` (the OCP MX spec's ``floor(log2(amax)) - emax``, which may saturate)."""


@dataclass(frozen=True, kw_only=True)
class QuantRule:
    """How one operand slot is quantized. Frozen, validated once, hashable (fast paths
    cache what they derive from it per rule).

    Attributes:
        granularity: the scaling groups (a :class:`Granularity` or its name).
        format: the data format: :data:`~fp8train.spec.formats.E4M3` or ``E5M2`` for the
            FP8 granularities, ``E2M1`` for the 4-bit ones (``nvfp4``, ``nvfp4_2d``,
            ``mxfp4``). ``None`` (the default) takes E4M3, or E2M1 for a 4-bit granularity.
        power_2_scales: round every scale down to a power of two. ``None`` (the default)
            takes the granularity's default (off for ``tensor`` and NVFP4, on for the
            others); always on for E8M0 scales (``mx``, ``mxfp4``), where ``False`` is an
            error; never for NVFP4's E4M3 scales, where ``True`` is an error.
        amax_epsilon: lower bound applied to each group's amax (>= 0; 0 for 4-bit).
        mx_scale_rule: the E8M0 exponent rule, one of :data:`MX_SCALE_RULES` (``mx``, ``mxfp4``).
        rht: apply the random Hadamard transform along the scaling axis before quantizing
            (NUMERICS.md 6; ``nvfp4`` only: Transformer Engine applies it only in its NVFP4
            recipe, to 1x16 operands).
        stochastic_rounding: round the E2M1 cast stochastically (4-bit granularities only).

    Raises:
        ValueError: an unknown granularity or ``mx_scale_rule``; a format that is not a
            data format (E8M0 is a scale format), or that does not match the granularity's
            data (E2M1 with an FP8 granularity or the reverse); ``power_2_scales=False``
            with E8M0 scales or ``True`` with NVFP4; a negative or non-finite
            ``amax_epsilon``, or a non-zero one for 4-bit; ``rht`` or
            ``stochastic_rounding`` where they do not apply.
        TypeError: ``format`` not a :class:`FloatFormat`; ``power_2_scales``, ``rht`` or
            ``stochastic_rounding`` not a bool; ``amax_epsilon`` not a number.
    """

    granularity: Granularity
    format: FloatFormat = None  # type: ignore[assignment]  # resolved in __post_init__
    power_2_scales: bool | None = None
    amax_epsilon: float = 0.0
    mx_scale_rule: str = "ceil"
    rht: bool = False
    stochastic_rounding: bool = False

    __hash__ = hash_once  # kernels cache per rule and format: hashed once
    __getstate__ = state_without_hash

    def __post_init__(self) -> None:
        granularity = Granularity.coerce(self.granularity)
        object.__setattr__(self, "granularity", granularity)
        if self.format is None:
            object.__setattr__(self, "format", E2M1 if granularity.fp4 else E4M3)
        check_type("format", self.format, FloatFormat, "a FloatFormat (E4M3, E5M2 or E2M1)")
        if self.format not in DATA_FORMATS:
            raise ValueError(
                f"format={self.format.name} is not a data format; use one of "
                f"{', '.join(f.name for f in DATA_FORMATS)} ({self.format.name} is a scale format)"
            )
        self._check_data_bits(granularity)
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
        self._check_fp4_options(granularity)

    def _check_data_bits(self, granularity: Granularity) -> None:
        """E2M1 data goes with the 4-bit granularities, and only with them."""
        if granularity.fp4 and self.format is not E2M1:
            raise ValueError(
                f"granularity {str(granularity)!r} takes 4-bit E2M1 data, not format={self.format.name}; "
                "use format=E2M1 (dtype=torch.float4_e2m1fn_x2)"
            )
        if not granularity.fp4 and self.format is E2M1:
            raise ValueError(
                f"format=E2M1 needs a 4-bit granularity ('nvfp4', 'nvfp4_2d' or 'mxfp4'), not "
                f"{str(granularity)!r}; use E4M3 or E5M2 with {str(granularity)!r}"
            )

    def _check_fp4_options(self, granularity: Granularity) -> None:
        """The options that exist only for 4-bit data, and the FP8 options they exclude."""
        check_bool("rht", self.rht)
        check_bool("stochastic_rounding", self.stochastic_rounding)
        if not granularity.fp4:
            for option in ("rht", "stochastic_rounding"):
                if getattr(self, option):
                    raise ValueError(
                        f"{option}=True is a 4-bit option; {str(granularity)!r} takes FP8 data. Use "
                        f"'nvfp4', 'nvfp4_2d' or 'mxfp4', or {option}=False"
                    )
            return
        if granularity.two_level_scales and self.power_2_scales:
            raise ValueError(
                f"power_2_scales=True is not possible for {str(granularity)!r}: its block scales are E4M3 "
                "under a global scale; leave power_2_scales unset"
            )
        if self.amax_epsilon != 0:
            raise ValueError(f"amax_epsilon={self.amax_epsilon!r} is not an option of {str(granularity)!r}; leave it 0")
        if self.rht and (granularity.symmetric or not granularity.two_level_scales):
            raise ValueError(
                f"rht=True is not possible for {str(granularity)!r}: the transform runs along the scaling "
                "axis of 1x16 NVFP4 groups (Transformer Engine applies it only there); use 'nvfp4' or rht=False"
            )

    @property
    def fp8_max(self) -> float:
        """Largest finite value of :attr:`format`: the amax a scale maps to."""
        return self.format.max

    @property
    def axis_free(self) -> bool:
        """Whether a quantization by this rule has no axis: one scale (``tensor``), or 4-bit
        16x16 tiles (``nvfp4_2d``), whose codes pack along the last dim; it runs as
        ``axis=-1`` whatever axis is asked (:meth:`check_input`)."""
        granularity = self.granularity
        return granularity.per_tensor or (granularity.fp4 and granularity.symmetric)

    def check_input(self, shape: tuple[int, ...], axis: int, *, scale_given: bool, noun: str) -> int:
        """The shape rules of quantizing an input of ``shape`` along ``axis`` with this
        rule, for both frontends; returns the normalized axis (-1 or 0; -1 for a
        per-tensor rule, where the axis means nothing, and for ``nvfp4_2d``, whose tiles
        do not care and whose codes pack along the last dim).

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
        rank = len(shape)
        axis = -1 if self.axis_free else normalize_axis(axis, rank)
        if rank < granularity.min_rank:
            article = "an" if noun[:1] in "aeiou" else "a"
            raise ValueError(
                f"granularity {str(granularity)!r} needs {article} {noun} of rank >= {granularity.min_rank}, "
                f"got shape {tuple(shape)}"
            )
        block = granularity.block
        if block:
            m, k = view_2d_shape(shape)
            if k % block or m % block:
                raise ValueError(
                    f"granularity {str(granularity)!r} needs the last dim and the product of the other dims to "
                    f"be divisible by {block}; shape {tuple(shape)} gives {m} x {k}. Pad the {noun}, or skip FP8 "
                    "for this layer"
                )
        if scale_given and not granularity.per_tensor:
            raise ValueError(
                f"a precomputed scale is only supported for granularity 'tensor', not {str(granularity)!r}"
            )
        return axis


def build_quantize_rule(
    granularity: Granularity | str,
    data_format: FloatFormat | None,
    *,
    power_2_scales: bool | None,
    amax_epsilon: float,
    mx_scale_rule: str,
    rht: bool,
    stochastic_rounding: bool,
) -> QuantRule:
    """The rule of a public ``quantize(x, granularity, dtype=..., ...)`` call: the one
    builder ``fp8train.quant.quantize`` (:mod:`fp8train.quant.public`) and
    ``fp8train.jax.quantize`` (:mod:`fp8train.jax.public`) share, so the two frontends
    read their common keywords one way and give the same errors.

    Args:
        granularity: the call's ``granularity`` (a :class:`Granularity` or its name).
        data_format: the format of the call's ``dtype``, which each frontend resolves from
            its own dtypes; ``None``: the granularity's default (E4M3, or E2M1 for 4-bit).
        power_2_scales, amax_epsilon, mx_scale_rule, rht, stochastic_rounding: the call's
            keywords, as :class:`QuantRule`'s fields.

    Raises:
        ValueError, TypeError: as :class:`QuantRule` (the message names the keyword).
    """
    return QuantRule(
        granularity=granularity,
        format=data_format,
        power_2_scales=power_2_scales,
        amax_epsilon=amax_epsilon,
        mx_scale_rule=mx_scale_rule,
        rht=rht,
        stochastic_rounding=stochastic_rounding,
    )
