"""``fp8train.inspect``: what every recipe's quantization does to every GEMM of a model.

One forward and backward of the user's model run in high precision with the Linear
layers hooked (:mod:`fp8train.diagnostics.gemm_capture`); then, for each recipe, the captured operands
are quantized as that recipe would quantize them and each GEMM runs in FP8 beside a
float64 GEMM. Nothing in the model changes: gradients are taken with ``autograd.grad``
(no ``.grad`` is written), buffers (delayed-scaling state, batch-norm statistics) are
restored, and the RNG is forked.

The records and their summaries are an :class:`~fp8train.diagnostics.inspection.Inspection`;
:mod:`fp8train.diagnostics.inspect_report` renders them.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Callable, Iterable

import torch
from torch import nn

from ..nn.autocast import autocast as fp8_autocast
from ..nn.convert import dims_skip_reason, linear_layers, matmul_modules
from .gemm_capture import capture_linear_calls, linear_call_statistics
from ..spec.checks import ArgumentTypeError, check_callable, check_type
from ..spec.recipe_map import RecipeMap, is_recipe_map, recipe_map
from ..spec.recipes import RECIPE_NAMES, Recipe, recipe_label, resolve_recipe
from .inspect_report import write_report
from .inspection import Inspection, Thresholds

__all__ = ["inspect", "inspect_step"]


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
        recipes: recipes or names (default: every recipe); a mixture
            (``hybrid(forward=..,backward=..)``) is one like any other; a recipe per module
            (a :class:`~fp8train.spec.recipe_map.RecipeMap`, or its one-line form
            ``"*.attn.*=mxfp8;*.mlp.*=nvfp4"``) is one column, each layer measured under the
            recipe its first matching pattern gives (the inspection's ``module_recipes``).
        loss_fn: ``loss_fn(output) -> scalar``; default ``output.loss`` where the output
            has one, else the mean square of the output.
        report_dir: also write ``report.md``, ``records.json`` and ``heatmap.png`` there.
        thresholds: where records are flagged (default :class:`Thresholds` ()).
        dim_alignment: the multiple a layer's dims must meet to convert (default: each
            recipe's own, as :func:`~fp8train.convert_to_float8_training` uses).

    Returns:
        An :class:`Inspection`: the list of records (see
        :class:`~fp8train.diagnostics.gemm_capture.NumericsRecord`), with the layers, recipes, skipped
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
    columns = [_column(recipe) for recipe in (RECIPE_NAMES if recipes is None else recipes)]
    if not columns:
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
    records, skipped, module_recipes = [], {}, {}
    for label, chosen in columns:
        skipped[label] = {}
        for call in calls:
            recipe, reason = _layer_recipe(chosen, call, dim_alignment)
            if isinstance(chosen, RecipeMap):
                module_recipes.setdefault(label, {})[call.layer] = "bf16" if recipe is None else recipe_label(recipe)
            if reason is not None:
                skipped[label][call.layer] = reason
                continue
            records += [r.with_flags(thresholds.flags(r)) for r in linear_call_statistics(call, recipe, label=label)]
    return Inspection(
        records,
        recipes=[label for label, _ in columns],
        layers=[(call.layer, call.call) for call in calls],
        skipped=skipped,
        thresholds=thresholds,
        backward=backward,
        unseen=unseen,
        module_recipes=module_recipes,
    )


def _column(value: object) -> tuple[str, "Recipe | RecipeMap"]:
    """``(label, recipe or map)`` of one of ``inspect``'s ``recipes``."""
    if isinstance(value, RecipeMap) or (isinstance(value, str) and is_recipe_map(value)):
        mapping = value if isinstance(value, RecipeMap) else recipe_map(value)
        return mapping.describe(), mapping
    recipe = resolve_recipe(value)
    return recipe_label(recipe), recipe


def _layer_recipe(chosen: "Recipe | RecipeMap", call, dim_alignment: int | None) -> tuple[Recipe | None, str | None]:
    """``(the recipe that measures call's layer, why it is not measured or None)``."""
    recipe = chosen
    if isinstance(chosen, RecipeMap):
        found = chosen.match(call.layer)
        if found is None:
            return None, "no pattern of the recipe map matches it: it stays in high precision"
        recipe = found[1]
        if recipe is None:
            return None, f"the recipe map keeps it in high precision (pattern {chosen.entries[found[0]][0]!r})"
    alignment = recipe.alignment if dim_alignment is None else dim_alignment
    # The GEMM's own dims: an attention's in-projection is [3E, E], its out_proj [E, E].
    return recipe, dims_skip_reason(call.in_features, call.out_features, max(alignment, recipe.operand_plan.block))


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
