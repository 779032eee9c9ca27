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
    [  # JAX compiles each for a few seconds: two of the three run with the heavy tests
        ("nvfp4", "mxfp8"),
        pytest.param("tensorwise", "mxfp8", marks=pytest.mark.heavy),
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
