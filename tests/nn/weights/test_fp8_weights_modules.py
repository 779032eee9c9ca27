"""FP8 weights beyond Float8Linear: transformers' Conv1D (GPT-2; weight stored [in, out], held
as a TransposedFloat8Weight) and nn.MultiheadAttention's in-projection, trainable
(``fp8_weights=True`` with ``fp8train.optim.AdamW``) and frozen
(``store_frozen_weights_in_fp8``): bit for bit the runs with high-precision weights, for
every recipe; checkpoints, resume, a real GPT-2; what stays in high precision is logged."""

from __future__ import annotations

import copy
import io
import logging
import re
from pathlib import Path

import pytest
import torch
from torch import nn

import fp8train
from fp8train.nn.config import Float8ModuleConfig
from fp8train.nn.modules.experts import Float8Experts
from fp8train.nn.weights.float8_weight import Float8Weight
from fp8train.nn.weights.transposed import TransposedFloat8Weight
from fp8train.optim import AdamW
from tests.helpers.fp8_weight_runs import assert_equal_states, ddp_state_after, train_steps
from fp8train.spec.recipes import RECIPE_NAMES, from_name

transformers = pytest.importorskip("transformers")
Conv1D = transformers.pytorch_utils.Conv1D

# peft 0.21 asks transformers 5.23 a deprecated question on every get_peft_model.
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
NUM_STEPS = 3


def _width(recipe: str) -> int:
    return 128 if recipe == "blockwise" else 32  # blockwise needs whole 128-blocks


class _Mlp(nn.Module):
    """GPT-2's MLP: two Conv1D."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.c_fc, self.c_proj = Conv1D(2 * width, width), Conv1D(width, 2 * width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(torch.nn.functional.gelu(self.c_fc(x)))


class _Attention(nn.Module):
    """Self-attention, then cross-attention (key is value) on one nn.MultiheadAttention."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(width, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.attn(x, x, x, need_weights=False)[0]
        return self.attn(y, x, x, need_weights=False)[0]


def _model(cls, recipe: str, fp8_weights: bool, dtype=torch.float32) -> nn.Module:
    torch.manual_seed(0)
    model = cls(_width(recipe)).to(dtype)
    return fp8train.convert_to_float8_training(model, recipe=recipe, backend="emulated", fp8_weights=fp8_weights)


def _steps(model: nn.Module, optimizer, width: int, num_steps: int = NUM_STEPS, first: int = 0) -> list[float]:
    # Inside the autocast (delayed: one scale update per step, for modules called twice in a forward).
    return train_steps(model, optimizer, (2, 16, width), num_steps, first, autocast=True, seed=1)


def _optimizer(model: nn.Module, **precision) -> AdamW:
    return AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, **precision)


def _assert_trains_bit_for_bit(cls, recipe: str, dtype=torch.float32, **precision) -> nn.Module:
    plain, model = (_model(cls, recipe, flag, dtype) for flag in (False, True))
    width = _width(recipe)
    expected = _steps(plain, _optimizer(plain, **precision), width)
    optimizer = _optimizer(model, **precision)
    assert _steps(model, optimizer, width) == expected
    assert_equal_states(plain.state_dict(), model.state_dict())
    return model


@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_a_stored_conv1d_weight_computes_what_its_master_computes(recipe):
    """One forward and backward: output, grad_input, grad_weight and grad_bias bit for bit."""
    width = _width(recipe)
    torch.manual_seed(0)
    plain = Conv1D(2 * width, width)
    results = []
    for fp8_weights in (False, True):
        module = fp8train.convert_to_float8_training(
            copy.deepcopy(plain), recipe=recipe, backend="emulated", fp8_weights=fp8_weights
        )
        optimizer = _optimizer(module)  # noqa: F841  (held: a training forward needs the master held)
        x = torch.randn(48, width, generator=torch.Generator().manual_seed(2), requires_grad=True)
        torch.manual_seed(1)
        output = module(x)
        output.square().sum().backward()
        results.append((output.detach(), x.grad, module.weight.grad, module.bias.grad))
    assert type(module.weight) is TransposedFloat8Weight
    for expected, actual in zip(*results):
        assert torch.equal(expected, actual)


