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

from ...quant.gemm.bf16 import matmul_bf16_via_float32
from ...quant.operand import check_shapes, checked_role_quantizer
from ...quant.prequantized import PrequantizedTensor
from ...quant.quantize import PLAIN_TENSOR_TYPES
from ...quant.tensor import QuantizedTensor, quantized_tensor
from ...spec.plan import OperandPlan
from ...spec.roles import Role, Usage
from ..autocast import current_state
from ..delayed.amax import record_forward_amaxes, record_grad_output_amax
from ..delayed.reduction import queue_end_backward, update_grad_output
from ..delayed.state import DelayedTensors
from .call import NO_DELAYED_STATE, LinearCall, linear_call

__all__ = ["Float8LinearFunction", "LinearCall", "linear_call", "NO_DELAYED_STATE"]


def _prequantized_operands(
    plan: OperandPlan, t: PrequantizedTensor, last: Usage, needs_first: bool
) -> tuple[QuantizedTensor, QuantizedTensor | None]:
    """The K-last operands of a tensor that arrived quantized (gathered in FP8 by FSDP2 or
    sequence parallelism): its last-dim usage ``last``, checked against the plan, and,
    where ``needs_first``, its first-dim usage."""
    return t.last_dim_operand(plan.operand(last)), t.first_dim_operand() if needs_first else None


def _update_grad_output_scale(ctx, delayed_grad_output: bool) -> None:
    """Delayed scaling: grad_output's scale is used once per step. Single process, rescale
    and roll right after use; distributed, once for all modules at the end of backward.
    Where grad_output's scale is not delayed, the end of backward still applies the
    forward updates owed there."""
    state = current_state()
    group = state.amax_reduction_group if state else None
    if delayed_grad_output:
        update_grad_output(ctx.amax_history, ctx.scale, ctx.call.delayed_recipe, group)
    elif not torch.compiler.is_compiling():
        queue_end_backward(group)




class Float8LinearFunction(torch.autograd.Function):
    """Autograd of ``x @ W^T + b`` with FP8 GEMMs; ``x`` is 2-D ``[M, K]`` here:
    ``apply(input_hp, weight_hp, bias, call, delayed)``, ``call`` a :class:`LinearCall`.

    ``delayed`` (:class:`~fp8train.nn.delayed.state.DelayedTensors`): ``scale`` and
    ``amax_history`` are delayed scaling's buffers (``None`` otherwise,
    :data:`NO_DELAYED_STATE`; a ``None`` history with a scale only reads the scales);
    ``forward_scale``, where given, the scales a recompute (activation checkpointing)
    quantizes the input and weight with, recording no amax. A tensor that arrives as a
    :class:`~fp8train.quant.prequantized.PrequantizedTensor` (a weight FSDP2 gathered in FP8,
    an input or grad_output that sequence parallelism did) gives its operands as they are.
    """

    @staticmethod
    def forward(ctx, input_hp, weight_hp, bias, call: LinearCall, delayed: DelayedTensors):
        launch = call.kernels.launch  # None: no block (the checked kernels', maybe traced; no CPU kernel)
        if launch is None:
            output = _forward(ctx, input_hp, weight_hp, bias, call, delayed)
        else:
            with launch:
                output = _forward(ctx, input_hp, weight_hp, bias, call, delayed)
        ctx.input_dtype, ctx.weight_dtype = input_hp.dtype, weight_hp.dtype
        return output

    @staticmethod
    def backward(ctx, grad_output):
        launch = ctx.call.kernels.launch
        if launch is None:
            grads = _backward(ctx, grad_output)
        else:
            with launch:
                grads = _backward(ctx, grad_output)
        return (*grads, None, None)


