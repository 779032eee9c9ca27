"""What :func:`fp8train.inspect` returns: the records of every recipe on every GEMM, and
the summaries the report shows (the worst GEMM per layer, the best recipes, the flags)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .gemm_capture import RESULT, NumericsRecord
from ..spec.checks import check_number

__all__ = ["TIE_DB", "Thresholds", "Inspection"]


@dataclass(frozen=True, kw_only=True)
class Thresholds:
    """Where a record is flagged.

    Attributes:
        min_sqnr_db: an FP8 operand or GEMM result whose SQNR is below this (20 dB: the
            quantization noise is 10% of the signal's RMS; a well-scaled E4M3 operand
            gives ~31 dB, E5M2 ~25 dB).
        max_underflow_pct: more than this % of an FP8 operand's non-zero values flush to zero.
        max_saturation_pct: more than this % of an operand's values are clipped at the max.
        fp4_min_sqnr_db: ``min_sqnr_db`` for 4-bit (E2M1) operands and their GEMMs (12 dB:
            E2M1 keeps one mantissa bit, so a well-scaled operand gives ~17-21 dB and a GEMM
            of two ~14-17 dB; below 12 the layer does notably worse than 4 bits do).
        fp4_max_underflow_pct: ``max_underflow_pct`` for 4-bit operands (25%: a 16- or
            32-value block flushes what lies under 1/24 of its amax, ~5-15% of a
            Gaussian's values; past 25% the block's outliers crush the rest).
    Any non-finite value is flagged too.
    """

    min_sqnr_db: float = 20.0
    max_underflow_pct: float = 1.0
    max_saturation_pct: float = 0.1
    fp4_min_sqnr_db: float = 12.0
    fp4_max_underflow_pct: float = 25.0

    def __post_init__(self) -> None:
        check_number("min_sqnr_db", self.min_sqnr_db)
        check_number("fp4_min_sqnr_db", self.fp4_min_sqnr_db)
        for name in ("max_underflow_pct", "max_saturation_pct", "fp4_max_underflow_pct"):
            check_number(name, getattr(self, name), minimum=0)

    def limits(self, data_bits: int) -> tuple[float, float]:
        """``(min SQNR dB, max underflow %)`` for operands of ``data_bits`` (8 or 4)."""
        if data_bits == 4:
            return self.fp4_min_sqnr_db, self.fp4_max_underflow_pct
        return self.min_sqnr_db, self.max_underflow_pct

    def flags(self, record: NumericsRecord) -> tuple[str, ...]:
        """The names of the thresholds ``record`` falls past: ``"sqnr"``, ``"underflow"``,
        ``"saturation"``, ``"nonfinite"`` (the 4-bit limits for a 4-bit record)."""
        min_sqnr_db, max_underflow_pct = self.limits(record.data_bits)
        flags = []
        if record.sqnr_db < min_sqnr_db or math.isnan(record.sqnr_db):
            flags.append("sqnr")
        if record.underflow_pct is not None and record.underflow_pct > max_underflow_pct:
            flags.append("underflow")
        if record.saturation_pct is not None and record.saturation_pct > self.max_saturation_pct:
            flags.append("saturation")
        if record.nonfinite:
            flags.append("nonfinite")
        return tuple(flags)

    def describe(self) -> str:
        return (
            f"SQNR below {self.min_sqnr_db:g} dB (4-bit: {self.fp4_min_sqnr_db:g} dB), underflow above "
            f"{self.max_underflow_pct:g}% (4-bit: {self.fp4_max_underflow_pct:g}%), "
            f"saturation above {self.max_saturation_pct:g}%, or any NaN/inf"
        )


TIE_DB = 0.1
"""Recipes whose worst-GEMM SQNR on a layer lie within this many dB of each other tie."""


class Inspection(list):
    """What :func:`inspect` returns: the list of :class:`~fp8train.diagnostics.gemm_capture.NumericsRecord`
    (one per layer call, recipe, GEMM and operand or result), with:

    Attributes:
        recipes: the recipe names, in the order given.
        layers: ``(layer, call)`` pairs in the order they ran.
        skipped: recipe -> ``{layer: reason}`` of layers the recipe would not convert.
        module_recipes: for each recipe map among the recipes (its one-line form),
            ``{layer: the recipe it gives the layer}`` (``"bf16"``: high precision).
        unseen: ``{module: reason}`` of matmul modules whose GEMMs the capture cannot see
            in high precision (an ``nn.MultiheadAttention``, fused experts): not measured.
        thresholds: the :class:`Thresholds` used for the records' flags.
        backward: whether a backward ran (``False``: the loss needed no gradient, so only
            the output GEMMs have records).
    """

    def __init__(self, records, *, recipes, layers, skipped, thresholds, backward, unseen=None, module_recipes=None) -> None:
        super().__init__(records)
        self.recipes, self.layers, self.skipped = recipes, layers, skipped
        self.module_recipes = dict(module_recipes or {})
        self.unseen = dict(unseen or {})
        self.thresholds, self.backward = thresholds, backward
        self._by_call: dict[tuple, list[NumericsRecord]] = {}
        for record in self:
            self._by_call.setdefault((record.layer, record.call, record.recipe), []).append(record)

    def flagged(self) -> list[NumericsRecord]:
        """The records with at least one flag."""
        return [record for record in self if record.flags]

    def worst_gemm_sqnr(self, layer: str, call: int, recipe: str) -> float | None:
        """The lowest result SQNR over the layer's FP8 GEMMs under ``recipe`` (``None``:
        the recipe does not convert the layer)."""
        values = [r.sqnr_db for r in self._by_call.get((layer, call, recipe), ()) if r.operand == RESULT]
        return min(values) if values else None

    def worst_underflow(self, layer: str, call: int, recipe: str) -> float | None:
        """The largest underflow % over the layer's operands under ``recipe``."""
        values = [r.underflow_pct for r in self._by_call.get((layer, call, recipe), ()) if r.underflow_pct is not None]
        return max(values) if values else None

    def best_recipes(self, layer: str, call: int = 0) -> list[str]:
        """The recipes whose worst FP8 GEMM on this layer has the highest SQNR, or lies
        within :data:`TIE_DB` of it (a difference that small is noise), in recipe order."""
        scored = [(self.worst_gemm_sqnr(layer, call, name), name) for name in self.recipes]
        scored = [(score, name) for score, name in scored if score is not None and not math.isnan(score)]
        if not scored:
            return []
        best = max(score for score, _ in scored)
        return [name for score, name in scored if score >= best - TIE_DB]

