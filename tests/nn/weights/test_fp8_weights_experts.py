"""FP8 weights of fused MoE experts (``Float8Experts``): the 3-D ``gate_up_proj`` and
``down_proj`` held as one Float8Weight per expert (``Float8GateUpWeights``,
``Float8DownWeights``), trainable (``fp8_weights=True`` with ``fp8train.optim.AdamW``) and
frozen (``store_frozen_weights_in_fp8``): bit for bit the runs with high-precision weights,
for every recipe; checkpoints, resume, conversion back; the refusals."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

import fp8train
from fp8train.nn.weights.experts import Float8DownWeights, Float8ExpertWeights, Float8GateUpWeights
from fp8train.nn.weights.float8_weight import Float8Weight
from fp8train.optim import AdamW
from tests.helpers.fp8_weight_runs import assert_equal_states, train_steps
from fp8train.spec.recipes import RECIPE_NAMES, from_name
from tests.nn.modules.test_experts import _Experts

NUM_EXPERTS, NUM_TOKENS, NUM_STEPS = 3, 40, 3
FAST = ("tensorwise", "delayed", "mxfp8", "nvfp4")  # the others under -m slow (the default run's budget)


def _recipes(names=RECIPE_NAMES) -> list:
    return [name if name in FAST else pytest.param(name, marks=pytest.mark.slow) for name in names]


def _width(recipe: str) -> int:
    return 128 if recipe == "blockwise" else 32  # blockwise needs whole 128-blocks


class _Moe(nn.Module):
    """Experts on a fixed routing: token t to experts t % 3 and (t + 1) % 3 (expert 2 gets
    none of the first token), weights 0.5."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.experts = _Experts(num_experts=NUM_EXPERTS, hidden=width, intermediate=width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = torch.arange(x.shape[0])
        top_k_index = torch.stack([tokens % NUM_EXPERTS, (tokens + 1) % NUM_EXPERTS], dim=-1)
        return self.experts(x, top_k_index, torch.full((x.shape[0], 2), 0.5, dtype=x.dtype))


def _model(recipe: str, fp8_weights: bool, dtype=torch.float32) -> nn.Module:
    torch.manual_seed(0)
    model = _Moe(_width(recipe)).to(dtype)
    return fp8train.convert_to_float8_training(model, recipe=recipe, backend="emulated", fp8_weights=fp8_weights)


def _optimizer(model: nn.Module, **precision) -> AdamW:
    return AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, **precision)


def _steps(model, optimizer, width: int, num_steps=NUM_STEPS, first=0, autocast=True) -> list[float]:
    return train_steps(model, optimizer, (NUM_TOKENS, width), num_steps, first, autocast=autocast, seed=1)


@pytest.mark.parametrize("recipe", _recipes())
def test_expert_fp8_weights_train_bit_for_bit_as_the_high_precision_run(recipe):
    plain, model = _model(recipe, False), _model(recipe, True)
    expected = _steps(plain, _optimizer(plain), _width(recipe))
    optimizer = _optimizer(model)  # held: the checkpoint saves its masters
    assert _steps(model, optimizer, _width(recipe)) == expected
    assert_equal_states(plain.state_dict(), model.state_dict())
    experts = model.experts
    assert type(experts.gate_up_proj) is Float8GateUpWeights and type(experts.down_proj) is Float8DownWeights
    assert experts.gate_up_proj.shape == (NUM_EXPERTS, 2 * _width(recipe), _width(recipe))
    slices = experts.gate_up_proj.unbind(0)  # what the forward hands each expert's GEMMs
    assert len(slices) == NUM_EXPERTS and all(type(s) is Float8Weight for s in slices)
    assert experts.gate_up_proj.storage_nbytes == sum(e.storage_nbytes for e in experts.gate_up_proj.fp8_experts)


def test_delayed_outside_fp8_autocast_and_bfloat16_masters_are_bit_identical():
    plain, model = _model("delayed", False), _model("delayed", True)
    kwargs = dict(autocast=False)
    assert _steps(model, _optimizer(model), 32, **kwargs) == _steps(plain, _optimizer(plain), 32, **kwargs)
    plain, model = _model("mxfp8", False, torch.bfloat16), _model("mxfp8", True, torch.bfloat16)
    precision = dict(master_weight_dtype=torch.bfloat16)  # rounded stochastically
    plain_optimizer, optimizer = _optimizer(plain, **precision), _optimizer(model, **precision)
    assert _steps(model, optimizer, 32) == _steps(plain, plain_optimizer, 32)
    assert_equal_states(plain.state_dict(), model.state_dict())


@pytest.mark.parametrize("model_first", [True, False])
def test_save_load_and_resume_are_bit_identical(model_first):
    reference = _model("delayed", True)
    reference_optimizer = _optimizer(reference)
    expected = _steps(reference, reference_optimizer, 32, num_steps=4)
    model = _model("delayed", True)
    optimizer = _optimizer(model)
    _steps(model, optimizer, 32, num_steps=2)
    model_state, optimizer_state = model.state_dict(), optimizer.state_dict()
    resumed = _model("delayed", True)
    resumed_optimizer = _optimizer(resumed)
    loads = [lambda: resumed.load_state_dict(model_state), lambda: resumed_optimizer.load_state_dict(optimizer_state)]
    for load in loads if model_first else loads[::-1]:
        load()
    assert _steps(resumed, resumed_optimizer, 32, num_steps=2, first=2) == expected[2:]
    assert_equal_states(reference.state_dict(), resumed.state_dict())


