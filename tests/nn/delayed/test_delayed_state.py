"""DelayedScalingState: one per module, reading the module's buffers (the state_dict keys
checkpoints hold), owning its flags; nothing set on the module by a step."""

import copy
import functools
import io
import sys

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import fp8train
from fp8train import Float8Linear
from fp8train.nn.modules.attention import Float8MultiheadAttention
from fp8train.nn.config import Float8ModuleConfig
from fp8train.nn.delayed.registry import reducing_states
from fp8train.nn.delayed.state import DelayedScalingState
from fp8train.nn.modules.experts import Float8Experts

IN_FEATURES, OUT_FEATURES = 32, 48


def _step(module: Float8Linear, seed: int, autocast: bool = True) -> torch.Tensor:
    x = torch.randn(40, IN_FEATURES, generator=torch.Generator().manual_seed(seed), requires_grad=True)
    with fp8train.autocast(enabled=True) if autocast else torch.enable_grad():
        out = module(x)
    out.square().sum().backward()
    return out.detach()


def _module() -> Float8Linear:
    torch.manual_seed(0)
    return Float8Linear(IN_FEATURES, OUT_FEATURES, config=Float8ModuleConfig(recipe="delayed", backend="emulated"))


def test_checkpoint_keys_load_bit_exactly_and_training_continues_identically():
    trained = _module()
    for seed in range(3):
        _step(trained, seed)
    buffer = io.BytesIO()
    torch.save(trained.state_dict(), buffer)  # a checkpoint, as written before the state object
    state_dict = torch.load(io.BytesIO(buffer.getvalue()))
    assert {"fp8_scale", "fp8_amax_history"} <= set(state_dict)
    restored = _module()
    restored.load_state_dict(state_dict)
    for name in ("fp8_scale", "fp8_amax_history"):
        assert torch.equal(getattr(restored, name), state_dict[name])
    assert restored.delayed_state.scale is restored.fp8_scale
    assert torch.equal(_step(restored, 3), _step(trained, 3))
    assert torch.equal(restored.fp8_scale, trained.fp8_scale)
    assert torch.equal(restored.fp8_amax_history, trained.fp8_amax_history)


def test_state_follows_the_modules_buffers_when_they_are_replaced():
    module = _module()
    _step(module, 0)
    module.load_state_dict({k: v.clone() + 1 for k, v in module.state_dict().items()}, assign=True)
    assert module.delayed_state.scale is module.fp8_scale
    module._apply(lambda t: t.clone())  # what .to(device) does to every buffer
    assert module.delayed_state.amax_history is module.fp8_amax_history
    for copied in (copy.deepcopy(module), _pickled(module)):
        assert copied.delayed_state is not module.delayed_state
        assert copied.delayed_state.scale is copied.fp8_scale
        assert torch.equal(copied.fp8_scale, module.fp8_scale)


def _pickled(module):
    buffer = io.BytesIO()
    torch.save(module, buffer)
    return torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)


def test_a_step_sets_nothing_on_the_module():
    module = _module()
    attributes = set(vars(module))
    _step(module, 0)
    _step(module, 1, autocast=False)
    with torch.no_grad():
        module(torch.randn(16, IN_FEATURES))
    assert set(vars(module)) == attributes
    assert isinstance(module.delayed_state, DelayedScalingState)


def test_reduction_order_is_first_forward_order():
    first, second = _module(), _module()
    _step(second, 0)
    _step(first, 0)
    states = reducing_states()
    assert states.index(second.delayed_state) < states.index(first.delayed_state)
    copied = copy.deepcopy(first)  # a copy carries the key, but registers as itself
    _step(copied, 1)
    assert states.index(first.delayed_state) < reducing_states().index(copied.delayed_state)


def _attention():
    torch.manual_seed(0)
    config = Float8ModuleConfig(recipe="delayed", backend="emulated")
    return Float8MultiheadAttention(32, 2, config=config, batch_first=True)


def _experts():
    torch.manual_seed(0)
    config = Float8ModuleConfig(recipe="delayed", backend="emulated")
    experts = Float8Experts(4, 32, 32, torch.nn.functional.silu, config=config)
    torch.nn.init.normal_(experts.gate_up_proj, std=0.1)
    torch.nn.init.normal_(experts.down_proj, std=0.1)
    return experts


