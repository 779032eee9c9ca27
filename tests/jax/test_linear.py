"""``fp8train.jax.linear`` (the three GEMMs of a dense layer, a ``jax.custom_vjp``) against
``fp8train.Float8Linear`` on the same values, every recipe, under ``jax.jit``: forward and
backward bit-exact where every float32 partial sum is exact, else within float32
accumulation error."""

from __future__ import annotations

import functools

import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import fp8train  # noqa: E402
import fp8train.jax as fj  # noqa: E402
from fp8train.nn.config import Float8ModuleConfig  # noqa: E402
from fp8train.quant.kernels import use_quant_settings  # noqa: E402
from fp8train.spec.fp4_recipes import NVFP4Scaling  # noqa: E402
from fp8train.spec.recipes import RECIPE_NAMES, DelayedScaling  # noqa: E402

from ._common import JAX_FLOAT, TORCH_FLOAT  # noqa: E402
from .test_gemm import exact_sum_values  # noqa: E402

IN_FEATURES, OUT_FEATURES = 128, 256  # the blockwise recipe's block, and two of them


@pytest.fixture(autouse=True)
def _float32_torch_gemm():
    with use_quant_settings(emulated_gemm="float32"):
        yield


def _recipe(recipe_name: str):
    """The recipe of ``recipe_name``, with NVFP4's stochastic rounding off: its bits come
    from a JAX key, not PyTorch's generator (``test_nvfp4_stochastic_rounding_*`` covers it)."""
    if recipe_name == "nvfp4":
        return NVFP4Scaling(disable_stochastic_rounding=True)
    return fp8train.recipes.from_name(recipe_name)


@functools.cache
def _step(recipe_name: str):
    """A jitted ``(y, dx, dw, db)`` of ``linear`` for ``recipe_name``; delayed scaling with
    its fresh state (scales 1)."""
    recipe = _recipe(recipe_name)

    def forward(x, w, b):
        if recipe.operand_plan.delayed:
            state = fj.init_delayed_state(recipe)
            return fj.linear(x, w, b, recipe=recipe, scale=state["scale"], amax_history=state["amax_history"])
        return fj.linear(x, w, b, recipe=recipe)

    @jax.jit
    def step(x, w, b, dy):
        y, vjp = jax.vjp(forward, x, w, b)
        return (y, *vjp(dy))

    return step


def _torch_step(recipe_name, x, w, b, dy, dtype):
    config = Float8ModuleConfig(recipe=_recipe(recipe_name), backend="emulated")
    layer = fp8train.Float8Linear(IN_FEATURES, OUT_FEATURES, config=config, dtype=TORCH_FLOAT[dtype])
    with torch.no_grad():
        layer.weight.copy_(torch.from_numpy(w))
        layer.bias.copy_(torch.from_numpy(b))
    x_t = torch.from_numpy(x).to(TORCH_FLOAT[dtype]).requires_grad_()
    y = layer(x_t)
    y.backward(torch.from_numpy(dy).to(TORCH_FLOAT[dtype]))
    return y, x_t.grad, layer.weight.grad, layer.bias.grad


def _run_both(recipe_name, x, w, b, dy, dtype):
    as_jax = functools.partial(jnp.asarray, dtype=JAX_FLOAT[dtype])
    got = _step(recipe_name)(as_jax(x), as_jax(w), as_jax(b), as_jax(dy))
    expected = _torch_step(recipe_name, x, w, b, dy, dtype)
    return [np.asarray(g.astype(jnp.float32)) for g in got], [e.detach().float().numpy() for e in expected]


# bfloat16 for every recipe; float32 for one by default, the others under -m slow. The 4-bit
# recipes' JAX compiles take seconds: under -m heavy (CI's second leg).
_HEAVY_JAX = {"nvfp4", "mxfp4"}


