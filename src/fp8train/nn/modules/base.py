"""``Float8Module``: what every module whose matmuls run as FP8 GEMMs holds, whatever its
parameters: the options (one ``Float8ModuleConfig``), delayed scaling's state, the one
adoption of a high-precision module's parameters (``_adopt``) and the one reversal
(``to_original``), the state-dict hooks that keep FP8 state and stored weights, and
``run_linear``: the FP8 ``input @ weight^T + bias`` through
:class:`~fp8train.nn.function.Float8LinearFunction`, driven by the recipe's operand plan.

``Float8Linear`` (:mod:`.linear`), ``Float8Conv1D`` (:mod:`.conv1d`),
``Float8MultiheadAttention`` (:mod:`.attention`) and ``Float8Experts`` (:mod:`.experts`)
are its kinds.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ...quant.gemm import backend_log
from ...quant.gemm.bf16 import matmul_via_float32_active
from ...quant.kernels.settings import ACTIVE_SETTINGS
from ...spec.hash_once import MEMO_PREFIX
from ...spec.recipes import DelayedScaling, Recipe
from ..autocast import HELD, current_state
from ..config import ConfigOption, Float8ModuleConfig
from ..delayed.reduction import settle_before_forward
from ..delayed.state import DelayedScalingState, DelayedTensors
from ..function import NO_DELAYED_STATE, Float8LinearFunction, LinearCall, linear_call
from ...quant.operand import takes_bound_path
from ...quant.quantize import PLAIN_TENSOR_TYPES
from ..gemm_observers import GEMM_OBSERVERS, notify_gemm_observers
from ..weights.delayed_scale import follow_delayed_weight_scales, rescale_frozen_weight
from ..weights.float8_weight import Float8Weight
from ..weights.module_weights import (
    dequantize_stored_weights,
    requantize_stored_weights,
    restore_weight_precision,
    take_stored_weights,
)

__all__ = ["Float8Module", "forget_linear_calls"]

_CALL_MEMO = MEMO_PREFIX + "linear_call"
"""Where a module's config keeps its last LinearCall (:meth:`Float8Module._linear_call`)."""

_FORGOTTEN = [0]
"""How many times kept LinearCalls were forgotten (:func:`forget_linear_calls`): one kept
before is not taken again."""


def forget_linear_calls() -> None:
    """Take no LinearCall a module's config keeps again: where the GEMM backend log is
    forgotten (the kernels log their backend when built), or where a caller empties
    ``linear_call``'s cache to bind other kernels (``tests/helpers/aten_ops.py``)."""
    _FORGOTTEN[0] += 1


backend_log.on_forget(forget_linear_calls)

logger = logging.getLogger(__name__)


def _compute_operands(input, weight, bias, autocast_on: bool):
    """``input``, ``weight``, ``bias`` in the dtype the GEMM computes in (``torch.autocast``'s
    where ``autocast_on``), checked: one dtype, and ``input`` ``[..., in_features]``."""
    device_type = input.device.type
    if autocast_on:
        compute_dtype = torch.get_autocast_dtype(device_type)
        input, weight = input.to(compute_dtype), weight.to(compute_dtype)
        bias = bias.to(compute_dtype) if bias is not None else None
    if input.dtype != weight.dtype:
        raise TypeError(
            f"input dtype {input.dtype} does not match weight dtype {weight.dtype}; cast one of "
            "them or run under torch.autocast"
        )
    if input.shape[-1] != weight.shape[-1]:
        raise ValueError(f"input of shape {tuple(input.shape)} does not end in in_features={weight.shape[-1]}")
    return input, weight, bias


