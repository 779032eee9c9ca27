"""What a conversion to FP8 did: every matmul module, converted or not and why.

:func:`fp8train.convert_to_float8_training` builds a :class:`ConversionReport` and
:func:`fp8train.conversion_report` returns it; its :meth:`~ConversionReport.summary` is
the line the conversion logs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = [
    "ModuleConversion", "ConversionReport", "CONVERTED", "SKIPPED", "EXCLUDED", "ADAPTER", "HEAD", "MAX_LISTED",
]

CONVERTED, SKIPPED, EXCLUDED, ADAPTER, HEAD = "converted", "skipped", "excluded", "adapter", "head"
"""A module's status: in FP8; left in high precision because it cannot convert (its dims,
its type); left in high precision because ``module_filter_fn`` said so; left in high
precision because it is a PEFT adapter (:mod:`fp8train.nn.adapters`; ``convert_adapters=True``
converts adapters); left in high precision as the model's output head (``keep_head``,
:mod:`fp8train.nn.head`: the 4-bit recipes' default)."""
MAX_LISTED = 5
"""Skipped modules named in the summary line; the report lists them all."""

Status = Literal["converted", "skipped", "excluded", "adapter", "head"]


@dataclass(frozen=True)
class ModuleConversion:
    """One matmul module of the model.

    Attributes:
        fqn: its qualified name (``""``: the model itself).
        module_type: the class name of the high-precision module (``"Linear"``,
            ``"Conv1D"``, ``"MultiheadAttention"``, ...).
        status: ``"converted"``, ``"skipped"`` (cannot convert), ``"excluded"`` (by
            ``module_filter_fn``), ``"adapter"`` (a PEFT adapter, kept in high precision)
            or ``"head"`` (the output head, kept in high precision: ``keep_head``).
        reason: why it stays in high precision (``None`` where converted).
        num_params: the number of values in its parameters (weights and biases).
        recipe: the recipe it runs where converted by this conversion (its name, or a
            mixture's description), else ``None``.
    """

    fqn: str
    module_type: str
    status: Status
    reason: str | None
    num_params: int
    recipe: str | None = None

    @property
    def name(self) -> str:
        return self.fqn or "<root>"


@dataclass(frozen=True)
class ConversionReport:
    """Every module of a model that runs a matmul on its parameters, in ``named_modules``
    order, and what :func:`fp8train.convert_to_float8_training` did with it.

    Matmul modules are ``nn.Linear`` and its subclasses, transformers' ``Conv1D``,
    ``nn.MultiheadAttention`` (its projections), fused MoE experts, and their FP8
    versions; a converted module is counted once with its children (an attention's
    ``out_proj``). Matmuls a forward computes from other modules' parameters (tied
    weights used with ``F.linear``, ``torch.matmul`` in model code) and convolutions
    are not seen.

    Attributes:
        recipe: the recipe's name.
        modules: one :class:`ModuleConversion` per matmul module.
    """

    recipe: str
    modules: tuple[ModuleConversion, ...]

    @property
    def num_matmul_modules(self) -> int:
        return len(self.modules)

    @property
    def num_converted(self) -> int:
        return sum(m.status == CONVERTED for m in self.modules)

    @property
    def converted(self) -> tuple[ModuleConversion, ...]:
        return tuple(m for m in self.modules if m.status == CONVERTED)

    @property
    def skipped(self) -> tuple[ModuleConversion, ...]:
        """The modules that could not convert (not those ``module_filter_fn`` excluded)."""
        return tuple(m for m in self.modules if m.status == SKIPPED)

    @property
    def excluded(self) -> tuple[ModuleConversion, ...]:
        return tuple(m for m in self.modules if m.status == EXCLUDED)

    @property
    def heads(self) -> tuple[ModuleConversion, ...]:
        """The output head modules kept in high precision (``keep_head``)."""
        return tuple(m for m in self.modules if m.status == HEAD)

    @property
    def adapters(self) -> tuple[ModuleConversion, ...]:
        """The PEFT adapter modules kept in high precision."""
        return tuple(m for m in self.modules if m.status == ADAPTER)

    @property
    def fp8_param_share(self) -> float:
        """The share of the matmul modules' parameter values that are in converted modules,
        in [0, 1] (``nan`` without matmul parameters)."""
        total = sum(m.num_params for m in self.modules)
        return sum(m.num_params for m in self.converted) / total if total else float("nan")

    def summary(self) -> str:
        """One line, e.g. ``FP8 training (tensorwise): converted 8/9 matmul modules, 97.1%
        of matmul parameters in FP8; 1 skipped: lm_head (Linear: in_features=128,
        out_features=50 are not both multiples of 16)``."""
        if not self.modules:
            return (
                f"FP8 training ({self.recipe}): no matmul modules found (nn.Linear, transformers Conv1D, "
                "nn.MultiheadAttention, fused MoE experts): nothing runs in FP8"
            )
        line = (
            f"FP8 training ({self.recipe}): converted {self.num_converted}/{self.num_matmul_modules} matmul modules, "
            f"{100 * self.fp8_param_share:.1f}% of matmul parameters in FP8"
        )
        if self.skipped:
            listed = [f"{m.name} ({m.module_type}: {m.reason})" for m in self.skipped[:MAX_LISTED]]
            more = len(self.skipped) - MAX_LISTED
            line += f"; {len(self.skipped)} skipped: {', '.join(listed)}"
            line += f" and {more} more (fp8train.conversion_report(model) lists them)" if more > 0 else ""
        if self.excluded:
            names = [m.name for m in self.excluded[:MAX_LISTED]]
            more = len(self.excluded) - MAX_LISTED
            line += f"; {len(self.excluded)} excluded by module_filter_fn: {', '.join(names)}"
            line += f" and {more} more" if more > 0 else ""
        if self.heads:
            names = ", ".join(m.name for m in self.heads)
            line += f"; head kept in high precision: {names} ({self.heads[0].reason})"
        if self.adapters:
            line += (
                f"; {len(self.adapters)} PEFT adapter modules kept in high precision (they train; "
                "convert_adapters=True converts them)"
            )
        return line
