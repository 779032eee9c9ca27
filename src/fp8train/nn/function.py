"""The autograd of a Linear layer whose three GEMMs run in FP8, driven by an operand plan.

Notation (:mod:`fp8train.spec.roles`): ``y = x W^T + b`` with ``x[M,K]``, ``W[N,K]``,
``dy[M,N]``; the output, grad_input and grad_weight GEMMs each take two K-last operands.
Every slot is quantized as the recipe's :class:`~fp8train.spec.plan.OperandPlan` says: the
last-dim usage of a tensor with ``axis=-1``, its first-dim usage with ``axis=0`` and
transposed, or, where the plan allows (symmetric granularities), as the transpose of the
last-dim quantization.

What the backward keeps of the input: where the grad_weight GEMM runs in FP8, the forward
quantizes the input's first-dim usage right away and saves only that FP8 operand (data and
scales, through ``save_for_backward``), not the high-precision input; where it runs in high
precision, or the caller asks for it (``save_fp8_input=False``), the high-precision input.
"""

from __future__ import annotations


import torch

from ..quant.cast import torch_dtype
from ..quant.gathered import Float8GatheredActivation
from ..quant.gemm import scaled_mm
from ..quant.quantize import quantize, quantize_both
from ..quant.tensor import QuantizedTensor, transpose
from ..quant.weight import Float8GatheredWeight
from ..spec.plan import Operand, OperandPlan
from ..spec.roles import LAST_DIM, Role, Usage
from .amax import record_amax
from .amax_reduction import update_grad_output
from .autocast import current_state

__all__ = ["Float8LinearFunction", "quantize_operand", "quantize_usage", "quantize_both_usages"]


def quantize_operand(
    plan: OperandPlan, op: Operand, t_hp: torch.Tensor, scale: torch.Tensor | None = None
) -> QuantizedTensor:
    """Quantize ``t_hp`` as the slot ``op`` of ``plan`` says, in ``t_hp``'s orientation.

    Args:
        plan: the recipe's operand plan (amax epsilon, E8M0 rule).
        op: the slot's :class:`~fp8train.spec.plan.Operand`.
        t_hp: the high-precision tensor of ``op.role``.
        scale: the delayed-scaling scale of the role, or ``None``.
    """
    return quantize(t_hp, op.granularity, axis=op.axis, scale=scale, **_quantize_options(plan, op))


def _quantize_options(plan: OperandPlan, op: Operand) -> dict:
    """The arguments of :func:`quantize` that ``op`` and ``plan`` fix for a slot."""
    return dict(
        dtype=torch_dtype(op.format),
        power_2_scales=op.power_2_scales,
        amax_epsilon=plan.amax_epsilon,
        mx_scale_rule=plan.mx_scale_rule,
    )


def quantize_usage(
    plan: OperandPlan,
    usage: Usage,
    t_hp: torch.Tensor,
    scale: torch.Tensor | None = None,
    last_dim: QuantizedTensor | None = None,
) -> QuantizedTensor:
    """The K-last operand of ``usage`` from the high-precision tensor ``t_hp``.

    Args:
        plan: the recipe's operand plan.
        usage: the slot; a first-dim usage comes back transposed.
        t_hp: the tensor of ``usage.role``, 2-D.
        scale: the delayed-scaling scale of the role, or ``None``.
        last_dim: the role's last-dim quantization, which a first-dim usage reuses (as its
            transpose) where the plan allows.
    """
    if last_dim is not None and plan.reuses_last_dim(usage):
        return transpose(last_dim)
    qt = quantize_operand(plan, plan.operand(usage), t_hp, scale)
    return qt if usage.axis == LAST_DIM else transpose(qt)


def quantize_both_usages(
    plan: OperandPlan, last: Usage, first: Usage, t_hp: torch.Tensor, scale: torch.Tensor | None = None
) -> tuple[QuantizedTensor, QuantizedTensor]:
    """The K-last operands of one role's last-dim usage ``last`` and first-dim usage
    ``first``, as two :func:`quantize_usage` calls give them; where the plan quantizes the
    two alike (same granularity, format and scale rule, computed scales), from one read of
    ``t_hp`` (:func:`~fp8train.quant.quantize.quantize_both`)."""
    op_last, op_first = plan.operand(last), plan.operand(first)
    alike = (op_last.granularity, op_last.format, op_last.power_2_scales) == (
        op_first.granularity,
        op_first.format,
        op_first.power_2_scales,
    )
    if scale is not None or plan.reuses_last_dim(first) or not alike:
        last_qt = quantize_usage(plan, last, t_hp, scale)
        return last_qt, quantize_usage(plan, first, t_hp, scale, last_qt)
    last_qt, first_qt = quantize_both(t_hp, op_last.granularity, **_quantize_options(plan, op_last))
    return last_qt, transpose(first_qt)


