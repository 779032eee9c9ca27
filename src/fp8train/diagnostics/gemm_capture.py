"""What a recipe's quantization does to the GEMMs of real Linear layers.

Two steps, used by :func:`fp8train.inspect` (every recipe, one step in high precision) and
by the trainer's telemetry (the recipe in use, every N steps):

1. :func:`capture_linear_calls` hooks Linear modules and keeps, per call, the operands
   their GEMMs saw: the input and weight (in the autocast dtype where ``torch.autocast``
   is on, as the GEMM gets them), the gradient of the output from the backward, and, for
   a module with delayed-scaling state, the scales each role was (or would be) quantized
   with.
2. :func:`linear_call_statistics` quantizes those tensors as a recipe's operand plan says,
   slot by slot, and runs each GEMM in FP8 (``scaled_mm``) next to a float64 GEMM of the
   high-precision operands, giving one :class:`NumericsRecord` per (GEMM, operand) and
   one per GEMM result (statistics: :mod:`fp8train.diagnostics.statistics`).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, replace
from typing import Iterator, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from ..quant.gemm import scaled_mm
from ..quant.hadamard import random_hadamard_transform
from ..quant.operand import quantize_usage
from ..quant.scaling import delayed_scaling_update
from .statistics import count_nonfinite, finite_mask, quantization_statistics, sqnr_db
from ..quant.tensor import transpose
from ..spec.granularities import round_up
from ..spec.recipes import Recipe, recipe_label
from ..spec.roles import LAST_DIM, Gemm, Role
from ..nn.autocast import current_state
from ..nn.modules.conv1d import is_transformers_conv1d
from ..nn.delayed.state import DelayedScalingState, fp8_max_per_role
from ..nn.gemm_observers import observe_gemms
from ..nn.modules.base import Float8Module

__all__ = ["LinearCall", "NumericsRecord", "RESULT", "capture_linear_calls", "linear_call_statistics"]

RESULT = "result"
"""The ``operand`` of a record about a GEMM's own output."""


@dataclass(eq=False)
class LinearCall:
    """One call of a Linear module, as its three GEMMs saw it.

    Attributes:
        layer: the module's qualified name in the model.
        call: 0 for the module's first call in the step, 1 for its second, ...
        input: ``[M, K]``, leading dims flattened, in the dtype the GEMM used.
        weight: ``[N, K]``, likewise; ``None`` where the module's weight is not a plain
            tensor during its forward (FSDP2 hands an FP8-gathered weight: the high-precision
            weight is on no rank), which leaves only the grad_weight GEMM measurable.
        grad_output: ``[M, N]`` gradient of the output (``None`` until the backward
            reaches this call, and where the output needed no gradient).
        delayed_scale: float32 ``(3,)``, the delayed-scaling scale of each role (input,
            weight, grad_output) as this call used it (or, with FP8 off, as an FP8
            forward would have); ``None`` for a module without delayed-scaling state.
        out_features: ``N`` of the GEMM (with ``in_features``, ``K``: whether a recipe's
            alignment admits it).
    """

    layer: str
    call: int
    input: torch.Tensor
    weight: torch.Tensor | None
    grad_output: torch.Tensor | None = None
    delayed_scale: torch.Tensor | None = None
    out_features: int = 0

    @property
    def in_features(self) -> int:
        return self.input.shape[-1]