@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_conv1d_fp8_weights_train_bit_for_bit_as_the_high_precision_run(recipe):
    model = _assert_trains_bit_for_bit(_Mlp, recipe)
    weight = model.c_fc.weight
    assert type(weight) is TransposedFloat8Weight and weight.shape == (_width(recipe), 2 * _width(recipe))
    gemm_weight = weight.t()  # what the forward hands the GEMMs: the [out, in] weight, same bytes
    assert type(gemm_weight) is Float8Weight and gemm_weight.shape == (2 * _width(recipe), _width(recipe))
    assert gemm_weight.fp8_rowwise is weight.fp8_rowwise and gemm_weight.fp8_master is weight.fp8_master


@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_attention_fp8_weights_train_bit_for_bit_self_and_cross_attention(recipe):
    model = _assert_trains_bit_for_bit(_Attention, recipe)
    assert type(model.attn.in_proj_weight) is Float8Weight and type(model.attn.out_proj.weight) is Float8Weight


@pytest.mark.parametrize("cls", [_Mlp, _Attention])
def test_bfloat16_masters_with_stochastic_rounding_are_bit_identical(cls):
    _assert_trains_bit_for_bit(cls, "mxfp8", torch.bfloat16, master_weight_dtype=torch.bfloat16)


def test_conv1d_gradient_is_a_plain_in_out_tensor_and_the_checkpoint_loads_into_conv1d():
    plain, model = _Mlp(32), _model(_Mlp, "rowwise", fp8_weights=True)
    plain.load_state_dict(_model(_Mlp, "rowwise", fp8_weights=False).state_dict())
    optimizer = _optimizer(model)
    model(torch.randn(4, 32)).sum().backward()
    grad = model.c_fc.weight.grad
    assert type(grad) is torch.Tensor and grad.shape == (32, 64) and grad.is_contiguous()
    reloaded = _Mlp(32)
    reloaded.load_state_dict(model.state_dict())  # before any step: the exact initial weights
    assert_equal_states(plain.state_dict(), reloaded.state_dict())
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    x = torch.randn(4, 32)
    for other in (copy.deepcopy(model), torch.load(buffer, weights_only=False)):
        assert type(other.c_fc.weight) is TransposedFloat8Weight
        with torch.no_grad():
            assert torch.equal(other(x), model(x))
    assert "TransposedFloat8Weight(shape=(32, 64)" in repr(model.c_fc.weight)
    master = optimizer.state[model.c_fc.weight]["master"]
    conv1d = fp8train.convert_to_linear(model).c_fc  # back to a transformers Conv1D
    assert type(conv1d) is Conv1D and type(conv1d.weight) is nn.Parameter and torch.equal(conv1d.weight, master)


@pytest.mark.parametrize("model_first", [True, False])
def test_conv1d_save_load_and_resume_are_bit_identical(model_first):
    reference = _model(_Mlp, "delayed", fp8_weights=True)
    reference_optimizer = _optimizer(reference)  # held: the checkpoint saves its masters
    expected = _steps(reference, reference_optimizer, 32, num_steps=4)
    model = _model(_Mlp, "delayed", fp8_weights=True)
    optimizer = _optimizer(model)
    _steps(model, optimizer, 32, num_steps=2)
    model_state, optimizer_state = model.state_dict(), optimizer.state_dict()
    resumed = _model(_Mlp, "delayed", fp8_weights=True)
    resumed_optimizer = _optimizer(resumed)
    loads = [lambda: resumed.load_state_dict(model_state), lambda: resumed_optimizer.load_state_dict(optimizer_state)]
    for load in loads if model_first else loads[::-1]:
        load()
    assert _steps(resumed, resumed_optimizer, 32, num_steps=2, first=2) == expected[2:]
    assert_equal_states(reference.state_dict(), resumed.state_dict())


