"""Swap a model's matmul modules for their FP8 versions and back, and report what happened.

One :class:`MatmulConverter` per kind of module (``nn.Linear``, opted-in ``nn.Linear``
subclasses, transformers' ``Conv1D``, ``nn.MultiheadAttention``, fused MoE experts) says
how to recognize it, when it cannot convert, and how to convert it and back; adding a
kind is one entry in :func:`matmul_converters`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch
from torch import nn

from ..spec.checks import ArgumentTypeError, check_callable, check_int, check_type
from ..spec.recipes import Recipe
from .attention import (
    Float8MultiheadAttention,
    attention_alignment_skip_reason,
    block_fused_fast_paths,
    unblock_fused_fast_paths,
)
from .conv1d import Float8Conv1D, is_transformers_conv1d
from .linear import Float8Linear, check_fp8_arguments
from .report import CONVERTED, EXCLUDED, SKIPPED, ConversionReport, ModuleConversion

try:  # fused MoE experts: converted where fp8train.nn.experts is present
    from .experts import Float8Experts, experts_alignment_skip_reason, fused_experts_mismatch
except ImportError:  # pragma: no cover
    Float8Experts = None

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
# Where a Float8Linear made from an opted-in nn.Linear subclass keeps that module, which
# convert_to_linear gives back (not a submodule: its parameters are the Float8Linear's).
_ORIGINAL_ATTRIBUTE = "_fp8_original_module"


@dataclass(frozen=True)
class MatmulConverter:
    """One kind of matmul module: how to recognize it, when it stays in high precision, and
    how to convert it to FP8 and back.

    Attributes:
        matches: ``module -> bool``, true for the high-precision modules this converts.
        skip_reason: ``(module, dim_alignment) -> str | None``, why one stays in high
            precision (its dims), or ``None``.
        convert: ``(module, recipe, backend, save_fp8_activations) -> FP8 module`` sharing
            the module's parameters.
        fp8_type: the class of the FP8 modules ``convert`` makes.
        revert: ``FP8 module -> high-precision module`` with the same parameters.
    """

    matches: Callable[[nn.Module], bool]
    skip_reason: Callable[[nn.Module, int], str | None]
    convert: Callable[[nn.Module, Recipe, str, bool], nn.Module]
    fp8_type: type
    revert: Callable[[nn.Module], nn.Module]


def alignment_skip_reason(module: nn.Module, dim_alignment: int) -> str | None:
    """Why ``module`` (an ``nn.Linear`` or a transformers ``Conv1D``) stays in high
    precision under ``dim_alignment`` (``None``: it converts)."""
    if is_transformers_conv1d(module):
        return dims_skip_reason(module.nx, module.nf, dim_alignment)
    return dims_skip_reason(module.in_features, module.out_features, dim_alignment)


def dims_skip_reason(in_features: int, out_features: int, dim_alignment: int) -> str | None:
    """Why a GEMM ``[..., in] x [out, in]^T`` stays in high precision under
    ``dim_alignment`` (``None``: it converts)."""
    if dim_alignment and (in_features % dim_alignment or out_features % dim_alignment):
        return (
            f"in_features={in_features}, out_features={out_features} are not both multiples of {dim_alignment}"
        )
    return None


def _linear_to_fp8(module: nn.Linear, recipe: Recipe, backend: str, save_fp8_activations: bool) -> Float8Linear:
    new = Float8Linear.from_linear(module, recipe, backend, save_fp8_activations=save_fp8_activations)
    new.train(module.training)
    if type(module) is not nn.Linear:
        object.__setattr__(new, _ORIGINAL_ATTRIBUTE, module)
    return new


def _linear_from_fp8(module: Float8Linear) -> nn.Linear:
    original = getattr(module, _ORIGINAL_ATTRIBUTE, None)
    if original is None:
        with torch.device("meta"):
            original = nn.Linear(module.in_features, module.out_features, bias=False)
    original.weight, original.bias = module.weight, module.bias
    original.train(module.training)
    return original


def matmul_converters(linear_subclasses: Sequence[type] = ()) -> tuple[MatmulConverter, ...]:
    """The kinds of matmul module :func:`convert_to_float8_training` converts, in the order
    it tries them: ``nn.Linear`` (that class, and the ``linear_subclasses`` given),
    transformers' ``Conv1D``, ``nn.MultiheadAttention``, fused MoE experts."""
    linear_types = (nn.Linear, *linear_subclasses)
    converters = [
        MatmulConverter(
            matches=lambda m: type(m) in linear_types,
            skip_reason=alignment_skip_reason,
            convert=_linear_to_fp8,
            fp8_type=Float8Linear,
            revert=_linear_from_fp8,
        ),
        MatmulConverter(
            matches=is_transformers_conv1d,
            skip_reason=alignment_skip_reason,
            convert=lambda m, r, b, s: Float8Conv1D.from_conv1d(m, r, b, save_fp8_activations=s),
            fp8_type=Float8Conv1D,
            revert=lambda m: m.to_conv1d(),
        ),
        MatmulConverter(
            matches=lambda m: type(m) is nn.MultiheadAttention,
            skip_reason=attention_alignment_skip_reason,
            convert=lambda m, r, b, s: Float8MultiheadAttention.from_attention(m, r, b, save_fp8_activations=s),
            fp8_type=Float8MultiheadAttention,
            revert=lambda m: m.to_attention(),
        ),
    ]
    if Float8Experts is not None:
        converters.append(
            MatmulConverter(
                matches=lambda m: fused_experts_mismatch(m) is None,
                skip_reason=experts_alignment_skip_reason,
                convert=lambda m, r, b, s: Float8Experts.from_experts(m, r, b, save_fp8_activations=s),
                fp8_type=Float8Experts,
                revert=lambda m: m.to_original(),
            )
        )
    return tuple(converters)


