"""A mixed recipe (issue 41) in the JAX frontend: ``fp8train.jax.linear`` under a hybrid
recipe gives the PyTorch layer's output and gradients, bit for bit (the plan drives both)."""

from __future__ import annotations

import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import fp8train  # noqa: E402
from fp8train import recipes  # noqa: E402
from fp8train.jax.linear import linear  # noqa: E402


@pytest.mark.parametrize(
    "forward, backward",
    [  # JAX compiles each for seconds (nvfp4's 17 s, the cheapest 8): all with the heavy tests
        pytest.param("tensorwise", "mxfp8", marks=pytest.mark.heavy),
        pytest.param("nvfp4", "mxfp8", marks=pytest.mark.heavy),
        pytest.param("mxfp8", "rowwise", marks=pytest.mark.heavy),
    ],
)
def test_a_hybrid_in_jax_matches_the_pytorch_layer_bit_for_bit(forward, backward):
    recipe = recipes.hybrid(forward=forward, backward=backward)
    torch.manual_seed(0)
    layer = fp8train.Float8Linear(128, 128, bias=False, recipe=recipe)
    x = torch.randn(128, 128, generator=torch.Generator().manual_seed(1))
    grad_output = torch.randn(128, 128, generator=torch.Generator().manual_seed(2))
    x_torch = x.clone().requires_grad_()
    out = layer(x_torch)
    out.backward(grad_output)

    weight = jnp.asarray(layer.weight.detach().numpy())
    out_jax, vjp = jax.vjp(lambda x_, w_: linear(x_, w_, recipe=recipe), jnp.asarray(x.numpy()), weight)
    grad_x, grad_w = vjp(jnp.asarray(grad_output.numpy()))
    assert np.array_equal(np.asarray(out_jax), out.detach().numpy())
    assert np.array_equal(np.asarray(grad_x), x_torch.grad.numpy())
    assert np.array_equal(np.asarray(grad_w), layer.weight.grad.numpy())


@pytest.mark.heavy  # JAX compiles it for seconds
def test_a_delayed_mixture_in_jax_matches_the_pytorch_layer_and_its_state():
    """hybrid(forward=delayed, backward=mxfp8) over two steps: outputs, gradients and the
    delayed state (grad_output's column untouched: its scale is mxfp8's own) bit for bit."""
    import fp8train.jax as fj

    recipe = recipes.hybrid(forward="delayed", backward="mxfp8")
    torch.manual_seed(0)
    layer = fp8train.Float8Linear(64, 64, bias=False, recipe=recipe)
    weight = jnp.asarray(layer.weight.detach().numpy())
    state = fj.init_delayed_state(recipe)
    for step in range(2):
        x = torch.randn(64, 64, generator=torch.Generator().manual_seed(step)) * (1 + step)
        grad_output = torch.randn(64, 64, generator=torch.Generator().manual_seed(10 + step))
        x_torch = x.clone().requires_grad_()
        with fp8train.autocast():
            out = layer(x_torch)
        out.backward(grad_output)

        def run(x_, w_, s_):
            return linear(x_, w_, recipe=recipe, scale=s_["scale"], amax_history=s_["amax_history"])

        out_jax, vjp = jax.vjp(run, jnp.asarray(x.numpy()), weight, state)
        grad_x, _, grad_state = vjp(jnp.asarray(grad_output.numpy()))
        state = fj.update_fp8_state(state, grad_state, recipe)
        assert np.array_equal(np.asarray(out_jax), out.detach().numpy()), step
        assert np.array_equal(np.asarray(grad_x), x_torch.grad.numpy()), step
    assert np.array_equal(np.asarray(state["scale"]), layer.fp8_scale.numpy())
    assert np.array_equal(np.asarray(state["amax_history"]), layer.fp8_amax_history.numpy())
