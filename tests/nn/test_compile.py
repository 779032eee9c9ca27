"""A converted model compiles (fullgraph=False) for every recipe and matches eager."""

import copy

import pytest
import torch

from fp8train.spec.recipes import RECIPE_NAMES


@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_compiled_matches_eager(recipe, small_model):
    torch._dynamo.reset()
    eager = small_model((128, 128), "gelu", (128, 128), recipe=recipe, backend="emulated")
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model)
    generator = torch.Generator().manual_seed(1)
    for step in range(3):  # delayed: the scales evolve the same way in both
        x = torch.randn(2, 64, 128, generator=generator)
        out_eager = eager(x)
        out_compiled = compiled(x)
        # Same arithmetic; only fusion may reorder float32 rounding.
        torch.testing.assert_close(out_compiled, out_eager, rtol=1e-5, atol=1e-5)
        out_eager.square().mean().backward()
        out_compiled.square().mean().backward()
        for (name, p_eager), p_compiled in zip(eager.named_parameters(), compiled_model.parameters()):
            torch.testing.assert_close(p_compiled.grad, p_eager.grad, rtol=1e-4, atol=1e-5, msg=name)
    for (name, b_eager), b_compiled in zip(eager.named_buffers(), compiled_model.buffers()):
        torch.testing.assert_close(b_compiled, b_eager, msg=name)


# Forward graph breaks of a converted 2-layer MLP, as of the layered package: the
# backend-choice log (one per model), plus delayed scaling's module registry and autocast
# state. A change that adds a break (an object Dynamo cannot build or rebuild, say) fails
# here; removing breaks (issue 12) lowers these numbers.
MAX_FORWARD_GRAPH_BREAKS = {"delayed": 6}


@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_forward_graph_breaks_do_not_grow(recipe, small_model):
    torch._dynamo.reset()
    model = small_model((128, 256), "gelu", (256, 128), recipe=recipe, backend="emulated")
    explanation = torch._dynamo.explain(model)(torch.randn(64, 128))
    assert explanation.graph_break_count <= MAX_FORWARD_GRAPH_BREAKS.get(recipe, 1), [
        b.reason.splitlines()[0] for b in explanation.break_reasons
    ]
