"""``Float8Experts``: fused MoE experts whose GEMMs run in FP8 per a recipe.

transformers 5 stores the experts of Mixtral, Qwen3-MoE and most MoE models (every
``@use_experts_implementation`` class whose eager forward is Mixtral's) as two 3-D
parameters rather than Linear layers::

    gate_up_proj [E, 2I, H]     down_proj [E, H, I]     act_fn

and expert ``e`` computes, on the tokens routed to it, ``x[T_e, H]``::

    gate, up = (x @ gate_up_proj[e]^T).chunk(2, -1)      # output GEMM of a Linear [2I, H]
    h = act_fn(gate) * up
    y = h @ down_proj[e]^T                               # output GEMM of a Linear [H, I]

each routed row weighted by its router weight and summed into its token's output.

:class:`Float8Experts` runs each expert's two projections as two Linear layers would under
:class:`~fp8train.nn.modules.linear.Float8Linear`: every expert's output, grad_input and
grad_weight GEMMs in FP8 through :class:`~fp8train.nn.function.Float8LinearFunction`, the
tokens routed to the expert being that GEMM's input (zero-padded to the recipe's
alignment, as ``Float8Linear`` pads its tokens), the expert's slice of the 3-D parameter
its weight. Scales are per expert: a per-tensor scale covers one expert's routed tokens
(or its weight, or its grad_output), never the whole group.

Delayed scaling keeps one state per expert, per projection, per role: ``fp8_scale``
``(E, 2, 3)`` and ``fp8_amax_history`` ``(amax_history_len, E, 2, 3)`` (projection 0 is
``gate_up_proj``, 1 ``down_proj``; roles input, weight, grad_output). An expert that
receives no tokens in a step records no amax, so its state is neither rescaled nor rolled.

The routing is grouped: one stable sort of the routed rows by expert, one gather into
per-expert groups padded to the alignment, one activation and one weighted sum for all
experts; only the GEMMs loop over the experts with rows (``benchmarks/bench_experts.py``
measures this against transformers' loop). A ``Float8Experts`` runs its own forward
whatever transformers' ``config._experts_implementation`` says.

A model's own experts module converts when it meets the contract that
:func:`fused_experts_mismatch` checks (the docs' "Making your experts convertible").
"""

from __future__ import annotations

import inspect
import logging
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ...spec.checks import check_callable, check_int
from ...spec.recipes import Recipe
from ..autocast import current_state
from ..config import Float8ModuleConfig
from ..delayed.state import DelayedTensors
from ..function import Float8LinearFunction
from .base import Float8Module
from .routing import ExpertRoutes
from ..weights.experts import Float8DownWeights, Float8GateUpWeights
from ..weights.float8_weight import Float8Weight
from ..weights.module_weights import is_frozen_parameter

__all__ = [
    "EXPERTS_FORWARD_ARGS",
    "NUM_PROJECTIONS",
    "Float8Experts",
    "fused_experts_mismatch",
    "is_fused_experts",
    "experts_alignment_skip_reason",
]

logger = logging.getLogger(__name__)

EXPERTS_FORWARD_ARGS = ("hidden_states", "top_k_index", "top_k_weights")
"""The parameters of a fused experts module's ``forward``, in order."""
NUM_PROJECTIONS = 2
"""Projections per expert (``gate_up_proj``, ``down_proj``): the second dim of delayed state."""
_GATE_UP, _DOWN = 0, 1

# What @use_experts_implementation records of a layout other than Mixtral's, and the value
# Mixtral's layout has. A module without these attributes has Mixtral's layout.
_LAYOUT_FLAGS = {
    "has_gate": True,
    "has_bias": False,
    "is_transposed": False,
    "is_concatenated": True,
    "has_post_expert_norm": False,
}
# transformers' default gating, which @use_experts_implementation attaches as ``_apply_gate``
# to classes without their own: ``act_fn(gate) * up``, as Mixtral's forward computes.
_DEFAULT_GATE_NAME = "_default_apply_gate"