@dataclass(frozen=True)
class NumericsRecord:
    """What one recipe's quantization does to one operand (or result) of one GEMM.

    Attributes:
        layer: the module's qualified name; ``call``: which call of it (0: the first).
        recipe: the recipe's name (a mixture's description, ``hybrid(forward=..,backward=..)``;
            under :func:`fp8train.inspect`, a recipe map's one-line form, the column it is in).
        gemm: ``"output"``, ``"grad_input"`` or ``"grad_weight"``.
        operand: ``"input"``, ``"weight"``, ``"grad_output"``, or ``"result"`` for the
            GEMM's output.
        sqnr_db: SQNR of the dequantized operand against the high-precision one; for a
            result, of the FP8 GEMM (float32 output) against a float64 GEMM of the
            high-precision operands. ``inf``: exact.
        underflow_pct, saturation_pct: see :mod:`fp8train.diagnostics.statistics` (``None`` for a
            result).
        amax: largest finite magnitude of the high-precision tensor (for a result, of the
            float64 GEMM).
        nonfinite: NaN and inf values in the high-precision operand (for a result, in the
            FP8 GEMM's output).
        scale_min, scale_max: the range of the scales used (``None`` for a result).
        granularity, format: the operand's scaling groups and data format (``"E4M3"``,
            ``"E5M2"``, ``"E2M1"``; ``None`` for a result).
        data_bits: the bits of the GEMM's operand data: 8 (FP8) or 4 (E2M1), for the
            operand's record and the result's alike (which thresholds apply).
        flags: the thresholds this record falls past (set by :func:`fp8train.inspect`).
    """

    layer: str
    call: int
    recipe: str
    gemm: str
    operand: str
    sqnr_db: float
    underflow_pct: float | None
    saturation_pct: float | None
    amax: float
    nonfinite: int
    scale_min: float | None = None
    scale_max: float | None = None
    granularity: str | None = None
    format: str | None = None
    data_bits: int = 8
    flags: tuple[str, ...] = ()

    def with_flags(self, flags: tuple[str, ...]) -> "NumericsRecord":
        """A copy carrying ``flags``."""
        return replace(self, flags=flags)


def _gemm_operand_dtype(tensor: torch.Tensor) -> torch.dtype:
    """The dtype a Linear's GEMM computes in for ``tensor``: the autocast dtype where
    ``torch.autocast`` is on for its device, else its own."""
    device_type = tensor.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return tensor.dtype


def _delayed_scale_in_use(module: nn.Module) -> torch.Tensor | None:
    """A copy of ``module``'s delayed-scaling scales as its next (or, inside an FP8
    forward, current) quantization uses them; ``None`` without delayed-scaling state."""
    delayed = getattr(module, "delayed_state", None)
    if not isinstance(delayed, DelayedScalingState):
        return None
    state = current_state()
    # With FP8 off, a forward update recorded outside an autocast and not yet applied is
    # one an FP8 forward would first apply.
    return delayed.next_forward_scale(update_owed=state is not None and not state.enabled)


@contextlib.contextmanager
def capture_linear_calls(modules: Mapping[str, nn.Module]) -> Iterator[list[LinearCall]]:
    """Record every GEMM call of ``modules`` (``{qualified name: module}``) in the block.

    ``nn.Linear`` and transformers' ``Conv1D`` are seen through forward hooks; a
    :class:`~fp8train.nn.modules.linear.Float8Module` (``Float8Linear``, ``Float8Conv1D``,
    ``Float8MultiheadAttention``, FP8 on or off) through
    :func:`~fp8train.nn.gemm_observers.observe_gemms`, one call per GEMM it runs, which also
    shows the GEMMs no hook sees (an attention's in-projection: one packed GEMM for
    self-attention, else two or three). Other modules record nothing.

    Yields the list the calls are appended to, in the order they ran; each call's
    ``grad_output`` is filled in when the backward reaches it. Tensors are copied (a
    later in-place change cannot alter them); the hooks are removed on exit. Eager calls
    only: a ``torch.compile``'d model runs no hooks (run the step eagerly).
    """
    calls: list[LinearCall] = []
    counts: dict[str, int] = {}
    fp8_names = {id(module): name for name, module in modules.items() if isinstance(module, Float8Module)}

    def record(name: str, module: nn.Module, input_hp: torch.Tensor, weight: torch.Tensor, output) -> None:
        dtype = _gemm_operand_dtype(input_hp)
        call = LinearCall(
            layer=name,
            call=counts.get(name, 0),
            input=input_hp.detach().reshape(-1, input_hp.shape[-1]).to(dtype, copy=True),
            weight=_plain_weight(weight, dtype),
            delayed_scale=_delayed_scale_in_use(module),
            out_features=weight.shape[0],
        )
        counts[name] = call.call + 1
        calls.append(call)
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(lambda grad: _keep_grad_output(call, module, grad))

    def observer(module, input_hp, weight, output) -> None:
        name = fp8_names.get(id(module))
        if name is not None:
            record(name, module, input_hp, weight, output)

    def hook(name: str):
        def after_forward(module, args, kwargs, output):
            input_hp = args[0] if args else kwargs[_input_name(module)]
            weight = module.weight.t() if is_transformers_conv1d(module) else module.weight
            record(name, module, input_hp, weight, output)

        return after_forward

    handles = []
    try:
        for name, module in modules.items():
            if id(module) not in fp8_names:
                handles.append(module.register_forward_hook(hook(name), with_kwargs=True))
        with observe_gemms(observer):
            yield calls
    finally:
        for handle in handles:
            handle.remove()