@pytest.mark.parametrize(
    "recipe_name, dtype",
    [pytest.param(r, "bfloat16", marks=pytest.mark.heavy) if r in _HEAVY_JAX else (r, "bfloat16") for r in RECIPE_NAMES]
    + [("tensorwise", "float32")],
)
def test_forward_and_backward_bit_exact(recipe_name, dtype):
    """Values whose every GEMM partial sum is exact in float32 (k/16 for integers k of
    10..100): y, grad_input, grad_weight and grad_bias equal bit for bit. A 3-D input of
    100 tokens: padded to the recipe's block inside both layers. (The 4-bit GEMMs are
    bit-exact on any values; their partial sums are exact by construction.)"""
    rng = np.random.default_rng(0)
    x = exact_sum_values((2, 50, IN_FEATURES), rng)
    w = exact_sum_values((OUT_FEATURES, IN_FEATURES), rng, 1 / 4)
    b = exact_sum_values((OUT_FEATURES,), rng)
    dy = exact_sum_values((2, 50, OUT_FEATURES), rng, 4)
    got, expected = _run_both(recipe_name, x, w, b, dy, dtype)
    for name, g, e in zip(("y", "grad_input", "grad_weight", "grad_bias"), got, expected):
        assert g.shape == e.shape, name
        np.testing.assert_array_equal(g, e, err_msg=f"{recipe_name} {name}")


@pytest.mark.slow
@pytest.mark.parametrize("recipe_name", [r for r in RECIPE_NAMES if r != "tensorwise"])
def test_forward_and_backward_float32(recipe_name):
    rng = np.random.default_rng(0)
    x = exact_sum_values((2, 50, IN_FEATURES), rng)
    w = exact_sum_values((OUT_FEATURES, IN_FEATURES), rng, 1 / 4)
    b = exact_sum_values((OUT_FEATURES,), rng)
    dy = exact_sum_values((2, 50, OUT_FEATURES), rng, 4)
    got, expected = _run_both(recipe_name, x, w, b, dy, "float32")
    for g, e in zip(got, expected):
        np.testing.assert_array_equal(g, e)