def _forward(ctx, input_hp, weight_hp, bias, call: LinearCall, delayed: DelayedTensors):
    """:meth:`Float8LinearFunction.forward`'s work, inside its kernels' block."""
    plan, kernels = call.plan, call.kernels
    scale, amax_history, forward_scale = delayed
    input_amax = weight_amax = None  # where the quantizers record the amaxes (else recorded here)
    if forward_scale is None:
        forward_scale = scale
        if amax_history is not None:
            input_amax, weight_amax = record_forward_amaxes(amax_history, input_hp, weight_hp, kernels)
    # A role's delayed scale, or None: inline, not a helper (a call less each, issue 38).
    input_scale = None if forward_scale is None else forward_scale[Role.INPUT.index]
    input_q = _pad_tokens(ctx, input_hp, call.alignment, kernels.bound)
    if kernels.bound:  # the shapes the checked doors would check, once per shape (a set lookup)
        (m, k), n = input_q.shape, weight_hp.shape[0]
        shape = (m, k, n, scale is not None)
        if shape not in call.checked_shapes:
            check_shapes(plan, *shape)
            call.checked_shapes.add(shape)
    # (each type test first: a plain tensor makes no isinstance() call, issue 38)
    if type(input_hp) not in PLAIN_TENSOR_TYPES and isinstance(input_hp, PrequantizedTensor):  # sequence parallel
        input_fp8, input_t = _prequantized_operands(plan, input_hp, Usage.OUTPUT_INPUT, ctx.needs_input_grad[1])
    elif ctx.needs_input_grad[1] and call.keeps_fp8_input:  # the plan asked once
        input_fp8, input_t = kernels.input.both(input_q, input_scale, input_amax)
    else:
        input_fp8, input_t = kernels.input.last(input_q, input_scale, input_amax), None
    if type(weight_hp) not in PLAIN_TENSOR_TYPES and isinstance(weight_hp, PrequantizedTensor):  # FSDP2: gathered
        weight_fp8 = weight_hp.last_dim_operand(plan.operand(Usage.OUTPUT_WEIGHT))
    else:
        weight_scale = None if forward_scale is None else forward_scale[Role.WEIGHT.index]
        weight_fp8 = kernels.weight.last(weight_hp, weight_scale, weight_amax)
    output = kernels.mm(input_fp8, weight_fp8, input_hp.dtype, bias, rows=ctx.gemm_rows)
    tokens = input_hp.shape[0]
    output = output if output.shape[0] == tokens else output[:tokens]

    ctx.call, ctx.has_bias = call, bias is not None
    saved_input = _save_input(ctx, input_hp, input_t)
    saved_weight = _save_weight(ctx, weight_hp, weight_fp8)
    if kernels.bound:  # never traced: the delayed buffers held on ctx (_hold_delayed_state), inline
        ctx.scale, ctx.amax_history, saved_delayed = scale, amax_history, ()
    else:
        saved_delayed = _hold_delayed_state(ctx, scale, amax_history)
    # The scales this forward used, where the backward quantizes with them (an update may
    # replace the buffer's in place before it runs): a copy, saved.
    ctx.keeps_forward_scale = call.keeps_forward_scale and forward_scale is not None
    saved_forward_scale = (forward_scale.detach().clone(),) if ctx.keeps_forward_scale else ()
    ctx.save_for_backward(*saved_input, *saved_weight, *saved_delayed, *saved_forward_scale)
    return output


