"""FP8 primary weights, the module's side: ``convert_to_float8_training(..., fp8_weights=True)``
holds each Float8Linear's trainable weight as a :class:`Float8Weight` (its bytes counted by
hand), its gradient reaches ``.grad`` as a plain tensor, its checkpoint loads into a plain
model, and what it cannot do (shard, train without an optimizer that holds its master) is
refused. The optimizer's side: tests/optim/test_fp8_weights_optim.py."""

from __future__ import annotations

import copy
import io
import logging

import pytest
import torch
from torch import nn

import fp8train
from fp8train.nn.weights.float8_weight import Float8Weight
from fp8train.optim import AdamW
from fp8train.parallel import Float8WeightShard, enable_fp8_all_gather

IN_FEATURES, OUT_FEATURES = 32, 64
NUM_ELEMENTS = IN_FEATURES * OUT_FEATURES
FLOAT32, E8M0 = 4, 1
# Bytes of the stored weight: 1 per element per copy, plus its scales (and delayed's amax).
STORED_BYTES = {
    "tensorwise": NUM_ELEMENTS + FLOAT32,  # one copy (its transpose serves grad_input), one scale
    "delayed": NUM_ELEMENTS + FLOAT32 + FLOAT32,  # and max|W| for the amax history
    "rowwise": 2 * NUM_ELEMENTS + (OUT_FEATURES + IN_FEATURES) * FLOAT32,  # two copies, a scale per row
    "mxfp8": 2 * NUM_ELEMENTS + 2 * (NUM_ELEMENTS // 32) * E8M0,  # two copies, a scale per 32
}


def _models(recipe: str = "tensorwise") -> tuple[nn.Module, nn.Module, nn.Module]:
    """(the plain model, its high-precision conversion, its fp8_weights conversion)."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(IN_FEATURES, OUT_FEATURES), nn.GELU(), nn.Linear(OUT_FEATURES, IN_FEATURES))
    convert = fp8train.convert_to_float8_training
    hp = convert(copy.deepcopy(plain), recipe=recipe, backend="emulated")
    fp8 = convert(copy.deepcopy(plain), recipe=recipe, backend="emulated", fp8_weights=True)
    return plain, hp, fp8


@pytest.mark.parametrize("recipe", STORED_BYTES)
def test_the_module_holds_only_the_quantized_weight(recipe):
    _, _, model = _models(recipe)
    weight = model[0].weight
    assert type(weight) is Float8Weight and isinstance(weight, nn.Parameter) and weight.requires_grad
    assert weight.storage_nbytes == STORED_BYTES[recipe]
    assert weight.fp8_master.pending is not None  # the exact weight, until an optimizer takes it
    optimizer = AdamW(model.parameters())
    assert weight.fp8_master.pending is None and weight.fp8_master.master is optimizer.state[weight]["master"]
    # No high-precision tensor of the weight's shape is left in the module (bias, delayed's buffers)
    others = [t for t in (*model[0].buffers(), *model[0].parameters()) if t is not weight]
    assert others and all(t.shape != weight.shape for t in others)


def test_the_gradient_reaches_grad_as_a_plain_high_precision_tensor():
    _, hp, model = _models("rowwise")
    optimizer = AdamW(model.parameters())  # held: the forward needs an optimizer holding the master
    assert optimizer.state[model[0].weight]["master"] is not None
    x = torch.randn(16, IN_FEATURES)
    for m in (hp, model):
        for _ in range(2):  # accumulates
            m(x).square().sum().backward()
    grad = model[0].weight.grad
    assert type(grad) is torch.Tensor and grad.dtype == torch.float32 and grad.shape == (OUT_FEATURES, IN_FEATURES)
    assert torch.equal(grad, hp[0].weight.grad)


def test_the_checkpoint_loads_into_a_plain_model_and_copies_keep_the_weight():
    plain, _, model = _models()
    state = model.state_dict()
    assert all(type(value) is torch.Tensor for value in state.values())
    reloaded = copy.deepcopy(plain)
    reloaded.load_state_dict(state)  # before any step: the exact initial weights
    for a, b in zip(plain.parameters(), reloaded.parameters()):
        assert torch.equal(a, b)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    x = torch.randn(16, IN_FEATURES)
    for other in (copy.deepcopy(model), torch.load(buffer, weights_only=False)):
        assert type(other[0].weight) is Float8Weight and torch.equal(other[0].weight.fp8_master.pending, plain[0].weight)
        with torch.no_grad():  # an evaluation needs no optimizer
            assert torch.equal(other(x), model(x))


def test_copy_into_the_weight_sets_it_and_other_writes_are_refused():
    _, _, model = _models()
    weight = model[0].weight
    optimizer = AdamW(model.parameters())
    new = torch.full((OUT_FEATURES, IN_FEATURES), 0.25)
    with torch.no_grad():
        weight.data.copy_(new)  # through an alias: the module's weight too
    assert torch.equal(optimizer.state[weight]["master"], new) and torch.equal(weight.dequantize(), new)
    with pytest.raises(RuntimeError, match=r"aten::add_ would change a weight stored in FP8 \(fp8_weights=True\)"):
        with torch.no_grad():
            weight.add_(1)


def test_sharding_is_refused_but_through_enable_fp8_all_gather():
    _, _, model = _models()
    # What fully_shard (and tensor parallelism's distribute_tensor) does to a parameter.
    with pytest.raises(NotImplementedError, match=r"and only a Float8Linear.s; tensor parallelism and the FP8 weights of Conv1D"):
        torch.chunk(model[0].weight, 2)
    enable_fp8_all_gather(model, shard_world_size=1)  # FSDP2's way: tests/parallel/test_fsdp_fp8_weights.py
    assert isinstance(model[0].weight, Float8WeightShard)


def test_frozen_and_tied_weights_stay_in_high_precision(caplog):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32))
    model[0].weight.requires_grad_(False)
    model[2].weight = model[1].weight
    with caplog.at_level(logging.INFO, logger="fp8train"):
        fp8train.convert_to_float8_training(model, fp8_weights=True)
    assert [type(m.weight) for m in model] == [nn.Parameter] * 3
    assert "0 (frozen: fp8train.store_frozen_weights_in_fp8 stores it), 1 (tied), 2 (tied)" in caplog.text
    with pytest.raises(TypeError, match="fp8_weights=1 must be True or False"):
        fp8train.convert_to_float8_training(nn.Linear(32, 32), fp8_weights=1)


def test_convert_to_linear_gives_back_a_trainable_parameter_of_the_master():
    plain, _, model = _models()
    optimizer = AdamW(model.parameters())
    with torch.no_grad():
        optimizer.state[model[0].weight]["master"].add_(1.0)  # what a step would change
    expected = optimizer.state[model[0].weight]["master"].clone()
    linear = fp8train.convert_to_linear(model)[0]
    assert type(linear) is nn.Linear and type(linear.weight) is nn.Parameter and linear.weight.requires_grad
    assert torch.equal(linear.weight, expected)


def test_a_weight_frozen_after_conversion_becomes_a_frozen_fp8_weight():
    """PEFT freezes base layers after conversion: store_frozen_weights_in_fp8 drops the
    trainable weight's pending high-precision copy, and the layer computes what a frozen
    FP8 weight stored from the same values computes."""
    plain, _, model = _models("delayed")
    model[0].weight.requires_grad_(False)
    assert model[0].weight.fp8_master.pending is not None
    assert fp8train.store_frozen_weights_in_fp8(model) == ["0"]
    weight = model[0].weight
    assert type(weight) is Float8Weight and weight.fp8_master is None and not weight.requires_grad
    frozen = fp8train.convert_to_float8_training(copy.deepcopy(plain), recipe="delayed", backend="emulated")
    frozen[0].weight.requires_grad_(False)
    fp8train.store_frozen_weights_in_fp8(frozen)
    x = torch.randn(16, IN_FEATURES)
    with torch.no_grad():
        assert torch.equal(model(x), frozen(x))
