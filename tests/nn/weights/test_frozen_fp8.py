"""Frozen weights stored in FP8 only (``fp8train.store_frozen_weights_in_fp8``,
``Float8Weight``): bit-identical to the high-precision frozen module for every recipe,
hand-computed bytes, no grad_weight GEMM and nothing saved for it, state_dict in high
precision, deepcopy, pickle, ``.to()``, and the refusals."""

from __future__ import annotations

import copy
import io
import logging
import weakref

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import fp8train
from fp8train import Float8Linear
from fp8train.nn import function
from fp8train.nn.config import Float8ModuleConfig
from fp8train.nn.weights.float8_weight import Float8Weight
from fp8train.spec.plan import OperandPlan
from fp8train.spec.recipes import RECIPE_NAMES, from_name
from fp8train.spec.roles import Gemm
from fp8train.quant.operand import RoleQuantizer

IN_FEATURES, OUT_FEATURES, NUM_TOKENS = 256, 128, 64
N, K = OUT_FEATURES, IN_FEATURES
# Hand-computed bytes of the stored weight W[N, K]: data (FP8: 1 byte a value, E2M1: 1/2)
# and scales of the output GEMM's operand, and of the grad_input GEMM's where it is not
# the transpose of that one.
STORED_BYTES = {
    "tensorwise": N * K + 4,  # one float32 scale
    "delayed": N * K + 4 + 4,  # and the float32 amax delayed scaling records
    "rowwise": (N * K + 4 * N) + (N * K + 4 * K),  # per row; per column (first-dim usage)
    "rowwise_with_gw_hp": (N * K + 4 * N) + (N * K + 4),  # per row; the grad_input slot per tensor
    "blockwise": N * K + 4 * (N // 128) * (K // 128),  # one float32 per 128x128 tile
    "mxfp8": 2 * (N * K + N * K // 32),  # one E8M0 byte per 32 values, along each dim
    "nvfp4": N * K // 2 + (N // 16) * (K // 16) + 4,  # E4M3 per 16x16 tile, float32 global amax
    "mxfp4": 2 * (N * K // 2 + N * K // 32),
}


def frozen_pair(recipe: str, dtype=torch.float32) -> tuple[Float8Linear, Float8Linear]:
    """The same frozen Float8Linear twice: its weight in high precision, and in FP8 only."""
    torch.manual_seed(0)
    config = Float8ModuleConfig(recipe=recipe, backend="emulated")
    hp = Float8Linear(IN_FEATURES, OUT_FEATURES, config=config, dtype=dtype)
    hp.requires_grad_(False)
    fp8_only = copy.deepcopy(hp)
    fp8_only.store_weight_in_fp8()
    return hp, fp8_only


def run_steps(module: nn.Module, x: torch.Tensor, steps: int = 2):
    """Output and grad_input of ``steps`` training steps (the same draws for stochastic rounding)."""
    torch.manual_seed(5)
    for _ in range(steps):
        x = x.detach().requires_grad_()
        with fp8train.autocast():
            out = module(x)
        out.backward(out.detach() * 1e-3 + 1e-2)
    return out.detach(), x.grad


def drop_weight(state: dict) -> dict:
    return {key: value for key, value in state.items() if key != "weight"}


def module_bytes(module: nn.Module) -> int:
    params = [p.storage_nbytes if isinstance(p, Float8Weight) else p.nbytes for p in module.parameters()]
    return sum(params) + sum(b.nbytes for b in module.buffers())


@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_fp8_only_weight_is_bit_identical_and_holds_only_quantized_bytes(recipe):
    hp, fp8_only = frozen_pair(recipe)
    assert type(fp8_only.weight) is Float8Weight and isinstance(fp8_only.weight, nn.Parameter)
    x = torch.randn(NUM_TOKENS, IN_FEATURES)
    for a, b in zip(run_steps(hp, x), run_steps(fp8_only, x)):
        assert torch.equal(a, b)
    for key, value in drop_weight(hp.state_dict()).items():  # delayed scaling's state too
        assert torch.equal(value, fp8_only.state_dict()[key]), key
    buffers = sum(b.nbytes for b in hp.buffers()) + hp.bias.nbytes
    assert module_bytes(fp8_only) == STORED_BYTES[recipe] + buffers
    assert fp8_only.weight.fp8_rowwise.gemm_cache.values is None  # no converted copy kept


@pytest.mark.parametrize("recipe", ["rowwise", "nvfp4"])
def test_bfloat16_weight_is_bit_identical_under_autocast_too(recipe):
    """A bfloat16 weight: the same bits with bfloat16 inputs, and with float32 ones under
    ``torch.autocast`` (a float32 weight there would be quantized from its bfloat16 copy
    by the high-precision module: docs/peft.md)."""
    hp, fp8_only = frozen_pair(recipe, torch.bfloat16)
    x = torch.randn(NUM_TOKENS, IN_FEATURES)
    for a, b in zip(run_steps(hp, x.bfloat16()), run_steps(fp8_only, x.bfloat16())):
        assert torch.equal(a, b)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for a, b in zip(run_steps(hp, x, steps=1), run_steps(fp8_only, x, steps=1)):
            assert torch.equal(a, b)


@pytest.mark.slow
def test_compiled_module_runs_the_fp8_only_layer_eagerly_to_the_same_bits():
    hp, fp8_only = frozen_pair("mxfp8")
    x = torch.randn(NUM_TOKENS, IN_FEATURES)
    for a, b in zip(run_steps(hp, x), run_steps(torch.compile(fp8_only), x)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("recipe", ["delayed", "mxfp8"])
def test_activation_checkpointing_recomputes_the_same_bits(recipe):
    hp, fp8_only = frozen_pair(recipe)
    x = torch.randn(NUM_TOKENS, IN_FEATURES)
    results = []
    for module in (hp, fp8_only):
        x_grad = x.clone().requires_grad_()
        with fp8train.autocast():
            out = checkpoint(module, x_grad, use_reentrant=False)
        out.sum().backward()
        results.append((out, x_grad.grad, module.fp8_scale if recipe == "delayed" else out))
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_high_precision_weight_is_freed():
    config = Float8ModuleConfig(backend="emulated")
    module = Float8Linear(IN_FEATURES, OUT_FEATURES, config=config).requires_grad_(False)
    original = weakref.ref(module.weight)
    module.store_weight_in_fp8()
    assert original() is None  # by its reference count alone (no gc pass: ~1 s in the suite)


class SavedTensors(torch.autograd.graph.saved_tensors_hooks):
    """Bytes of the tensors the autograd saves that are not parameters nor an FP8-stored
    weight's own codes and scales (activations: new memory)."""

    def __init__(self, parameters):
        self.num_bytes, ids, stored = 0, set(), set()
        for p in parameters:
            ids.add(id(p))
            inner = p.__tensor_flatten__()[0] if hasattr(p, "__tensor_flatten__") else ()
            stored |= {getattr(p, name).untyped_storage().data_ptr() for name in inner}

        def pack(t):
            if id(t) not in ids and t.untyped_storage().data_ptr() not in stored:
                self.num_bytes += t.numel() * t.element_size()
            return t

        super().__init__(pack, lambda t: t)


@pytest.mark.parametrize("recipe", ["tensorwise", "mxfp8"])
def test_frozen_weight_skips_the_grad_weight_gemm_and_saves_nothing_for_it(recipe, monkeypatch):
    calls, both_usages = [], []
    grad_weight, quantize_both_usages = function._grad_weight, RoleQuantizer.both
    monkeypatch.setattr(function, "_grad_weight", lambda *a: calls.append(1) or grad_weight(*a))
    # Both usages of the input (forward) and of grad_output (backward): only for grad_weight.
    monkeypatch.setattr(RoleQuantizer, "both", lambda *a: both_usages.append(1) or quantize_both_usages(*a))
    x = torch.randn(NUM_TOKENS, IN_FEATURES, requires_grad=True)
    saved_bytes = {}
    for frozen in (False, True):
        config = Float8ModuleConfig(recipe=recipe, backend="emulated")
        module = Float8Linear(IN_FEATURES, OUT_FEATURES, config=config).requires_grad_(not frozen)
        if frozen:
            module.store_weight_in_fp8()
        saved = SavedTensors(module.parameters())
        with saved:
            out = module(x)
        out.sum().backward()
        saved_bytes[frozen] = saved.num_bytes
        if not frozen:
            assert len(both_usages) == 2
            both_usages.clear()
    assert len(calls) == 1 and not both_usages  # the grad_weight GEMM: the trainable module's only
    assert saved_bytes[False] >= NUM_TOKENS * IN_FEATURES and saved_bytes[True] == 0


@pytest.mark.parametrize("recipe", ["delayed", "mxfp8"])
def test_state_dict_holds_the_dequantized_weight_and_loading_requantizes(recipe):
    hp, fp8_only = frozen_pair(recipe)
    state = fp8_only.state_dict()
    assert type(state["weight"]) is torch.Tensor and torch.equal(state["weight"], fp8_only.weight.dequantize())
    plain = nn.Linear(IN_FEATURES, OUT_FEATURES)
    plain.load_state_dict(fp8train.drop_fp8_state(state))
    assert torch.equal(plain.weight, state["weight"])
    # A new weight loads re-quantized: as a module storing it from high precision.
    with torch.no_grad():
        hp.weight.mul_(2)
    fp8_only.load_state_dict(hp.state_dict())
    hp.store_weight_in_fp8()
    x = torch.randn(NUM_TOKENS, IN_FEATURES)
    assert torch.equal(run_steps(hp, x)[0], run_steps(fp8_only, x)[0])
    with pytest.raises(RuntimeError, match="size mismatch for weight"):
        fp8_only.load_state_dict({**state, "weight": torch.zeros(3, 3)})


def test_deepcopy_pickle_and_to_keep_the_stored_weight():
    _, module = frozen_pair("rowwise")
    x = torch.randn(NUM_TOKENS, IN_FEATURES)
    expected = module(x)
    buffer = io.BytesIO()
    torch.save(module, buffer)
    buffer.seek(0)
    for other in (copy.deepcopy(module), torch.load(buffer, weights_only=False)):
        assert type(other.weight) is Float8Weight and not other.weight.requires_grad
        assert torch.equal(other(x), expected)
    moved = copy.deepcopy(module).to(torch.bfloat16)
    assert type(moved.weight) is Float8Weight and moved.weight.dtype == torch.bfloat16
    assert isinstance(moved.weight, nn.Parameter) and moved.weight.fp8_rowwise.dtype == torch.float8_e4m3fn
    assert moved(x.bfloat16()).dtype == torch.bfloat16


def test_requantize_and_dequantize_round_trip_a_hand_computed_weight():
    weight_hp = torch.tensor([[448.0, -1.0], [2.0, 0.5]]).repeat(8, 8)  # [16, 16]
    stored = Float8Weight.quantize(weight_hp, from_name("tensorwise").operand_plan)
    assert torch.equal(stored.dequantize(), weight_hp)  # amax 448 is E4M3's max: scale 1, exact
    stored.requantize_(weight_hp * 3)
    assert stored.fp8_rowwise.scale_inv == 3 and torch.equal(stored.dequantize(), weight_hp * 3)
    with pytest.raises(ValueError, match=r"cannot requantize a weight of shape \(16, 16\) from \(4, 4\)"):
        stored.requantize_(torch.ones(4, 4))


def test_store_frozen_weights_in_fp8_walks_the_model(caplog):
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64))
    model[3].weight = model[2].weight  # tied
    model = fp8train.convert_to_float8_training(model, backend="emulated")
    model[1].requires_grad_(False)
    model[2].requires_grad_(False)
    with caplog.at_level(logging.INFO, logger="fp8train"):
        assert fp8train.store_frozen_weights_in_fp8(model) == ["1"]
    assert "frozen weights left in high precision: 2 (tied), 3 (tied)" in caplog.text
    assert type(model[0].weight) is nn.Parameter and type(model[1].weight) is Float8Weight
    values = model[1].weight.dequantize()
    assert fp8train.restore_high_precision_weights(model) == ["1"]
    assert type(model[1].weight) is nn.Parameter and torch.equal(model[1].weight, values)
    fp8train.store_frozen_weights_in_fp8(model)
    plain = fp8train.convert_to_linear(model)  # converted back: plain parameters
    assert type(plain[1]) is nn.Linear and type(plain[1].weight) is nn.Parameter
    assert torch.equal(plain[1].weight, values)


class ShardedParameter(nn.Parameter):
    """Stands for a parameter type that is not a plain one (a DTensor, FSDP2's)."""


def test_refusals_name_the_fix():
    for function_ in (fp8train.store_frozen_weights_in_fp8, fp8train.restore_high_precision_weights):
        with pytest.raises(TypeError, match="model"):
            function_("model")
    module = Float8Linear(64, 64, config=Float8ModuleConfig(backend="emulated"))
    with pytest.raises(ValueError, match=r"weight requires grad.*requires_grad_\(False\)"):
        module.store_weight_in_fp8()
    module.weight = ShardedParameter(module.weight.detach(), requires_grad=False)
    with pytest.raises(TypeError, match="weight is a ShardedParameter: only a plain, unsharded parameter"):
        module.store_weight_in_fp8()
    module.weight = nn.Parameter(module.weight.detach())
    module.requires_grad_(False).store_weight_in_fp8()
    x = torch.randn(16, 64)
    with pytest.raises(RuntimeError, match="aten::add_ would change a weight stored in FP8 only.*restore_high"):
        module.weight.data += 1  # a PEFT merge
    with pytest.raises(RuntimeError, match="aten::copy_ would change"):
        module.weight.copy_(torch.zeros(64, 64))
    plain = torch.zeros(64, 64)
    plain.copy_(module.weight)  # reading it is fine
    assert torch.equal(plain, module.weight.dequantize())
    tensorwise = "output 'tensor' E4M3, grad_input 'tensor' E4M3"
    stored = rf"stored in FP8 for its module's recipe \({tensorwise}\)"
    rowwise = "output 'row' E4M3, grad_input 'row' E4M3"
    for recipe, other in (("rowwise", rowwise), ("delayed", f"{tensorwise}, delayed")):
        with pytest.raises(ValueError, match=f"{stored}, but this forward's recipe quantizes it as {other}"):
            with fp8train.autocast(recipe=recipe):
                module(x)
    module.weight.requires_grad_(True)
    with pytest.raises(ValueError, match="cannot train.*restore_high_precision_weights"):
        module(x)
    plan = from_name("tensorwise").operand_plan
    with pytest.raises(ValueError, match=r"must be 2-D \[out, in\], got shape \(2, 16, 16\)"):
        Float8Weight.quantize(torch.ones(2, 16, 16), plan)
    no_grad_input = OperandPlan(operands=tuple(op for op in plan.operands if op.usage.gemm is not Gemm.GRAD_INPUT))
    with pytest.raises(NotImplementedError, match="the plan runs grad_input in high precision"):
        Float8Weight.quantize(torch.ones(16, 16), no_grad_input)
