"""``fp8train.jax.Dense``: a drop-in ``flax.linen.Dense`` whose three GEMMs run in FP8 (or 4 bits)."""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.linen.dtypes import promote_dtype
from jax import lax

from ..spec.recipes import Recipe, resolve_recipe
from .autocast import current_state
from .linear import NUM_ROLES, linear

__all__ = ["Dense", "FP8_STATE", "STOCHASTIC_ROUNDING"]

FP8_STATE = "fp8_state"
"""Name of the variable collection holding delayed scaling's ``scale`` and ``amax_history``."""

STOCHASTIC_ROUNDING = "stochastic_rounding"
"""Name of the RNG stream a layer whose recipe rounds stochastically (``nvfp4``) draws from:
``apply(..., rngs={"stochastic_rounding": key})``; Flax folds in each layer's path and call."""


class Dense(nn.Module):
    """A ``flax.linen.Dense`` whose output, grad_input and grad_weight GEMMs run in FP8.

    Same parameters as ``flax.linen.Dense`` (``kernel`` ``(in, features)``, ``bias``
    ``(features,)``) and its arguments below (not ``precision`` and the ``dot_general``
    hooks), plus ``recipe``. With a delayed recipe the layer also
    owns, in the :data:`FP8_STATE` collection, ``scale`` ``(3,)`` (init 1) and
    ``amax_history`` ``(amax_history_len, 3)`` (init 0), columns input, weight,
    grad_output; carry them through a step with :func:`fp8train.jax.update_fp8_state`
    (``docs/jax.md``). An :func:`fp8train.jax.autocast` active while the layer is traced
    turns FP8 off or overrides the recipe.

    Inputs may have any rank; the flattened token dim is zero-padded to the recipe's block,
    which changes no result. ``in`` and ``features`` must be divisible by the recipe's
    block (128 blockwise, 32 MXFP8 and MXFP4, 16 NVFP4). A recipe that rounds
    stochastically (``nvfp4``) draws from the :data:`STOCHASTIC_ROUNDING` RNG stream: pass
    ``rngs={"stochastic_rounding": key}`` to ``apply`` (a new key each step).

    Attributes:
        features: number of output features.
        use_bias: add a bias.
        dtype: computation dtype (``None``: promoted from input and parameters, as Flax does).
        param_dtype: dtype of the parameters.
        kernel_init, bias_init: initializers, as ``flax.linen.Dense``.
        recipe: a :class:`~fp8train.spec.recipes.Recipe`, a recipe name, or ``None`` for a
            plain high-precision layer.
        amax_reduction_axis: inside ``shard_map``, the mesh axis the layer's inputs are
            split across (sequence parallelism): per-tensor scales come from the MAX of the
            shards' amaxes (``jax.lax.pmax``). Under ``jax.jit`` with sharded arrays amaxes
            are global already; delayed scaling reduces in ``update_fp8_state(axis_name=)``.
    """

    features: int
    use_bias: bool = True
    dtype: Any = None
    param_dtype: Any = jnp.float32
    kernel_init: Callable = nn.initializers.lecun_normal()
    bias_init: Callable = nn.initializers.zeros_init()
    recipe: Recipe | str | None = "tensorwise"
    amax_reduction_axis: str | tuple[str, ...] | None = None

    def _recipe(self) -> Recipe | None:
        state = current_state()
        if state is not None and not state.enabled:
            return None
        if state is not None and state.recipe is not None:
            return state.recipe
        return None if self.recipe is None else resolve_recipe(self.recipe)

    @nn.compact
    def __call__(self, inputs: jax.Array) -> jax.Array:
        kernel = self.param("kernel", self.kernel_init, (jnp.shape(inputs)[-1], self.features), self.param_dtype)
        bias = self.param("bias", self.bias_init, (self.features,), self.param_dtype) if self.use_bias else None
        inputs, kernel, bias = promote_dtype(inputs, kernel, bias, dtype=self.dtype)
        recipe = self._recipe()
        if recipe is None:
            y = lax.dot_general(inputs, kernel, (((inputs.ndim - 1,), (0,)), ((), ())))
            return y if bias is None else y + jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))
        scale = amax_history = None
        if recipe.operand_plan.delayed:
            scale, amax_history = self._delayed_state(recipe.delayed_scaling)
        return linear(
            inputs, kernel.T, bias, recipe=recipe, scale=scale, amax_history=amax_history, key=self._rounding_key(recipe),
            # init usually runs outside shard_map, where the axis is unbound; its output
            # is discarded, so it runs without the reduction.
            amax_axis_name=None if self.is_initializing() else self.amax_reduction_axis,
        )

    def _rounding_key(self, recipe) -> jax.Array | None:
        """The key of this call's stochastic rounding (``None`` if the recipe has none)."""
        if not any(op.rule.stochastic_rounding for op in recipe.operand_plan.operands):
            return None
        if self.is_initializing() and not self.has_rng(STOCHASTIC_ROUNDING):
            return jax.random.key(0)  # init's forward rounds nothing stochastically
        if not self.has_rng(STOCHASTIC_ROUNDING):
            raise ValueError(
                f"{self.name or 'Dense'} runs recipe {recipe.name!r}, which rounds grad_output stochastically, "
                f"but apply() got no {STOCHASTIC_ROUNDING!r} RNG: pass rngs={{{STOCHASTIC_ROUNDING!r}: key}} "
                "(a new key each step), or disable it (NVFP4Scaling(disable_stochastic_rounding=True))"
            )
        return self.make_rng(STOCHASTIC_ROUNDING)

    def _delayed_state(self, recipe) -> tuple[jax.Array, jax.Array]:
        if not self.is_initializing() and not self.has_variable(FP8_STATE, "scale"):
            raise ValueError(
                f"{self.name or 'Dense'} runs the delayed recipe but has no {FP8_STATE!r} variables: pass "
                f"the model's {FP8_STATE!r} collection to apply(), and initialize the model with the "
                "delayed recipe (Dense(recipe='delayed'), or init() under autocast(recipe=...))"
            )
        scale = self.variable(FP8_STATE, "scale", jnp.ones, (NUM_ROLES,), jnp.float32)
        history = self.variable(
            FP8_STATE, "amax_history", jnp.zeros, (recipe.amax_history_len, NUM_ROLES), jnp.float32
        )
        if history.value.shape != (recipe.amax_history_len, NUM_ROLES):
            raise ValueError(
                f"{FP8_STATE} amax_history has shape {history.value.shape} but the recipe has "
                f"amax_history_len={recipe.amax_history_len}; use the recipe the model was initialized with"
            )
        return scale.value, history.value
