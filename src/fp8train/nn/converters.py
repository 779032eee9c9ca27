"""Which modules of a model are matmul modules, and how each kind converts to FP8 and back.

One :class:`MatmulConverter` per kind of module (``nn.Linear``, opted-in ``nn.Linear``
subclasses, transformers' ``Conv1D``, ``nn.MultiheadAttention``, fused MoE experts) says
how to recognize it, when it cannot convert, and how to convert it (with a
:class:`~fp8train.nn.config.Float8ModuleConfig`; the FP8 module's ``to_original`` converts
it back); adding a kind is one entry in :func:`matmul_converters`.
:mod:`fp8train.nn.convert` walks a model with them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from torch import nn

from .modules.attention import Float8MultiheadAttention, attention_alignment_skip_reason
from .config import Float8ModuleConfig
from .modules.conv1d import Float8Conv1D, is_transformers_conv1d
from .modules.linear import Float8Linear

try:  # fused MoE experts: converted where fp8train.nn.modules.experts is present
    from .modules.experts import Float8Experts, experts_alignment_skip_reason, fused_experts_mismatch
except ImportError:  # pragma: no cover
    Float8Experts = None

__all__ = [
    "MatmulConverter",
    "matmul_converters",
    "matmul_modules",
    "find_matmul_modules",
    "fp8_types",
    "linear_layers",
    "alignment_skip_reason",
    "dims_skip_reason",
]


@dataclass(frozen=True)
class MatmulConverter:
    """One kind of matmul module: how to recognize it, when it stays in high precision, and
    how to convert it to FP8.

    Attributes:
        matches: ``module -> bool``, true for the high-precision modules this converts.
        skip_reason: ``(module, dim_alignment) -> str | None``, why one stays in high
            precision (its dims), or ``None``.
        convert: ``(module, config) -> FP8 module`` sharing the module's parameters, with
            the :class:`~fp8train.nn.config.Float8ModuleConfig` options.
        fp8_type: the class of the FP8 modules ``convert`` makes (each gives its
            high-precision module back with ``to_original()``).
    """

    matches: Callable[[nn.Module], bool]
    skip_reason: Callable[[nn.Module, int], str | None]
    convert: Callable[[nn.Module, Float8ModuleConfig], nn.Module]
    fp8_type: type


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


def matmul_converters(linear_subclasses: Sequence[type] = ()) -> tuple[MatmulConverter, ...]:
    """The kinds of matmul module :func:`convert_to_float8_training` converts, in the order
    it tries them: ``nn.Linear`` (that class, and the ``linear_subclasses`` given),
    transformers' ``Conv1D``, ``nn.MultiheadAttention``, fused MoE experts."""
    linear_types = (nn.Linear, *linear_subclasses)
    converters = [
        MatmulConverter(
            matches=lambda m: type(m) in linear_types,
            skip_reason=alignment_skip_reason,
            convert=lambda m, config: Float8Linear.from_linear(m, config=config),
            fp8_type=Float8Linear,
        ),
        MatmulConverter(
            matches=is_transformers_conv1d,
            skip_reason=alignment_skip_reason,
            convert=lambda m, config: Float8Conv1D.from_conv1d(m, config=config),
            fp8_type=Float8Conv1D,
        ),
        MatmulConverter(
            matches=lambda m: type(m) is nn.MultiheadAttention,
            skip_reason=attention_alignment_skip_reason,
            convert=lambda m, config: Float8MultiheadAttention.from_attention(m, config=config),
            fp8_type=Float8MultiheadAttention,
        ),
    ]
    if Float8Experts is not None:
        converters.append(
            MatmulConverter(
                matches=lambda m: fused_experts_mismatch(m) is None,
                skip_reason=experts_alignment_skip_reason,
                convert=lambda m, config: Float8Experts.from_experts(m, config=config),
                fp8_type=Float8Experts,
            )
        )
    return tuple(converters)


def fp8_types() -> tuple[type, ...]:
    """The classes of the FP8 modules the converters make."""
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
class Found:
    """A matmul module of a model, and the converter that takes it."""

    fqn: str
    module: nn.Module
    converter: MatmulConverter | None  # None: already FP8, or unconvertible
    reason: str | None  # unconvertible: why


def find_matmul_modules(model: nn.Module, converters: Sequence[MatmulConverter]) -> list[Found]:
    """Every matmul module of ``model`` in ``named_modules`` order; the children of one
    (an attention's ``out_proj``) belong to it and are not listed."""
    fp8_types = tuple(c.fp8_type for c in converters)
    found, claimed = [], []
    for fqn, module in model.named_modules():
        if any(fqn.startswith(prefix) for prefix in claimed):
            continue
        if isinstance(module, fp8_types):
            entry = Found(fqn, module, None, None)
        else:
            converter = next((c for c in converters if c.matches(module)), None)
            reason = None if converter is not None else _unconvertible_reason(module)
            if converter is None and reason is None:
                continue
            entry = Found(fqn, module, converter, reason)
        found.append(entry)
        claimed.append(f"{fqn}." if fqn else "")
    return found


def matmul_modules(model: nn.Module, linear_subclasses: Sequence[type] = ()) -> list[tuple[str, nn.Module]]:
    """``(qualified name, module)`` of every matmul module of ``model`` that a
    :class:`~fp8train.nn.report.ConversionReport` would list: convertible, converted, or
    known but not convertible (an ``nn.Linear`` subclass not in ``linear_subclasses``)."""
    return [(f.fqn, f.module) for f in find_matmul_modules(model, matmul_converters(linear_subclasses))]


def linear_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(qualified name, module)``, in ``named_modules`` order, of every module of
    ``model`` whose GEMMs :func:`~fp8train.diagnostics.gemm_capture.capture_linear_calls` sees: the
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
