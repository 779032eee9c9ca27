"""What one :class:`~fp8train.nn.function.Float8LinearFunction` call takes besides its
tensors: :class:`LinearCall`, the values that travel together from a module's forward to the
call's backward, decided once per distinct options (issue 38), and :data:`NO_DELAYED_STATE`."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from ...quant.gemm import backend_log
from ...quant.kernels.settings import ACTIVE_SETTINGS
from ...quant.operand import LinearKernels, bound_kernels, checked_kernels
from ...spec.plan import OperandPlan
from ...spec.recipes import DelayedScaling
from ...spec.roles import Gemm, Usage
from ..delayed.state import DelayedTensors

__all__ = ["LinearCall", "linear_call", "NO_DELAYED_STATE"]


@dataclass(frozen=True, kw_only=True)
class LinearCall:
    """How one :class:`Float8LinearFunction` call runs its three GEMMs: the values that
    travel together from a module's forward to the call's backward (held on ``ctx``).
    Delayed scaling's tensors, which change in place, travel beside it
    (:class:`~fp8train.nn.delayed.state.DelayedTensors`).

    Attributes:
        plan: the recipe's :class:`~fp8train.spec.plan.OperandPlan`: how each slot is
            quantized, which GEMMs run in high precision.
        backend: the GEMM backend, ``"auto"``, ``"emulated"`` or ``"hardware"``.
        save_fp8_input: keep the input for the backward as its FP8 grad_weight operand
            rather than in high precision, where that GEMM runs in FP8 (``False`` without
            grad: nothing is saved then, so the quantization would be wasted).
        delayed_recipe: the :class:`~fp8train.spec.recipes.DelayedScaling` whose update
            the backward runs on grad_output's column after using it; ``None`` without
            delayed scaling.
        bf16_via_float32: run the high-precision GEMMs' bfloat16 products as float32 GEMMs
            of their bfloat16 operands, rounded once to bfloat16 (a CPU without native bf16:
            :mod:`fp8train.quant.gemm.bf16`; the forward's context decides, the backward follows).
        kernels: who quantizes and multiplies (:mod:`fp8train.quant.operand`): bound
            to a device's kernels, or through the checked doors (``None``: the checked ones).
        keeps_forward_scale: the backward quantizes the input or the weight by a delayed
            slot of its own (a mixture whose backward is delayed and forward not): it takes
            the scales the forward used, kept (derived from ``plan``).
        keeps_fp8_input, quantizes_grad_weight, reuses_weight, alignment: the plan's answers
            a call asks (derived once, issue 38): the input is kept for the backward as its
            FP8 grad_weight operand where the weight needs a gradient: where that GEMM runs
            in FP8, if ``save_fp8_input`` asks for it or the operand is the transpose of the
            forward's own (which costs nothing to keep); the grad_weight GEMM runs in FP8;
            the grad_input GEMM takes the forward's quantized weight transposed; the
            multiple the tokens are padded to for quantization (the plan's ``alignment``).
        checked_shapes: the ``(m, k, n, delayed_scale)`` a bound call has checked
            (:func:`~fp8train.quant.operand.check_shapes`), so it checks each once.
    """

    plan: OperandPlan
    backend: str
    save_fp8_input: bool
    delayed_recipe: DelayedScaling | None = None
    bf16_via_float32: bool = False
    kernels: LinearKernels | None = None
    keeps_forward_scale: bool = field(init=False, default=False)
    keeps_fp8_input: bool = field(init=False, default=False)
    quantizes_grad_weight: bool = field(init=False, default=False)
    reuses_weight: bool = field(init=False, default=False)
    alignment: int = field(init=False, default=16)
    checked_shapes: set = field(init=False, default_factory=set, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.kernels is None:
            object.__setattr__(self, "kernels", checked_kernels(self.plan, self.backend))
        plan = self.plan
        # (A plan quantizes both slots of a GEMM or neither.)
        grad_weight = plan.quantizes(Gemm.GRAD_WEIGHT)
        keeps = grad_weight and (self.save_fp8_input or plan.reuses_last_dim(Usage.GRAD_WEIGHT_INPUT))
        object.__setattr__(self, "keeps_fp8_input", keeps)
        object.__setattr__(self, "quantizes_grad_weight", grad_weight)
        object.__setattr__(self, "reuses_weight", plan.reuses_last_dim(Usage.GRAD_INPUT_WEIGHT))
        object.__setattr__(self, "alignment", plan.alignment)
        own_delayed = [
            usage for usage in (Usage.GRAD_INPUT_WEIGHT, Usage.GRAD_WEIGHT_INPUT)
            if self.plan.quantizes_usage(usage) and self.plan.operand(usage).delayed and not self.plan.reuses_last_dim(usage)
        ]
        object.__setattr__(self, "keeps_forward_scale", bool(own_delayed))


def linear_call(
    plan: OperandPlan,
    backend: str,
    save_fp8_input: bool,
    delayed_recipe: DelayedScaling | None,
    bf16_via_float32: bool,
    device_type: str | None,
    compiling: bool,
) -> LinearCall:
    """The :class:`LinearCall` of these options, its kernels bound to ``device_type``
    (``None``: the checked doors), built once per distinct options and quantization settings
    (not while ``torch.compile`` traces, ``compiling``: there, each time, into the graph)."""
    args = (plan, backend, save_fp8_input, delayed_recipe, bf16_via_float32, device_type)
    if compiling:
        return _linear_call.__wrapped__(*args, None)
    return _linear_call(*args, ACTIVE_SETTINGS.settings)


@functools.lru_cache(maxsize=256)
def _linear_call(plan, backend, save_fp8_input, delayed_recipe, bf16_via_float32, device_type, settings) -> LinearCall:
    kernels = checked_kernels(plan, backend) if device_type is None else bound_kernels(plan, backend, device_type)
    return LinearCall(
        plan=plan,
        backend=backend,
        save_fp8_input=save_fp8_input,
        delayed_recipe=delayed_recipe,
        bf16_via_float32=bf16_via_float32,
        kernels=kernels,
    )


backend_log.on_forget(_linear_call.cache_clear)  # its kernels say their GEMM backend when built


NO_DELAYED_STATE = DelayedTensors(None, None, None)
"""The delayed tensors of a call without delayed scaling."""
