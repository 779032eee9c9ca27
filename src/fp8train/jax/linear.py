"""The three GEMMs of a dense layer in FP8 or 4 bits, driven by a recipe's operand plan, as
one ``jax.custom_vjp``; and delayed scaling's state, carried through a training step.

Notation (:mod:`fp8train.spec.roles`): ``y = x W^T + b`` with ``x[M,K]`` (leading dims
flattened), ``W[N,K]``, ``dy[M,N]``; the output, grad_input and grad_weight GEMMs each take
two K-last operands, quantized as the plan says, exactly as
:class:`fp8train.nn.function.Float8LinearFunction` quantizes them.

Delayed scaling: each layer's state is ``scale`` ``(3,)`` and ``amax_history``
``(amax_history_len, 3)`` (columns input, weight, grad_output, as ``fp8_scale`` and
``fp8_amax_history`` of a PyTorch ``Float8Linear``). The forward quantizes with ``scale``;
the amaxes seen in the step (input and weight in the forward, grad_output in the backward)
leave through the *gradient* of ``amax_history``: its row 0 holds them, the other rows are
zero. :func:`update_fp8_state` folds them into the state after the step, with the rule of
:func:`fp8train.quant.delayed_scaling_update`.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping

import jax
import jax.numpy as jnp
from jax import lax

from ..spec.checks import check_type
from ..spec.granularities import round_up
from ..spec.plan import OperandPlan
from ..spec.recipes import DelayedScaling, Recipe, resolve_recipe
from ..spec.roles import LAST_DIM, Gemm, Role, Usage
from .cast import check_array, from_bits, magnitude_bits, to_float32
from .gemm import scaled_matmul
from .quantize import QuantizedArray, quantize, transpose
from .scaling import delayed_scaling_update

__all__ = ["linear", "quantize_usage", "usage_key", "init_delayed_state", "update_fp8_state", "NUM_ROLES"]

NUM_ROLES = len(Role)


def quantize_usage(
    plan: OperandPlan,
    usage: Usage,
    t_hp: jax.Array,
    scale: jax.Array | None = None,
    last_dim: QuantizedArray | None = None,
    amax_axis_name=None,
    key: jax.Array | None = None,
) -> QuantizedArray:
    """The K-last operand of ``usage`` from the 2-D high-precision ``t_hp``: a first-dim
    usage comes back transposed, or, where the plan allows, as the transpose of the role's
    last-dim quantization ``last_dim``. ``scale``: the role's delayed-scaling scale (a slot
    that is not delayed, in a mixture, computes its own);
    ``amax_axis_name``: mesh axis to reduce a per-tensor (or NVFP4 global) amax over
    (``shard_map``); ``key``: the layer call's key, from which a slot that rounds
    stochastically draws (:func:`usage_key`)."""
    if last_dim is not None and plan.reuses_last_dim(usage):
        return transpose(last_dim)
    op = plan.operand(usage)
    usage_rng = usage_key(key, usage) if op.rule.stochastic_rounding else None
    scale = scale if op.delayed else None
    qa = quantize(t_hp, op.rule, axis=op.axis, scale=scale, amax_axis_name=amax_axis_name, key=usage_rng)
    return qa if usage.axis == LAST_DIM else transpose(qa)


def usage_key(key: jax.Array, usage: Usage) -> jax.Array:
    """The stochastic-rounding key of one slot: ``jax.random.fold_in(key, i)``, ``i`` the
    slot's index in :class:`~fp8train.spec.roles.Usage` (so grad_input's and grad_weight's
    grad_output draw independently)."""
    return jax.random.fold_in(key, list(Usage).index(usage))


def _role_scale(scale, role: Role):
    return None if scale is None else scale[role.index]


def _amax(t: jax.Array) -> jax.Array:
    """``max|t|`` as a float32 scalar (NaN wins, subnormals count; 0 for an empty array)."""
    return from_bits(jnp.max(magnitude_bits(to_float32(t)), initial=0))


def _matmul_hp(a: jax.Array, b: jax.Array, out_dtype) -> jax.Array:
    """``a @ b^T`` in high precision (a GEMM the plan does not quantize)."""
    out = lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST)
    return out.astype(out_dtype)


def _forward(static, x, w, b, scale, key):
    """``(output, residuals)`` of ``x[M,K] @ w[N,K]^T + b``."""
    plan, axis_name = static[0], static[3]
    if plan.quantizes(Gemm.OUTPUT):
        x_fp8 = quantize_usage(plan, Usage.OUTPUT_INPUT, x, _role_scale(scale, Role.INPUT), amax_axis_name=axis_name, key=key)
        w_fp8 = quantize_usage(plan, Usage.OUTPUT_WEIGHT, w, _role_scale(scale, Role.WEIGHT), amax_axis_name=axis_name, key=key)
        y = scaled_matmul(x_fp8, w_fp8, x.dtype, bias=b)
    else:
        x_fp8 = w_fp8 = None
        y = _matmul_hp(x, w, x.dtype)
        y = y if b is None else (y + b).astype(x.dtype)
    # What the backward needs: the FP8 operands where the plan reuses them or the forward
    # can quantize them now (the same call on the same array gives the same codes, as the
    # PyTorch layer's save_fp8_activations), else the high-precision arrays.
    if plan.quantizes(Gemm.GRAD_WEIGHT):
        x_saved = quantize_usage(
            plan, Usage.GRAD_WEIGHT_INPUT, x, _role_scale(scale, Role.INPUT), x_fp8, amax_axis_name=axis_name, key=key
        )
    else:
        x_saved = x
    reuse_weight = w_fp8 is not None and plan.quantizes(Gemm.GRAD_INPUT) and plan.reuses_last_dim(Usage.GRAD_INPUT_WEIGHT)
    w_saved = w_fp8 if reuse_weight else w
    amaxes = None if scale is None else jnp.stack([_amax(x), _amax(w)])
    return y, (x_saved, w_saved, amaxes, scale, key)


def _backward(static, residuals, dy):
    plan, w_dtype, b_dtype, axis_name = static
    x_saved, w_saved, amaxes, scale, key = residuals
    dy_scale = _role_scale(scale, Role.GRAD_OUTPUT)
    dy_fp8 = None
    if plan.quantizes(Gemm.GRAD_INPUT):
        dy_fp8 = quantize_usage(plan, Usage.GRAD_INPUT_GRAD_OUTPUT, dy, dy_scale, amax_axis_name=axis_name, key=key)
        if isinstance(w_saved, QuantizedArray):
            w_t = transpose(w_saved)
        else:
            w_scale = _role_scale(scale, Role.WEIGHT)
            w_t = quantize_usage(plan, Usage.GRAD_INPUT_WEIGHT, w_saved, w_scale, amax_axis_name=axis_name, key=key)
        dx = scaled_matmul(dy_fp8, w_t, dy.dtype)
    else:
        dx = _matmul_hp(dy, w_saved.T, dy.dtype)
    if plan.quantizes(Gemm.GRAD_WEIGHT):
        dy_t = quantize_usage(
            plan, Usage.GRAD_WEIGHT_GRAD_OUTPUT, dy, dy_scale, dy_fp8, amax_axis_name=axis_name, key=key
        )
        dw = scaled_matmul(dy_t, x_saved, w_dtype)
    else:
        dw = _matmul_hp(dy.T, x_saved.T, w_dtype)
    db = None if b_dtype is None else dy.sum(0).astype(b_dtype)
    # grad_output's amax where its scale is delayed (a mixture's current-scaled backward: 0, no update).
    dy_amax = _amax(dy) if Role.GRAD_OUTPUT in plan.delayed_roles else jnp.zeros((), jnp.float32)
    recorded = None if scale is None else jnp.concatenate([amaxes, dy_amax[None]])
    return dx, dw, db, recorded


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fp8_matmul(static, x, w, b, scale, amax_history, key):
    return _forward(static, x, w, b, scale, key)[0]


def _fp8_matmul_fwd(static, x, w, b, scale, amax_history, key):
    y, residuals = _forward(static, x, w, b, scale, key)
    return y, (residuals, amax_history)


def _fp8_matmul_bwd(static, saved, dy):
    residuals, amax_history = saved
    dx, dw, db, recorded = _backward(static, residuals, dy)
    # The key takes no gradient (None: a zero cotangent of its integer dtype).
    if recorded is None:
        return dx, dw, db, None, None, None
    # The step's amaxes leave as the gradient of amax_history (row 0); scale gets none.
    d_history = jnp.zeros_like(amax_history).at[0].set(recorded)
    return dx, dw, db, jnp.zeros_like(residuals[3]), d_history, None


_fp8_matmul.defvjp(_fp8_matmul_fwd, _fp8_matmul_bwd)


def linear(
    x: jax.Array,
    weight: jax.Array,
    bias: jax.Array | None = None,
    *,
    recipe: Recipe | str = "tensorwise",
    scale: jax.Array | None = None,
    amax_history: jax.Array | None = None,
    amax_axis_name=None,
    key: jax.Array | None = None,
) -> jax.Array:
    """``x @ weight^T + bias`` with the output, grad_input and grad_weight GEMMs in FP8 (or
    4 bits: ``nvfp4``, ``mxfp4``) as ``recipe``'s operand plan says; differentiable (a
    ``jax.custom_vjp``) and jittable.

    The token dim is zero-padded to the plan's alignment, as ``fp8train.Float8Linear`` pads it.

    Args:
        x: ``[..., K]`` float32, bfloat16 or float16; the output takes its dtype.
        weight: ``[N, K]`` of ``x``'s dtype (PyTorch's layout: a Flax kernel is its transpose).
        bias: ``[N]`` or ``None``.
        recipe: a :class:`~fp8train.spec.recipes.Recipe` or recipe name.
        scale: delayed scaling: the layer's float32 ``(3,)`` scales (input, weight,
            grad_output); required with a delayed recipe, else ``None``.
        amax_history: delayed scaling: the layer's ``(L, 3)`` history. Only its gradient
            is used: row 0 of the gradient holds the amaxes of this call (see
            :func:`update_fp8_state`).
        amax_axis_name: inside ``shard_map``: the mesh axis (or axes) across which the
            tensors are split (sequence parallelism): every per-tensor scale computed here
            (``tensorwise``, and ``rowwise_with_gw_hp``'s weight in the grad_input GEMM)
            comes from the MAX of the shards' amaxes, and so does NVFP4's global amax.
            Delayed scaling reduces in :func:`update_fp8_state` instead.
        key: a JAX PRNG key, required by a plan that rounds stochastically (``nvfp4``),
            drawn from per slot (:func:`usage_key`); a new one each step and layer
            (``jax.random.fold_in``) makes a run reproducible from its seed.

    Returns:
        ``[..., N]`` of ``x``'s dtype.

    Raises:
        ValueError: mismatched shapes or dtypes, a delayed recipe without its state (or
            state without one), dims the recipe's blocks cannot tile, a stochastic-rounding
            plan without a key.
    """
    recipe = resolve_recipe(recipe)
    x, weight = check_array("x", x), check_array("weight", weight)
    plan = recipe.operand_plan
    _check_linear_arguments(recipe, x, weight, bias, scale, key)
    leading, k = x.shape[:-1], x.shape[-1]
    x2d = x.reshape(-1, k)
    num_tokens, padded = x2d.shape[0], round_up(x2d.shape[0], plan.alignment)
    if padded != num_tokens:
        x2d = jnp.pad(x2d, ((0, padded - num_tokens), (0, 0)))
    if scale is not None:
        scale = lax.stop_gradient(scale.astype(jnp.float32))
        if amax_history is None:
            amax_history = jnp.zeros((1, NUM_ROLES), jnp.float32)
    static = (plan, weight.dtype, None if bias is None else bias.dtype, amax_axis_name)
    y = _fp8_matmul(static, x2d, weight, bias, scale, amax_history if scale is not None else None, key)
    return y[:num_tokens].reshape(*leading, weight.shape[0])


def _check_linear_arguments(recipe: Recipe, x: jax.Array, weight: jax.Array, bias, scale, key) -> None:
    """:func:`linear`'s shape, dtype, state and key checks (the errors its docstring lists)."""
    plan = recipe.operand_plan
    if key is None and any(op.rule.stochastic_rounding for op in plan.operands):
        raise ValueError(
            f"recipe {recipe.name!r} rounds grad_output stochastically: pass key=jax.random.key(seed) "
            "(a new one each step, e.g. jax.random.fold_in(key, step)), or disable it "
            "(NVFP4Scaling(disable_stochastic_rounding=True))"
        )
    if weight.ndim != 2 or x.ndim < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x of shape {tuple(x.shape)} and weight of shape {tuple(weight.shape)} do not make x @ weight^T: weight is [N, K], x [..., K]")
    if x.dtype != weight.dtype:
        raise TypeError(f"x dtype {x.dtype} does not match weight dtype {weight.dtype}; cast one of them")
    if bias is not None and tuple(check_array("bias", bias).shape) != (weight.shape[0],):
        raise ValueError(f"bias of shape {tuple(bias.shape)} must be [N] = [{weight.shape[0]}]")
    if plan.delayed != (scale is not None):
        raise ValueError(
            f"recipe {recipe.name!r} {'needs' if plan.delayed else 'takes no'} delayed-scaling state: "
            + ("pass scale and amax_history (init_delayed_state)" if plan.delayed else "pass scale=None")
        )
    if plan.block and (weight.shape[0] % plan.block or weight.shape[1] % plan.block):
        raise ValueError(
            f"recipe {recipe.name!r} needs in and out features divisible by {plan.block}; weight has shape "
            f"{tuple(weight.shape)}. Pick sizes that are multiples of {plan.block}, or run this layer in high precision"
        )


def init_delayed_state(recipe: DelayedScaling) -> dict[str, jax.Array]:
    """A layer's fresh delayed-scaling state: ``{"scale": ones(3), "amax_history": zeros(L, 3)}``
    (``recipe``: delayed scaling, or a mixture with a delayed direction)."""
    check_type("recipe", recipe, Recipe, "a DelayedScaling recipe")
    recipe = _delayed_part(recipe)
    return {
        "scale": jnp.ones((NUM_ROLES,), jnp.float32),
        "amax_history": jnp.zeros((recipe.amax_history_len, NUM_ROLES), jnp.float32),
    }


def _delayed_part(recipe: Any) -> DelayedScaling:
    """The delayed-scaling recipe that drives ``recipe``'s state (its own, or a mixture's
    delayed direction)."""
    recipe = resolve_recipe(recipe)
    check_type("recipe", recipe.delayed_scaling or recipe, DelayedScaling, "a DelayedScaling recipe (or 'delayed')")
    return recipe.delayed_scaling


def _is_state(node: Any) -> bool:
    return isinstance(node, Mapping) and set(node) == {"scale", "amax_history"}


def update_fp8_state(fp8_state: Any, fp8_grads: Any, recipe: DelayedScaling | str, *, axis_name=None) -> Any:
    """Delayed scaling's update after a training step, for every layer's state in a tree.

    For each ``{"scale", "amax_history"}`` in ``fp8_state`` (e.g. a model's ``"fp8_state"``
    collection), row 0 of the matching gradient (the amaxes the layer saw in the step) is
    folded into ``amax_history[0]`` (MAX), then scale and history are updated with the rule
    of :func:`fp8train.quant.delayed_scaling_update`: a layer that did not run (zero amaxes) is
    neither rescaled nor rolled.

    Args:
        fp8_state: the state tree before the step.
        fp8_grads: the gradient of the loss with respect to ``fp8_state`` (same structure).
        recipe: the :class:`~fp8train.spec.recipes.DelayedScaling` the layers use (formats,
            margin, ``amax_compute_algo``, ``reduce_amax``), or a mixture with a delayed direction.
        axis_name: inside ``shard_map``/``pmap``: the mesh axis (or axes) to reduce the
            amaxes over (MAX, one ``jax.lax.pmax`` for the whole tree) when the recipe's
            ``reduce_amax`` is on. Not needed under ``jax.jit`` with sharded arrays, where
            every amax is already global.

    Returns:
        The updated state tree.

    Raises:
        TypeError: ``recipe`` is not a delayed recipe.
        ValueError: the two trees do not match.
    """
    recipe = _delayed_part(recipe)
    states, treedef = jax.tree_util.tree_flatten(fp8_state, is_leaf=_is_state)
    grads = treedef.flatten_up_to(fp8_grads) if states else []
    states_found = [s for s in states if _is_state(s)]
    if len(states_found) != len(states):
        raise ValueError("fp8_state holds values that are not delayed-scaling states ({'scale', 'amax_history'} per layer)")
    recorded = [g["amax_history"][0] for g in grads]
    if recorded and axis_name is not None and recipe.reduce_amax:
        # One collective for every layer; on bits, so subnormal amaxes count.
        flat = jnp.concatenate([r.reshape(-1) for r in recorded])
        flat = from_bits(lax.pmax(magnitude_bits(flat), axis_name))
        recorded = list(flat.reshape(len(recorded), -1))
    fp8_max = jnp.asarray([recipe.role_format(role).max for role in Role], jnp.float32)
    updated = []
    for state, amax in zip(states, recorded):
        history = state["amax_history"].at[0].max(amax)
        history, scale = delayed_scaling_update(
            history, state["scale"], fp8_max, margin=recipe.margin, algo=recipe.amax_compute_algo
        )
        updated.append({"scale": scale, "amax_history": history})
    return treedef.unflatten(updated)
