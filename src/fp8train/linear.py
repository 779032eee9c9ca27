"""``Float8Linear``: an ``nn.Linear`` whose three GEMMs run in FP8 per a recipe.

Notation (NUMERICS.md): ``y = x W^T + b`` with ``x[M,K]`` (leading dims flattened),
``W[N,K]``, ``dy[M,N]``; GEMMs are named by their output::

    output      y  = x  @ W^T     contracts K
    grad_input  dx = dy @ W       contracts N
    grad_weight dW = dy^T @ x     contracts M

Every operand enters its GEMM "K-last" with its scaling groups along that GEMM's
contraction dim: the *last-dim usage* of a tensor is quantized with ``axis=-1``, the
*first-dim usage* with ``axis=0`` and transposed. Tensors with one scale (``tensor``) or
with 128x128 tiles reuse one quantization for both usages; every other granularity is
quantized separately for each usage from the high-precision tensor.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .autocast import current_state
from .delayed import (
    FORWARD_ROLES,
    GRAD_OUTPUT,
    GRAD_OUTPUT_ROLES,
    INPUT,
    WEIGHT,
    grad_output_flush,
    record_amax,
    reduction_active,
    register,
    update_delayed_tensors,
)
from .gemm import BACKENDS, scaled_mm, transpose
from .layouts import _round_up
from .quantize import QuantizedTensor, quantize
from .recipes import (
    BlockScaling,
    DelayedScaling,
    MXFP8Scaling,
    Recipe,
    RowwiseScaling,
    TensorwiseScaling,
    from_name,
)

__all__ = ["Float8Linear", "operand_plan", "OperandPlan"]

logger = logging.getLogger(__name__)

_REUSABLE = ("tensor", "block128x128")


@dataclass(frozen=True)
class OperandPlan:
    """How each operand of each GEMM is quantized for one recipe.

    Attributes:
        granularity: role -> granularity of its last-dim usage (``input``, ``weight``,
            ``grad_output``).
        weight_grad_input_granularity: granularity of the weight in the grad_input GEMM.
        dtype: role -> FP8 dtype.
        power_2_scales: round scales down to powers of two.
        amax_epsilon: lower bound of every amax.
        grad_weight_hp: run the grad_weight GEMM in high precision.
        mx_scale_rule: E8M0 rule for MXFP8.
        m_multiple: the flattened token dim M is zero-padded to a multiple of this.
    """

    granularity: dict
    weight_grad_input_granularity: str
    dtype: dict
    power_2_scales: bool
    amax_epsilon: float
    grad_weight_hp: bool
    mx_scale_rule: str
    m_multiple: int


def operand_plan(recipe: Recipe) -> OperandPlan:
    """The :class:`OperandPlan` of ``recipe`` (see ``docs/numerics.md``)."""
    dtype = {"input": recipe.input_dtype, "weight": recipe.weight_dtype, "grad_output": recipe.grad_output_dtype}
    common = dict(dtype=dtype, grad_weight_hp=False, mx_scale_rule="ceil", amax_epsilon=0.0)
    if isinstance(recipe, (TensorwiseScaling, DelayedScaling)):
        granularity = dict.fromkeys(dtype, "tensor")
        p2 = getattr(recipe, "power_2_scales", False)
        return OperandPlan(
            granularity=granularity,
            weight_grad_input_granularity="tensor",
            power_2_scales=p2,
            m_multiple=16,
            **{**common, "amax_epsilon": getattr(recipe, "amax_epsilon", 0.0)},
        )
    if isinstance(recipe, RowwiseScaling):
        return OperandPlan(
            granularity=dict.fromkeys(dtype, "row"),
            weight_grad_input_granularity="tensor" if recipe.grad_weight_hp else "row",
            power_2_scales=recipe.power_2_scales,
            m_multiple=16,
            **{**common, "grad_weight_hp": recipe.grad_weight_hp, "amax_epsilon": recipe.amax_epsilon},
        )
    if isinstance(recipe, BlockScaling):
        granularity = {role: recipe.granularity(role) for role in dtype}
        return OperandPlan(
            granularity=granularity,
            weight_grad_input_granularity=granularity["weight"],
            power_2_scales=recipe.power_2_scales,
            m_multiple=128,
            **{**common, "amax_epsilon": recipe.amax_epsilon},
        )
    if isinstance(recipe, MXFP8Scaling):
        return OperandPlan(
            granularity=dict.fromkeys(dtype, "mx"),
            weight_grad_input_granularity="mx",
            power_2_scales=True,
            m_multiple=32,
            **{**common, "mx_scale_rule": recipe.scale_rule},
        )
    raise NotImplementedError(f"no Float8Linear plan for recipe {type(recipe).__name__}")


def _quantize(plan: OperandPlan, t: torch.Tensor, role: str, granularity: str, axis: int, scale=None) -> QuantizedTensor:
    return quantize(
        t,
        granularity,
        dtype=plan.dtype[role],
        axis=axis,
        power_2_scales=None if granularity == "mx" else plan.power_2_scales,
        amax_epsilon=plan.amax_epsilon,
        scale=scale,
        mx_scale_rule=plan.mx_scale_rule,
    )


def _first_dim_usage(plan, t_hp, role, granularity, last_usage: QuantizedTensor | None, scale=None):
    """``t^T`` as a K-last operand whose groups run along ``t``'s first dim."""
    if granularity in _REUSABLE and last_usage is not None and last_usage.granularity == granularity:
        return transpose(last_usage)
    return transpose(_quantize(plan, t_hp, role, granularity, axis=0, scale=scale))