def _fp8_types() -> tuple[type, ...]:
    return tuple(c.fp8_type for c in matmul_converters())


def _unconvertible_reason(module: nn.Module) -> str | None:
    """Why a module that runs a matmul, but that no converter takes, stays in high precision
    (``None``: it is not such a module)."""
    name = type(module).__name__
    if isinstance(module, nn.Linear):
        return (
            f"an nn.Linear subclass, whose forward may not be F.linear: pass linear_subclasses=({name},) "
            "to convert it if it is"
        )
    if isinstance(module, nn.MultiheadAttention):
        return "an nn.MultiheadAttention subclass, whose forward may differ: not converted"
    if Float8Experts is not None and isinstance(getattr(module, "gate_up_proj", None), nn.Parameter):
        return f"fused experts that do not meet the contract: {fused_experts_mismatch(module)}"
    return None


@dataclass(frozen=True)
class _Found:
    fqn: str
    module: nn.Module
    converter: MatmulConverter | None  # None: already FP8, or unconvertible
    reason: str | None  # unconvertible: why


def _find_matmul_modules(model: nn.Module, converters: Sequence[MatmulConverter]) -> list[_Found]:
    """Every matmul module of ``model`` in ``named_modules`` order; the children of one
    (an attention's ``out_proj``) belong to it and are not listed."""
    fp8_types = tuple(c.fp8_type for c in converters)
    found, claimed = [], []
    for fqn, module in model.named_modules():
        if any(fqn.startswith(prefix) for prefix in claimed):
            continue
        if isinstance(module, fp8_types):
            entry = _Found(fqn, module, None, None)
        else:
            converter = next((c for c in converters if c.matches(module)), None)
            reason = None if converter is not None else _unconvertible_reason(module)
            if converter is None and reason is None:
                continue
            entry = _Found(fqn, module, converter, reason)
        found.append(entry)
        claimed.append(f"{fqn}." if fqn else "")
    return found


def matmul_modules(model: nn.Module, linear_subclasses: Sequence[type] = ()) -> list[tuple[str, nn.Module]]:
    """``(qualified name, module)`` of every matmul module of ``model`` that a
    :class:`~fp8train.nn.report.ConversionReport` would list: convertible, converted, or
    known but not convertible (an ``nn.Linear`` subclass not in ``linear_subclasses``)."""
    return [(f.fqn, f.module) for f in _find_matmul_modules(model, matmul_converters(linear_subclasses))]