def _backward(ctx, grad_output):
    """:meth:`Float8LinearFunction.backward`'s work, inside its kernels' block:
    ``(grad_input, grad_weight, grad_bias)``."""
    saved = ctx.saved_tensors
    saved_input, saved_weight, saved_delayed = saved[:_SAVED], saved[_SAVED : 2 * _SAVED], saved[2 * _SAVED :]
    ctx.forward_scale = saved_delayed[-1] if ctx.keeps_forward_scale else None
    if saved_delayed[ctx.keeps_forward_scale :]:  # (more than the forward's scale; no len() call, issue 38)
        ctx.scale, ctx.amax_history = saved_delayed[:2]
    plan, kernels, scale = ctx.call.plan, ctx.call.kernels, ctx.scale
    if ctx.forward_scale is None:
        ctx.forward_scale = scale
    if ctx.weight_fp8_layout is None:
        weight_hp, weight_fp8 = saved_weight[0], None
    else:
        weight_hp, weight_fp8 = None, _restored(ctx, ctx.weight_fp8_layout, *saved_weight)
    if not kernels.bound:  # (the bound quantizers make their input contiguous themselves)
        grad_output = grad_output.contiguous()
    # grad_output's tokens padded as the forward padded the input's, for its quantization.
    grad_output_q = torch.constant_pad_nd(grad_output, (0, 0, 0, ctx.pad_rows)) if ctx.pads else grad_output
    # A mixture with a delayed forward only: grad_output's scale is its own, no history.
    delayed_grad_output = scale is not None and Role.GRAD_OUTPUT in plan.delayed_roles
    grad_output_amax = None  # where its quantizer records its amax (else recorded here)
    if delayed_grad_output:
        grad_output_amax = record_grad_output_amax(ctx.amax_history, grad_output, kernels)
    grad_output_scale = scale[Role.GRAD_OUTPUT.index] if delayed_grad_output else None
    if type(grad_output) not in PLAIN_TENSOR_TYPES and isinstance(grad_output, PrequantizedTensor):  # sequence parallel
        # The bias is added after the reduce-scatter there, so no bias gradient here.
        assert not (ctx.has_bias and ctx.needs_input_grad[2]), "a gathered grad_output has no bias to reduce"
        needs_first = ctx.needs_input_grad[1]
        usage = Usage.GRAD_INPUT_GRAD_OUTPUT
        grad_output_fp8, grad_output_t = _prequantized_operands(plan, grad_output, usage, needs_first)
    else:
        # The bound kernels take the plain tensors the forward checked; a grad_output of
        # another kind (a DTensor) takes the checked door.
        role = kernels.grad_output if type(grad_output) is torch.Tensor else checked_role_quantizer(plan, Role.GRAD_OUTPUT)
        if ctx.needs_input_grad[1] and ctx.call.quantizes_grad_weight:
            grad_output_fp8, grad_output_t = role.both(grad_output_q, grad_output_scale, grad_output_amax)
        else:
            grad_output_fp8, grad_output_t = role.last(grad_output_q, grad_output_scale, grad_output_amax), None

    grad_input = grad_weight = None
    if ctx.needs_input_grad[0]:
        if type(weight_hp) not in _PLAIN_OR_NONE and isinstance(weight_hp, PrequantizedTensor):
            weight_t = weight_hp.first_dim_operand()
        else:
            weight_scale = None if scale is None else ctx.forward_scale[Role.WEIGHT.index]
            weight_t = kernels.weight.first(weight_hp, weight_scale, weight_fp8)
        grad_input = kernels.mm(grad_output_fp8, weight_t, ctx.input_dtype, rows=ctx.gemm_rows)
        tokens = grad_output.shape[0]
        grad_input = grad_input if grad_input.shape[0] == tokens else grad_input[:tokens]
    if ctx.needs_input_grad[1]:
        input_t = saved_input[0] if ctx.input_t_layout is None else _restored(ctx, ctx.input_t_layout, *saved_input)
        grad_weight = _grad_weight(ctx, grad_output, grad_output_t, input_t)
    grad_bias = grad_output.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
    if scale is not None:
        _update_grad_output_scale(ctx, delayed_grad_output)
    return grad_input, grad_weight, grad_bias


GEMM_ROWS = 16
"""The granule of the token rows a layer's emulated GEMMs multiply (:func:`_pad_tokens`):
FP8 hardware's multiple, and one that keeps the CPU's BLAS on the GEMM path a padded call
takes (a GEMM of one row takes its GEMV path, whose float32 sums run in another order)."""