@dataclass(frozen=True)
class _DelayedState:
    """The delayed-scaling buffers of one module, as :func:`update_delayed_tensors` takes them."""

    fp8_amax_history: torch.Tensor
    fp8_scale: torch.Tensor
    delayed_recipe: DelayedScaling


class _Float8LinearFunction(torch.autograd.Function):
    """Autograd of ``x @ W^T + b`` with FP8 GEMMs; ``x`` is 2-D ``[M, K]`` here."""

    @staticmethod
    def forward(ctx, input_hp, weight_hp, bias, plan, backend, scale, amax_history, delayed_recipe):
        delayed = scale is not None
        # A weight all-gathered in FP8 (FSDP2) arrives quantized: its shards' amaxes were
        # recorded when they were cast.
        gathered_weight = getattr(weight_hp, "fp8_rowwise", None)
        if amax_history is not None:
            record_amax(amax_history, INPUT, input_hp)
            shard_amax = getattr(weight_hp, "fp8_shard_amax", None)
            if gathered_weight is None:
                record_amax(amax_history, WEIGHT, weight_hp)
            elif shard_amax is not None:  # this rank's shard; the all-reduce makes it global
                record_amax(amax_history, WEIGHT, shard_amax)
        input_fp8 = _quantize(plan, input_hp, "input", plan.granularity["input"], -1, scale[INPUT] if delayed else None)
        weight_fp8 = gathered_weight
        if weight_fp8 is None:
            weight_fp8 = _quantize(
                plan, weight_hp, "weight", plan.granularity["weight"], -1, scale[WEIGHT] if delayed else None
            )
        output = scaled_mm(input_fp8, weight_fp8, input_hp.dtype, backend=backend, bias=bias)

        # Save FP8 where the backward reuses it, high precision where it re-quantizes.
        reuse_input = plan.granularity["input"] in _REUSABLE and not plan.grad_weight_hp
        reuse_weight = (
            plan.granularity["weight"] in _REUSABLE
            and plan.weight_grad_input_granularity == plan.granularity["weight"]
        )
        ctx.plan, ctx.backend, ctx.has_bias = plan, backend, bias is not None
        ctx.delayed_recipe = delayed_recipe
        ctx.input_fp8 = input_fp8 if reuse_input else None
        ctx.weight_fp8 = weight_fp8 if reuse_weight else None
        ctx.save_for_backward(None if reuse_input else input_hp, None if reuse_weight else weight_hp)
        # Delayed-scaling buffers change in place between forward and backward (updates at
        # autocast exit or at the next forward): hold them by reference, not as saved tensors.
        ctx.scale, ctx.amax_history = scale, amax_history
        ctx.input_dtype, ctx.weight_dtype = input_hp.dtype, weight_hp.dtype
        return output

    @staticmethod
    def backward(ctx, grad_output):
        plan, backend = ctx.plan, ctx.backend
        input_hp, weight_hp = ctx.saved_tensors
        scale, amax_history = ctx.scale, ctx.amax_history
        delayed = scale is not None
        grad_output = grad_output.contiguous()
        grad_output_scale = None
        if delayed:
            record_amax(amax_history, GRAD_OUTPUT, grad_output)
            grad_output_scale = scale[GRAD_OUTPUT]
        granularity = plan.granularity["grad_output"]
        grad_output_fp8 = _quantize(plan, grad_output, "grad_output", granularity, -1, grad_output_scale)

        grad_input = grad_weight = None
        if ctx.needs_input_grad[0]:
            weight_granularity = plan.weight_grad_input_granularity
            weight_t = getattr(weight_hp, "fp8_columnwise", None)  # gathered in FP8 (FSDP2)
            if weight_t is None:
                weight_t = _first_dim_usage(
                    plan, weight_hp, "weight", weight_granularity, ctx.weight_fp8, scale[WEIGHT] if delayed else None
                )
            grad_input = scaled_mm(grad_output_fp8, weight_t, ctx.input_dtype, backend=backend)
        if ctx.needs_input_grad[1]:
            if plan.grad_weight_hp:
                grad_weight = (grad_output.t() @ input_hp).to(ctx.weight_dtype)
            else:
                grad_output_t = _first_dim_usage(plan, grad_output, "grad_output", granularity, grad_output_fp8, grad_output_scale)
                input_t = _first_dim_usage(
                    plan, input_hp, "input", plan.granularity["input"], ctx.input_fp8, scale[INPUT] if delayed else None
                )
                grad_weight = scaled_mm(grad_output_t, input_t, ctx.weight_dtype, backend=backend)
        grad_bias = grad_output.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        if delayed:
            autocast_state = current_state()
            group = autocast_state.amax_reduction_group if autocast_state else None
            if ctx.delayed_recipe.reduce_amax and reduction_active(group):
                # One batched all-reduce for every module, when the backward pass ends.
                grad_output_flush.queue(group)
            else:
                # grad_output's scale is used once per step: rescale and roll right after use.
                update_delayed_tensors([_DelayedState(amax_history, scale, ctx.delayed_recipe)], GRAD_OUTPUT_ROLES)
        return grad_input, grad_weight, grad_bias, None, None, None, None, None


