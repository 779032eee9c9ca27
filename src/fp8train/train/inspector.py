"""``fp8train.inspect``: what every recipe's quantization does to every GEMM of a model.

One forward and backward of the user's model run in high precision with the Linear
layers hooked (:mod:`fp8train.nn.numerics`); then, for each recipe, the captured operands
are quantized as that recipe would quantize them and each GEMM runs in FP8 beside a
float64 GEMM. Nothing in the model changes: gradients are taken with ``autograd.grad``
(no ``.grad`` is written), buffers (delayed-scaling state, batch-norm statistics) are
restored, and the RNG is forked.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterable

import torch
from torch import nn

from ..nn.autocast import autocast as fp8_autocast
from ..nn.convert import dims_skip_reason, linear_layers, matmul_modules
from ..nn.numerics import RESULT, NumericsRecord, capture_linear_calls, linear_call_statistics
from ..spec.checks import ArgumentTypeError, check_callable, check_number, check_type
from ..spec.recipes import RECIPE_NAMES, Recipe, resolve_recipe

__all__ = ["Thresholds", "Inspection", "inspect", "inspect_step", "write_report"]


@dataclass(frozen=True, kw_only=True)
class Thresholds:
    """Where a record is flagged.

    Attributes:
        min_sqnr_db: an operand or GEMM result whose SQNR is below this (20 dB: the
            quantization noise is 10% of the signal's RMS; a well-scaled E4M3 operand
            gives ~31 dB, E5M2 ~25 dB).
        max_underflow_pct: more than this % of an operand's non-zero values flush to zero.
        max_saturation_pct: more than this % of an operand's values are clipped at the max.
    Any non-finite value is flagged too.
    """

    min_sqnr_db: float = 20.0
    max_underflow_pct: float = 1.0
    max_saturation_pct: float = 0.1

    def __post_init__(self) -> None:
        check_number("min_sqnr_db", self.min_sqnr_db)
        check_number("max_underflow_pct", self.max_underflow_pct, minimum=0)
        check_number("max_saturation_pct", self.max_saturation_pct, minimum=0)

    def flags(self, record: NumericsRecord) -> tuple[str, ...]:
        """The names of the thresholds ``record`` falls past: ``"sqnr"``, ``"underflow"``,
        ``"saturation"``, ``"nonfinite"``."""
        flags = []
        if record.sqnr_db < self.min_sqnr_db or math.isnan(record.sqnr_db):
            flags.append("sqnr")
        if record.underflow_pct is not None and record.underflow_pct > self.max_underflow_pct:
            flags.append("underflow")
        if record.saturation_pct is not None and record.saturation_pct > self.max_saturation_pct:
            flags.append("saturation")
        if record.nonfinite:
            flags.append("nonfinite")
        return tuple(flags)

    def describe(self) -> str:
        return (
            f"SQNR below {self.min_sqnr_db:g} dB, underflow above {self.max_underflow_pct:g}%, "
            f"saturation above {self.max_saturation_pct:g}%, or any NaN/inf"
        )


TIE_DB = 0.1
"""Recipes whose worst-GEMM SQNR on a layer lie within this many dB of each other tie."""


class Inspection(list):
    """What :func:`inspect` returns: the list of :class:`~fp8train.nn.numerics.NumericsRecord`
    (one per layer call, recipe, GEMM and operand or result), with:

    Attributes:
        recipes: the recipe names, in the order given.
        layers: ``(layer, call)`` pairs in the order they ran.
        skipped: recipe -> ``{layer: reason}`` of layers the recipe would not convert.
        unseen: ``{module: reason}`` of matmul modules whose GEMMs the capture cannot see
            in high precision (an ``nn.MultiheadAttention``, fused experts): not measured.
        thresholds: the :class:`Thresholds` used for the records' flags.
        backward: whether a backward ran (``False``: the loss needed no gradient, so only
            the output GEMMs have records).
    """

    def __init__(self, records, *, recipes, layers, skipped, thresholds, backward, unseen=None) -> None:
        super().__init__(records)
        self.recipes, self.layers, self.skipped = recipes, layers, skipped
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


def _loss_of(output) -> torch.Tensor:
    """The default ``loss_fn``: ``output.loss`` (or ``output["loss"]``) when there is one,
    else the mean square of the output (of its first tensor, for a tuple)."""
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, Mapping):
        loss = output.get("loss")
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        output = output[0]
    if isinstance(output, torch.Tensor):
        return output.float().pow(2).mean()
    raise ArgumentTypeError(
        f"cannot make a loss of the model's output of type {type(output).__name__}: pass "
        "loss_fn=lambda output: <a scalar tensor>"
    )


def _call_model(model: nn.Module, batch):
    if isinstance(batch, torch.Tensor):
        return model(batch)
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    raise ArgumentTypeError(
        f"batch of type {type(batch).__name__} is not a tensor, a tuple of positional arguments or a dict of "
        "keyword arguments: pass what the model's forward takes in one of those forms"
    )


def inspect(
    model: nn.Module,
    batch,
    *,
    recipes: Iterable[Recipe | str] | None = None,
    loss_fn: Callable[[object], torch.Tensor] | None = None,
    report_dir: str | Path | None = None,
    thresholds: Thresholds | None = None,
    dim_alignment: int | None = None,
) -> Inspection:
    """Measure what each recipe's FP8 quantization does to every GEMM of ``model``.

    Runs one forward and backward of ``model`` on ``batch`` in high precision (FP8 off for
    converted layers; inside a ``torch.autocast`` block the GEMMs see the autocast dtype,
    as in training), then for every Linear a recipe would convert and each of its GEMMs
    (``output``, ``grad_input``, ``grad_weight``) quantizes the same operands as the
    recipe does and compares the FP8 GEMM with a float64 one. Delayed scaling uses a
    converted layer's own stored scales (so a stale amax history shows), and for a plain
    layer the scale one step of history with these tensors would give.

    Args:
        model: any module; nothing of it changes (weights, ``.grad``, buffers such as
            delayed-scaling state, the RNG).
        batch: what the model takes: a tensor, a tuple of positional arguments, or a dict
            of keyword arguments.
        recipes: recipes or names (default: every recipe).
        loss_fn: ``loss_fn(output) -> scalar``; default ``output.loss`` where the output
            has one, else the mean square of the output.
        report_dir: also write ``report.md``, ``records.json`` and ``heatmap.png`` there.
        thresholds: where records are flagged (default :class:`Thresholds` ()).
        dim_alignment: the multiple a layer's dims must meet to convert (default: each
            recipe's own, as :func:`~fp8train.convert_to_float8_training` uses).

    Returns:
        An :class:`Inspection`: the list of records (see
        :class:`~fp8train.nn.numerics.NumericsRecord`), with the layers, recipes, skipped
        layers and summaries.

    Raises:
        TypeError: ``model`` is not a module, ``batch`` not one of the forms above,
            ``loss_fn`` not callable, or the loss not a scalar tensor.
        ValueError: an unknown recipe, or a model without Linear layers.
    """
    check_type("model", model, nn.Module, "an nn.Module")
    check_callable("loss_fn", loss_fn, allow_none=True, signature="(output) -> scalar loss")
    loss_of = loss_fn if loss_fn is not None else _loss_of
    inspection = inspect_step(
        model,
        lambda: loss_of(_call_model(model, batch)),
        recipes=recipes,
        thresholds=thresholds,
        dim_alignment=dim_alignment,
    )
    if report_dir is not None:
        write_report(inspection, report_dir)
    return inspection


def inspect_step(
    model: nn.Module,
    run: Callable[[], torch.Tensor],
    *,
    recipes: Iterable[Recipe | str] | None = None,
    thresholds: Thresholds | None = None,
    dim_alignment: int | None = None,
) -> Inspection:
    """:func:`inspect` with the forward given as ``run() -> loss`` (a closure over the
    model and its batch), for callers whose loss needs more than the model's output."""
    resolved = [resolve_recipe(recipe) for recipe in (RECIPE_NAMES if recipes is None else recipes)]
    if not resolved:
        raise ValueError("recipes is empty: name at least one recipe, or pass None for all of them")
    thresholds = thresholds if thresholds is not None else Thresholds()
    check_type("thresholds", thresholds, Thresholds, "a Thresholds")
    layers = dict(linear_layers(model))
    unseen = {name: _UNSEEN_REASON.format(type(m).__name__) for name, m in matmul_modules(model) if name not in layers}
    if not layers:
        unseen_text = f" ({', '.join(unseen)}: {_UNSEEN_REASON.format('they')})" if unseen else ""
        raise ValueError(
            f"{type(model).__name__} has no nn.Linear or Conv1D layers, nor converted FP8 modules: there is "
            f"nothing to measure{unseen_text}"
        )
    calls, backward = _capture(model, run, layers)
    records, skipped = [], {recipe.name: {} for recipe in resolved}
    for recipe in resolved:
        alignment = recipe.alignment if dim_alignment is None else dim_alignment
        for call in calls:
            # The GEMM's own dims: an attention's in-projection is [3E, E], its out_proj [E, E].
            reason = dims_skip_reason(call.in_features, call.out_features, max(alignment, recipe.operand_plan.block))
            if reason is not None:
                skipped[recipe.name][call.layer] = reason
                continue
            records += [record.with_flags(thresholds.flags(record)) for record in linear_call_statistics(call, recipe)]
    return Inspection(
        records,
        recipes=[recipe.name for recipe in resolved],
        layers=[(call.layer, call.call) for call in calls],
        skipped=skipped,
        thresholds=thresholds,
        backward=backward,
        unseen=unseen,
    )