def _gpt2(fp8_weights: bool, convert: bool = True) -> nn.Module:
    config = dict(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**config))
    if not convert:
        return model
    return fp8train.convert_to_float8_training(model, recipe="tensorwise", backend="emulated", fp8_weights=fp8_weights)


def _gpt2_steps(model: nn.Module, optimizer) -> list[float]:
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(NUM_STEPS):
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_a_transformers_gpt2_trains_with_its_conv1d_weights_in_fp8(caplog):
    plain = _gpt2(fp8_weights=False)
    expected = _gpt2_steps(plain, _optimizer(plain))
    with caplog.at_level(logging.INFO, logger="fp8train"):
        model = _gpt2(fp8_weights=True)
    assert "lm_head (tied)" in caplog.text  # tied to the embedding: stays in high precision
    conv1ds = [m for m in model.modules() if type(m).__name__ == "Float8Conv1D"]
    assert len(conv1ds) == 8 and all(type(m.weight) is TransposedFloat8Weight for m in conv1ds)
    optimizer = _optimizer(model)  # held: the checkpoint saves its masters
    losses = _gpt2_steps(model, optimizer)
    assert losses == expected and losses[-1] < losses[0]
    reloaded = transformers.GPT2LMHeadModel(model.config)  # a plain GPT-2 loads the checkpoint
    reloaded.load_state_dict(model.state_dict())
    assert_equal_states(plain.state_dict(), reloaded.state_dict())


def _frozen_pair(cls, recipe: str) -> tuple[nn.Module, nn.Module]:
    hp = _model(cls, recipe, fp8_weights=False).requires_grad_(False)
    stored = copy.deepcopy(hp)
    fp8train.store_frozen_weights_in_fp8(stored)
    return hp, stored


