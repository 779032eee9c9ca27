"""Swap a model's matmul modules for their FP8 versions and back, and report what happened.

Which modules are matmul modules, and how each kind converts, is
:mod:`fp8train.nn.converters` (one :class:`~fp8train.nn.converters.MatmulConverter` per
kind); this module walks a model with them, once, with one
:class:`~fp8train.nn.config.Float8ModuleConfig` for every module it converts.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Mapping, Sequence

from torch import nn

from ..spec.checks import ArgumentTypeError, check_bool, check_callable, check_int, check_type
from ..spec.recipe_map import RecipeMap, is_recipe_map, recipe_map
from ..spec.recipes import Recipe, recipe_label
from .adapters import adapter_containers
from .modules.attention import block_fused_fast_paths, unblock_fused_fast_paths
from .config import Float8ModuleConfig
from .converters import (
    Found,
    MatmulConverter,
    alignment_skip_reason,
    dims_skip_reason,
    find_matmul_modules,
    fp8_types,
    linear_layers,
    matmul_converters,
    matmul_modules,
)
from .modules.linear import Float8Linear
from .head import HEAD_KEPT_REASON, NO_HEAD_NOTE, head_names, heads_kept
from .report import ADAPTER, CONVERTED, EXCLUDED, HEAD, SKIPPED, ConversionReport, ModuleConversion
from .store_weights import store_trainable_weights_in_fp8

__all__ = [
    "convert_to_float8_training",
    "convert_to_linear",
    "conversion_report",
    "drop_fp8_state",
    "FP8_STATE_NAMES",
    "MatmulConverter",
    "matmul_converters",
    "matmul_modules",
    "linear_layers",
    "alignment_skip_reason",
    "dims_skip_reason",
]

FP8_STATE_NAMES = ("fp8_scale", "fp8_amax_history")
"""Buffer names of delayed scaling's state in a converted model's ``state_dict``."""

logger = logging.getLogger(__name__)

ModuleFilter = Callable[[nn.Module, str], bool]

# Where a converted model keeps its ConversionReport (read with conversion_report).
_REPORT_ATTRIBUTE = "_fp8_conversion_report"


def _replace(model: nn.Module, fqn: str, new: nn.Module) -> nn.Module:
    if not fqn:
        return new
    parent_name, _, child_name = fqn.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child_name, new)
    return model


def _num_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _check_linear_subclasses(linear_subclasses) -> tuple[type, ...]:
    if not isinstance(linear_subclasses, (tuple, list)) or not all(
        isinstance(cls, type) and issubclass(cls, nn.Linear) and not issubclass(cls, Float8Linear)
        for cls in linear_subclasses
    ):
        raise ArgumentTypeError(
            f"linear_subclasses={linear_subclasses!r} must be a tuple of nn.Linear subclasses (classes, "
            "not instances) whose forward is F.linear(input, self.weight, self.bias)"
        )
    return tuple(linear_subclasses)


def convert_to_float8_training(
    model: nn.Module,
    recipe: Recipe | str | Mapping | Sequence = "tensorwise",
    *,
    module_filter_fn: ModuleFilter | None = None,
    dim_alignment: int | None = None,
    backend: str = "auto",
    save_fp8_activations: bool = True,
    linear_subclasses: Sequence[type] = (),
    config: Float8ModuleConfig | None = None,
    convert_adapters: bool = False,
    fp8_weights: bool = False,
    keep_head: bool | None = None,
) -> nn.Module:
    """Swap every eligible matmul module of ``model`` for its FP8 version, in place.

    ``nn.Linear`` becomes :class:`~fp8train.nn.modules.linear.Float8Linear`; transformers'
    ``Conv1D`` (GPT-2) :class:`~fp8train.nn.modules.conv1d.Float8Conv1D`; ``nn.MultiheadAttention``
    :class:`~fp8train.nn.modules.attention.Float8MultiheadAttention` (input and output
    projections); fused MoE experts ``Float8Experts``. Parameters are shared, not copied,
    and ``state_dict`` keys stay the same. Convert after moving the model to its device
    and before ``torch.compile`` and the optimizer.

    Under a 4-bit recipe the model's output head (``model.get_output_embeddings()``, else a
    matmul module named ``lm_head``) stays in high precision (``keep_head``; a 4-bit head
    ruins training: docs/recipes.md). A module stays in high precision when
    ``module_filter_fn`` rejects it (excluded), when
    its dims are not multiples of the alignment, or when it runs a matmul but is of a
    type that does not convert (an ``nn.Linear`` subclass not in ``linear_subclasses``, an
    ``nn.MultiheadAttention`` subclass, experts that break the contract) (skipped). PEFT's
    adapters stay in high precision (``docs/peft.md``). Each is logged at INFO; then the summary line
    (:meth:`~fp8train.nn.report.ConversionReport.summary`), at WARNING where a module was
    skipped (visible without any logging setup), else at INFO.
    :func:`conversion_report` returns the whole report.

    Args:
        model: any module; may itself be a matmul module.
        recipe: a :class:`~fp8train.spec.recipes.Recipe` or a recipe name; or a recipe per
            module: an ordered mapping (a dict, or a list of pairs) from module-name patterns
            to recipes, its one-line form or a :class:`~fp8train.spec.recipe_map.RecipeMap`
            (:mod:`fp8train.spec.recipe_map`): the first
            pattern that matches a module's name wins, ``None`` keeps it in high precision,
            and a module no pattern matches stays in high precision (``"*"`` gives the rest a
            recipe). A pattern that matches no matmul module is an error.
        module_filter_fn: ``(module, fqn) -> bool``; ``False`` keeps the module in high
            precision (e.g. ``lambda m, fqn: fqn != "lm_head"``). Called for the matmul
            modules that would convert.
        dim_alignment: the multiple every GEMM dim must meet; ``None`` takes the recipe's
            (16, 128 for blockwise, 32 for MXFP8); ``0`` turns the check off.
        backend: GEMM backend of the new modules (``"auto"``, ``"emulated"``, ``"hardware"``).
        save_fp8_activations: the new modules keep their inputs for the backward in FP8
            where the grad_weight GEMM runs in FP8 (``False``: in high precision); see
            :class:`~fp8train.nn.modules.linear.Float8Linear`.
        linear_subclasses: ``nn.Linear`` subclasses to convert to ``Float8Linear`` too
            (only those whose forward is ``F.linear(input, self.weight, self.bias)``:
            ``Float8Linear`` runs that, whatever the subclass's forward did).
            ``convert_to_linear`` gives the original modules back.
        config: ``recipe``, ``backend`` and ``save_fp8_activations`` as one
            :class:`~fp8train.nn.config.Float8ModuleConfig` (then leave those three out).
        convert_adapters: convert PEFT's adapters (LoRA's ``lora_A``, ``lora_B``) too; the
            layers they adapt convert either way.
        fp8_weights: FP8 primary weights: hold each converted ``Float8Linear``'s trainable
            weight only quantized between steps
            (:func:`~fp8train.nn.store_weights.store_trainable_weights_in_fp8`); train it with
            ``fp8train.optim.AdamW``, which keeps its master (docs/optim.md).

    Returns:
        ``model`` (or the new module, if ``model`` itself was converted).

    Raises:
        ValueError: bad recipe name, negative ``dim_alignment`` or unknown backend; a recipe
            map pattern that matches no matmul module (nothing is converted then).
        TypeError: ``model`` is not an ``nn.Module``, ``recipe`` neither a Recipe nor a
            name, ``module_filter_fn`` not callable, ``dim_alignment`` not an int,
            ``save_fp8_activations``, ``convert_adapters`` or ``fp8_weights`` not a bool,
            ``keep_head`` neither a bool nor ``None``,
            ``linear_subclasses`` not a tuple of ``nn.Linear`` subclasses.
    """
    check_type("model", model, nn.Module, "an nn.Module")
    mapping = recipe if isinstance(recipe, RecipeMap) else recipe_map(recipe) if is_recipe_map(recipe) else None
    if mapping is not None:  # the config's recipe: the first the map runs (each module gets its own)
        recipe = mapping.recipes[0] if mapping.recipes else "tensorwise"
    options = dict(recipe=recipe, backend=backend, save_fp8_activations=save_fp8_activations)
    config = Float8ModuleConfig.build(config, **options)
    recipe = config.recipe
    check_callable("module_filter_fn", module_filter_fn, allow_none=True, signature="(module, fqn) -> bool")
    if dim_alignment is not None:  # None: each module's recipe's alignment
        check_int("dim_alignment", dim_alignment, minimum=0)
    linear_subclasses = _check_linear_subclasses(linear_subclasses)
    adapters = {} if check_bool("convert_adapters", convert_adapters) else adapter_containers(model)
    check_bool("fp8_weights", fp8_weights)
    if keep_head is not None:
        check_bool("keep_head", keep_head)
    heads = heads_kept(model, recipe, keep_head, linear_subclasses) if mapping is None else head_names(model, linear_subclasses)
    if mapping is None and recipe.keeps_head_in_high_precision and keep_head is None and not heads:
        logger.info("FP8 training (%s): %s", recipe_label(recipe), NO_HEAD_NOTE)

    found_modules = list(find_matmul_modules(model, matmul_converters(linear_subclasses)))
    configs = _module_configs(found_modules, config, mapping, keep_head, heads)
    entries = []
    for found in found_modules:
        module_config, kept = configs[found.fqn]
        module_heads = heads if mapping is None else [found.fqn] if kept else []
        model, entry = _convert_one(model, found, module_config, module_filter_fn, dim_alignment, adapters, module_heads)
        entries.append(entry)

    report = ConversionReport(recipe_label(recipe) if mapping is None else mapping.describe(), tuple(entries))
    object.__setattr__(model, _REPORT_ATTRIBUTE, report)
    block_fused_fast_paths(model, fp8_types())
    if fp8_weights:
        store_trainable_weights_in_fp8(model)
    level = logging.WARNING if report.skipped or not report.modules else logging.INFO
    logger.log(level, "%s", report.summary())
    return model


def _module_configs(found_modules, config: Float8ModuleConfig, mapping: RecipeMap | None, keep_head, heads):
    """``{fqn: (config or a reason it stays in high precision, head kept)}`` for each
    matmul module: ``config`` for all without a recipe map; else the config of the recipe
    the map gives the module (a reason where it gives none), the head kept where its recipe
    keeps heads (``keep_head`` ``None``) or ``keep_head`` says so.

    Raises:
        ValueError: a pattern of the map that matches no matmul module.
    """
    if mapping is None:
        return {found.fqn: (config, False) for found in found_modules}
    configs, used = {}, set()
    for found in found_modules:
        matched = mapping.match(found.fqn)
        if matched is None:
            configs[found.fqn] = ("no pattern of the recipe map matches it (add '*' to give the rest a recipe)", False)
            continue
        index, module_recipe = matched
        used.add(index)
        pattern = mapping.entries[index][0]
        if module_recipe is None:
            configs[found.fqn] = (f"kept in high precision by the recipe map (pattern {pattern!r})", False)
            continue
        keep = module_recipe.keeps_head_in_high_precision if keep_head is None else keep_head
        configs[found.fqn] = (dataclasses.replace(config, recipe=module_recipe), keep and found.fqn in heads)
    unused = [pattern for index, (pattern, _) in enumerate(mapping.entries) if index not in used]
    if unused:
        names = ", ".join(found.fqn or "<root>" for found in found_modules[:8])
        raise ValueError(
            f"recipe map pattern(s) {', '.join(map(repr, unused))} match no matmul module (the model's are: "
            f"{names}{', ...' if len(found_modules) > 8 else ''}); nothing was converted"
        )
    return configs


def _adapter_reason(fqn: str, adapters: Mapping[str, str]) -> str | None:
    """Why the module ``fqn`` stays in high precision as a PEFT adapter (``None``: it is none)."""
    container = next((what for prefix, what in adapters.items() if fqn.startswith(prefix)), None)
    if container is None:
        return None
    return f"a PEFT adapter ({container}): adapters train in high precision; convert_adapters=True converts them"


def _convert_one(
    model: nn.Module, found: Found, config: Float8ModuleConfig, module_filter_fn, dim_alignment: int,
    adapters: Mapping[str, str], heads: Sequence[str],
) -> tuple[nn.Module, ModuleConversion]:
    """Convert one matmul module of ``model`` where it converts (in place), and log why not
    where it does not: ``model`` (or the new module, if it was ``model`` itself) and the
    report's entry. ``adapters``: :func:`~fp8train.nn.adapters.adapter_containers`, the
    PEFT adapters that stay in high precision; ``heads``: the output head modules kept."""
    name, module, converter = found.fqn or "<root>", found.module, found.converter
    status, reason = SKIPPED, found.reason
    adapter_reason = _adapter_reason(found.fqn, adapters)
    if converter is None and reason is None:  # converted before
        status = CONVERTED
    elif adapter_reason is not None:
        status, reason = ADAPTER, adapter_reason
    elif converter is not None and isinstance(config, str):  # the recipe map keeps it
        status, reason = EXCLUDED, config
    elif converter is not None:
        alignment = config.recipe.alignment if dim_alignment is None else dim_alignment
        reason = converter.skip_reason(module, alignment)
        if found.fqn in heads and reason is None:
            status, reason = HEAD, HEAD_KEPT_REASON
        elif module_filter_fn is not None and not module_filter_fn(module, found.fqn):
            status, reason = EXCLUDED, "excluded by module_filter_fn"
        elif reason is None:
            module = converter.convert(module, config)
            model = _replace(model, found.fqn, module)
            status = CONVERTED
    if status == EXCLUDED:
        logger.info("FP8 training: skipping %s (%s)", name, reason)
    elif status in (SKIPPED, ADAPTER, HEAD):
        logger.info("FP8 training: skipping %s: %s", name, reason)
    module_type = type(found.module).__name__
    label = recipe_label(config.recipe) if status == CONVERTED and not isinstance(config, str) else None
    return model, ModuleConversion(found.fqn, module_type, status, reason, _num_params(module), label)


def conversion_report(model: nn.Module) -> ConversionReport:
    """The :class:`~fp8train.nn.report.ConversionReport` of the last
    :func:`convert_to_float8_training` of ``model`` (the module it returned).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: ``model`` was not converted (or was converted back).
    """
    check_type("model", model, nn.Module, "an nn.Module")
    report = getattr(model, _REPORT_ATTRIBUTE, None)
    if report is None:
        raise ValueError(
            f"{type(model).__name__} has no conversion report: call fp8train.convert_to_float8_training(model, ...) "
            "first, and pass the module it returns"
        )
    return report


def convert_to_linear(model: nn.Module) -> nn.Module:
    """Swap every converted module back to its original class with the same parameters:
    ``Float8Linear`` to ``nn.Linear`` (or the opted-in subclass it came from),
    ``Float8Conv1D`` to ``Conv1D``, ``Float8MultiheadAttention`` to
    ``nn.MultiheadAttention``, ``Float8Experts`` to the experts module.

    FP8 state (delayed scaling's ``fp8_scale`` and ``fp8_amax_history``) is dropped. An
    ``nn.TransformerEncoder`` that conversion stopped from nesting stays so (a speed path).

    Returns:
        ``model`` (or the new module, if ``model`` itself was converted).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
    """
    check_type("model", model, nn.Module, "an nn.Module")
    converters = matmul_converters()
    fp8_classes = tuple(c.fp8_type for c in converters)
    for found in find_matmul_modules(model, converters):
        if isinstance(found.module, fp8_classes):
            model = _replace(model, found.fqn, found.module.to_original())
    unblock_fused_fast_paths(model)
    if getattr(model, _REPORT_ATTRIBUTE, None) is not None:
        object.__delattr__(model, _REPORT_ATTRIBUTE)
    return model


def drop_fp8_state(state_dict: dict) -> dict:
    """A copy of ``state_dict`` without delayed scaling's FP8 state, for loading a converted
    model's checkpoint strictly into a plain model.

    Raises:
        TypeError: ``state_dict`` is not a mapping.
    """
    check_type("state_dict", state_dict, Mapping, "a mapping of names to tensors (a state_dict)")
    return {key: value for key, value in state_dict.items() if key.rpartition(".")[2] not in FP8_STATE_NAMES}