class Float8Module(nn.Module):
    """What every module whose matmuls run as FP8 GEMMs holds, whatever its parameters:
    the recipe, ``backend`` and ``save_fp8_activations``, delayed scaling's state (the
    buffers ``fp8_scale`` ``(3,)`` and ``fp8_amax_history`` ``(amax_history_len, 3)``,
    shared by every GEMM the module runs), and :meth:`run_linear`, the FP8
    ``input @ weight^T + bias`` through :class:`~fp8train.nn.function.Float8LinearFunction`.

    :class:`Float8Linear` is one; ``Float8Conv1D`` (:mod:`fp8train.nn.modules.conv1d`),
    ``Float8MultiheadAttention`` (:mod:`fp8train.nn.modules.attention`) and ``Float8Experts``
    (:mod:`fp8train.nn.modules.experts`) are others. A subclass calls ``_init_fp8`` in its
    constructor, after ``nn.Module.__init__``, builds its ``from_*`` constructor on
    :meth:`_adopt`, says what :meth:`to_original` hands back (``_original_parameters``,
    ``_new_original``) and what its ``repr`` shows before the options (``_dims_repr``).
    """

    def _init_fp8(self, config: Float8ModuleConfig) -> None:
        """Set the FP8 options and state (after ``nn.Module.__init__``)."""
        self.fp8_config = config
        self.delayed_state: DelayedScalingState | None = None
        # The module from_* replaced, where to_original gives it back; not a submodule (its
        # parameters are this module's).
        object.__setattr__(self, "_original", None)
        if self.recipe.operand_plan.delayed:
            self._add_delayed_state(self.recipe.delayed_scaling)

    # The options read from the one config value; assigning one replaces the config (checked).
    recipe: Recipe = ConfigOption()
    backend: str = ConfigOption()
    save_fp8_activations: bool = ConfigOption()

    @classmethod
    def _adopt(
        cls,
        source: nn.Module,
        build: Callable[[], "Float8Module"],
        parameters: dict[str, object],
        device: torch.device,
        keep_source: bool = False,
    ) -> "Float8Module":
        """What every ``from_*`` constructor does: ``build()`` the FP8 module on the meta
        device (no memory), set ``source``'s ``parameters`` (``{name: parameter or
        submodule}``, shared, not copied) on it, create its delayed-scaling state on
        ``device`` (the parameters'), and copy ``source``'s ``training``. ``keep_source``:
        :meth:`to_original` gives ``source`` back (else it builds a new module)."""
        with torch.device("meta"):
            new = build()
        for name, value in parameters.items():
            setattr(new, name, value)
        if new.recipe.operand_plan.delayed:
            new._add_delayed_state(new.recipe.delayed_scaling, device=device)
        new.train(source.training)
        if keep_source:
            object.__setattr__(new, "_original", source)
        return new

    # The parameters to_original hands to the module it gives back, by reference (a dotted
    # name: a submodule's), each first restored to high precision where stored in FP8.
    _original_parameters: tuple[str, ...] = ("weight", "bias")

    def _new_original(self) -> nn.Module:
        """A new high-precision module of this one's kind and dims, built on the meta device
        (:meth:`to_original` sets its parameters), where ``from_*`` kept no module."""
        raise NotImplementedError(f"{type(self).__name__} does not say which module it converts back to")

    def to_original(self) -> nn.Module:
        """The high-precision module this one stands for, holding its parameters (no copy) and
        training mode: the module ``from_*`` replaced where it kept it, else a new one. FP8
        state is dropped; a weight stored in FP8 comes back in high precision (a trainable
        one its master's value, a frozen one dequantized).

        Raises:
            ValueError: a ``Float8Experts`` built by its constructor (no module to give back).
            ImportError: a ``Float8Conv1D`` without transformers installed.
        """
        original = self._original
        if original is None:
            with torch.device("meta"):
                original = self._new_original()
        for name in self._original_parameters:
            owner_name, _, leaf = name.rpartition(".")
            owner = self.get_submodule(owner_name)
            restore_weight_precision(owner, leaf)
            setattr(original.get_submodule(owner_name), leaf, getattr(owner, leaf))
        original.train(self.training)
        return original

    @property
    def _delayed_state_shape(self) -> tuple[int, ...]:
        """Leading dims ``S`` of the delayed-scaling buffers: ``()``, one state for every
        GEMM the module runs (``Float8Experts``: one per expert and projection)."""
        return ()

    def _add_delayed_state(self, recipe: DelayedScaling, device=None) -> None:
        """Register delayed scaling's buffers (on ``device``, default the parameters') and
        the :class:`~fp8train.nn.delayed.state.DelayedScalingState` that reads them."""
        device = device if device is not None else next(self.parameters()).device
        for name, tensor in DelayedScalingState.initial_buffers(recipe, self._delayed_state_shape, device).items():
            self.register_buffer(name, tensor)
        self.delayed_state = DelayedScalingState(self._buffers, recipe)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        dequantize_stored_weights(self, destination, prefix)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        # Checkpoints load across recipes and across plain/FP8 models: FP8 state is kept
        # when both sides have it, dropped when this module has none, and left at its
        # initial value when the checkpoint has none. A stored FP8 weight loads re-quantized.
        stored = take_stored_weights(self, state_dict, prefix)
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
        requantize_stored_weights(self, stored, prefix, missing_keys, error_msgs)

    def _dims_repr(self) -> str:
        """What the module's ``repr`` says before the FP8 options (its dims)."""
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"{self._dims_repr()}, {self.fp8_config.describe()}"

    def run_linear(
        self, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *, transposed: bool = False
    ) -> torch.Tensor:
        """``input @ weight^T + bias`` with FP8 GEMMs per this module's recipe (an
        ``fp8train.autocast`` may override it, or turn FP8 off: then ``F.linear``), on
        this module's delayed-scaling state.

        Args:
            input: ``[..., in]``, any rank and strides.
            weight: ``[out, in]``, any strides; with ``transposed``, ``[in, out]`` (a ``Conv1D``'s
                parameter: transposed after a stored one followed its delayed scale).
            bias: ``[out]`` or ``None``.

        Returns:
            ``[..., out]``.
        """
        compiling = torch.compiler.is_compiling()
        # Eager, the autocast's own state, read without a call (issue 38); traced, one built
        # from plain values (fp8train.nn.autocast says why).
        state = current_state() if compiling else HELD.held
        if state is not None and not state.enabled:
            weight = weight.t() if transposed else weight
            return notify_gemm_observers(self, input, weight, F.linear(input, weight, bias))
        # (the config's field, not the ConfigOption that reads it: two calls less, issue 38)
        recipe = state.recipe if state is not None and state.recipe is not None else self.fp8_config.recipe
        plan = recipe.operand_plan
        if type(weight) not in PLAIN_TENSOR_TYPES and isinstance(weight, Float8Weight):  # (no call for a plain one)
            weight.check_plan(plan)
        grad = torch.is_grad_enabled()  # (asked once for the state and the call: issue 38)
        delayed = self._delayed_tensors(recipe, state, compiling, grad) if plan.delayed else NO_DELAYED_STATE
        weight = weight.t() if transposed else weight
        observed = input, weight  # as given, before the autocast cast
        in_features, out_features = weight.shape[-1], weight.shape[0]
        device_type = input.device.type
        autocast_on = torch.is_autocast_enabled(device_type)
        # (_compute_operands only where it casts or raises: its tests pass with no call otherwise)
        if autocast_on or input.dtype != weight.dtype or input.shape[-1] != weight.shape[-1]:
            input, weight, bias = _compute_operands(input, weight, bias, autocast_on)
        bound = takes_bound_path(input, weight, bias, compiling)
        call = self._linear_call(plan, device_type if bound else None, compiling, grad)
        # (a weight that requires grad is no frozen parameter's: no call to ask, issue 38)
        if plan.delayed and delayed.forward_scale is None and not weight.requires_grad and self._weight_frozen():
            rescale_frozen_weight(self.delayed_state, weight)

        leading_shape = input.shape[:-1]
        input_2d = input if input.ndim == 2 else input.reshape(-1, in_features)  # (ndim: no call)
        # (the function pads the tokens to the recipe's alignment where its blocks need it)
        if autocast_on:  # the GEMMs keep their own dtypes; entering a disabled block on every forward cost 27 calls
            with torch.autocast(device_type, enabled=False):
                output = Float8LinearFunction.apply(input_2d, weight, bias, call, delayed)
        else:
            output = Float8LinearFunction.apply(input_2d, weight, bias, call, delayed)
        output_shape = (*leading_shape, out_features)
        # Like nn.Linear, return a fresh tensor rather than a view where the shape allows.
        output = output if output.shape == output_shape else output.reshape(output_shape)
        return notify_gemm_observers(self, *observed, output) if GEMM_OBSERVERS else output  # (none: no call)

    fp8_weights_left_reason = "its weights are not stored in FP8"  # logged where fp8_weight_types() is {}

    cuda_graph_blocker: str | None = None
    """Why a training step through this module cannot be captured in a CUDA graph
    (:class:`~fp8train.nn.step_graph.StepGraph` runs it eagerly and says this), or ``None``."""

    def fp8_weight_types(self) -> dict[str, type[Float8Weight]]:
        """``{parameter name: the Float8Weight class that stores it}`` for each weight this module can
        hold in FP8 (``fp8_weights=True``, ``store_frozen_weights_in_fp8``); ``{}``: none."""
        return {}

    def _weight_frozen(self) -> bool:
        """Whether delayed scaling's weight column holds one frozen parameter's amax, which
        then sets it at each forward (:func:`~.weights.delayed_scale.rescale_frozen_weight`). A
        module whose state serves several weights (an attention's projections) says
        ``False``: its column is the largest of their amaxes, which a history gives."""
        return False

    def _begin_call(self, recipe: Recipe, state) -> tuple[LinearCall, DelayedTensors]:
        """What a :class:`~fp8train.nn.function.Float8LinearFunction` call takes under
        ``recipe`` through the checked doors: the call value and delayed scaling's tensors
        (its state begun)."""
        plan, compiling, grad = recipe.operand_plan, torch.compiler.is_compiling(), torch.is_grad_enabled()
        delayed = self._delayed_tensors(recipe, state, compiling, grad) if plan.delayed else NO_DELAYED_STATE
        return self._linear_call(plan, None, compiling, grad), delayed

    def _linear_call(self, plan, device_type: str | None, compiling: bool, grad: bool) -> LinearCall:
        """This module's :class:`~fp8train.nn.function.LinearCall` under ``plan``, its
        kernels bound to ``device_type`` (``None``: the checked doors;
        :mod:`fp8train.quant.operand`); ``compiling``: whether ``torch.compile`` traces;
        ``grad``: ``torch.is_grad_enabled()``.

        Outside a trace, the last one is kept on the module's config with what chose it, and taken
        again where each is the same object (or equal bool or string) and no backend log was
        forgotten since: no call to ``linear_call``'s cache, whose key hashes the plan, the
        recipe and the settings (four calls a forward, issue 38)."""
        config = self.fp8_config
        # Without grad nothing is kept for a backward: skip quantizing the input for one.
        save_fp8_input = config.save_fp8_activations and grad
        delayed_recipe = self.delayed_state.recipe if plan.delayed else None
        # (its C test first, inline: a call less in the common case, issue 38)
        via_float32 = torch._C._is_torch_function_mode_enabled() and matmul_via_float32_active()
        if compiling:
            return linear_call(plan, config.backend, save_fp8_input, delayed_recipe, via_float32, device_type, True)
        try:  # (on the config, not the module: a step sets nothing on the module)
            memo = config.__dict__[_CALL_MEMO]
        except KeyError:
            memo = None
        settings = ACTIVE_SETTINGS.settings
        if (
            memo is not None and memo[0] is plan and memo[1] == config.backend and memo[2] == save_fp8_input
            and memo[3] is delayed_recipe and memo[4] == via_float32 and memo[5] == device_type
            and memo[6] is settings and memo[7] == _FORGOTTEN[0]
        ):
            return memo[8]
        call = linear_call(plan, config.backend, save_fp8_input, delayed_recipe, via_float32, device_type, False)
        key = (plan, config.backend, save_fp8_input, delayed_recipe, via_float32, device_type, settings, _FORGOTTEN[0])
        config.__dict__[_CALL_MEMO] = (*key, call)  # (a memo the config's pickling leaves out)
        return call

    def _delayed_tensors(self, recipe: Recipe, state, compiling: bool, grad: bool) -> DelayedTensors:
        """This forward's delayed-scaling tensors, on a state following ``recipe``'s delayed
        part (created for an override); ``compiling``: whether ``torch.compile`` traces;
        ``grad``: ``torch.is_grad_enabled()``."""
        delayed_state = self.delayed_state
        if delayed_state is None or delayed_state.recipe is not recipe:  # (the state's own: no call)
            delayed_state = self._follow_delayed_part(recipe.delayed_scaling)
        # Asked once here, for the three steps (issue 38): a traced forward and activation
        # checkpointing's recompute neither settle an update nor re-quantize a stored weight.
        # (is_recompute, inline, its grad mode shared with begin_forward)
        recompute = grad and not compiling and torch._C._current_graph_task_id() != -1
        eager = not (compiling or recompute)
        if eager and delayed_state.forward_pending:
            settle_before_forward(self, state)
        delayed = delayed_state.begin_forward(self, state, compiling, recompute, grad)
        if eager:  # where a parameter is not a plain one (a stored weight): no call otherwise
            parameters = self._parameters
            for name in parameters:
                if type(parameters[name]) is not nn.Parameter and parameters[name] is not None:
                    follow_delayed_weight_scales(self)
                    break
        return delayed

    def _follow_delayed_part(self, recipe: DelayedScaling) -> DelayedScalingState:
        """This module's delayed-scaling state, following ``recipe`` (an autocast override's
        delayed part), added where the module has none."""
        delayed_state = self.delayed_state
        if delayed_state is None:
            logger.info("fp8train: adding delayed-scaling state to %s for an autocast recipe override", self)
            self._add_delayed_state(recipe)
            delayed_state = self.delayed_state
        elif delayed_state.recipe is not recipe:
            delayed_state.follow(recipe)
        return delayed_state