def fused_experts_mismatch(module: nn.Module) -> str | None:
    """Why ``module`` is not a fused experts module :class:`Float8Experts` can replace, or
    ``None`` where it is.

    The contract (duck-typed, so a model's own class can meet it):

    * ``gate_up_proj``: an ``nn.Parameter`` ``[E, 2I, H]``; ``down_proj``: an
      ``nn.Parameter`` ``[E, H, I]`` (each expert's weights in ``nn.Linear``'s
      ``[out, in]`` layout, gate rows before up rows); ``num_experts == E``;
    * ``act_fn``: a callable; the expert computes ``act_fn(gate) * up``;
    * ``forward(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])`` returning
      ``[T, H]``: the sum over each token's ``k`` experts of the expert's output times its
      weight (expert ids ``>= E`` contribute nothing);
    * no other parameters, buffers or submodules (they would be lost), no biases, and none
      of transformers' other layouts (``has_bias``, ``is_transposed``, interleaved
      gate/up, no gate, a post-expert norm, an ``_apply_gate`` of its own).
    """
    if not isinstance(module, nn.Module):
        return f"{type(module).__name__} is not an nn.Module"
    if isinstance(module, Float8Experts):
        return "it is a Float8Experts already"
    params = dict(module.named_parameters(recurse=False))
    gate_up, down = params.get("gate_up_proj"), params.get("down_proj")
    if gate_up is None or down is None:
        return "no gate_up_proj and down_proj parameters"
    if gate_up.dim() != 3 or down.dim() != 3:
        return f"gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} are not both 3-D"
    num_experts, two_intermediate, hidden = gate_up.shape
    if two_intermediate % 2 or tuple(down.shape) != (num_experts, hidden, two_intermediate // 2):
        return (
            f"gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} are not "
            "[E, 2I, H] and [E, H, I]"
        )
    if getattr(module, "num_experts", None) != num_experts:
        return f"num_experts={getattr(module, 'num_experts', None)!r} is not gate_up_proj's {num_experts} experts"
    if not callable(getattr(module, "act_fn", None)):
        return "no callable act_fn"
    extra = sorted(set(params) - {"gate_up_proj", "down_proj"})
    extra += [name for name, _ in module.named_buffers(recurse=False)]
    extra += [name for name, _ in module.named_children() if name != "act_fn"]
    if extra:
        return f"holds state besides gate_up_proj, down_proj and act_fn: {', '.join(extra)}"
    for flag, expected in _LAYOUT_FLAGS.items():
        if getattr(module, flag, expected) != expected:
            return f"{flag}={getattr(module, flag)!r} (only {flag}={expected} converts)"
    gate = getattr(type(module), "_apply_gate", None)
    if gate is not None and getattr(gate, "__name__", None) != _DEFAULT_GATE_NAME:
        return "it has its own _apply_gate"
    try:
        names = tuple(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return "its forward has no signature to check"
    if names != EXPERTS_FORWARD_ARGS:
        return f"forward takes ({', '.join(names)}), not ({', '.join(EXPERTS_FORWARD_ARGS)})"
    return None


def is_fused_experts(module: nn.Module) -> bool:
    """Whether ``module`` meets the fused experts contract (:func:`fused_experts_mismatch`)
    and so converts to a :class:`Float8Experts`."""
    return fused_experts_mismatch(module) is None


def experts_alignment_skip_reason(module: nn.Module, dim_alignment: int) -> str | None:
    """Why fused experts stay in high precision under ``dim_alignment``: both GEMMs of every
    expert need ``H`` and ``I`` to be multiples of it (``None``: they convert)."""
    _, two_intermediate, hidden = module.gate_up_proj.shape
    intermediate = two_intermediate // 2
    if dim_alignment and (hidden % dim_alignment or intermediate % dim_alignment):
        return (
            f"hidden dim {hidden} and intermediate dim {intermediate} are not both multiples of {dim_alignment}"
        )
    return None


class Float8Experts(Float8Module):
    """Fused MoE experts whose every expert's output, grad_input and grad_weight GEMMs, in
    both projections, run in FP8 per a recipe.

    Same parameters (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``), ``act_fn`` and
    ``state_dict`` keys as the experts module it replaces; with
    :class:`~fp8train.spec.recipes.DelayedScaling` also the buffers ``fp8_scale``
    ``(E, 2, 3)`` and ``fp8_amax_history`` ``(amax_history_len, E, 2, 3)`` (expert,
    projection: gate_up then down, role: input, weight, grad_output).

    ``forward(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])`` as
    transformers' eager experts: float32, bfloat16 or float16 (matching the parameters, or
    under ``torch.autocast``); the output has ``hidden_states``' dtype. Under
    ``fp8train.autocast(enabled=False)`` it computes what transformers' eager loop
    computes, in high precision.

    Args:
        num_experts, hidden_dim, intermediate_dim: ``E``, ``H``, ``I``; ``H`` and ``I`` must
            meet the recipe's alignment (:func:`fp8train.convert_to_float8_training` skips modules that do not).
        act_fn: the activation of the gate half.
        device, dtype: of the (uninitialized) parameters.
        config, recipe: as :class:`~fp8train.nn.modules.linear.Float8Linear`'s.
    """

    # fp8_weights=True and store_frozen_weights_in_fp8 log this (fp8_weight_types() is {}).
    fp8_weights_left_reason = "frozen under delayed scaling: each expert's weight scale follows a history"
    cuda_graph_blocker = "its routing reads each expert's token count on the host (the GEMMs' shapes)"

    def fp8_weight_types(self) -> dict[str, type]:
        """Both 3-D weights, one ``Float8Weight`` per expert (``nn/weights/experts.py``);
        none where they are frozen under delayed scaling."""
        frozen = any(is_frozen_parameter(w) for w in (self.gate_up_proj, self.down_proj))
        if frozen and self.recipe.operand_plan.delayed:
            return {}
        return {"gate_up_proj": Float8GateUpWeights, "down_proj": Float8DownWeights}

    def __init__(
        self,
        num_experts: int,
        hidden_dim: int,
        intermediate_dim: int,
        act_fn: Callable[[torch.Tensor], torch.Tensor],
        device=None,
        dtype=None,
        *,
        config: Float8ModuleConfig | None = None,
        recipe: Recipe | str | None = None,
    ) -> None:
        check_int("num_experts", num_experts, minimum=1)
        check_int("hidden_dim", hidden_dim, minimum=1)
        check_int("intermediate_dim", intermediate_dim, minimum=1)
        check_callable("act_fn", act_fn, signature="(tensor) -> tensor")
        config = Float8ModuleConfig.build(config, recipe=recipe)
        super().__init__()
        self.num_experts, self.hidden_dim, self.intermediate_dim = num_experts, hidden_dim, intermediate_dim
        factory = dict(device=device, dtype=dtype)
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_dim, hidden_dim, **factory))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_dim, intermediate_dim, **factory))
        self.act_fn = act_fn
        self._init_fp8(config)

    @classmethod
    def from_experts(
        cls,
        module: nn.Module,
        recipe: Recipe | str | None = None,
        *,
        config: Float8ModuleConfig | None = None,
    ) -> "Float8Experts":
        """A ``Float8Experts`` sharing ``module``'s parameters and ``act_fn`` (no copy);
        ``config`` or ``recipe`` as in the constructor; :meth:`to_original` gives ``module`` back.

        Raises:
            TypeError: ``module`` does not meet the fused experts contract (the message
                says which part, see :func:`fused_experts_mismatch`).
        """
        mismatch = fused_experts_mismatch(module)
        if mismatch is not None:
            raise TypeError(
                f"{type(module).__name__} is not a fused experts module Float8Experts can replace: {mismatch}"
            )
        config = Float8ModuleConfig.build(config, recipe=recipe)
        num_experts, two_intermediate, hidden_dim = module.gate_up_proj.shape

        def build() -> "Float8Experts":
            return cls(num_experts, hidden_dim, two_intermediate // 2, module.act_fn, config=config)

        parameters = {"gate_up_proj": module.gate_up_proj, "down_proj": module.down_proj}
        return cls._adopt(module, build, parameters, module.gate_up_proj.device, keep_source=True)

    # to_original: the module from_experts replaced, holding this module's current parameters.
    _original_parameters = ("gate_up_proj", "down_proj")

    def _new_original(self) -> nn.Module:
        raise ValueError(
            "this Float8Experts was built by its constructor, not from_experts: there is no "
            "original experts module to return"
        )

    @property
    def _delayed_state_shape(self) -> tuple[int, ...]:
        return (self.num_experts, NUM_PROJECTIONS)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        # Float8Module's rules (kept, dropped or started fresh), after a check of the
        # experts' dims, which its message on the history length would not name.
        history = state_dict.get(prefix + "fp8_amax_history")
        state = self._buffers.get("fp8_amax_history")
        if history is not None and state is not None and tuple(history.shape[1:]) != tuple(state.shape[1:]):
            error_msgs.append(
                f"{prefix}fp8_amax_history has shape {tuple(history.shape)} in the checkpoint but "
                f"{tuple(state.shape)} here: the checkpoint's experts module has a different number of "
                "experts; drop the FP8 state with fp8train.drop_fp8_state to load the rest"
            )
            return
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)

    def _dims_repr(self) -> str:
        return f"num_experts={self.num_experts}, hidden_dim={self.hidden_dim}, intermediate_dim={self.intermediate_dim}"

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        if isinstance(self.gate_up_proj, Float8Weight):  # torch.compile: runs eagerly (a graph break)
            return torch.compiler.disable(self._forward)(hidden_states, top_k_index, top_k_weights)
        return self._forward(hidden_states, top_k_index, top_k_weights)

    def _forward(self, hidden_states, top_k_index, top_k_weights) -> torch.Tensor:
        self._check_inputs(hidden_states, top_k_index, top_k_weights)
        output = torch.zeros_like(hidden_states)
        state = current_state()
        if state is not None and not state.enabled:
            return self._forward_high_precision(output, hidden_states, top_k_index, top_k_weights)
        recipe = state.recipe if state is not None and state.recipe is not None else self.recipe

        gate_up_proj, down_proj = self.gate_up_proj, self.down_proj
        device_type = hidden_states.device.type
        if torch.is_autocast_enabled(device_type):
            compute_dtype = torch.get_autocast_dtype(device_type)
            hidden_states = hidden_states.to(compute_dtype)
            gate_up_proj, down_proj = gate_up_proj.to(compute_dtype), down_proj.to(compute_dtype)
        if hidden_states.dtype != gate_up_proj.dtype:
            raise TypeError(
                f"hidden_states dtype {hidden_states.dtype} does not match the experts' dtype "
                f"{gate_up_proj.dtype}; cast one of them or run under torch.autocast"
            )

        plan = recipe.operand_plan
        for weight in (gate_up_proj, down_proj):
            if isinstance(weight, Float8Weight):  # stored in FP8: for this plan, an optimizer holding its master
                weight.check_plan(plan)
        call, delayed = self._begin_call(recipe, state)
        routes = ExpertRoutes(top_k_index, self.num_experts, plan.alignment)
        if not routes.num_rows:
            return output

        def project(inputs, weight, projection):
            # One Float8LinearFunction per expert with rows (a padded row stays zero), its
            # weight a view of the 3-D parameter: one unbind, whose backward stacks the grads.
            outputs = []
            for expert, weight_e, input_e in routes.active(weight.unbind(0), inputs.split(routes.padded_counts)):
                delayed_e = DelayedTensors(*(None if t is None else t[..., expert, projection, :] for t in delayed))
                outputs.append(Float8LinearFunction.apply(input_e, weight_e, None, call, delayed_e))
            return torch.cat(outputs)

        with torch.autocast(device_type, enabled=False):
            gate_up = project(routes.gather_padded(hidden_states), gate_up_proj, _GATE_UP)
            gate, up = gate_up.chunk(2, dim=-1)
            expert_output = project(self.act_fn(gate) * up, down_proj, _DOWN)
        return routes.combine(output, expert_output[routes.padded_position], top_k_weights)

    def _forward_high_precision(self, output, hidden_states, top_k_index, top_k_weights) -> torch.Tensor:
        """transformers' eager experts loop, on the same rows in the same order (bit-exact
        with it on CPU), with the token gather and the sum hoisted out of the loop."""
        routes = ExpertRoutes(top_k_index, self.num_experts, alignment=1)
        if not routes.num_rows:
            return output
        rows = routes.gather_padded(hidden_states)
        outputs = []
        weights = zip(self.gate_up_proj.unbind(0), self.down_proj.unbind(0))
        for _, (gate_up_e, down_e), rows_e in routes.active(weights, rows.split(routes.counts)):
            gate, up = F.linear(rows_e, gate_up_e).chunk(2, dim=-1)
            outputs.append(F.linear(self.act_fn(gate) * up, down_e))
        return routes.combine(output, torch.cat(outputs), top_k_weights)

    def _check_inputs(self, hidden_states, top_k_index, top_k_weights) -> None:
        if hidden_states.dim() != 2 or hidden_states.shape[-1] != self.hidden_dim:
            raise ValueError(
                f"hidden_states of shape {tuple(hidden_states.shape)} must be [tokens, hidden_dim="
                f"{self.hidden_dim}] (flatten the batch and sequence dims first)"
            )
        expected = (hidden_states.shape[0], top_k_index.shape[-1] if top_k_index.dim() == 2 else "k")
        for name, tensor in (("top_k_index", top_k_index), ("top_k_weights", top_k_weights)):
            if tuple(tensor.shape) != expected:
                raise ValueError(f"{name} of shape {tuple(tensor.shape)} must be [tokens, top_k] = {expected}")