def _role_scale(scale: torch.Tensor | None, role: Role) -> torch.Tensor | None:
    return None if scale is None else scale[role.index]


def _record_forward_amaxes(amax_history, input_hp, weight_hp) -> None:
    _record_observed_amax(amax_history, Role.INPUT, input_hp)
    _record_observed_amax(amax_history, Role.WEIGHT, weight_hp)


def _record_observed_amax(amax_history, role: Role, t) -> None:
    """Record ``max|t|`` for ``role``; of a tensor gathered in FP8 (weight, input or
    grad_output), this rank's shard amax, which the step's all-reduce makes global."""
    if not isinstance(t, Float8GatheredWeight):
        record_amax(amax_history, role.index, t)
    elif t.fp8_shard_amax is not None:
        record_amax(amax_history, role.index, t.fp8_shard_amax)


def _gathered_operands(
    plan: OperandPlan, gathered: Float8GatheredActivation, last: Usage, first: Usage, needs_first: bool
) -> tuple[QuantizedTensor, QuantizedTensor | None]:
    """The K-last operands of an activation that arrived all-gathered in FP8 (sequence
    parallelism): its last-dim usage ``last`` and, where ``needs_first``, its first-dim
    usage ``first``.

    Raises:
        ValueError: the payload is not quantized as this layer's plan quantizes ``last``
            (it was gathered for another recipe).
    """
    op = plan.operand(last)
    rowwise = gathered.fp8_rowwise
    if rowwise.granularity is not op.granularity or rowwise.dtype != torch_dtype(op.format):
        raise ValueError(
            f"{op.role.value} arrived all-gathered in FP8 as {str(rowwise.granularity)!r} {rowwise.dtype}, but this "
            f"layer's recipe quantizes it as {str(op.granularity)!r} {torch_dtype(op.format)}: gather it with the "
            "recipe of the layers that consume it (e.g. PrepareFloat8ModuleInput(recipe=...))"
        )
    if not needs_first:
        return rowwise, None
    first_operand = gathered.fp8_columnwise
    return rowwise, transpose(rowwise) if first_operand is None else first_operand


def _update_grad_output_scale(ctx) -> None:
    """Delayed scaling: grad_output's scale is used once per step. Single process, rescale
    and roll right after use; distributed, once for all modules at the end of backward."""
    state = current_state()
    group = state.amax_reduction_group if state else None
    update_grad_output(ctx.amax_history, ctx.scale, ctx.delayed_recipe, group)