def _frozen_steps(model: nn.Module, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Output and grad_input of two steps (delayed: the second on the first one's scales)."""
    torch.manual_seed(5)
    for step in range(2):
        x = torch.randn(2, 16, width, generator=torch.Generator().manual_seed(step), requires_grad=True)
        out = model(x)
        out.backward(out.detach() * 1e-3 + 1e-2)
    return out.detach(), x.grad


@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_frozen_conv1d_weights_in_fp8_only_are_bit_identical(recipe):
    hp, stored = _frozen_pair(_Mlp, recipe)
    assert type(stored.c_fc.weight) is TransposedFloat8Weight and stored.c_fc.weight.fp8_master is None
    for a, b in zip(_frozen_steps(hp, _width(recipe)), _frozen_steps(stored, _width(recipe))):
        assert torch.equal(a, b)
    state = stored.state_dict()
    assert type(state["c_fc.weight"]) is torch.Tensor and state["c_fc.weight"].shape == stored.c_fc.weight.shape
    assert torch.equal(state["c_fc.weight"], stored.c_fc.weight.dequantize())
    stored.load_state_dict(hp.state_dict())  # re-quantized from the high-precision weights
    assert torch.equal(stored(torch.ones(2, _width(recipe))), hp(torch.ones(2, _width(recipe))))


@pytest.mark.parametrize("recipe", ["tensorwise", "mxfp8"])
def test_frozen_attention_in_projection_in_fp8_only_serves_self_attention(recipe):
    hp, stored = _frozen_pair(_Attention, recipe)
    assert type(stored.attn.in_proj_weight) is Float8Weight and stored.attn.in_proj_weight.fp8_master is None
    x = torch.randn(2, 16, 32)
    with torch.no_grad():
        assert torch.equal(stored.attn(x, x, x)[0], hp.attn(x, x, x)[0])
        refusal = r"cross-attention quantizes each of its slices .*restore_high_precision_weights\(attention\)"
        with pytest.raises(ValueError, match=refusal):
            stored(x)


def test_what_stays_in_high_precision_is_logged_with_the_reason(caplog):
    torch.manual_seed(0)
    model = nn.ModuleDict({
        "cross": nn.MultiheadAttention(32, 2, kdim=64, vdim=64),
        "self": nn.MultiheadAttention(32, 2),
        "experts": Float8Experts(
            2, 32, 32, torch.nn.functional.silu, config=Float8ModuleConfig(recipe="delayed", backend="emulated")
        ),
    })
    with caplog.at_level(logging.INFO, logger="fp8train"):
        fp8train.convert_to_float8_training(model, recipe="delayed", backend="emulated", fp8_weights=True)
    assert "cross (Float8MultiheadAttention: delayed scaling: the q, k and v GEMMs of one forward" in caplog.text
    assert type(model["self"].in_proj_weight) is Float8Weight and type(model["cross"].q_proj_weight) is nn.Parameter
    model["self"].requires_grad_(False)
    model["experts"].requires_grad_(False)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fp8train"):
        assert fp8train.store_frozen_weights_in_fp8(model) == ["self.out_proj"]
    assert "self (Float8MultiheadAttention: frozen under delayed scaling" in caplog.text
    assert "experts (Float8Experts: frozen under delayed scaling: each expert's weight scale" in caplog.text


def test_refusals_name_the_value_and_the_fix():
    plan = from_name("tensorwise").operand_plan
    with pytest.raises(ValueError, match=r"must be 2-D \[in, out\], got shape \(2, 16, 16\)"):
        TransposedFloat8Weight.quantize(torch.ones(2, 16, 16), plan)
    weight = TransposedFloat8Weight.quantize(torch.ones(16, 32), plan)
    with pytest.raises(ValueError, match=r"cannot requantize a weight of shape \(16, 32\) from \(32, 16\)"):
        weight.requantize_(torch.ones(32, 16))
    model = _model(_Attention, "tensorwise", fp8_weights=True)  # no optimizer holds the masters
    refusal = "in_proj_weight is stored in FP8 and trains, but no optimizer .* fp8train.optim.AdamW"
    with pytest.raises(ValueError, match=refusal):
        model.attn(torch.randn(2, 4, 32), torch.randn(2, 4, 32), torch.randn(2, 4, 32))
    conv1d = _model(_Mlp, "tensorwise", fp8_weights=True).c_fc
    with pytest.raises(RuntimeError, match=r"aten::add_ would change a weight stored in FP8 \(fp8_weights=True\)"):
        with torch.no_grad():
            conv1d.weight.add_(1)
    with pytest.raises(NotImplementedError, match=r"only a Float8Linear's; tensor parallelism and the FP8 weights of Conv1D, attention and experts"):
        torch.chunk(conv1d.weight, 2)  # what fully_shard does to a parameter


@pytest.mark.slow
def test_a_compiled_model_runs_the_stored_conv1d_layers_eagerly():
    """The stored layers run eagerly (a graph break): the losses are the eager model's bit for
    bit. (The state is not compared: the compiled GELU's backward between the layers differs
    from eager's in the last bits, which c_fc's bias gradient sums.)"""
    eager, model = _model(_Mlp, "rowwise", fp8_weights=True), _model(_Mlp, "rowwise", fp8_weights=True)
    expected = _steps(eager, _optimizer(eager), 32, num_steps=2)
    assert _steps(torch.compile(model), _optimizer(model), 32, num_steps=2) == expected
    assert type(model.c_fc.weight) is TransposedFloat8Weight


def test_attention_with_fp8_off_runs_cross_attention_on_the_master():
    """Under fp8train.autocast(enabled=False) nn.MultiheadAttention's own forward would split
    the stored in_proj_weight: this forward runs instead, F.linear on the master's slices (and,
    as any FP8-off Linear with a stored weight, on out_proj's dequantized weight)."""
    plain, model = _model(_Attention, "tensorwise", fp8_weights=False), _model(_Attention, "tensorwise", fp8_weights=True)
    with torch.no_grad():
        plain.attn.out_proj.weight.copy_(model.attn.out_proj.weight.dequantize())
    x, y = torch.randn(2, 4, 32), torch.randn(2, 4, 32)
    with torch.no_grad(), fp8train.autocast(enabled=False):  # not the same kernels: to float32 rounding
        torch.testing.assert_close(model.attn(x, y, y)[0], plain.attn(x, y, y)[0], rtol=1e-5, atol=1e-6)


def test_attention_converted_back_holds_its_masters():
    model = _model(_Attention, "tensorwise", fp8_weights=True)
    optimizer = _optimizer(model)
    _steps(model, optimizer, 32, num_steps=1)
    masters = {name[5:]: optimizer.state[p]["master"].clone() for name, p in model.named_parameters() if "weight" in name}
    attention = fp8train.convert_to_linear(model).attn
    assert type(attention) is nn.MultiheadAttention and set(masters) == {"in_proj_weight", "out_proj.weight"}
    parameters = dict(attention.named_parameters())
    assert all(type(p) is nn.Parameter and p.requires_grad for p in parameters.values())
    assert all(torch.equal(parameters[name], master) for name, master in masters.items())


def _peft_gpt2(fp8_weights: bool) -> nn.Module:
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True, lora_dropout=0.0)
    model = peft.get_peft_model(_gpt2(fp8_weights=False, convert=False), config)
    return fp8train.convert_to_float8_training(model, recipe="tensorwise", backend="emulated", fp8_weights=fp8_weights)


def test_peft_lora_on_gpt2_stores_the_frozen_conv1d_base_weights_in_fp8():
    """LoRA on GPT-2's Conv1D layers, then conversion with fp8_weights=True: the weights PEFT
    froze (every Conv1D's) are left to store_frozen_weights_in_fp8, which stores them as
    frozen TransposedFloat8Weight computing what they compute stored from a high-precision
    conversion; the adapters train in high precision."""
    model, frozen = _peft_gpt2(fp8_weights=True), _peft_gpt2(fp8_weights=False)
    for m in (model, frozen):
        stored = fp8train.store_frozen_weights_in_fp8(m)
        assert sum(fqn.endswith(("c_attn.base_layer", "c_fc.base_layer", "c_proj")) for fqn in stored) == 8
    base = model.get_submodule("base_model.model.transformer.h.0.attn.c_attn.base_layer")
    assert type(base.weight) is TransposedFloat8Weight and base.weight.fp8_master is None
    other = model.get_submodule("base_model.model.transformer.h.0.attn.c_proj")  # frozen by PEFT too
    assert type(other.weight) is TransposedFloat8Weight and not other.weight.requires_grad
    lora_a = model.get_submodule("base_model.model.transformer.h.0.attn.c_attn.lora_A.default")
    assert type(lora_a.weight) is nn.Parameter and lora_a.weight.requires_grad
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    model.eval(), frozen.eval()  # no dropout
    assert torch.equal(model(input_ids=tokens).logits, frozen(input_ids=tokens).logits)


def test_the_docs_gpt2_example_runs_and_prints_what_the_page_says(capsys):
    page = Path(__file__).resolve().parents[3] / "docs" / "optim.md"
    example = next(b for b in re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S) if "GPT2Config" in b)
    exec(compile(example, "<docs/optim.md GPT-2 example>", "exec"), {"__name__": "__main__"})
    lines = example.splitlines()
    documented = [line[2:] for before, line in zip(lines, lines[1:]) if before.startswith("print(")]
    assert capsys.readouterr().out.splitlines() == documented


def _ddp_conv1d_run(rank: int, fp8_weights: bool) -> dict:
    model = nn.parallel.DistributedDataParallel(_model(_Mlp, "delayed", fp8_weights), init_sync=False)
    x = torch.randn(4, 16, 32, generator=torch.Generator().manual_seed(1))[2 * rank : 2 * (rank + 1)]
    return ddp_state_after(model, _optimizer(model), x, num_steps=2)


def _ddp_conv1d_worker(rank: int, results) -> None:
    results[rank] = [_ddp_conv1d_run(rank, fp8_weights) for fp8_weights in (True, False)]


@pytest.mark.slow
def test_ddp_trains_conv1d_fp8_weights_as_the_high_precision_ddp_run(spawn_gloo):
    results = spawn_gloo(_ddp_conv1d_worker)
    for rank in (0, 1):
        fp8, plain = results[rank]
        assert_equal_states(plain, fp8)
    assert_equal_states(results[0][0], results[1][0])