_UNSEEN_REASON = (
    "{} runs GEMMs that inspect does not see: a high-precision nn.MultiheadAttention hands its weights to a "
    "fused function (convert the model first to measure its projections: fp8train.inspect on the converted "
    "model, or fp8train inspect --checkpoint); fused MoE experts run grouped GEMMs, not measured"
)


def _capture(model: nn.Module, run: Callable[[], torch.Tensor], layers: dict) -> tuple[list, bool]:
    """Run ``run`` and its backward with ``layers`` hooked; leave the model as it was."""
    buffers = {name: buffer.detach().clone() for name, buffer in model.named_buffers()}
    cuda_devices = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    params = [p for p in model.parameters() if p.requires_grad]
    try:
        with torch.random.fork_rng(devices=cuda_devices), fp8_autocast(enabled=False):
            with capture_linear_calls(layers) as calls:
                loss = run()
                if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                    shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
                    raise ArgumentTypeError(
                        f"the loss must be a scalar tensor, got {shape}: pass a loss_fn that reduces the output"
                    )
                backward = loss.requires_grad and bool(params)
                if backward:
                    # autograd.grad leaves every .grad as it was.
                    torch.autograd.grad(loss.reshape(()), params, allow_unused=True)
    finally:
        with torch.no_grad():
            for name, buffer in model.named_buffers():
                if name in buffers:
                    buffer.copy_(buffers[name])
    if not calls:
        raise ValueError("the model's forward called none of its Linear layers on this batch")
    return calls, backward