class Float8Linear(nn.Linear):
    """A drop-in ``nn.Linear`` whose output, grad_input and grad_weight GEMMs run in FP8.

    Same parameters and ``state_dict`` keys as ``nn.Linear``; with
    :class:`~fp8train.recipes.DelayedScaling` it also holds the buffers ``fp8_scale``
    ``(3,)`` and ``fp8_amax_history`` ``(amax_history_len, 3)`` (columns: input, weight,
    grad_output).

    Inputs may have any rank and strides and be float32, bfloat16 or float16 (matching
    the weight, or under ``torch.autocast``). The flattened token dim is zero-padded
    internally to the recipe's block (128 blockwise, 32 MXFP8, 16 otherwise), which
    changes no scale and no sum. ``in_features`` and ``out_features`` must meet the
    recipe's alignment (:func:`fp8train.convert_to_float8_training` skips layers that do not).

    Args:
        in_features, out_features, bias, device, dtype: as ``nn.Linear``.
        recipe: a :class:`~fp8train.recipes.Recipe` or recipe name (default ``"tensorwise"``).
        backend: ``"auto"``, ``"emulated"`` or ``"hardware"`` (see :func:`fp8train.scaled_mm`).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device=None,
        dtype=None,
        *,
        recipe: Recipe | str = "tensorwise",
        backend: str = "auto",
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.recipe = from_name(recipe) if isinstance(recipe, str) else recipe
        if not isinstance(self.recipe, Recipe):
            raise TypeError(f"recipe={recipe!r} must be a Recipe or a recipe name")
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r} must be one of {', '.join(BACKENDS)}")
        self.backend = backend
        self.fp8_forward_pending = False
        if isinstance(self.recipe, DelayedScaling):
            self._add_delayed_state(self.recipe)

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: Recipe | str = "tensorwise", backend: str = "auto") -> "Float8Linear":
        """A ``Float8Linear`` sharing ``linear``'s parameters (no copy)."""
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, bias=False, recipe=recipe, backend=backend)
        new.weight = linear.weight
        new.bias = linear.bias
        if isinstance(new.recipe, DelayedScaling):
            new._add_delayed_state(new.recipe, device=linear.weight.device)
        return new

    def _add_delayed_state(self, recipe: DelayedScaling, device=None) -> None:
        device = device if device is not None else self.weight.device
        self.delayed_recipe = recipe
        self.register_buffer("fp8_scale", torch.ones(3, dtype=torch.float32, device=device))
        self.register_buffer(
            "fp8_amax_history", torch.zeros(recipe.amax_history_len, 3, dtype=torch.float32, device=device)
        )

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        # Checkpoints load across recipes and across plain/FP8 models: FP8 state is kept
        # when both sides have it, dropped when this module has none, and left at its
        # initial value when the checkpoint has none.
        fp8_keys = [prefix + "fp8_scale", prefix + "fp8_amax_history"]
        has_state = "fp8_scale" in self._buffers
        if not has_state:
            for key in fp8_keys:
                if state_dict.pop(key, None) is not None:
                    logger.info("fp8train: %s does not use delayed scaling; ignoring %s", self, key)
        elif not any(key in state_dict for key in fp8_keys):
            logger.info("fp8train: checkpoint has no FP8 state for %s; starting it fresh", prefix or "<root>")
            state_dict[fp8_keys[0]] = self.fp8_scale
            state_dict[fp8_keys[1]] = self.fp8_amax_history
        elif prefix + "fp8_amax_history" in state_dict:
            history = state_dict[prefix + "fp8_amax_history"]
            if tuple(history.shape) != tuple(self.fp8_amax_history.shape):
                error_msgs.append(
                    f"{prefix}fp8_amax_history has shape {tuple(history.shape)} in the checkpoint but "
                    f"{tuple(self.fp8_amax_history.shape)} here: convert with amax_history_len="
                    f"{history.shape[0]} to load it, or drop the FP8 state with fp8train.drop_fp8_state"
                )
                return
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe.name}, backend={self.backend}"

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        state = current_state()
        if state is not None and not state.enabled:
            return F.linear(input, self.weight, self.bias)
        recipe = state.recipe if state is not None and state.recipe is not None else self.recipe

        weight, bias = self.weight, self.bias
        device_type = input.device.type
        if torch.is_autocast_enabled(device_type):
            compute_dtype = torch.get_autocast_dtype(device_type)
            input, weight = input.to(compute_dtype), weight.to(compute_dtype)
            bias = bias.to(compute_dtype) if bias is not None else None
        if input.dtype != weight.dtype:
            raise TypeError(
                f"input dtype {input.dtype} does not match weight dtype {weight.dtype}; cast one of "
                "them or run under torch.autocast"
            )
        if input.shape[-1] != self.in_features:
            raise ValueError(
                f"input of shape {tuple(input.shape)} does not end in in_features={self.in_features}"
            )

        scale = amax_history = delayed_recipe = None
        if isinstance(recipe, DelayedScaling):
            scale, amax_history, delayed_recipe = self._delayed_state_for(recipe, state)
            if not torch.is_grad_enabled():
                # Evaluation and inference use the scales and leave the state alone.
                amax_history = None

        plan = operand_plan(recipe)
        leading_shape = input.shape[:-1]
        input_2d = input.reshape(-1, self.in_features)
        num_tokens = input_2d.shape[0]
        padded_tokens = _round_up(num_tokens, plan.m_multiple)
        if padded_tokens != num_tokens:
            input_2d = F.pad(input_2d, (0, 0, 0, padded_tokens - num_tokens))
        with torch.autocast(device_type, enabled=False):
            output = _Float8LinearFunction.apply(
                input_2d, weight, bias, plan, self.backend, scale, amax_history, delayed_recipe
            )
        if padded_tokens != num_tokens:
            output = output[:num_tokens]
        output_shape = (*leading_shape, self.out_features)
        # Like nn.Linear, return a fresh tensor rather than a view where the shape allows.
        return output if output.shape == output_shape else output.reshape(output_shape)

    def _delayed_state_for(self, recipe: DelayedScaling, state):
        """Bring the delayed-scaling state up to date and register this step's update
        (a forward without grad only reads the state)."""
        if not isinstance(getattr(self, "delayed_recipe", None), DelayedScaling):
            logger.info("fp8train: adding delayed-scaling state to %s for an autocast recipe override", self)
            self._add_delayed_state(recipe)
        elif self.delayed_recipe != recipe:
            if self.delayed_recipe.amax_history_len != recipe.amax_history_len:
                raise ValueError(
                    f"autocast recipe has amax_history_len={recipe.amax_history_len} but this module's "
                    f"state has {self.delayed_recipe.amax_history_len}; convert with the same recipe"
                )
            self.delayed_recipe = recipe
        register(self)  # at its first forward: the order every rank's amax all-reduce follows
        if self.fp8_forward_pending and (state is None or self not in state.pending):
            # Recorded outside any autocast: the forward tensors update at this next forward.
            with torch.no_grad():
                update_delayed_tensors([self], FORWARD_ROLES)
            self.fp8_forward_pending = False
        if not self.fp8_forward_pending and torch.is_grad_enabled():
            # Inside an autocast the update waits for the outermost one's exit.
            self.fp8_forward_pending = True
            if state is not None:
                state.pending.append(self)
        return self.fp8_scale, self.fp8_amax_history, self.delayed_recipe