@pytest.mark.parametrize("recipe_name", ["rowwise_with_gw_hp"])
def test_within_float32_accumulation_error_on_any_values(recipe_name):
    """Normal random values: the two frameworks sum in their own orders; every output is
    within twice the float32 accumulation bound gamma_K * sum|a_i b_i| of the other (K the
    contraction length, gamma_K = K * 2^-24; the dequantized FP8 operands' magnitudes
    bound the sum), and most are identical."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 64, IN_FEATURES)).astype(np.float32)
    w = (rng.standard_normal((OUT_FEATURES, IN_FEATURES)) * 0.1).astype(np.float32)
    b = rng.standard_normal(OUT_FEATURES).astype(np.float32)
    dy = rng.standard_normal((2, 64, OUT_FEATURES)).astype(np.float32)
    got, expected = _run_both(recipe_name, x, w, b, dy, "float32")
    x2, dy2 = np.abs(x.reshape(-1, IN_FEATURES)), np.abs(dy.reshape(-1, OUT_FEATURES))
    # Magnitudes of the operands, with 2x headroom for the FP8 rounding and scales.
    bounds = [
        2 * IN_FEATURES * 2.0**-24 * 2 * (x2 @ np.abs(w).T).reshape(got[0].shape) + 1e-30,
        2 * OUT_FEATURES * 2.0**-24 * 2 * (dy2 @ np.abs(w)).reshape(got[1].shape) + 1e-30,
        2 * 128 * 2.0**-24 * 2 * (dy2.T @ x2) + 1e-30,
        2 * 128 * 2.0**-24 * 2 * dy2.sum(0) + 1e-30,
    ]
    for name, g, e, bound in zip(("y", "grad_input", "grad_weight", "grad_bias"), got, expected, bounds):
        assert (np.abs(g.astype(np.float64) - e) <= bound).all(), name


def test_grad_of_a_loss_under_jit_and_the_input_rank():
    """``jax.grad`` of a scalar loss; inputs of rank 1 and 3; float16 compute."""
    w = jnp.asarray(np.random.default_rng(2).standard_normal((32, 64)), jnp.float16)
    loss = jax.jit(jax.grad(lambda x, w: jnp.sum(fj.linear(x, w, recipe="mxfp8").astype(jnp.float32) ** 2), argnums=(0, 1)))
    for shape in ((3, 5, 64),):
        dx, dw = loss(jnp.ones(shape, jnp.float16), w)
        assert dx.shape == shape and dw.shape == (32, 64) and dx.dtype == jnp.float16
        assert bool(jnp.isfinite(dw.astype(jnp.float32)).all())


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: fj.linear(jnp.ones((4, 64)), jnp.ones((32, 48))), ValueError, r"x of shape \(4, 64\) and weight of shape \(32, 48\)"),
        (lambda: fj.linear(jnp.ones((4, 64)), jnp.ones((32, 64), jnp.bfloat16)), TypeError, "x dtype float32 does not match weight dtype bfloat16"),
        (lambda: fj.linear(jnp.ones((4, 64)), jnp.ones((32, 64)), recipe="delayed"), ValueError, "recipe 'delayed' needs delayed-scaling state"),
        (lambda: fj.linear(jnp.ones((4, 64)), jnp.ones((32, 64)), recipe="blockwise"), ValueError, r"divisible by 128; weight has shape \(32, 64\)"),
        (lambda: fj.linear(jnp.ones((4, 64)), jnp.ones((32, 64)), recipe="fp9"), ValueError, "unknown FP8 recipe 'fp9'"),
        (lambda: fj.linear(jnp.ones((4, 64)), jnp.ones((32, 64)), recipe="nvfp4"), ValueError,
         r"recipe 'nvfp4' rounds grad_output stochastically: pass key=jax.random.key\(seed\)"),
        (lambda: fj.linear(jnp.ones((4, 48)), jnp.ones((32, 48)), recipe="mxfp4"), ValueError,
         r"recipe 'mxfp4' needs in and out features divisible by 32; weight has shape \(32, 48\)"),
        (lambda: fj.update_fp8_state({}, {}, "mxfp8"), TypeError, "recipe must be a DelayedScaling recipe"),
        (lambda: fj.init_delayed_state("delayed"), TypeError, "recipe must be a DelayedScaling recipe"),
    ],
)
def test_bad_arguments_name_the_value_and_the_fix(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_delayed_scaling_sequence_matches_pytorch():
    """Six steps of delayed scaling, growing values, a step where the layer does not run
    (step 3), margin 1 and a short history: the same scales and histories, bit for bit,
    and the same outputs and gradients, as a PyTorch ``Float8Linear`` stepped the same way."""
    recipe = DelayedScaling(amax_history_len=4, margin=1)
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((64, 32)) * 0.1).astype(np.float32)
    layer = fp8train.Float8Linear(32, 64, bias=False, config=Float8ModuleConfig(recipe=recipe, backend="emulated"))
    with torch.no_grad():
        layer.weight.copy_(torch.from_numpy(w))
    state = fj.init_delayed_state(recipe)

    @jax.jit
    def step(w, state, x, dy):
        def loss(w, state):
            y = fj.linear(x, w, recipe=recipe, scale=state["scale"], amax_history=state["amax_history"])
            return jnp.sum(y * dy), y

        (_, y), (dw, recorded) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(w, state)
        return y, dw, fj.update_fp8_state(state, recorded, recipe)

    skip = jax.jit(lambda state: fj.update_fp8_state(state, jax.tree.map(jnp.zeros_like, state), recipe))
    for i in range(6):
        x = (rng.standard_normal((48, 32)) * 4.0**i).astype(np.float32)
        dy = (rng.standard_normal((48, 64)) * 10.0 ** (-i)).astype(np.float32)
        if i == 3:  # the layer does not run: no gradient reaches its state
            state = skip(state)
            continue
        y, dw, state = step(jnp.asarray(w), state, jnp.asarray(x), jnp.asarray(dy))
        with fp8train.autocast():
            y_t = layer(torch.from_numpy(x))
            y_t.backward(torch.from_numpy(dy))
        scale, history = np.asarray(state["scale"]), np.asarray(state["amax_history"])
        np.testing.assert_array_equal(scale.view(np.uint32), layer.fp8_scale.numpy().view(np.uint32), err_msg=f"step {i}")
        np.testing.assert_array_equal(history.view(np.uint32), layer.fp8_amax_history.numpy().view(np.uint32), err_msg=f"step {i}")
        np.testing.assert_allclose(np.asarray(y), y_t.detach().numpy(), rtol=1e-6, atol=1e-6 * np.abs(y_t.detach().numpy()).max())
        np.testing.assert_allclose(np.asarray(dw), layer.weight.grad.numpy(), rtol=1e-5, atol=1e-5 * np.abs(layer.weight.grad.numpy()).max())
        layer.weight.grad = None
    assert float(state["scale"][0]) != 1.0 and float(history[0].max()) == 0.0


_NVFP4_SR_STEP = jax.jit(
    lambda x, w, dy, key: (lambda y, vjp: (y, *vjp(dy)))(*jax.vjp(lambda x, w: fj.linear(x, w, recipe="nvfp4", key=key), x, w))
)


@pytest.mark.slow  # ~3 s; the 4-bit JAX path itself runs by default (test_forward_and_backward_bit_exact)
def test_nvfp4_stochastic_rounding_from_a_key():
    """The default NVFP4 recipe (grad_output rounded stochastically from the key): the
    forward is PyTorch's bit for bit (no stochastic rounding there); the same key gives the
    same gradients, another key others; each within a few 4-bit steps of the
    round-to-nearest gradients, and their mean over keys closer than any one of them."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((64, IN_FEATURES)).astype(np.float32)
    w = (rng.standard_normal((OUT_FEATURES, IN_FEATURES)) * 0.1).astype(np.float32)
    dy = rng.standard_normal((64, OUT_FEATURES)).astype(np.float32)
    args = (jnp.asarray(x), jnp.asarray(w), jnp.asarray(dy))
    runs = [_NVFP4_SR_STEP(*args, jax.random.key(seed)) for seed in (0, 0, 1, 2, 3)]
    config = Float8ModuleConfig(recipe="nvfp4", backend="emulated")
    layer = fp8train.Float8Linear(IN_FEATURES, OUT_FEATURES, bias=False, config=config)
    with torch.no_grad():
        layer.weight.copy_(torch.from_numpy(w))
    np.testing.assert_array_equal(np.asarray(runs[0][0]), layer(torch.from_numpy(x)).detach().numpy())
    for a, b in zip(runs[0], runs[1]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert all((np.asarray(runs[0][i]) != np.asarray(runs[2][i])).any() for i in (1, 2))
    # Round-to-nearest gradients from PyTorch (equal to JAX's: the bit-exact test above).
    nearest = [None, *[g.numpy() for g in _nearest_nvfp4_grads(x, w, dy)]]
    for i in (1, 2):
        grads = np.stack([np.asarray(r[i]) for r in runs[1:]])
        errors = np.abs(grads - nearest[i]).mean(axis=tuple(range(1, grads.ndim)))
        assert (errors < 0.5 * np.abs(nearest[i]).mean()).all(), errors
        assert np.abs(grads.mean(0) - nearest[i]).mean() < errors.mean()


def _nearest_nvfp4_grads(x, w, dy):
    config = Float8ModuleConfig(recipe=_recipe("nvfp4"), backend="emulated")
    layer = fp8train.Float8Linear(IN_FEATURES, OUT_FEATURES, bias=False, config=config)
    with torch.no_grad():
        layer.weight.copy_(torch.from_numpy(w))
    x_t = torch.from_numpy(x).requires_grad_()
    layer(x_t).backward(torch.from_numpy(dy))
    return x_t.grad, layer.weight.grad