# ---------------------------------------------------------------------------- the report
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
    names = inspection.recipes
    header = "| layer | " + " | ".join(names) + " |"
    rule = "|---|" + "---:|" * len(names)
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
    ]
    lines += [header[:-1] + "| best |", rule + "---|"]
    for layer, call in inspection.layers:
        cells = [_fmt(inspection.worst_gemm_sqnr(layer, call, name)) for name in names]
        lines.append(f"| {_row_name(layer, call)} | " + " | ".join(cells) + f" | {_best_text(inspection, layer, call)} |")
    lines += ["", "## Largest underflow per layer (% of non-zero values that quantize to zero, worst operand)", ""]
    lines += [header, rule]
    for layer, call in inspection.layers:
        cells = [_fmt(inspection.worst_underflow(layer, call, name), 2) for name in names]
        lines.append(f"| {_row_name(layer, call)} | " + " | ".join(cells) + " |")
    flagged = inspection.flagged()
    lines += ["", f"## Flagged ({len(flagged)})", ""]
    if flagged:
        lines += [
            "| layer | recipe | GEMM | operand | flags | SQNR | underflow % | saturation % | amax | NaN/inf |",
            "|---|---|---|---|---|---:|---:|---:|---:|---:|",
        ]
        for r in flagged:
            lines.append(
                f"| {_row_name(r.layer, r.call)} | {r.recipe} | {r.gemm} | {r.operand} | {', '.join(r.flags)} | "
                f"{_fmt(r.sqnr_db)} | {_fmt(r.underflow_pct, 2)} | {_fmt(r.saturation_pct, 2)} | {r.amax:.3g} | {r.nonfinite} |"
            )
    else:
        lines.append("Nothing crosses a threshold.")
    skipped = [(name, layer, reason) for name in names for layer, reason in inspection.skipped[name].items()]
    if skipped:
        lines += ["", "## Not converted (n/a above)", ""]
        lines += [f"- {layer} under {name}: {reason}" for name, layer, reason in skipped]
    if inspection.unseen:
        lines += ["", "## Not measured", ""]
        lines += [f"- {layer}: {reason}" for layer, reason in inspection.unseen.items()]
    lines += ["", "## Every FP8 GEMM", ""]
    lines += [
        "| layer | recipe | GEMM | operand SQNR (a, b) | result SQNR | underflow % (a, b) | saturation % (a, b) |",
        "|---|---|---|---|---:|---|---|",
    ]
    by_gemm: dict[tuple, list[NumericsRecord]] = {}
    for r in inspection:
        by_gemm.setdefault((r.layer, r.call, r.recipe, r.gemm), []).append(r)
    for (layer, call, recipe, gemm), (a, b, result) in by_gemm.items():
        lines.append(
            f"| {_row_name(layer, call)} | {recipe} | {gemm} | {a.operand} {_fmt(a.sqnr_db)}, {b.operand} "
            f"{_fmt(b.sqnr_db)} | {_fmt(result.sqnr_db)} | {_fmt(a.underflow_pct, 2)}, {_fmt(b.underflow_pct, 2)} | "
            f"{_fmt(a.saturation_pct, 2)}, {_fmt(b.saturation_pct, 2)} |"
        )
    lines += ["", "![SQNR and underflow per layer and recipe](heatmap.png)", ""]
    return "\n".join(lines)


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