class Float8LinearFunction(torch.autograd.Function):
    """Autograd of ``x @ W^T + b`` with FP8 GEMMs; ``x`` is 2-D ``[M, K]`` here.

    ``scale`` and ``amax_history`` are delayed scaling's buffers (``None`` otherwise; a
    ``None`` history with a scale only reads the scales); ``forward_scale``, where given,
    the scales a recompute (activation checkpointing) quantizes the input and weight with,
    recording no amax (:class:`~fp8train.nn.delayed.DelayedTensors`). A weight that arrives as a
    :class:`~fp8train.quant.weight.Float8GatheredWeight` is used as gathered.
    ``save_fp8_input``: keep the input for the backward as its FP8 grad_weight operand
    rather than in high precision, where that GEMM runs in FP8 (pass ``False`` without grad:
    nothing is saved then, so the quantization would be wasted).
    """

    @staticmethod
    def forward(
        ctx, input_hp, weight_hp, bias, plan, backend, scale, amax_history, delayed_recipe, save_fp8_input, forward_scale
    ):
        if forward_scale is None:
            forward_scale = scale
            if amax_history is not None:
                _record_forward_amaxes(amax_history, input_hp, weight_hp)
        input_scale = _role_scale(forward_scale, Role.INPUT)
        if isinstance(input_hp, Float8GatheredActivation):  # sequence parallel: gathered in FP8
            input_fp8, input_t = _gathered_operands(
                plan, input_hp, Usage.OUTPUT_INPUT, Usage.GRAD_WEIGHT_INPUT, ctx.needs_input_grad[1]
            )
        elif _keeps_fp8_input(ctx, plan, save_fp8_input):
            input_fp8, input_t = quantize_both_usages(
                plan, Usage.OUTPUT_INPUT, Usage.GRAD_WEIGHT_INPUT, input_hp, input_scale
            )
        else:
            input_fp8, input_t = quantize_usage(plan, Usage.OUTPUT_INPUT, input_hp, input_scale), None
        if isinstance(weight_hp, Float8GatheredWeight):
            weight_fp8 = weight_hp.fp8_rowwise
        else:
            weight_fp8 = quantize_usage(plan, Usage.OUTPUT_WEIGHT, weight_hp, _role_scale(forward_scale, Role.WEIGHT))
        output = scaled_mm(input_fp8, weight_fp8, input_hp.dtype, backend=backend, bias=bias)

        ctx.plan, ctx.backend, ctx.has_bias = plan, backend, bias is not None
        ctx.delayed_recipe = delayed_recipe
        saved_input, input_scale_inv = _save_input(ctx, input_hp, input_t)
        saved_weight, weight_scale_inv = _save_weight(ctx, plan, weight_hp, weight_fp8)
        saved_delayed = _hold_delayed_state(ctx, scale, amax_history)
        ctx.save_for_backward(saved_input, input_scale_inv, saved_weight, weight_scale_inv, *saved_delayed)
        ctx.input_dtype, ctx.weight_dtype = input_hp.dtype, weight_hp.dtype
        return output

    @staticmethod
    def backward(ctx, grad_output):
        saved_input, input_scale_inv, saved_weight, weight_scale_inv, *saved_delayed = ctx.saved_tensors
        if saved_delayed:
            ctx.scale, ctx.amax_history = saved_delayed
        plan, backend, scale = ctx.plan, ctx.backend, ctx.scale
        weight_hp, weight_fp8 = _restore_weight(ctx, saved_weight, weight_scale_inv)
        grad_output = grad_output.contiguous()
        if scale is not None:
            _record_observed_amax(ctx.amax_history, Role.GRAD_OUTPUT, grad_output)
        grad_output_scale = _role_scale(scale, Role.GRAD_OUTPUT)
        usages = (Usage.GRAD_INPUT_GRAD_OUTPUT, Usage.GRAD_WEIGHT_GRAD_OUTPUT)
        if isinstance(grad_output, Float8GatheredActivation):  # sequence parallel: gathered in FP8
            # The bias is added after the reduce-scatter there, so no bias gradient here.
            assert not (ctx.has_bias and ctx.needs_input_grad[2]), "a gathered grad_output has no bias to reduce"
            grad_output_fp8, grad_output_t = _gathered_operands(plan, grad_output, *usages, ctx.needs_input_grad[1])
        elif ctx.needs_input_grad[1] and plan.quantizes_usage(Usage.GRAD_WEIGHT_GRAD_OUTPUT):
            grad_output_fp8, grad_output_t = quantize_both_usages(plan, *usages, grad_output, grad_output_scale)
        else:
            grad_output_fp8 = quantize_usage(plan, usages[0], grad_output, grad_output_scale)
            grad_output_t = None

        grad_input = grad_weight = None
        if ctx.needs_input_grad[0]:
            weight_t = weight_hp.fp8_columnwise if isinstance(weight_hp, Float8GatheredWeight) else None
            if weight_t is None:
                weight_scale = _role_scale(scale, Role.WEIGHT)
                weight_t = quantize_usage(plan, Usage.GRAD_INPUT_WEIGHT, weight_hp, weight_scale, weight_fp8)
            grad_input = scaled_mm(grad_output_fp8, weight_t, ctx.input_dtype, backend=backend)
        if ctx.needs_input_grad[1]:
            input_t = _restore_input(ctx, saved_input, input_scale_inv)
            grad_weight = _grad_weight(ctx, grad_output, grad_output_t, input_t)
        grad_bias = grad_output.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        if scale is not None:
            _update_grad_output_scale(ctx)
        return grad_input, grad_weight, grad_bias, None, None, None, None, None, None, None


def _keeps_fp8_input(ctx, plan: OperandPlan, save_fp8_input: bool) -> bool:
    """Whether the backward keeps the input as its FP8 grad_weight operand: where that GEMM
    runs in FP8 and the weight needs a gradient, if ``save_fp8_input`` asks for it or the
    operand is the transpose of the forward's own (which costs nothing to keep)."""
    usage = Usage.GRAD_WEIGHT_INPUT
    wanted = save_fp8_input or plan.reuses_last_dim(usage)
    return ctx.needs_input_grad[1] and plan.quantizes_usage(usage) and wanted


def _save_input(ctx, input_hp, input_t):
    """The tensors the grad_weight GEMM needs of the input, ``(tensor, scale_inv)``.

    ``(data, scale_inv)`` of its K-last FP8 operand ``input_t`` where the forward quantized
    it (:func:`_keeps_fp8_input`); else ``(input_hp, None)``; ``(None, None)`` where the
    weight needs no gradient. The FP8 operand goes through ``save_for_backward`` as plain
    tensors (its layout on ``ctx``), so saved-tensor hooks (activation checkpointing,
    offloading) see it, and it leaves behind the emulated GEMM's converted copy
    (``gemm_cache``). Quantized in the forward rather than the backward: the same call on
    the same tensor, so the same codes and scales (delayed scaling: this forward's scale).
    """
    ctx.input_t_layout = None
    if not ctx.needs_input_grad[1]:
        return None, None
    if input_t is None:
        return input_hp, None
    ctx.input_t_layout = _layout(input_t)
    return input_t.data, input_t.scale_inv


