"""``fp8train.jax.Dense`` (a drop-in ``flax.linen.Dense``), its delayed-scaling collection,
``fp8train.jax.autocast``, and the amax reduction over a mesh axis in ``shard_map``."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import textwrap

import pytest

jax = pytest.importorskip("jax")
nn = pytest.importorskip("flax.linen")
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import fp8train.jax as fj  # noqa: E402
from fp8train.spec.recipes import DelayedScaling  # noqa: E402

RECIPE = DelayedScaling(amax_history_len=8)


class MLP(nn.Module):
    recipe: object = "tensorwise"

    @nn.compact
    def __call__(self, x):
        x = nn.gelu(fj.Dense(64, recipe=self.recipe)(x))
        return fj.Dense(32, recipe=self.recipe, use_bias=False)(x)


def _x(shape=(4, 8, 32), seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


@pytest.mark.heavy
def test_same_parameters_as_flax_dense_and_equal_without_fp8():
    x = _x()
    ours, theirs = fj.Dense(64), nn.Dense(64)
    params = theirs.init(jax.random.key(0), x)
    assert jax.tree.structure(ours.init(jax.random.key(0), x)) == jax.tree.structure(params)
    plain = jax.jit(theirs.apply)(params, x)
    np.testing.assert_array_equal(jax.jit(fj.Dense(64, recipe=None).apply)(params, x), plain)
    with fj.autocast(enabled=False):
        np.testing.assert_array_equal(jax.jit(ours.apply)(params, x), plain)
    fp8 = jax.jit(ours.apply)(params, x)  # traced again: a new function, outside the autocast
    kernel, bias = params["params"]["kernel"], params["params"]["bias"]
    np.testing.assert_array_equal(fp8, jax.jit(lambda x, w, b: fj.linear(x, w.T, b, recipe="tensorwise"))(x, kernel, bias))
    assert not np.array_equal(fp8, plain)


@pytest.mark.heavy  # a subprocess or a JAX compile of seconds: CI's second leg runs it (default run under 6 minutes)
def test_autocast_overrides_the_recipe_where_the_layer_is_traced():
    x = _x()
    model = fj.Dense(64, recipe="tensorwise")
    params = model.init(jax.random.key(0), x)

    @jax.jit
    def apply_mx(params, x):
        with fj.autocast(recipe="mxfp8"):
            return model.apply(params, x)

    np.testing.assert_array_equal(apply_mx(params, x), jax.jit(fj.Dense(64, recipe="mxfp8").apply)(params, x))
    with pytest.raises(TypeError, match="enabled='no' must be True or False"):
        with fj.autocast(enabled="no"):
            pass
    with pytest.raises(ValueError, match="unknown FP8 recipe 'mx'"):
        with fj.autocast(recipe="mx"):
            pass


@pytest.mark.heavy  # a torch.compile or JAX compile of seconds: CI's second leg runs it (default run under 6 minutes)
def test_delayed_state_lives_in_its_collection_and_a_step_carries_it():
    """Two training steps of a delayed-scaling MLP with optax, the state carried through
    ``update_fp8_state``: the first layer's history holds its input's and kernel's amaxes
    of each step, and its scales follow from them (the rule itself is held to PyTorch's in
    test_linear.py)."""
    optax = pytest.importorskip("optax")
    model = MLP(recipe=RECIPE)
    x, target = _x(), _x((4, 8, 32), seed=1)
    variables = model.init(jax.random.key(0), x)
    assert set(variables) == {"params", fj.FP8_STATE}
    state = variables[fj.FP8_STATE]["Dense_0"]
    assert state["scale"].shape == (3,) and state["amax_history"].shape == (8, 3)
    tx = optax.sgd(0.1)
    opt_state = tx.init(variables["params"])

    @jax.jit
    def train_step(params, fp8_state, opt_state):
        def loss_fn(params, fp8_state):
            y = model.apply({"params": params, fj.FP8_STATE: fp8_state}, x)
            return jnp.mean((y - target) ** 2)

        loss, (grads, recorded) = jax.value_and_grad(loss_fn, argnums=(0, 1))(params, fp8_state)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), fj.update_fp8_state(fp8_state, recorded, RECIPE), opt_state, loss

    params, fp8_state = variables["params"], variables[fj.FP8_STATE]
    for _ in range(2):
        old_params = params
        params, fp8_state, opt_state, loss = train_step(params, fp8_state, opt_state)
    assert np.isfinite(float(loss))
    kernel = old_params["Dense_0"]["kernel"]
    expected_amaxes = [np.abs(np.asarray(x)).max(), np.abs(np.asarray(kernel)).max()]
    history = np.asarray(fp8_state["Dense_0"]["amax_history"])
    np.testing.assert_array_equal(history[-1, :2], np.float32(expected_amaxes))
    assert (history[-2, :] > 0).all() and (history[:-2] == 0).all()
    scale = np.asarray(fp8_state["Dense_0"]["scale"])
    np.testing.assert_array_equal(scale[:2], np.float32(448.0) / history[-2:, :2].max(0))


def test_delayed_layer_without_its_state_says_how_to_fix():
    model = MLP(recipe=RECIPE)
    variables = model.init(jax.random.key(0), _x())
    with pytest.raises(ValueError, match="has no 'fp8_state' variables: pass the model's 'fp8_state' collection"):
        model.apply({"params": variables["params"]}, _x())
    with pytest.raises(ValueError, match=r"recipe 'blockwise' needs in and out features divisible by 128"):
        fj.Dense(48, recipe="blockwise").init(jax.random.key(0), _x((2, 128)))


SHARD_MAP_SCRIPT = textwrap.dedent(
    """
    import os, sys, types
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    # fp8train.jax without the PyTorch frontend's import (faster; it needs none of it).
    package = types.ModuleType("fp8train")
    package.__path__ = [PACKAGE]
    sys.modules["fp8train"] = package
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    import fp8train.jax as fj
    from fp8train.spec.recipes import DelayedScaling

    recipe = DelayedScaling(amax_history_len=4)
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, 64, 32)) * np.array([1.0, 8.0])[:, None, None], jnp.float32)
    w = jnp.asarray(rng.standard_normal((64, 32)) * 0.1, jnp.float32)
    state = fj.init_delayed_state(recipe)

    def recorded(x, w, state, axis_name):
        def loss(state):
            y = fj.linear(x, w, recipe=recipe, scale=state["scale"], amax_history=state["amax_history"])
            return jnp.sum(y ** 2)
        return fj.update_fp8_state(state, jax.grad(loss)(state), recipe, axis_name=axis_name)

    sharded = jax.jit(jax.shard_map(
        lambda x, w, state: recorded(x[0], w, state, "data"), mesh=mesh,
        in_specs=(P("data"), P(), P()), out_specs=P(), check_vma=False))(x, w, state)
    local = jax.jit(lambda x, w, state: recorded(x[0], w, state, None))(x[:1], w, state)
    # Shard 1 (8x larger inputs) sets the input amax everywhere; the grad_output amax is
    # the max over shards too.
    amax_inputs = float(jnp.abs(x).max())
    assert float(sharded["amax_history"][-1, 0]) == amax_inputs, sharded["amax_history"]
    assert float(local["amax_history"][-1, 0]) == float(jnp.abs(x[0]).max())
    q = jax.jit(jax.shard_map(lambda v: fj.quantize(v, "tensor", amax_axis_name="data").scale_inv[None],
        mesh=mesh, in_specs=P("data"), out_specs=P("data"), check_vma=False))(x)
    np.testing.assert_array_equal(np.asarray(q), np.full(2, fj.quantize(x, "tensor").scale_inv))
    # NVFP4's global amax: the MAX over the shards, so each shard's codes are the rows of
    # the unsharded tensor's.
    nv = jax.jit(jax.shard_map(lambda v: fj.quantize(v[0], "nvfp4", amax_axis_name="data").data[None],
        mesh=mesh, in_specs=P("data"), out_specs=P("data"), check_vma=False))(x)
    np.testing.assert_array_equal(np.asarray(nv).reshape(128, 16), np.asarray(fj.quantize(x.reshape(128, 32), "nvfp4").data))
    # Sequence parallelism with current scaling: one scale from both shards, so each
    # shard's rows are the unsharded layer's rows.
    dense = fj.Dense(64, recipe="tensorwise", amax_reduction_axis="data")
    params = dense.init(jax.random.key(0), x)
    y_sharded = jax.jit(jax.shard_map(lambda x: dense.apply(params, x), mesh=mesh,
        in_specs=P("data"), out_specs=P("data"), check_vma=False))(x)
    y_global = jax.jit(lambda x: fj.Dense(64, recipe="tensorwise").apply(params, x))(x)
    np.testing.assert_allclose(np.asarray(y_sharded), np.asarray(y_global), rtol=1e-6, atol=1e-6)
    y_local = jax.jit(jax.shard_map(lambda x: fj.Dense(64, recipe="tensorwise").apply(params, x), mesh=mesh,
        in_specs=P("data"), out_specs=P("data"), check_vma=False))(x)
    assert not np.allclose(np.asarray(y_local[0]), np.asarray(y_global[0]), rtol=1e-6, atol=1e-6)
    print("ok")
    """
)


@pytest.mark.slow  # a subprocess with two CPU devices: ~10 s
def test_amax_reduction_over_a_mesh_axis_in_shard_map():
    """Two CPU devices (a subprocess, since the device count is fixed at JAX's start):
    delayed scaling's recorded amaxes, a per-tensor amax, NVFP4's global amax and a
    tensorwise ``Dense``'s scales are the MAX over the shards."""
    script = SHARD_MAP_SCRIPT.replace("PACKAGE", repr(str(pathlib.Path(fj.__file__).parents[1])))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok")
