"""The Trainer with ``torch_compile=True``: it trains compiled, its telemetry still records
(a compiled model ignores hooks added after compiling), and several compiled models in one
process (``compare --torch_compile true``) each keep their own recompile limit."""

import functools
import math

import pytest
import torch
from torch._dynamo.utils import counters

from ._trainer_helpers import _args, _metrics, _train

STEPS = 3
SETTINGS = dict(steps=STEPS, fp8_stats_interval=2, eval_interval=0)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


@pytest.fixture
def aot_eager(monkeypatch):
    """The Trainer's ``torch.compile`` with Dynamo and AOTAutograd only: the same
    arithmetic as eager, bit for bit, and seconds instead of inductor's minutes."""
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))


def _stats(output_dir) -> list[dict]:
    return [record.get("fp8_stats") for record in _metrics(output_dir)]


@pytest.mark.heavy
@pytest.mark.parametrize(
    "recipe", ["tensorwise", pytest.param("delayed", marks=pytest.mark.slow), pytest.param("mxfp8", marks=pytest.mark.slow)]
)
def test_compiled_training_equals_eager_and_records_statistics(tmp_path, datasets, aot_eager, recipe):
    # The statistics step (step 2) runs eagerly, between compiled steps; delayed scaling's
    # state must come through that mix exactly.
    eager = _train(_args(tmp_path / "eager", fp8_recipe=recipe, **SETTINGS), datasets)
    compiled = _train(_args(tmp_path / "compiled", fp8_recipe=recipe, torch_compile=True, **SETTINGS), datasets)
    assert counters["stats"]["unique_graphs"] >= 1  # it did compile
    assert compiled["losses"] == eager["losses"]
    stats = _stats(tmp_path / "compiled")
    assert stats[0] is None and stats[2] is None and stats[1]  # recorded at step 2 only
    assert stats == _stats(tmp_path / "eager")


@pytest.mark.heavy
def test_compiles_where_torch_compile_has_no_isolate_recompiles(tmp_path, datasets, monkeypatch, caplog):
    # torch 2.10/2.11's torch.compile, which has no isolate_recompiles (passing it raises
    # TypeError): the trainer compiles without it, says so, and trains compiled.
    calls = []

    def compile_2_11(model=None, *, fullgraph=False, dynamic=None, backend="inductor", mode=None, options=None,
                     disable=False):
        calls.append(model)
        return compile_2_13(model, backend="eager")

    compile_2_13 = torch.compile
    monkeypatch.setattr(torch, "compile", compile_2_11)
    result = _train(_args(tmp_path, fp8_recipe="tensorwise", torch_compile=True, steps=1, eval_interval=0), datasets)
    assert len(calls) == 1 and counters["stats"]["unique_graphs"] >= 1
    assert math.isfinite(result["losses"][0])
    assert "no torch.compile(isolate_recompiles=...)" in caplog.text


@pytest.mark.slow
def test_inductor_training_is_close_to_eager(tmp_path, datasets):
    # Inductor fuses a few float32 sums differently (an ulp); FP8 codes then differ now and
    # then, so losses are close, not equal.
    eager = _train(_args(tmp_path / "eager", fp8_recipe="tensorwise", **SETTINGS), datasets)
    compiled = _train(_args(tmp_path / "compiled", fp8_recipe="tensorwise", torch_compile=True, **SETTINGS), datasets)
    for step, (a, b) in enumerate(zip(eager["losses"], compiled["losses"]), 1):
        assert math.isclose(a, b, rel_tol=2e-3), (step, a, b)


@pytest.mark.slow  # two trainers compiled, each training and evaluating: ~25 s
def test_each_compiled_model_has_its_own_recompile_limit(tmp_path, datasets, aot_eager):
    # Each trainer compiles a training graph and an evaluation graph. With a limit of 2
    # shared by every model in the process, the second trainer's graphs would exceed it
    # (and, by default, silently run eager): here that raises instead.
    settings = dict(steps=2, eval_interval=2, torch_compile=True)
    with torch._dynamo.config.patch(recompile_limit=2, fail_on_recompile_limit_hit=True):
        for index, recipe in enumerate(["tensorwise", "mxfp8"]):
            result = _train(_args(tmp_path / str(index), fp8_recipe=recipe, **settings), datasets)
            assert all(math.isfinite(loss) for loss in result["losses"])