def _pad_tokens(ctx, input_hp: torch.Tensor, alignment: int, bound: bool) -> torch.Tensor:
    """The input to quantize: its tokens padded by zero rows to the recipe's ``alignment``
    (blockwise 128, MX and 4-bit 32: blocks run along them in the grad_weight GEMM). On
    ``ctx``: ``pads`` and ``pad_rows`` (grad_output is padded alike), and ``gemm_rows``, the
    tokens the emulated GEMMs multiply (``None``: all): 16 tokens padded to 128 cost 16 rows.
    Compiled, it pads always (maybe by zero rows): aligned and unaligned token counts share
    one graph. A tensor gathered in FP8 arrives aligned and quantized."""
    tokens = input_hp.shape[0]
    padded = -(-tokens // alignment) * alignment  # round_up, inline (issue 38)
    ctx.pad_rows = padded - tokens
    ctx.pads = padded != tokens or (not bound and torch.compiler.is_compiling())
    gemm_rows = -(-tokens // GEMM_ROWS) * GEMM_ROWS
    ctx.gemm_rows = gemm_rows if bound and gemm_rows != padded else None  # (compiled: the checked GEMM's whole)
    if not ctx.pads or type(input_hp) is PrequantizedTensor:  # (a type test: no call, issue 38)
        return input_hp
    return torch.constant_pad_nd(input_hp, (0, 0, 0, ctx.pad_rows))  # F.pad's op, without its four checks


# Saved tensors per operand, in _SAVED slots (None where empty): a high-precision tensor, or a
# quantized one's data, scale_inv and (NVFP4) global_amax, as QuantizedTensor.prepare_for_saving
# gives them (its layout on ctx), so that saved-tensor hooks (activation checkpointing,
# offloading) see them. Not the QuantizedTensor with its gemm_cache: the emulated GEMM's
# converted copy (4 bytes a value) would live from the forward to the backward, and an object
# on ctx outlives the backward as long as the graph is referenced; the backward converts again.
_SAVED = 3

_PLAIN_OR_NONE = (*PLAIN_TENSOR_TYPES, type(None))
"""The types of a backward's ``weight_hp`` that are no gathered weight: a plain tensor, or
``None`` where the forward's quantized weight is reused (a ``type() in`` test: no call)."""

_NOTHING_SAVED = (None,) * _SAVED


def _restored(ctx, layout: tuple, data, scale_inv, global_amax) -> QuantizedTensor:
    """The quantized operand :func:`_save_input` or :func:`_save_weight` took apart."""
    if ctx.call.kernels.bound:  # never traced: the tensor as it was, with a cache (a call less)
        return quantized_tensor(data, scale_inv, *layout, global_amax)
    return QuantizedTensor.restore_from_saved(layout, data, scale_inv, global_amax)


def _save_input(ctx, input_hp, input_t):
    """What the grad_weight GEMM needs of the input: its K-last quantized operand
    ``input_t`` where the forward quantized it (``LinearCall.keeps_fp8_input``: the same call
    on the same tensor as the backward's would be, so the same codes and scales), else
    ``input_hp``; nothing where the weight needs no gradient."""
    ctx.input_t_layout = None
    if not ctx.needs_input_grad[1]:
        return _NOTHING_SAVED
    if input_t is None:
        return input_hp, None, None
    # its saved tensors, and its layout as a plain tuple (no QuantizedLayout): inline, issue 38
    ctx.input_t_layout = (input_t.granularity, input_t.axis, input_t.power_2_scales)
    return input_t.data, input_t.scale_inv, input_t.global_amax


def _save_weight(ctx, weight_hp, weight_fp8: QuantizedTensor):
    """What the grad_input GEMM needs of the weight: the forward's quantized weight where the
    backward reuses it (as its transpose), else ``weight_hp`` (quantized again)."""
    ctx.weight_fp8_layout = None
    if not ctx.call.reuses_weight:
        return weight_hp, None, None
    # its saved tensors, and its layout as a plain tuple (no QuantizedLayout): inline, issue 38
    ctx.weight_fp8_layout = (weight_fp8.granularity, weight_fp8.axis, weight_fp8.power_2_scales)
    return weight_fp8.data, weight_fp8.scale_inv, weight_fp8.global_amax


def _hold_delayed_state(ctx, scale, amax_history) -> tuple:
    """Delayed scaling's buffers for the backward (which reads grad_output's scale and
    updates its column in place): what to add to the saved tensors.

    Eagerly, nothing: they are held by reference on ``ctx``, since they change in place
    between forward and backward (the update at the autocast exit),
    which a saved tensor would refuse. Under ``torch.compile`` they are saved tensors (the
    compiled backward holds them as such anyway, and compiled autograd fails on tensors
    held on ``ctx``); there the forward update waits for the backward
    (:meth:`~fp8train.nn.delayed.state.DelayedScalingState.defer_until_backward`).
    """
    if not torch.compiler.is_compiling():
        ctx.scale, ctx.amax_history = scale, amax_history
        return ()
    ctx.scale = ctx.amax_history = None
    return scale, amax_history


def _grad_weight(ctx, grad_output, grad_output_t, input_t) -> torch.Tensor:
    """``dW = dy^T @ x``: in FP8 per the plan, or in high precision where the plan says.

    ``grad_output_t`` is grad_output's K-last FP8 operand for this GEMM (``None`` where it
    runs in high precision); ``input_t`` the input's, or the high-precision input, which
    is quantized here where the plan quantizes it.
    """
    scale = ctx.forward_scale
    if not ctx.call.quantizes_grad_weight:
        if ctx.call.bf16_via_float32 and grad_output.dtype == input_t.dtype == torch.bfloat16:
            return matmul_bf16_via_float32(grad_output.T, input_t).to(ctx.weight_dtype)  # (.T: no call)
        return (grad_output.T @ input_t).to(ctx.weight_dtype)
    if type(input_t) is not QuantizedTensor and not isinstance(input_t, QuantizedTensor):  # the high-precision input
        input_q = torch.constant_pad_nd(input_t, (0, 0, 0, ctx.pad_rows)) if ctx.pads else input_t
        input_t = ctx.call.kernels.input.first(input_q, None if scale is None else scale[Role.INPUT.index])
    # K here is the tokens: only the first gemm_rows hold any (the rest, padding, add zeros).
    return ctx.call.kernels.mm(grad_output_t, input_t, ctx.weight_dtype, depth=ctx.gemm_rows)