def linear_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(qualified name, module)``, in ``named_modules`` order, of every module of
    ``model`` whose GEMMs :func:`~fp8train.nn.gemm_capture.capture_linear_calls` sees: the
    layers ``fp8train.inspect`` measures. ``nn.Linear`` (that class) and transformers'
    ``Conv1D``, and the FP8 modules that run ``run_linear`` (``Float8Linear``,
    ``Float8Conv1D``, ``Float8MultiheadAttention``, whose ``out_proj`` is listed too).
    A high-precision ``nn.MultiheadAttention`` hands its weights to a fused function, and
    fused experts run grouped GEMMs: neither is seen."""
    fp8_types = (Float8Linear, Float8Conv1D, Float8MultiheadAttention)
    return [
        (fqn, m)
        for fqn, m in model.named_modules()
        if type(m) is nn.Linear or is_transformers_conv1d(m) or isinstance(m, fp8_types)
    ]


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
    recipe: Recipe | str = "tensorwise",
    *,
    module_filter_fn: ModuleFilter | None = None,
    dim_alignment: int | None = None,
    backend: str = "auto",
    save_fp8_activations: bool = True,
    linear_subclasses: Sequence[type] = (),
) -> nn.Module:
    """Swap every eligible matmul module of ``model`` for its FP8 version, in place.

    ``nn.Linear`` becomes :class:`~fp8train.nn.linear.Float8Linear`; transformers'
    ``Conv1D`` (GPT-2) :class:`~fp8train.nn.conv1d.Float8Conv1D`; ``nn.MultiheadAttention``
    :class:`~fp8train.nn.attention.Float8MultiheadAttention` (input and output
    projections); fused MoE experts ``Float8Experts``. Parameters are shared, not copied,
    and ``state_dict`` keys stay the same. Convert after moving the model to its device
    and before ``torch.compile`` and the optimizer.

    A module stays in high precision when ``module_filter_fn`` rejects it (excluded), when
    its dims are not multiples of the alignment, or when it runs a matmul but is of a
    type that does not convert (an ``nn.Linear`` subclass not in ``linear_subclasses``, an
    ``nn.MultiheadAttention`` subclass, experts that break the contract) (skipped). Each
    is logged at INFO; then the summary line
    (:meth:`~fp8train.nn.report.ConversionReport.summary`), at WARNING where a module was
    skipped (visible without any logging setup), else at INFO.
    :func:`conversion_report` returns the whole report.

    Args:
        model: any module; may itself be a matmul module.
        recipe: a :class:`~fp8train.spec.recipes.Recipe` or a recipe name.
        module_filter_fn: ``(module, fqn) -> bool``; ``False`` keeps the module in high
            precision (e.g. ``lambda m, fqn: fqn != "lm_head"``). Called for the matmul
            modules that would convert.
        dim_alignment: the multiple every GEMM dim must meet; ``None`` takes the recipe's
            (16, 128 for blockwise, 32 for MXFP8); ``0`` turns the check off.
        backend: GEMM backend of the new modules (``"auto"``, ``"emulated"``, ``"hardware"``).
        save_fp8_activations: the new modules keep their inputs for the backward in FP8
            where the grad_weight GEMM runs in FP8 (``False``: in high precision); see
            :class:`~fp8train.nn.linear.Float8Linear`.
        linear_subclasses: ``nn.Linear`` subclasses to convert to ``Float8Linear`` too
            (only those whose forward is ``F.linear(input, self.weight, self.bias)``:
            ``Float8Linear`` runs that, whatever the subclass's forward did).
            ``convert_to_linear`` gives the original modules back.

    Returns:
        ``model`` (or the new module, if ``model`` itself was converted).

    Raises:
        ValueError: bad recipe name, negative ``dim_alignment`` or unknown backend.
        TypeError: ``model`` is not an ``nn.Module``, ``recipe`` neither a Recipe nor a
            name, ``module_filter_fn`` not callable, ``dim_alignment`` not an int,
            ``save_fp8_activations`` not a bool, ``linear_subclasses`` not a tuple of
            ``nn.Linear`` subclasses.
    """
    check_type("model", model, nn.Module, "an nn.Module")
    recipe = check_fp8_arguments(recipe, backend, save_fp8_activations)
    check_callable("module_filter_fn", module_filter_fn, allow_none=True, signature="(module, fqn) -> bool")
    if dim_alignment is None:
        dim_alignment = recipe.alignment
    check_int("dim_alignment", dim_alignment, minimum=0)
    linear_subclasses = _check_linear_subclasses(linear_subclasses)

    entries = []
    for found in _find_matmul_modules(model, matmul_converters(linear_subclasses)):
        name, module, converter = found.fqn or "<root>", found.module, found.converter
        status, reason = SKIPPED, found.reason
        if converter is None and reason is None:  # converted before
            status = CONVERTED
        elif converter is not None:
            reason = converter.skip_reason(module, dim_alignment)
            if module_filter_fn is not None and not module_filter_fn(module, found.fqn):
                status, reason = EXCLUDED, "excluded by module_filter_fn"
            elif reason is None:
                module = converter.convert(module, recipe, backend, save_fp8_activations)
                model = _replace(model, found.fqn, module)
                status = CONVERTED
        if status == EXCLUDED:
            logger.info("FP8 training: skipping %s (excluded by module_filter_fn)", name)
        elif status == SKIPPED:
            logger.info("FP8 training: skipping %s: %s", name, reason)
        module_type = type(found.module).__name__
        entries.append(ModuleConversion(found.fqn, module_type, status, reason, _num_params(module)))

    report = ConversionReport(recipe.name, tuple(entries))
    object.__setattr__(model, _REPORT_ATTRIBUTE, report)
    block_fused_fast_paths(model, _fp8_types())
    level = logging.WARNING if report.skipped or not report.modules else logging.INFO
    logger.log(level, "%s", report.summary())
    return model


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
    for found in _find_matmul_modules(model, converters):
        converter = next((c for c in converters if isinstance(found.module, c.fp8_type)), None)
        if converter is not None:
            model = _replace(model, found.fqn, converter.revert(found.module))
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