def _restore_input(ctx, saved_input, input_scale_inv) -> torch.Tensor | QuantizedTensor:
    """The input as :func:`_save_input` kept it: its K-last FP8 operand, or high precision."""
    if ctx.input_t_layout is None:
        return saved_input
    return _rebuild(ctx.input_t_layout, saved_input, input_scale_inv)


def _layout(qt: QuantizedTensor) -> tuple:
    """What :func:`_rebuild` needs besides the tensors of ``qt``."""
    return qt.granularity, qt.axis, qt.power_2_scales


def _rebuild(layout: tuple, data: torch.Tensor, scale_inv: torch.Tensor) -> QuantizedTensor:
    granularity, axis, power_2_scales = layout
    return QuantizedTensor(
        data=data, scale_inv=scale_inv, granularity=granularity, axis=axis, power_2_scales=power_2_scales
    )


def _hold_delayed_state(ctx, scale, amax_history) -> tuple:
    """Delayed scaling's buffers for the backward (which reads grad_output's scale and
    updates its column in place): what to add to the saved tensors.

    Eagerly, nothing: they are held by reference on ``ctx``, since they change in place
    between forward and backward (the update at the autocast exit, or at the next forward),
    which a saved tensor would refuse. Under ``torch.compile`` they are saved tensors (the
    compiled backward holds them as such anyway, and compiled autograd fails on tensors
    held on ``ctx``); there the forward update waits for the backward
    (:meth:`~fp8train.nn.delayed.DelayedScalingState.defer_until_backward`).
    """
    if not torch.compiler.is_compiling():
        ctx.scale, ctx.amax_history = scale, amax_history
        return ()
    ctx.scale = ctx.amax_history = None
    return scale, amax_history


def _save_weight(ctx, plan: OperandPlan, weight_hp, weight_fp8: QuantizedTensor):
    """The tensors the grad_input GEMM needs of the weight, ``(tensor, scale_inv)``.

    Where the backward re-quantizes the weight, ``(weight_hp, None)``. Where it reuses the
    forward's FP8 weight (as its transpose), eagerly ``(None, None)`` and the
    :class:`QuantizedTensor` itself on ``ctx`` (its ``gemm_cache`` spares the backward a
    second conversion); under ``torch.compile``, which keeps no ``gemm_cache``, its
    ``(data, scale_inv)``: compiled autograd (torch 2.13) fails on the tensors of an object
    held on ``ctx`` when they are intermediates of the compiled forward.
    """
    ctx.weight_fp8 = ctx.weight_fp8_layout = None
    if not plan.reuses_last_dim(Usage.GRAD_INPUT_WEIGHT):
        return weight_hp, None
    if not torch.compiler.is_compiling():
        ctx.weight_fp8 = weight_fp8
        return None, None
    ctx.weight_fp8_layout = _layout(weight_fp8)
    return weight_fp8.data, weight_fp8.scale_inv


def _restore_weight(ctx, saved_weight, weight_scale_inv):
    """``(weight_hp, weight_fp8)`` as :func:`_save_weight` kept them (either may be ``None``)."""
    if ctx.weight_fp8_layout is not None:
        return None, _rebuild(ctx.weight_fp8_layout, saved_weight, weight_scale_inv)
    return saved_weight, ctx.weight_fp8


def _grad_weight(ctx, grad_output, grad_output_t, input_t) -> torch.Tensor:
    """``dW = dy^T @ x``: in FP8 per the plan, or in high precision where the plan says.

    ``grad_output_t`` is grad_output's K-last FP8 operand for this GEMM (``None`` where it
    runs in high precision); ``input_t`` the input's, or the high-precision input, which
    is quantized here where the plan quantizes it.
    """
    plan, scale = ctx.plan, ctx.scale
    if not plan.quantizes_usage(Usage.GRAD_WEIGHT_INPUT):
        return (grad_output.t() @ input_t).to(ctx.weight_dtype)
    if not isinstance(input_t, QuantizedTensor):
        input_t = quantize_usage(plan, Usage.GRAD_WEIGHT_INPUT, input_t, _role_scale(scale, Role.INPUT))
    return scaled_mm(grad_output_t, input_t, ctx.weight_dtype, backend=ctx.backend)
