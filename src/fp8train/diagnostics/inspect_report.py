"""The report of :func:`fp8train.inspect`: ``report.md`` (summary tables, the flagged
records, every GEMM), ``records.json`` and ``heatmap.png`` (layers x recipes)."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path

from .gemm_capture import NumericsRecord
from .inspection import TIE_DB, Inspection
from .markdown import markdown_table

__all__ = ["format_report", "summary_text", "write_report", "plot_heatmap"]


def _row_name(layer: str, call: int) -> str:
    return layer if call == 0 else f"{layer} (call {call + 1})"


def _fmt(value: float | None, digits: int = 1) -> str:
    if value is None:
        return "n/a"
    if math.isinf(value):
        return "exact" if value > 0 else "-inf"
    return f"{value:.{digits}f}"


def _best_text(inspection: Inspection, layer: str, call: int) -> str:
    best = inspection.best_recipes(layer, call)
    if not best:
        return "-"
    return ", ".join(best) if len(best) < len(inspection.recipes) or len(best) == 1 else "all (within 0.1 dB)"


def format_report(inspection: Inspection) -> str:
    """The Markdown report: summary tables, the flagged records, and every GEMM."""
    lines = [
        "# fp8train inspect",
        "",
        "Every recipe's quantization of the same operands, from one forward and backward in high precision. "
        "SQNR is in dB (higher is better; `exact`: no error). "
        f"Flagged: {inspection.thresholds.describe()}.",
    ]
    if not inspection.backward:
        lines += ["", "The loss needed no gradient, so only the output GEMMs were measured."]
    lines += [
        "",
        "## Worst GEMM per layer (SQNR of the FP8 GEMM result, dB) and the best recipe",
        "",
        f"Best: the highest worst-GEMM SQNR, with every recipe within {TIE_DB} dB of it.",
        "",
        _worst_gemm_table(inspection),
        "",
        "## Largest underflow per layer (% of non-zero values that quantize to zero, worst operand)",
        "",
        _underflow_table(inspection),
        *_flagged_section(inspection),
        *_not_measured_section(inspection),
        "",
        "## Every FP8 GEMM",
        "",
        _every_gemm_table(inspection),
        "",
        "![SQNR and underflow per layer and recipe](heatmap.png)",
        "",
    ]
    return "\n".join(lines)


def _worst_gemm_table(inspection: Inspection) -> str:
    names = inspection.recipes
    rows = [
        (_row_name(layer, call), *(_fmt(inspection.worst_gemm_sqnr(layer, call, name)) for name in names),
         _best_text(inspection, layer, call))
        for layer, call in inspection.layers
    ]
    return markdown_table(("layer", *names, "best"), rows, align="l" + "r" * len(names) + "l")


def _underflow_table(inspection: Inspection) -> str:
    names = inspection.recipes
    rows = [
        (_row_name(layer, call), *(_fmt(inspection.worst_underflow(layer, call, name), 2) for name in names))
        for layer, call in inspection.layers
    ]
    return markdown_table(("layer", *names), rows, align="l" + "r" * len(names))


def _flagged_section(inspection: Inspection) -> list[str]:
    flagged = inspection.flagged()
    lines = ["", f"## Flagged ({len(flagged)})", ""]
    if not flagged:
        return lines + ["Nothing crosses a threshold."]
    headers = ("layer", "recipe", "GEMM", "operand", "flags", "SQNR", "underflow %", "saturation %", "amax", "NaN/inf")
    rows = [
        (_row_name(r.layer, r.call), r.recipe, r.gemm, r.operand, ", ".join(r.flags), _fmt(r.sqnr_db),
         _fmt(r.underflow_pct, 2), _fmt(r.saturation_pct, 2), f"{r.amax:.3g}", r.nonfinite)
        for r in flagged
    ]
    return lines + [markdown_table(headers, rows, align="lllllrrrrr")]


def _not_measured_section(inspection: Inspection) -> list[str]:
    """Each recipe map's recipe per module, the layers a recipe does not convert, and the
    modules the capture does not see."""
    lines = []
    for name, by_layer in inspection.module_recipes.items():
        lines += ["", f"## Recipe per module under {name}", ""]
        lines += [f"- {layer}: {recipe}" for layer, recipe in by_layer.items()]
    skipped = [(name, layer, reason) for name in inspection.recipes for layer, reason in inspection.skipped[name].items()]
    if skipped:
        lines += ["", "## Not converted (n/a above)", ""]
        lines += [f"- {layer} under {name}: {reason}" for name, layer, reason in skipped]
    if inspection.unseen:
        lines += ["", "## Not measured", ""]
        lines += [f"- {layer}: {reason}" for layer, reason in inspection.unseen.items()]
    return lines


def _every_gemm_table(inspection: Inspection) -> str:
    """One row per layer call, recipe and GEMM: its two operands and its result."""
    by_gemm: dict[tuple, list[NumericsRecord]] = {}
    for r in inspection:
        by_gemm.setdefault((r.layer, r.call, r.recipe, r.gemm), []).append(r)
    rows = [
        (_row_name(layer, call), recipe, gemm, f"{a.operand} {_fmt(a.sqnr_db)}, {b.operand} {_fmt(b.sqnr_db)}",
         _fmt(result.sqnr_db), f"{_fmt(a.underflow_pct, 2)}, {_fmt(b.underflow_pct, 2)}",
         f"{_fmt(a.saturation_pct, 2)}, {_fmt(b.saturation_pct, 2)}")
        for (layer, call, recipe, gemm), (a, b, result) in by_gemm.items()
    ]
    headers = ("layer", "recipe", "GEMM", "operand SQNR (a, b)", "result SQNR", "underflow % (a, b)",
               "saturation % (a, b)")
    return markdown_table(headers, rows, align="llllrll")


def summary_text(inspection: Inspection) -> str:
    """The report without its table of every GEMM: what the command line prints."""
    report = format_report(inspection)
    return report.split("\n## Every FP8 GEMM", 1)[0].rstrip() + "\n"


def write_report(inspection: Inspection, report_dir: str | Path) -> Path:
    """Write ``report.md``, ``records.json`` and ``heatmap.png`` to ``report_dir``
    (created if missing). Returns the directory."""
    directory = Path(report_dir)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "report.md").write_text(format_report(inspection))
    summary = {
        "thresholds": asdict(inspection.thresholds),
        "recipes": inspection.recipes,
        "layers": [{"layer": layer, "call": call} for layer, call in inspection.layers],
        "best_recipes": {_row_name(layer, call): inspection.best_recipes(layer, call) for layer, call in inspection.layers},
        "skipped": inspection.skipped,
        "module_recipes": inspection.module_recipes,
        "unseen": inspection.unseen,
        "records": [asdict(record) for record in inspection],
    }
    (directory / "records.json").write_text(json.dumps(summary, indent=1))
    plot_heatmap(inspection, directory / "heatmap.png")
    return directory


def plot_heatmap(inspection: Inspection, path: Path) -> None:
    """Layers x recipes: the worst GEMM's SQNR (left) and the largest underflow (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    rows = inspection.layers
    names = inspection.recipes
    # Underflow's colours start at 0 and reach full strength at twice the threshold or the
    # worst value, so that 0.01% does not look like a problem.
    underflow_top = 2 * inspection.thresholds.max_underflow_pct
    panels = [
        ("worst GEMM SQNR (dB), higher is better", inspection.worst_gemm_sqnr, "viridis", 1, None),
        ("largest underflow (% of non-zero values)", inspection.worst_underflow, "magma_r", 2, (0.0, underflow_top)),
    ]
    height = 1.6 + 0.42 * len(rows)
    figure, axes = plt.subplots(1, 2, figsize=(4 + 2.1 * len(names), height), squeeze=False)
    for ax, (title, measure, cmap, digits, limits) in zip(axes[0], panels):
        values = np.array(
            [[np.nan if (v := measure(layer, call, name)) is None else v for name in names] for layer, call in rows],
            dtype=float,
        )
        shown = np.where(np.isinf(values), np.nan, values)
        finite = shown[np.isfinite(shown)]
        low, high = (finite.min(), finite.max()) if finite.size else (0.0, 1.0)
        if limits is not None:
            low, high = limits[0], max(limits[1], high)
        colormap = plt.get_cmap(cmap).with_extremes(bad="lightgrey")
        image = ax.imshow(np.ma.masked_invalid(shown), cmap=colormap, vmin=low, vmax=high if high > low else low + 1, aspect="auto")
        figure.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
        ax.set_yticks(range(len(rows)), [_row_name(layer, call) for layer, call in rows])
        ax.set_title(title, fontsize=10)
        for i in range(len(rows)):
            for j in range(len(names)):
                value = values[i, j]
                text = "n/a" if np.isnan(value) else ("exact" if np.isinf(value) else f"{value:.{digits}f}")
                ax.text(j, i, text, ha="center", va="center", fontsize=8, color=_text_color(shown[i, j], low, high, cmap))
    figure.suptitle("fp8train inspect: every recipe on the same operands (grey: layer not converted)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _text_color(value: float, low: float, high: float, cmap: str) -> str:
    """Black on light cells, white on dark ones."""
    if not math.isfinite(value) or high <= low:
        return "black"
    t = (value - low) / (high - low)
    dark = t < 0.45 if cmap == "viridis" else t > 0.55
    return "white" if dark else "black"