def _call(module, x, routing):
    if isinstance(module, Float8Experts):
        return module(x, *routing)
    return module(x, x, x, need_weights=False)[0]


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("build", [_attention, _experts], ids=["attention", "experts"])
def test_states_of_several_gemms_checkpoint_exactly(build, use_reentrant):
    """One state for an attention's in-projection GEMMs, one per expert and projection:
    checkpointing gives the same outputs, gradients and state, step after step."""
    plain, checkpointed = build(), build()
    for step in range(3):
        shape = (2, 16, 32) if isinstance(plain, Float8MultiheadAttention) else (48, 32)
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(step))
        generator = torch.Generator().manual_seed(step)
        routing = torch.randint(0, 4, (48, 2), generator=generator), torch.rand(48, 2, generator=generator)
        with fp8train.autocast():
            out = _call(plain, x.requires_grad_(True), routing)
            x_checkpointed = x.detach().requires_grad_(True)
            call = functools.partial(_call, checkpointed, routing=routing)
            out_checkpointed = checkpoint(call, x_checkpointed, use_reentrant=use_reentrant)
        assert torch.equal(out_checkpointed, out)
        out.square().sum().backward()
        out_checkpointed.square().sum().backward()
        assert torch.equal(x_checkpointed.grad, x.grad)
        for (name, p), p_checkpointed in zip(plain.named_parameters(), checkpointed.parameters()):
            assert torch.equal(p_checkpointed.grad, p.grad), f"step {step}: {name}"
        for (name, b), b_checkpointed in zip(plain.named_buffers(), checkpointed.buffers()):
            assert torch.equal(b_checkpointed, b), f"step {step}: {name}"


def _train(model: torch.nn.Module, optimizer, steps: range) -> list[float]:
    """Steps of a loop that never enters ``fp8train.autocast`` (transformers' Trainer)."""
    losses = []
    for step in steps:
        x = torch.randn(24, IN_FEATURES, generator=torch.Generator().manual_seed(step)) * (1 + step % 3)
        loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _model_and_optimizer(recipe):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(IN_FEATURES, OUT_FEATURES), torch.nn.GELU(), torch.nn.Linear(OUT_FEATURES, IN_FEATURES)
    )
    fp8train.convert_to_float8_training(model, recipe, backend="emulated")
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


@pytest.mark.parametrize(
    "recipe",
    [fp8train.recipes.DelayedScaling(amax_history_len=16, amax_compute_algo="most_recent"), "delayed"],
    ids=["most_recent", "default"],
)
def test_state_dict_resumes_bit_identically_in_a_loop_without_autocast(recipe):
    """After a step of any loop nothing is owed that the ``state_dict`` lacks: the end of
    the backward applied the forward update (it used to wait for the next forward, and a
    resume lost it)."""
    model, optimizer = _model_and_optimizer(recipe)
    expected = _train(model, optimizer, range(10))
    first, first_optimizer = _model_and_optimizer(recipe)
    _train(first, first_optimizer, range(6))
    buffer = io.BytesIO()
    torch.save({"model": first.state_dict(), "optimizer": first_optimizer.state_dict()}, buffer)
    saved = torch.load(io.BytesIO(buffer.getvalue()))
    resumed, resumed_optimizer = _model_and_optimizer(recipe)
    resumed.load_state_dict(saved["model"])
    resumed_optimizer.load_state_dict(saved["optimizer"])
    assert _train(resumed, resumed_optimizer, range(6, 10)) == expected[6:]
    for (name, value), resumed_value in zip(model.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(value, resumed_value), name


def test_a_recompute_outside_autocast_settles_nothing(monkeypatch):
    """Activation checkpointing's recompute inside the backward owes no update, so it
    applies none either (distributed, that would be a collective inside the backward): the
    end of the backward applies the one the forward owes, once a step."""
    module = _module()
    callers = []
    finish = DelayedScalingState.finish_forward_update

    def recording(self):
        callers.append(sys._getframe(1).f_code.co_name)
        finish(self)

    monkeypatch.setattr(DelayedScalingState, "finish_forward_update", recording)
    x = torch.randn(40, IN_FEATURES, requires_grad=True)
    for _ in range(2):
        checkpoint(module, x, use_reentrant=False).square().sum().backward()
    assert callers == ["end_backward", "end_backward"]  # not settle_before_forward, from the recompute
    assert not module.delayed_state.forward_pending


def test_a_backward_that_owes_nothing_at_its_end_queues_no_callback(monkeypatch):
    """Inside ``fp8train.autocast`` (one process) a backward's end owes nothing: no callback
    walks the registry (issue 38); outside it, the end applies the owed forward update."""
    import fp8train.nn.delayed.reduction as reduction

    ends = []
    monkeypatch.setattr(reduction, "end_backward", lambda group, end=reduction.end_backward: (ends.append(1), end(group)))
    module = _module()
    _step(module, 0, autocast=False)
    assert ends == [1] and not module.delayed_state.forward_pending
    _step(module, 1)
    _step(module, 2)
    assert ends == [1]