def _input_name(module: nn.Module) -> str:
    """The keyword of a hooked module's input: ``input`` (``nn.Linear``) or ``x`` (``Conv1D``)."""
    return "x" if is_transformers_conv1d(module) else "input"


def _plain_weight(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """A contiguous copy of ``weight`` ``[out, in]`` in ``dtype``; ``None`` where it is not a
    plain tensor (FSDP2's FP8-gathered weight: the high-precision weight is on no rank)."""
    if not isinstance(weight, torch.Tensor) or type(weight.detach()) is not torch.Tensor:
        return None
    return weight.detach().to(dtype, copy=True, memory_format=torch.contiguous_format)


def _keep_grad_output(call: LinearCall, module: nn.Module, grad: torch.Tensor) -> None:
    call.grad_output = grad.detach().reshape(-1, grad.shape[-1]).clone()
    if call.delayed_scale is not None:
        # grad_output's scale as the backward about to run uses it.
        call.delayed_scale[Role.GRAD_OUTPUT.index] = module.fp8_scale[Role.GRAD_OUTPUT.index]


def _pad_rows(t: torch.Tensor, multiple: int) -> torch.Tensor:
    rows = t.shape[0]
    padded = round_up(rows, multiple)
    return t if padded == rows else F.pad(t, (0, 0, 0, padded - rows))


def _role_scales(call: LinearCall, recipe: Recipe, tensors: dict[Role, torch.Tensor]) -> torch.Tensor:
    """Delayed scaling's per-role scales for ``call``: the module's own where it has
    delayed-scaling state; else what a history holding only these tensors' amaxes gives
    (the scale after one step: ``fp8_max / amax / 2**margin``). ``recipe``: the delayed part
    of the recipe measured."""
    if call.delayed_scale is not None:
        return call.delayed_scale
    amaxes = [
        tensors[role].abs().amax().to(torch.float32) if role in tensors else torch.zeros((), dtype=torch.float32)
        for role in Role
    ]
    history = torch.stack(amaxes).unsqueeze(0)
    scale = torch.ones(len(Role), dtype=torch.float32)
    delayed_scaling_update(history, scale, fp8_max_per_role(recipe), margin=recipe.margin, algo="max")
    return scale


def linear_call_statistics(
    call: LinearCall, recipe: Recipe, *, backend: str = "auto", label: str | None = None
) -> list[NumericsRecord]:
    """Quantize ``call``'s operands as ``recipe`` would and measure every FP8 GEMM.

    For each GEMM the recipe runs in FP8 (a GEMM it keeps in high precision has no
    records) whose operands were captured: one record per operand, then one for its
    result. The token dim is zero-padded to the recipe's alignment, as
    :class:`~fp8train.nn.modules.linear.Float8Linear` pads it (padding changes no scale, no sum,
    and no statistic). An operand quantized through NVFP4's Hadamard transform is measured
    against the transformed tensor (what its codes hold); stochastic rounding draws from a
    fork of the default generator, so measuring leaves the training's random stream as it was.

    Args:
        call: a captured call.
        recipe: the recipe to measure; it must be able to convert this layer (its dims
            meet the recipe's alignment).
        backend: the FP8 GEMM backend (see :func:`fp8train.quant.scaled_mm`).
        label: the records' ``recipe`` (default: the recipe's name, :func:`~fp8train.spec.recipes.recipe_label`).
    """
    # Stochastic rounding draws from the default generator: measuring must not move it.
    devices = [call.input.device.index or 0] if call.input.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        return _measure(call, recipe, backend, recipe_label(recipe) if label is None else label)


def _measure(call: LinearCall, recipe: Recipe, backend: str, label: str) -> list[NumericsRecord]:
    plan = recipe.operand_plan
    tensors = {
        role: t
        for role, t in ((Role.INPUT, call.input), (Role.WEIGHT, call.weight), (Role.GRAD_OUTPUT, call.grad_output))
        if t is not None
    }
    padded = {role: t if role is Role.WEIGHT else _pad_rows(t, plan.alignment) for role, t in tensors.items()}
    scales = _role_scales(call, recipe.delayed_scaling, tensors) if plan.delayed else None
    records, last_dim = [], {}
    for gemm in Gemm:
        if not plan.quantizes(gemm) or any(usage.role not in tensors for usage in gemm.usages):
            continue
        operands_fp8, operands_hp = [], []
        for usage in gemm.usages:
            scale = None if scales is None else scales[usage.role.index]
            oriented = (lambda t: t) if usage.axis == LAST_DIM else (lambda t: t.t())  # noqa: E731
            if plan.reuses_last_dim(usage) and usage.role in last_dim:
                # The transpose of the role's last-dim quantization: the same codes, the same statistics.
                qt, stats = transpose(last_dim[usage.role][0]), last_dim[usage.role][1]
            else:
                qt = quantize_usage(plan, usage, padded[usage.role], scale)
                reference = _quantized_domain(plan.operand(usage), padded[usage.role], tensors[usage.role].shape)
                stats = quantization_statistics(oriented(reference), qt)
            if usage.axis == LAST_DIM:
                last_dim[usage.role] = (qt, stats)
            op = plan.operand(usage)
            records.append(
                NumericsRecord(
                    layer=call.layer, call=call.call, recipe=label, gemm=gemm.value,
                    operand=usage.role.value, granularity=str(op.granularity), format=op.format.name,
                    data_bits=op.format.bits, **stats,
                )
            )
            operands_fp8.append(qt)
            operands_hp.append(oriented(padded[usage.role]))
        records.append(_result_record(call, recipe, label, gemm, operands_fp8, operands_hp, backend))
    return records


def _quantized_domain(operand, padded: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """The values ``operand``'s codes approximate, in the captured tensor's ``shape``: the
    tensor itself, or (NVFP4's grad_weight operands) its Hadamard transform along the
    scaled axis, taken over the padded tensor as the quantizer takes it. The GEMM's result
    is compared in the original domain (the transforms of its two operands cancel)."""
    if not operand.rule.rht:
        return padded[: shape[0]]
    return random_hadamard_transform(padded, operand.axis)[: shape[0]]


def _result_record(call: LinearCall, recipe: Recipe, label: str, gemm: Gemm, operands_fp8, operands_hp, backend: str):
    """The record of ``gemm``'s result: its FP8 GEMM (float32 output) against a float64 GEMM
    of the high-precision operands."""
    result_fp8 = scaled_mm(*operands_fp8, torch.float32, backend=backend)
    a_hp, b_hp = (t.to(torch.float64) for t in operands_hp)
    result_hp = a_hp @ b_hp.t()
    finite = finite_mask(result_hp)
    finite_hp = result_hp if finite is None else result_hp[finite]
    return NumericsRecord(
        layer=call.layer, call=call.call, recipe=label, gemm=gemm.value, operand=RESULT,
        sqnr_db=sqnr_db(result_hp, result_fp8),
        underflow_pct=None, saturation_pct=None,
        amax=float(finite_hp.abs().amax()) if finite_hp.numel() else math.nan,
        nonfinite=count_nonfinite(result_fp8),
        data_bits=max(recipe.operand_plan.operand(usage).format.bits for usage in gemm.usages),
    )

