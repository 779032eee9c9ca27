"""``fp8train.autocast`` under ``torch.compile`` (issue 29): what a compiled forward guards
on is the autocast's plain settings, never a state object, and a changed setting
recompiles instead of reusing a graph traced for another.

torch 2.10/2.11 failed to compile a converted model inside an autocast ("AssertionError:
Unexpected type <class 'fp8train.nn.autocast.AutocastState'>"): Dynamo resolves a
``threading.local``'s attribute with ``inspect.getattr_static``, which found the holder's
class default (``None``) rather than the thread's state; it traced that constant and then
failed to build an equality guard on the live object. Tracing only (backend ``eager``):
seconds on 2 cores.
"""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import fp8train
from fp8train.spec.recipes import DelayedScaling

ac = importlib.import_module("fp8train.nn.autocast")  # the module; fp8train.autocast is the function

DIM, NUM_TOKENS = 64, 32
STATE_TYPE = f"type=<class '{ac.AutocastState.__module__}.{ac.AutocastState.__qualname__}'>"
MISSING = object()


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        yield
    torch._dynamo.reset()


def _linear(recipe) -> torch.nn.Module:
    torch.manual_seed(0)
    return fp8train.convert_to_float8_training(torch.nn.Linear(DIM, DIM), recipe, backend="emulated")


def _x() -> torch.Tensor:
    return torch.randn(NUM_TOKENS, DIM, generator=torch.Generator().manual_seed(1))


AUTOCASTS = {
    "default": {},
    "off": {"enabled": False},
    "override": {"recipe": "rowwise"},
}


@pytest.mark.parametrize(
    "recipe, settings",
    [("tensorwise", settings) for settings in AUTOCASTS] + [(DelayedScaling(), "default")],  # delayed reads `pending`
    ids=[*AUTOCASTS, "delayed"],
)
def test_compiled_forward_guards_on_plain_settings_only(recipe, settings):
    """No guard checks an AutocastState's type or identity (the guard torch 2.10/2.11 could
    not build); the settings are guarded as plain values, so each change recompiles."""
    with fp8train.autocast(**AUTOCASTS[settings]):
        explanation = torch._dynamo.explain(_linear(recipe))(_x())
    assert (explanation.graph_count, explanation.graph_break_count) == (1, 0)
    # A guard on the class itself (read to build the state) names it; one on an instance does not.
    on_instances = [guard for guard in explanation.out_guards if not guard.name.endswith(".AutocastState")]
    assert not [code for guard in on_instances for code in guard.code_list or [] if STATE_TYPE in code]
    guarded = {guard.name.rsplit("._STATE.", 1)[1] for guard in explanation.out_guards if "._STATE." in guard.name}
    assert {"enabled", "recipe"} <= guarded  # what the forward reads, as values


def test_every_setting_is_seen_by_a_static_lookup_as_it_is():
    """Dynamo looks a ``threading.local``'s attributes up with ``inspect.getattr_static``
    first; what that finds must be the thread's own value (or nothing, so that Dynamo asks
    the object), never a class attribute standing in for it."""
    with fp8train.autocast(enabled=False, recipe="mxfp8"):
        live = vars(ac._STATE)
        assert live  # the settings are the thread's own attributes
        for name, value in live.items():
            assert inspect.getattr_static(ac._STATE, name, MISSING) in (MISSING, value), name


@pytest.mark.heavy  # a torch.compile or JAX compile of seconds: CI's second leg runs it (default run under 6 minutes)
def test_a_changed_setting_recompiles_and_runs_as_eager():
    """One compiled model run under each autocast setting in turn, and back: every output
    is the eager module's under the same setting, bit for bit (never a graph traced for
    another), and each distinct setting is compiled once."""
    eager = _linear("tensorwise")
    compiled = torch.compile(_linear("tensorwise"), backend="eager")
    x = _x()
    order = ["default", "off", "override", "default", "off"]
    for settings in order:
        with torch.no_grad(), fp8train.autocast(**AUTOCASTS[settings]):
            expected, got = eager(x), compiled(x)
        assert torch.equal(got, expected), settings
    with torch.no_grad():
        assert torch.equal(compiled(x), eager(x))  # outside any autocast
        with fp8train.autocast(enabled=False):
            assert torch.equal(compiled(x), F.linear(x, eager.weight, eager.bias))
    assert counters["frames"]["total"] == len(set(order)) + 1