# ---------------------------------------------------------------------------- the command
def run_inspect(args, recipes: list[str], checkpoint: str | Path | None = None) -> Inspection:
    """``fp8train inspect``: build the model of ``args`` (the default GPT, or
    ``args.model``) as the trainer would (seeded; converted with ``args.fp8_recipe`` if
    set), load ``checkpoint``'s weights if given, and inspect it on the trainer's first
    batch under the trainer's autocast; the report goes to ``args.output_dir``."""
    from .checkpoint import CheckpointError, verify_checkpoint
    from .trainer import mixed_precision_autocast, sample_batch, training_device
    from .user_model import model_setup
    from ..nn.convert import convert_to_float8_training, drop_fp8_state

    setup = model_setup(args)
    torch.manual_seed(args.seed)
    model = setup.model_factory()
    device = training_device(args)
    model = model.to(device)
    if args.fp8_recipe is not None:
        model = convert_to_float8_training(model, args.fp8_recipe, dim_alignment=args.fp8_dim_alignment)
    if checkpoint is not None:
        from safetensors.torch import load_file

        problems = verify_checkpoint(checkpoint)
        if problems:
            raise CheckpointError(f"checkpoint {checkpoint} does not verify: {problems[0]}")
        state = load_file(str(Path(checkpoint) / "model.safetensors"), device=str(device))
        model.load_state_dict(state if args.fp8_recipe is not None else drop_fp8_state(state))
    inputs, targets = sample_batch(setup.train_dataset, args.seed, 0, args.batch_size)
    inputs, targets = inputs.to(device), targets.to(device)
    with mixed_precision_autocast(args, device):
        inspection = inspect_step(
            model, lambda: setup.loss_fn(model, inputs, targets), recipes=recipes, dim_alignment=args.fp8_dim_alignment
        )
    write_report(inspection, args.output_dir)
    return inspection


def summary_text(inspection: Inspection) -> str:
    """The report without its table of every GEMM: what the command line prints."""
    report = format_report(inspection)
    return report.split("\n## Every FP8 GEMM", 1)[0].rstrip() + "\n"