def test_the_gradient_is_plain_copies_keep_the_weight_and_conversion_back_gives_the_master():
    model = _model("rowwise", True)
    optimizer = _optimizer(model)
    _steps(model, optimizer, 32, num_steps=1)
    model(torch.randn(NUM_TOKENS, 32)).sum().backward()
    grad = model.experts.down_proj.grad
    assert type(grad) is torch.Tensor and grad.shape == (NUM_EXPERTS, 32, 32)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    x = torch.randn(NUM_TOKENS, 32)
    for other in (copy.deepcopy(model), torch.load(buffer, weights_only=False)):
        assert type(other.experts.gate_up_proj) is Float8GateUpWeights
        with torch.no_grad():
            assert torch.equal(other(x), model(x))
    master = optimizer.state[model.experts.gate_up_proj]["master"].clone()
    original = fp8train.convert_to_linear(model).experts
    assert type(original) is _Experts and type(original.gate_up_proj) is nn.Parameter
    assert torch.equal(original.gate_up_proj, master) and original.gate_up_proj.requires_grad


@pytest.mark.parametrize("recipe", _recipes([name for name in RECIPE_NAMES if name != "delayed"]))
def test_frozen_expert_weights_in_fp8_only_are_bit_identical(recipe):
    hp = _model(recipe, False).requires_grad_(False)
    stored = copy.deepcopy(hp)
    assert fp8train.store_frozen_weights_in_fp8(stored) == ["experts"]
    assert type(stored.experts.gate_up_proj) is Float8GateUpWeights and stored.experts.gate_up_proj.fp8_master is None
    outputs = []
    for model in (hp, stored):
        torch.manual_seed(5)
        x = torch.randn(NUM_TOKENS, _width(recipe), generator=torch.Generator().manual_seed(0), requires_grad=True)
        out = model(x)
        out.backward(out.detach() * 1e-3 + 1e-2)
        outputs.append((out.detach(), x.grad))
    for a, b in zip(*outputs):
        assert torch.equal(a, b)
    state = stored.state_dict()
    assert type(state["experts.down_proj"]) is torch.Tensor
    assert torch.equal(state["experts.down_proj"], stored.experts.down_proj.dequantize())


def test_refusals_name_the_value_and_the_fix():
    plan = from_name("tensorwise").operand_plan
    with pytest.raises(ValueError, match=r"must be 3-D \[E, N, K\], got shape \(16, 16\)"):
        Float8GateUpWeights.quantize(torch.ones(16, 16), plan)
    weight = Float8ExpertWeights.quantize(torch.ones(2, 16, 32), plan)
    with pytest.raises(ValueError, match=r"cannot requantize a weight of shape \(2, 16, 32\) from \(2, 32, 16\)"):
        weight.requantize_(torch.ones(2, 32, 16))
    model = _model("tensorwise", True)  # no optimizer holds the masters
    with pytest.raises(ValueError, match="no optimizer holds its master weight: build fp8train.optim.AdamW"):
        model(torch.randn(NUM_TOKENS, 32))
    with pytest.raises(RuntimeError, match=r"aten::add_ would change a weight stored in FP8 \(fp8_weights=True\)"):
        with torch.no_grad():
            model.experts.gate_up_proj.add_(1)
    with pytest.raises(NotImplementedError, match=r"only a Float8Linear's; tensor parallelism and the FP8 weights of Conv1D, attention and experts"):
        torch.chunk(model.experts.gate_up_proj, 2)


def _mixtral(fp8_weights: bool) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2, bos_token_id=0, eos_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(config)
    return fp8train.convert_to_float8_training(model, recipe="tensorwise", backend="emulated", fp8_weights=fp8_weights)


@pytest.mark.slow  # about 10 s: the default run has Float8Experts' bit-identity above
def test_a_transformers_mixtral_trains_with_its_expert_weights_in_fp8():
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    runs = []
    for fp8_weights in (False, True):
        model = _mixtral(fp8_weights)
        optimizer = _optimizer(model)
        losses = []
        for _ in range(2):
            loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        runs.append((losses, model.state_dict(), model))
    (expected, plain_state, _), (losses, state, model) = runs
    experts = [m for m in model.modules() if type(m).__name__ == "Float8Experts"]
    assert experts and all(type(m.gate_up_proj) is Float8GateUpWeights for m in experts)
    assert losses == expected
    assert_equal_states(plain_state, state)


@pytest.mark.slow
def test_a_compiled_model_runs_the_stored_experts_eagerly_to_the_same_bits():
    eager, model = _model("rowwise", True), _model("rowwise", True)
    eager_optimizer, optimizer = _optimizer(eager), _optimizer(model)
    assert _steps(torch.compile(model), optimizer, 32, num_steps=2) == _steps(eager, eager_optimizer, 32, num_steps=2)
    assert_equal_states(eager.state_dict(), model.state_dict())
