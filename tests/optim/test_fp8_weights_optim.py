"""FP8 primary weights with ``fp8train.optim.AdamW``: the optimizer keeps the masters and
re-quantizes the modules' weights after each step, so a run with ``fp8_weights=True`` and
float32 masters equals the run without, bit for bit (losses, weights, checkpoints), for
every recipe; resume, DDP."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

import fp8train
from fp8train.nn.weights.float8_weight import Float8Weight
from fp8train.optim import AdamW
from tests.helpers.fp8_weight_runs import assert_equal_states, ddp_state_after, train_steps
from fp8train.spec.recipes import RECIPE_NAMES

NUM_STEPS = 5



def _model(recipe: str, fp8_weights: bool, dtype=torch.float32) -> nn.Module:
    torch.manual_seed(0)
    width = 128 if recipe == "blockwise" else 32  # blockwise needs whole 128-blocks
    model = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)).to(dtype)
    return fp8train.convert_to_float8_training(model, recipe=recipe, backend="emulated", fp8_weights=fp8_weights)


def _optimizer(model: nn.Module, **precision) -> AdamW:
    return AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, **precision)


def _first_linear(model: nn.Module) -> nn.Module:
    return next(m for m in model.modules() if isinstance(m, nn.Linear))


def _steps(model, optimizer, num_steps: int, first: int = 0) -> list[float]:
    return train_steps(model, optimizer, (32, _first_linear(model).in_features), num_steps, first)


@pytest.mark.parametrize("recipe", RECIPE_NAMES)  # every recipe
def test_fp8_weights_equal_the_high_precision_run_bit_for_bit(recipe):
    plain = _model(recipe, fp8_weights=False)
    expected_losses = _steps(plain, _optimizer(plain), NUM_STEPS)
    model = _model(recipe, fp8_weights=True)
    assert all(isinstance(m.weight, Float8Weight) for m in (model[0], model[2]))
    optimizer = _optimizer(model)  # held: the checkpoint saves its masters
    losses = _steps(model, optimizer, NUM_STEPS)
    assert losses == expected_losses
    assert_equal_states(plain.state_dict(), model.state_dict())
    del optimizer  # without it, the state_dict holds the dequantized weights
    assert torch.equal(model.state_dict()["0.weight"], model[0].weight.dequantize())


def test_the_optimizer_takes_the_pending_master_and_the_module_frees_it():
    model = _model("tensorwise", fp8_weights=True)
    weight = model[0].weight
    initial = weight.fp8_master.pending.clone()
    optimizer = _optimizer(model)
    assert weight.fp8_master.pending is None
    assert torch.equal(optimizer.state[weight]["master"], initial)  # the exact weight, not its FP8 value
    assert optimizer.state[weight]["master"] is weight.fp8_master.master
    # master_weight_dtype=None: the master is of the weight's dtype; bfloat16 of a float32 weight is refused
    with pytest.raises(ValueError, match="master_weight_dtype=torch.bfloat16 is narrower"):
        AdamW(_model("tensorwise", fp8_weights=True).parameters(), master_weight_dtype=torch.bfloat16)


def test_a_bfloat16_model_trains_with_bfloat16_masters_and_fp8_moments():
    model = _model("mxfp8", fp8_weights=True, dtype=torch.bfloat16)
    optimizer = _optimizer(
        model, master_weight_dtype=torch.bfloat16, exp_avg_dtype=torch.float8_e4m3fn, exp_avg_sq_dtype=torch.bfloat16
    )
    losses = _steps(model, optimizer, NUM_STEPS)
    assert losses[-1] < losses[0]
    master = optimizer.state[model[0].weight]["master"]
    assert master.dtype == torch.bfloat16 and model.state_dict()["0.weight"].dtype == torch.bfloat16
    # The FP8 weight is the master's quantization, as the next forward needs it
    assert torch.equal(model[0].weight.fp8_rowwise.data, Float8Weight.quantize(master, model[0].recipe.operand_plan).fp8_rowwise.data)


@pytest.mark.parametrize("model_first", [True, False])
@pytest.mark.parametrize("recipe", ["delayed", pytest.param("rowwise", marks=pytest.mark.slow)])
def test_save_load_and_resume_are_bit_identical(recipe, model_first):
    reference = _model(recipe, fp8_weights=True)
    reference_optimizer = _optimizer(reference)
    expected = _steps(reference, reference_optimizer, NUM_STEPS)

    model = _model(recipe, fp8_weights=True)
    optimizer = _optimizer(model)
    _steps(model, optimizer, 3)
    model_state, optimizer_state = model.state_dict(), optimizer.state_dict()

    resumed = _model(recipe, fp8_weights=True)
    resumed_optimizer = _optimizer(resumed)
    loads = [lambda: resumed.load_state_dict(model_state), lambda: resumed_optimizer.load_state_dict(optimizer_state)]
    for load in loads if model_first else loads[::-1]:
        load()
    assert _steps(resumed, resumed_optimizer, NUM_STEPS - 3, first=3) == expected[3:]
    assert_equal_states(reference.state_dict(), resumed.state_dict())


def test_torch_adamw_is_refused_naming_fp8train_adamw():
    model = _model("tensorwise", fp8_weights=True)
    torch.optim.AdamW(model.parameters())
    x = torch.randn(16, 32)
    with pytest.raises(ValueError, match="no optimizer holds its master weight: build fp8train.optim.AdamW"):
        model(x)
    with torch.no_grad():  # an evaluation needs no master
        model(x)
    with pytest.raises(RuntimeError, match=r"aten::mul_ would change a weight stored in FP8 \(fp8_weights=True\)"):
        with torch.no_grad():
            model[0].weight.mul_(0.5)  # what torch.optim.AdamW's step does


def _ddp_run(rank: int, fp8_weights: bool, init_sync: bool) -> dict:
    model = nn.parallel.DistributedDataParallel(_model("delayed", fp8_weights=fp8_weights), init_sync=init_sync)
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))[32 * rank : 32 * (rank + 1)]
    return ddp_state_after(model, _optimizer(model), x, num_steps=3)


def _ddp_worker(rank: int, results) -> None:
    results[rank] = [_ddp_run(rank, fp8_weights, init_sync) for fp8_weights, init_sync in ((True, True), (True, False), (False, True))]


@pytest.mark.slow
def test_ddp_keeps_replicas_identical(spawn_gloo):
    results = spawn_gloo(_ddp_worker)
    for synced_0, synced_1 in zip(results[0], results[1]):
        assert_equal_states(synced_0, synced_1)
    # DDP's first broadcast sends (and loads) the dequantized weights; without it
    # (init_sync=False: every rank built the same model) the masters start exact, and the
    # run equals the high-precision DDP run bit for bit.
    init_synced, unsynced, plain = results[0]
    assert_equal_states(plain, unsynced)
    assert not torch.equal(plain["0.weight"], init_synced["0.weight"])


def test_the_docs_example_runs_and_prints_what_the_page_says(capsys):
    page = Path(__file__).resolve().parents[2] / "docs" / "optim.md"
    example = re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)[1]
    assert "fp8_weights=True" in example
    exec(compile(example, "<docs/optim.md FP8 weights example>", "exec"), {"__name__": "__main__"})
    printed = capsys.readouterr().out.splitlines()
    lines = example.splitlines()
    documented = [line[2:] for before, line in zip(lines, lines[1:]) if before.startswith("print(")]
    assert printed[-2:] == documented
    losses = [float(line.rpartition(" ")[2]) for line in printed[:-2]]
    assert len(losses) == 3 and losses[-1] < 0.6 * losses[0]


def _checkpointed_steps(model, optimizer) -> list[float]:
    """Steps under fp8train.autocast with activation checkpointing (the forward update at the
    autocast's exit; the recompute quantizes with the forward's scales)."""
    losses = []
    for step in range(3):
        x = torch.randn(32, 32, generator=torch.Generator().manual_seed(step))
        with fp8train.autocast():
            loss = (torch.utils.checkpoint.checkpoint(model, x, use_reentrant=False) - x).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_fp8_autocast_and_activation_checkpointing_stay_bit_identical():
    plain, model = _model("delayed", fp8_weights=False), _model("delayed", fp8_weights=True)
    plain_optimizer, optimizer = _optimizer(plain), _optimizer(model)
    assert _checkpointed_steps(plain, plain_optimizer) == _checkpointed_steps(model, optimizer)
    assert_equal_states(plain.state_dict(), model.state_dict())


def test_a_state_without_masters_takes_them_from_the_weights():
    """An optimizer state dict without masters (saved before the parameters joined, or
    edited) loads: each FP8 weight's master starts from its dequantized value."""
    model = _model("tensorwise", fp8_weights=True)
    optimizer = _optimizer(model)
    _steps(model, optimizer, 1)
    state = optimizer.state_dict()
    for entry in state["state"].values():
        entry.pop("master", None)
    other = _model("tensorwise", fp8_weights=True)
    other.load_state_dict(model.state_dict())
    other_optimizer = _optimizer(other)
    other_optimizer.load_state_dict(state)  # replaces the state, and the masters it held
    assert torch.equal(other_optimizer.state[other[0].weight]["master"], other[0].weight.dequantize())


@pytest.mark.slow
def test_a_compiled_model_runs_the_fp8_weight_layers_eagerly_to_the_same_bits():
    plain, model = _model("rowwise", fp8_weights=False), _model("rowwise", fp8_weights=True)
    plain_optimizer, optimizer = _optimizer(plain), _optimizer(model)
    assert _steps(plain, plain_optimizer, 2) == _steps(torch.compile(model), optimizer, 2)
    assert_equal_states(plain.state_dict(), model.state_dict())


def test_a_bfloat16_model_with_float32_masters_equals_its_high_precision_run():
    """bfloat16 weights, float32 masters: the FP8 weight is quantized from the master rounded
    to bfloat16, as the high-precision module quantizes its bfloat16 parameter."""
    plain, model = (_model("mxfp8", fp8_weights=flag, dtype=torch.bfloat16) for flag in (False, True))
    precision = dict(master_weight_dtype=torch.float32, stochastic_rounding=False)
    plain_optimizer, optimizer = _optimizer(plain, **precision), _optimizer(model, **precision)
    assert _steps(plain, plain_optimizer, 3) == _steps(model, optimizer, 3)
    assert_equal_states(plain.state_dict(), model.state_dict())
